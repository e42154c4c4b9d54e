"""Backward capture: the gradient of a loss with respect to each recorded op's output.

A recording made with ``CaptureOptions(backward_ready=True)`` notes, for each selected
entry whose tensor requires grad, the autograd node that produced it and which of the
node's outputs it is (:class:`GradEdges`, filled on the forward thread as each entry is
added, before any later in-place op can rebase the tensor's ``grad_fn``).

``backward(loss)`` (:class:`BackwardCapture`) registers a pre-hook on each of those
nodes for the duration of one ``torch.autograd.backward`` call: when the engine runs a
node, its pre-hook receives the gradients with respect to the node's outputs, which are
the gradients a ``tensor.register_hook`` on the op's output would see. A pre-hook that
returns ``None`` changes nothing, so parameters' ``.grad`` are what a plain backward
gives. Each call of ``backward`` is numbered (from 1) and each fire of a node gets the
next fire number, in the engine's execution order; a sink (memory, or a store's writer)
keeps the gradients.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch.autograd.graph import get_gradient_edge

from tracelake.errors import RecorderError

from .entries import OpEntry, OpTable
from .selectors import Selector

__all__ = ["BackwardCapture", "CaptureOptions", "GradEdges", "GradFire", "GradSink", "node_name"]


@dataclass(frozen=True)
class CaptureOptions:
    """What a recording captures besides the forward pass.

    ``backward_ready``: note each recorded op's autograd node, so that a later
    ``trace.backward(loss)`` (``rec.backward(loss)`` in a store's recording) records the
    gradient of the loss with respect to each op's output. Which ops' gradients are kept
    is chosen by ``save_grads=`` on the entry point (default: the ``save=`` selector).
    """

    backward_ready: bool = False
    #: Record each call's function and non-tensor arguments (``OpTable.call_args``; the
    #: catalog's ``args`` column, as JSON), so that ``tl.validate`` can recompute saved
    #: ops. The interception then runs in Python (the compiled path does not see
    #: arguments).
    record_args: bool = False
    #: Keep the ops connected to neither the model's inputs nor its outputs (a tensor
    #: made and dropped inside the forward: ``torch.ones(3) * 2``, an unused ``arange``).
    #: By default they are pruned after the forward pass, as TorchLens prunes them (its
    #: ``keep_orphans=False``), and labels are numbered without them.
    keep_orphans: bool = False

    def __post_init__(self) -> None:
        for name in ("backward_ready", "record_args", "keep_orphans"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"CaptureOptions({name}=...) takes True or False, not {type(value).__name__}"
                )


def as_options(capture: Any) -> CaptureOptions:
    """``capture=`` as :class:`CaptureOptions` (``None``: the defaults)."""
    if capture is None:
        return CaptureOptions()
    if not isinstance(capture, CaptureOptions):
        raise TypeError(
            f"capture= takes tl.options.CaptureOptions(...), not {type(capture).__name__}"
        )
    return capture


class GradFire(NamedTuple):
    """One op's gradient from one fire of its autograd node."""

    backward: int  # which backward call of the recording (from 1)
    fire: int  # order of the node's fire among all fires of the recording (from 0)
    node: str  # the autograd node's class name: AddmmBackward0, AccumulateGrad, ...
    step: int  # the forward pass (step) of the op
    op: int  # the op entry (its index in the step)


def node_name(node: Any) -> str:
    return type(node).__name__


class GradEdges:
    """The autograd nodes of one recorded forward pass whose output gradients are
    wanted: node id -> (node, [(entry, output number), ...])."""

    def __init__(self, selector: Selector, table: OpTable):
        self._selector = selector
        self._const = selector.constant
        self._table = table
        self.nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}

    def add(self, index: int, tensor: torch.Tensor) -> None:
        """Entry ``index`` produced ``tensor`` just now (on the forward thread)."""
        if not tensor.requires_grad:
            return
        selected = self._const
        if selected is None:
            selected = self._selector.matches_op(OpEntry(self._table, None, index))
        if not selected:
            return
        node = tensor.grad_fn
        if node is None:  # a leaf: its gradient arrives at its accumulator
            edge = get_gradient_edge(tensor)
            node, number = edge.node, edge.output_nr
        else:
            number = tensor.output_nr
        held = self.nodes.get(id(node))
        if held is None:
            self.nodes[id(node)] = (node, [(index, number)])
        else:
            held[1].append((index, number))

    def renumber(self, new: list[int]) -> None:
        """Orphans were pruned: entry ``i`` is now ``new[i]`` (-1: pruned, forgotten)."""
        for key, (node, targets) in list(self.nodes.items()):
            kept = [(new[index], number) for index, number in targets if new[index] >= 0]
            if kept:
                self.nodes[key] = (node, kept)
            else:
                del self.nodes[key]

    def clear(self) -> None:
        self.nodes.clear()


class GradSink(Protocol):
    """Where gradients go: ``keep`` runs in the backward pass (on autograd's thread),
    ``done`` after each backward call. ``keep`` gets the engine's own tensor (the same
    object wherever the engine passes one gradient to several nodes); a sink that holds
    on to it detaches it."""

    def keep(self, fire: GradFire, grad: torch.Tensor) -> None: ...

    def done(self) -> object: ...


class BackwardCapture:
    """Runs backward calls with pre-hooks on the recorded nodes of ``steps`` (one
    :class:`GradEdges` per forward pass) and hands each op's gradient to ``sink``."""

    def __init__(self, steps: list[GradEdges], sink: GradSink):
        self.steps = steps
        self.sink = sink
        self.calls = 0
        self.fires = 0
        self._lock = threading.Lock()  # autograd may run nodes on several device threads

    def _hook(self, step: int, node: Any, targets: list[tuple[int, int]]) -> Any:
        name = node_name(node)
        call = self.calls

        def pre_hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            with self._lock:  # (one call: a loop's head here could skip the exit)
                self._keep(call, name, step, targets, grad_outputs)

        return pre_hook

    def _keep(
        self,
        call: int,
        name: str,
        step: int,
        targets: list[tuple[int, int]],
        grad_outputs: tuple[torch.Tensor | None, ...],
    ) -> None:
        fire = self.fires
        self.fires += 1
        for index, number in targets:
            grad = grad_outputs[number] if number < len(grad_outputs) else None
            if grad is not None:
                self.sink.keep(GradFire(call, fire, name, step, index), grad)

    def backward(self, loss: Any, gradient: Any = None, **options: Any) -> None:
        """``torch.autograd.backward(loss, gradient, **options)`` with the gradients of
        the recorded ops kept; ``options``: ``retain_graph``, ``create_graph``,
        ``inputs``, as torch takes them."""
        if not any(edges.nodes for edges in self.steps):
            raise RecorderError(
                "nothing to record a backward pass of: no selected op of this recording "
                "requires grad (record with capture=tl.options.CaptureOptions("
                "backward_ready=True), with gradients enabled, and a save_grads= selector "
                "that selects something)"
            )
        self.calls += 1
        handles = []
        try:
            for step, edges in enumerate(self.steps):
                for node, targets in edges.nodes.values():
                    handles.append(node.register_prehook(self._hook(step, node, targets)))
            torch.autograd.backward(loss, gradient, **options)
        finally:
            for handle in handles:
                handle.remove()
            self.sink.done()


class MemoryGrads:
    """Keeps gradients in memory for an in-memory trace (detached aliases: the engine
    hands each pre-hook a gradient it does not write afterwards while a reference is
    held; a version counter that moved all the same drops the value, with a warning)."""

    def __init__(self) -> None:
        self.fires: list[GradFire] = []
        self.tensors: list[torch.Tensor | None] = []
        self._versions: list[int] = []
        self._by_op: dict[tuple[int, int], list[int]] = {}
        self._checked = 0

    def keep(self, fire: GradFire, grad: torch.Tensor) -> None:
        grad = grad.detach()
        self._by_op.setdefault((fire.step, fire.op), []).append(len(self.fires))
        self.fires.append(fire)
        self.tensors.append(grad)
        self._versions.append(grad._version)

    def done(self) -> list[GradFire]:
        """After a backward call: drop (and return) gradients written since."""
        lost = []
        for k in range(self._checked, len(self.tensors)):
            grad = self.tensors[k]
            if grad is not None and grad._version != self._versions[k]:
                self.tensors[k] = None
                lost.append(self.fires[k])
        self._checked = len(self.tensors)
        return lost

    def grads(self, step: int, index: int) -> list[tuple[GradFire, torch.Tensor | None]]:
        """Op ``index``'s gradients in fire order."""
        return [(self.fires[k], self.tensors[k]) for k in self._by_op.get((step, index), ())]

    def free(self) -> None:
        self.tensors = [None] * len(self.tensors)
