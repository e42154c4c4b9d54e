"""Emit: decide what to keep of each labelled entry, and keep it in memory.

A saved tensor is a detached, contiguous copy taken the moment the op returns, so later
in-place ops cannot change it. A module's inputs and outputs, and the model's outputs,
are usually the very tensors some op just produced: then the op's copy is shared instead
of copied again, unless the tensor was written in place since (its version counter moved).
"""

from __future__ import annotations

from typing import Any

import torch

from .entries import ModuleEntry, OpEntry
from .selectors import Selector
from .stats import compute_stats

__all__ = ["MemoryEmitter", "copy_tensor", "tensor_version"]


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or ``None`` where it has none."""
    try:
        return int(tensor._version)
    except (RuntimeError, AttributeError):  # inference tensors track no version
        return None


def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy that shares nothing with ``tensor``."""
    with torch.no_grad():
        try:
            return tensor.detach().clone(memory_format=torch.contiguous_format)
        except RuntimeError:  # layouts without memory formats (sparse, ...)
            return tensor.detach().clone()


def share_or_copy(tensor: torch.Tensor, producer: OpEntry | None) -> torch.Tensor:
    """The producer's saved copy when it still equals ``tensor``, else a new copy."""
    if producer is not None and producer._out is not None:
        version = tensor_version(tensor)
        if version is not None and version == producer._version:
            return producer._out
    return copy_tensor(tensor)


def rebuild(obj: Any, copies: list[torch.Tensor], depth: int = 0) -> Any:
    """``obj``'s structure with its tensors replaced, in flatten order, by ``copies``.

    Tuples, lists and dicts (model-output dataclasses included) keep their shape as plain
    containers; other non-tensor leaves are kept when they are plain values, else ``None``.
    """
    if isinstance(obj, torch.Tensor):
        return copies.pop(0)
    if depth > 8:
        return None
    if isinstance(obj, (tuple, list)):
        items = [rebuild(item, copies, depth + 1) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {key: rebuild(value, copies, depth + 1) for key, value in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return None


class MemoryEmitter:
    """Keeps selected tensors on their entries, for an in-memory :class:`Trace`."""

    def __init__(self, selector: Selector, stats: str):
        self._selector = selector
        self._stats_all = stats == "all"

    def on_entry(self, entry: OpEntry, tensor: torch.Tensor, same_as: OpEntry | None) -> None:
        if self._selector.matches_op(entry):
            entry._out = share_or_copy(tensor, same_as)
            entry._version = tensor_version(tensor)
            entry.saved = True
        elif self._stats_all:
            entry._stats = compute_stats(tensor)

    def on_module_enter(
        self, entry: ModuleEntry, tensors: list[torch.Tensor], producers: list[OpEntry | None]
    ) -> None:
        if self._selector.matches_module(entry):
            entry._inputs = tuple(map(share_or_copy, tensors, producers))

    def on_module_exit(
        self,
        entry: ModuleEntry,
        output: Any,
        tensors: list[torch.Tensor],
        producers: list[OpEntry | None],
    ) -> None:
        if self._selector.matches_module(entry):
            copies = list(map(share_or_copy, tensors, producers))
            entry._outputs = tuple(copies)
            entry._out = rebuild(output, copies)
            entry.saved = True
