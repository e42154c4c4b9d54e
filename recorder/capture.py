"""``tl.trace``: record one forward pass at operation resolution, into memory.

Wires the three stages together: intercept (torch function mode and module hooks) →
label (entries, layers, passes) → emit (what to keep).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import torch

from tracelake.errors import TraceLakeWarning

from .backward import CaptureOptions, GradEdges, as_options
from .eager import EagerStance, uncompiled
from .emit import MemoryEmitter
from .entries import OpTable
from .inputs import model_arguments
from .intercept import Interceptor
from .intervene import Interventions, as_rules
from .labels import Emitter, Labeller
from .replay import encode_call, training_modes
from .rng import RngWatch
from .selectors import Selector, as_selector, warn_unmatched
from .trace import Trace

__all__ = ["ForwardRecording", "check_model", "grad_selector", "record_forward", "trace"]

log = logging.getLogger("tracelake.recorder")

_STATS_CHOICES = ("saved", "all")


class _Warner:
    """Reports what could not be recorded, once per function and kind of failure."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, type]] = set()

    def __call__(self, what: str, exc: BaseException) -> None:
        key = (what, type(exc))
        log.debug("could not record %s", what, exc_info=exc)
        if key in self._seen:
            return
        self._seen.add(key)
        warnings.warn(
            f"tracelake could not fully record {what} ({type(exc).__name__}: {exc}); "
            "the forward pass went on unchanged and the entry may be incomplete",
            TraceLakeWarning,
            stacklevel=2,
        )


def grad_selector(capture: Any, save: Any, save_grads: Any) -> Selector | None:
    """The selector of the ops whose gradients a backward-ready recording keeps (None
    when ``capture`` does not ask for backward capture; ``save_grads`` then must not be
    given). Default: ``save``'s."""
    options = as_options(capture)
    if not options.backward_ready:
        if save_grads is not None:
            raise ValueError(
                "save_grads= selects gradients of a backward-ready recording: pass "
                "capture=tl.options.CaptureOptions(backward_ready=True) too"
            )
        return None
    return as_selector(save if save_grads is None else save_grads)


def check_model(model: object) -> torch.nn.Module:
    """``model`` itself if tracelake can record it (a ``torch.nn.Module``), else a
    ``TypeError`` saying what to do instead. Every entry point that records calls it
    first (``tl.trace`` and the store's ``record`` / ``recording``)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"tracelake records torch.nn.Module forward passes; got {type(model).__name__}. "
            "Wrap a plain function in an nn.Module whose forward calls it."
        )
    return model


class ForwardRecording:
    """One forward pass under interception, in two halves, for callers that cannot wrap
    the call themselves (a store's recording block starts a step in a module's pre-hook
    and ends it in its post-hook): ``start(args, kwargs)``, the forward, ``stop(output)``.
    ``stop`` must run even if the forward raises (it removes the mode and hooks), or
    ``abort`` (which only removes them, whatever of them is installed; again is safe)."""

    def __init__(
        self,
        model: torch.nn.Module,
        emitter: Emitter,
        table: OpTable,
        interventions: Interventions | None = None,
        step: int = 0,
        *,
        record_args: bool = False,
        keep_orphans: bool = False,
    ):
        Interceptor.refuse_nesting()
        # the rules see each op before the emitter does
        wrapper = interventions.step(step, table, emitter) if interventions else None
        self.labeller = Labeller(uncompiled(model), emitter if wrapper is None else wrapper, table)
        if wrapper is not None:
            wrapper.bind(self.labeller)
        table.keep_orphans = keep_orphans
        if record_args:  # before the interceptor, which picks its path by it
            self.labeller.record_args()
        self._interceptor = Interceptor(self.labeller, _Warner(), wrapper)
        # a compiled model runs eagerly while recorded (compiled: a module inside it is,
        # or it is a wrapper itself)
        self._eager = EagerStance(
            model, compiled=self.labeller.compiled or uncompiled(model) is not model
        )
        self.rng = RngWatch()  # what the forward draws, for a replay to draw again
        self._model = uncompiled(model)
        self.training: bool | list[str] = False  # its modules' modes, for a replay

    def start(self, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():  # copies of inputs are not the user's ops
            self.labeller.add_inputs(args, kwargs)
        self.rng.start()
        self.training = training_modes(self._model, self.labeller.named)
        self._eager.__enter__()
        try:
            self._interceptor.__enter__()
        except BaseException:
            self._eager.__exit__()
            raise

    def release(self) -> None:
        """Remove the mode and hooks (and the eager stance), whatever of them is still
        installed: the forward is over, or was interrupted (again is safe)."""
        try:
            self._interceptor.close()
        finally:
            self._eager.__exit__()

    def stop(self, output: Any, failed: bool = False) -> None:
        self.release()
        self.rng.stop()
        if not failed:
            with torch._C.DisableTorchFunction():
                self.labeller.add_outputs(output)
        self.labeller.finish()

    def abort(self) -> None:
        """The forward failed or was interrupted: only remove what is installed."""
        self.release()


def record_forward(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    emitter: Emitter,
    table: OpTable,
    interventions: Interventions | None = None,
    record_args: bool = False,
    keep_orphans: bool = False,
) -> tuple[ForwardRecording, Any]:
    """Run ``model(*args, **kwargs)`` once under interception, filling ``table``; return
    the recording (its labeller, what it drew from the generators) and the model's
    output. The forward's own exceptions propagate unchanged, after every mode and hook
    has been removed."""
    recording = ForwardRecording(
        model, emitter, table, interventions, record_args=record_args, keep_orphans=keep_orphans
    )
    try:
        recording.start(args, kwargs)
        output = uncompiled(model)(*args, **kwargs)  # (a wrapper would run it all the same)
        recording.stop(output)
    except BaseException:
        recording.abort()  # (after a stop cut short by a Ctrl-C too: again is safe)
        raise
    return recording, output


def trace(
    model: torch.nn.Module,
    *inputs: Any,
    save: Any = None,
    stats: str = "saved",
    intervene: Any = None,
    capture: CaptureOptions | None = None,
    save_grads: Any = None,
    args: tuple | None = None,
    kwargs: dict[str, Any] | None = None,
    **model_kwargs: Any,
) -> Trace:
    """Run one forward pass of ``model`` and return its :class:`Trace`.

    Every torch call that returns a tensor is recorded as an op, with its label, module
    stack, dataflow edges, source line, shape and dtype. ``save`` (a selector: ``tl.func``,
    ``tl.in_module``, ``tl.module``, ``tl.label``, ``tl.all``, ``tl.none``; default all)
    picks the tensors to keep as detached copies. ``stats="all"`` also computes summary
    statistics of ops that are not saved (saved ones always have them). ``intervene``:
    ``tl.when(selector, action)`` or a list of them, applied to the ops they select as
    the forward runs (``trace.interventions`` audits them).

    Ops connected to neither the inputs nor the outputs are pruned after the forward, as
    TorchLens prunes them; ``capture=tl.options.CaptureOptions(keep_orphans=True)`` keeps
    them. ``capture=tl.options.CaptureOptions(backward_ready=True)`` makes the trace ready for
    ``trace.backward(loss)``, which records the gradient of ``loss`` with respect to the
    output of each op ``save_grads`` selects (a selector; default: ``save``).

    The model is called as ``model(*inputs, **model_kwargs)``; ``args=(...)`` and
    ``kwargs={...}`` give its inputs explicitly (a model keyword named like one of these
    options goes in ``kwargs=``). Keyword inputs are labelled by their name
    (``input_ids``), positional ones ``input_1``, ``input_2``, ...
    """
    model = check_model(model)
    inputs, model_kwargs = model_arguments(
        model,
        "tl.trace",
        inputs,
        args,
        kwargs,
        model_kwargs,
        {
            "save": (save, None),
            "stats": (stats, "saved"),
            "intervene": (intervene, None),
            "capture": (capture, None),
            "save_grads": (save_grads, None),
        },
    )
    selector = as_selector(save)
    if stats not in _STATS_CHOICES:
        raise ValueError(f"stats= takes 'saved' or 'all', not {stats!r}")
    interventions = Interventions(as_rules(intervene))
    grads = grad_selector(capture, save, save_grads)
    table = OpTable()
    edges = None if grads is None else GradEdges(grads, table)
    emitter = MemoryEmitter(selector, stats, table, edges)
    options = as_options(capture)
    recording, output = record_forward(
        model,
        inputs,
        model_kwargs,
        emitter,
        table,
        interventions,
        options.record_args,
        options.keep_orphans,
    )
    with torch._C.DisableTorchFunction():
        lost = emitter.finish()
    for index in lost:
        warnings.warn(
            f"{table.labels[index]} was written in place by an operation tracelake could "
            "not intercept, or could not be copied, so its value is not saved",
            TraceLakeWarning,
            stacklevel=2,
        )
    result = Trace(table, emitter, recording.labeller.module_entries, output, type(model).__name__)
    result.interventions = interventions
    result.call = encode_call(inputs, model_kwargs, recording.rng.drawn, recording.training)
    interventions.warn_unused(result.labels)
    result.model_ref = weakref.ref(model)
    if selector.constant is None:  # a name in save= that matched nothing: likely a typo
        warn_unmatched(selector, result, result.modules)
    return result
