"""``tl.trace``: record one forward pass at operation resolution, into memory.

Wires the three stages together: intercept (torch function mode and module hooks) →
label (entries, layers, passes) → emit (what to keep).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from tracelake.errors import TraceLakeWarning

from .emit import MemoryEmitter
from .entries import OpTable
from .intercept import Interceptor
from .labels import Emitter, Labeller
from .selectors import as_selector
from .trace import Trace

__all__ = ["ForwardRecording", "check_model", "record_forward", "trace"]

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

    def __init__(self, model: torch.nn.Module, emitter: Emitter, table: OpTable):
        Interceptor.refuse_nesting()
        self.labeller = Labeller(model, emitter, table)
        self._interceptor = Interceptor(self.labeller, _Warner())

    def start(self, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():  # copies of inputs are not the user's ops
            self.labeller.add_inputs(args, kwargs)
        self._interceptor.__enter__()

    def stop(self, output: Any, failed: bool = False) -> None:
        self._interceptor.close()
        if not failed:
            with torch._C.DisableTorchFunction():
                self.labeller.add_outputs(output)
        self.labeller.finish()

    def abort(self) -> None:
        self._interceptor.close()


def record_forward(
    model: torch.nn.Module, args: tuple, kwargs: dict, emitter: Emitter, table: OpTable
) -> tuple[Labeller, Any]:
    """Run ``model(*args, **kwargs)`` once under interception, filling ``table``; return
    the labeller and the model's output. The forward's own exceptions propagate
    unchanged, after every mode and hook has been removed."""
    recording = ForwardRecording(model, emitter, table)
    try:
        recording.start(args, kwargs)
        output = model(*args, **kwargs)
    except BaseException:
        recording.abort()
        raise
    recording.stop(output)
    return recording.labeller, output


def trace(
    model: torch.nn.Module, *args: Any, save: Any = None, stats: str = "saved", **kwargs: Any
) -> Trace:
    """Run one forward pass of ``model`` and return its :class:`Trace`.

    Every torch call that returns a tensor is recorded as an op, with its label, module
    stack, dataflow edges, source line, shape and dtype. ``save`` (a selector: ``tl.func``,
    ``tl.in_module``, ``tl.module``, ``tl.label``, ``tl.all``, ``tl.none``; default all)
    picks the tensors to keep as detached copies. ``stats="all"`` also computes summary
    statistics of ops that are not saved (saved ones always have them). Remaining
    positional and keyword arguments go to the model.
    """
    model = check_model(model)
    selector = as_selector(save)
    if stats not in _STATS_CHOICES:
        raise ValueError(f"stats= takes 'saved' or 'all', not {stats!r}")
    table = OpTable()
    emitter = MemoryEmitter(selector, stats, table)
    labeller, output = record_forward(model, args, kwargs, emitter, table)
    with torch._C.DisableTorchFunction():
        lost = emitter.finish()
    for index in lost:
        warnings.warn(
            f"{table.labels[index]} was written in place by an operation tracelake could "
            "not intercept, or could not be copied, so its value is not saved",
            TraceLakeWarning,
            stacklevel=2,
        )
    return Trace(table, emitter, labeller.module_entries, output, type(model).__name__)
