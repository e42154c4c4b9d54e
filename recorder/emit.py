"""Emit: decide what to keep of each labelled entry, and keep it in memory.

Saved tensors are copy-on-write: a selected tensor is first kept as a detached alias of
the live tensor (no bytes copied), and copied only when something could change it: just
before an intercepted in-place op writes to its storage, or, when the recording ends, if
anything besides the trace still holds that storage (the user's inputs and outputs,
buffers, the autograd graph). A write the recorder could not intercept is detected by
the tensor's version counter, and that value is dropped rather than kept wrong.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tracelake.errors import RecorderError

from . import compiled
from .backward import GradEdges, MemoryGrads
from .entries import ModuleEntry, OpEntry, OpTable, SlotRef
from .selectors import Selector
from .stats import (
    EXACT_SQUARES,
    GATHER_MAX,
    Stats,
    StatsGatherer,
    compute_stats,
    fused_layout,
    fused_stats,
)
from .trees import Structure, flatten

__all__ = [
    "MemoryEmitter",
    "SelectingEmitter",
    "TensorSlots",
    "copy_tensor",
    "storage_address",
    "structure",
    "tensor_version",
]


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or ``None`` where it has none."""
    try:
        return int(tensor._version)
    except (RuntimeError, AttributeError):  # inference tensors track no version
        return None


def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous copy that shares nothing with ``tensor``. (Copies of a
    detached tensor record no graph, so no ``torch.no_grad()`` either: a Ctrl-C landing
    inside its ``__enter__``, after grad was turned off, would leave it off for the
    thread, ``__exit__`` never run.)"""
    try:
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    except RuntimeError:  # layouts without memory formats (sparse, ...)
        return tensor.detach().clone()


def copy_together(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of tensors that share one storage, sharing one new storage in the same
    layout (one copy of the bytes, however many views); per-tensor copies where that
    cannot be done (tensor subclasses, unusual layouts)."""
    if len(tensors) > 1 and all(type(t) is torch.Tensor for t in tensors):
        try:  # (storages and new tensors: nothing autograd records; see copy_tensor)
            storage = tensors[0].untyped_storage().clone()
            return [
                torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    storage, t.storage_offset(), t.size(), t.stride()
                )
                for t in tensors
            ]
        except (RuntimeError, TypeError):
            pass
    return [copy_tensor(t) for t in tensors]


def storage_address(tensor: Any) -> int | None:
    """Where ``tensor``'s storage lives (what every view of it shares), or ``None`` for
    what is not a tensor with one."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share ``tensor``'s storage, if torch says."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    storage = tensor.untyped_storage()
    return int(counter(storage._cdata)) - 1  # minus the handle just taken


def _freed_error() -> RecorderError:
    return RecorderError("this trace was freed by cleanup(); record it again to read its tensors")


class TensorSlots:
    """Saved tensors, numbered; kept as aliases until they might change (copy on write)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor | None] = []
        self.versions: list[int | None] = []
        self._aliases: dict[int, list[int]] = {}  # storage address -> slots aliasing it
        self._lost: list[int] = []  # slots that could not be copied when they had to be
        self.freed = False

    def put(self, tensor: torch.Tensor) -> int:
        slot = len(self.tensors)
        version = tensor_version(tensor)
        kept = None
        if version is not None and tensor.layout is torch.strided:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            # Alias what spans most of its storage, or a storage the trace holds anyway;
            # a small view must not keep a large base alive on its own.
            if address in self._aliases or (
                storage.nbytes() <= 2 * tensor.numel() * tensor.element_size()
            ):
                kept = tensor.detach()
                self._aliases.setdefault(address, []).append(slot)
        self.tensors.append(kept if kept is not None else copy_tensor(tensor))
        self.versions.append(version)
        return slot

    def holds(self, slot: int, tensor: torch.Tensor) -> bool:
        """Whether ``slot`` still holds the value ``tensor`` has now."""
        version = self.versions[slot]
        return version is not None and version == tensor_version(tensor)

    def before_write(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is about to be written: copy every alias of it first."""
        address = storage_address(tensor) if self._aliases else None
        if address is not None:
            self._copy_slots(self._aliases.pop(address, []))

    def _copy_slots(self, slots: list[int]) -> None:
        """Replace the aliases in ``slots`` (all of one storage) by copies; what cannot be
        copied is dropped, never kept as an alias that is about to change."""
        live = [slot for slot in slots if self.tensors[slot] is not None]
        try:
            copies = copy_together([self.tensors[slot] for slot in live])  # type: ignore[misc]
        except Exception:
            for slot in live:
                self.tensors[slot] = None
            self._lost.extend(live)
            return
        for slot, copy in zip(live, copies, strict=True):
            self.tensors[slot] = copy

    def settle(self) -> list[int]:
        """End of recording: copy aliases that anything else still holds; drop (and
        return) slots written by something the recorder could not intercept, or that
        could not be copied."""
        lost: list[int] = []
        for slots in self._aliases.values():
            live = []
            for slot in slots:
                kept = self.tensors[slot]
                if kept is None:
                    continue
                if tensor_version(kept) != self.versions[slot]:
                    self.tensors[slot] = None
                    lost.append(slot)
                else:
                    live.append(slot)
            if not live:
                continue
            distinct = {id(self.tensors[slot]) for slot in live}
            users = _storage_users(self.tensors[live[0]])  # type: ignore[arg-type]
            if users is not None and users <= len(distinct):
                continue  # only the trace holds this memory: nothing can change it now
            self._copy_slots(live)
        self._aliases.clear()
        return lost + self._lost

    def get(self, slot: int) -> torch.Tensor | None:
        if self.freed:
            raise _freed_error()
        return self.tensors[slot]

    def free(self) -> None:
        self.tensors = []
        self._aliases.clear()
        self.freed = True


def structure(obj: Any, slots: list[int]) -> Structure:
    """``obj`` flattened through pytree (:func:`.trees.flatten`), its tensor leaves
    replaced, in order, by :class:`SlotRef` to ``slots``. Other leaves are kept when they
    are plain values (None, bool, int, float, str), else replaced by ``None``: a trace
    holds no reference to the user's objects."""
    spec, leaves = flatten(obj)
    numbers = iter(slots)
    kept = tuple(
        SlotRef(next(numbers))
        if isinstance(leaf, torch.Tensor)
        else leaf
        if isinstance(leaf, _PLAIN)
        else None
        for leaf in leaves
    )
    return Structure(spec, kept)


_PLAIN = (type(None), bool, int, float, str)


class ViewedStats:
    """:func:`compute_stats` for a forward's unsaved ops, each reduction done once per
    memory layout: a view that only reshapes or permutes the elements of a tensor
    reduced before (a model's ``view``, ``transpose``, ``permute`` of an activation)
    has the very same statistics, to the bit (:func:`fused_layout`), as long as nothing
    has written them since: the version counter, shared by views, tells, and the tensor
    first reduced, still alive, keeps the memory from being another tensor's."""

    def __init__(self) -> None:
        #: layout -> (the tensor first reduced, its version then, its statistics); the
        #: compiled ``Reducer`` reads and fills it too
        self.seen: dict[tuple[int, ...], tuple[weakref.ref[torch.Tensor], int, Stats]] = {}

    def stats(self, tensor: torch.Tensor) -> Stats:
        key = fused_layout(tensor)
        version = None if key is None else tensor_version(tensor)
        if key is None or version is None:
            return fused_stats(tensor, key)
        seen = self.seen.get(key)
        if seen is not None:
            first, when, stats = seen
            kept = first()
            if when == version and kept is not None and tensor_version(kept) == version:
                return stats
        stats = fused_stats(tensor, key)
        self.seen[key] = (weakref.ref(tensor), version, stats)
        return stats


class SelectingEmitter:
    """What every emitter shares: which entries to keep (the selector), statistics of
    unsaved ops on request, and module entries pointing at kept tensors. Subclasses say
    how a tensor is kept (``_keep``, returning a slot number) and whether a slot still
    holds a tensor's current value (``_holds``)."""

    def __init__(
        self, selector: Selector, stats: str, table: OpTable, grads: GradEdges | None = None
    ):
        self._selector = selector
        self._const = selector.constant
        self._stats_all = stats == "all"
        self._table = table
        self._op_slot: dict[int, int] = {}
        self._stats: dict[int, Stats] = {}
        # unsaved ops' statistics: small tensors' gathered, complete at finish_ops()
        self._gather = StatsGatherer() if self._stats_all else None
        self._viewed = ViewedStats()
        #: False when no op entry needs anything: the labeller then skips on_entry.
        #: The autograd nodes of entries whose gradients a later backward call records
        #: (``CaptureOptions(backward_ready=True)``), or None.
        self.grad_edges = grads
        self.wants_ops = self._const is not False or self._stats_all or grads is not None
        #: Whether every entry is selected (``tl.all()``): a subclass may then keep a
        #: new tensor without asking the selector.
        self.saves_all = self._const is True
        reducer = getattr(compiled.hot(), "Reducer", None)
        if self._stats_all and self._const is False and grads is None and reducer is not None:
            # A large float32 tensor's statistics compiled (recorder/_hot.c, ``Reducer``):
            # what on_entry -> ViewedStats.stats -> fused_stats do for it, without their
            # frames, sharing the views' dict; any other entry goes to the Python below,
            # the reference.
            self.on_entry = reducer(  # type: ignore[method-assign]
                self.on_entry,
                self._stats,
                self._viewed.seen,
                Stats,
                torch.Tensor,
                torch.strided,
                torch.float32,
                (GATHER_MAX, EXACT_SQUARES),
            )

    def _keep(self, tensor: torch.Tensor) -> int:
        raise NotImplementedError

    def _holds(self, slot: int, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    # -- the emitter protocol -----------------------------------------------------------

    def _slot_for(self, tensor: torch.Tensor, producer: int) -> int:
        slot = self._op_slot.get(producer, -1) if producer >= 0 else -1
        if slot >= 0 and self._holds(slot, tensor):
            return slot
        return self._keep(tensor)

    def on_entry(self, index: int, tensor: torch.Tensor, same_as: int) -> None:
        if self.grad_edges is not None:
            self.grad_edges.add(index, tensor)
        selected = self._const
        if selected is None:
            selected = self._selector.matches_op(OpEntry(self._table, None, index))
        if selected:
            self._op_slot[index] = self._slot_for(tensor, same_as)
        elif self._gather is not None and not self._gather.add(index, tensor):
            self._stats[index] = self._viewed.stats(tensor)

    @property
    def op_slots(self) -> dict[int, int]:
        """Op entry -> the slot its saved tensor went to, for every saved op."""
        return self._op_slot

    @property
    def unsaved_stats(self) -> dict[int, Stats]:
        """Op entry -> statistics computed during the forward for ops not saved
        (``stats="all"``)."""
        return self._stats

    def finish_ops(self) -> None:
        """The forward pass is over: complete the statistics of unsaved ops."""
        if self._gather is not None:
            self._stats.update(self._gather.finish())
            self._gather = StatsGatherer()
            self._viewed = ViewedStats()
        # no more entries: drop a compiled on_entry, and with it the cycle through its
        # Python fallback (this emitter's method), so the step's objects go by refcount
        self.__dict__.pop("on_entry", None)

    def before_write(self, tensor: torch.Tensor) -> None:
        pass

    def renumber(self, new: list[int], modules: list[ModuleEntry]) -> set[int]:
        """Orphans were pruned: op entry ``i`` is now ``new[i]`` (-1: pruned); return the
        slots only pruned entries used (a subclass drops their tensors)."""
        slots, dropped = {}, set()
        for index, slot in self._op_slot.items():
            if new[index] >= 0:
                slots[new[index]] = slot
            else:
                dropped.add(slot)
        self._op_slot.clear()  # (in place: a compiled on_entry holds this dict)
        self._op_slot.update(slots)
        kept = {new[i]: st for i, st in self._stats.items() if new[i] >= 0}
        self._stats.clear()  # (in place too: a compiled on_entry holds this dict)
        self._stats.update(kept)
        if self.grad_edges is not None:
            self.grad_edges.renumber(new)
        used = set(slots.values())
        for m in modules:
            used.update(m.input_slots or (), m.output_slots or ())
        return dropped - used

    def on_module_enter(
        self, entry: ModuleEntry, tensors: list[torch.Tensor], producers: list[int]
    ) -> None:
        if self._selector.matches_module(entry):
            entry.input_slots = tuple(map(self._slot_for, tensors, producers))
            entry.tensor_source = self  # type: ignore[assignment]  # subclasses are sources

    def on_module_exit(
        self, entry: ModuleEntry, output: Any, tensors: list[torch.Tensor], producers: list[int]
    ) -> None:
        if self._selector.matches_module(entry):
            slots = list(map(self._slot_for, tensors, producers))
            entry.output_slots = tuple(slots)
            entry.structure = structure(output, slots)
            entry.tensor_source = self  # type: ignore[assignment]  # subclasses are sources


class MemoryEmitter(SelectingEmitter):
    """Keeps selected tensors in memory for an in-memory trace; a :class:`TensorSource`."""

    def __init__(
        self, selector: Selector, stats: str, table: OpTable, grads: GradEdges | None = None
    ):
        super().__init__(selector, stats, table, grads)
        self.slots = TensorSlots()
        #: Gradients kept by ``Trace.backward`` (None until then).
        self.grads: MemoryGrads | None = None
        self._keep = self.slots.put  # type: ignore[method-assign]
        self._holds = self.slots.holds  # type: ignore[method-assign]

    def before_write(self, tensor: torch.Tensor) -> None:
        self.slots.before_write(tensor)

    def renumber(self, new: list[int], modules: list[ModuleEntry]) -> set[int]:
        dropped = super().renumber(new, modules)
        for slot in dropped:  # no entry reads them: their memory goes back now
            self.slots.tensors[slot] = None
        return dropped

    def finish(self) -> list[int]:
        """Settle the aliases; return the op entries whose values had to be dropped."""
        lost = set(self.slots.settle())
        return [index for index, slot in self._op_slot.items() if slot in lost]

    # -- the tensor source --------------------------------------------------------------

    def op_tensor(self, index: int) -> torch.Tensor | None:
        slot = self._op_slot.get(index)
        return None if slot is None else self.slots.get(slot)

    def op_saved(self, index: int) -> bool:
        slot = self._op_slot.get(index)
        return slot is not None and (self.slots.freed or self.slots.tensors[slot] is not None)

    def op_stats(self, index: int) -> Stats | None:
        # Stats of a saved tensor are computed from the saved value on first use: the
        # same numbers as at record time, without charging the forward pass.
        stats = self._stats.get(index)
        if stats is None and not self.slots.freed:
            tensor = self.op_tensor(index)
            if tensor is not None:
                stats = self._stats[index] = compute_stats(tensor)
        return stats

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self.slots.get(slot)  # type: ignore[return-value]

    def op_grads(self, index: int) -> list[torch.Tensor | None]:
        if self.grads is None:
            return []
        if self.slots.freed:
            raise _freed_error()
        return [grad for _, grad in self.grads.grads(0, index)]

    @property
    def nbytes(self) -> int:
        """Bytes held by saved tensors, each storage counted once."""
        if self.slots.freed:
            return 0
        sizes: dict[int, int] = {}
        for tensor in self.slots.tensors:
            if tensor is not None:
                storage = tensor.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def cleanup(self) -> None:
        self.slots.free()
        if self.grads is not None:
            self.grads.free()
        if self.grad_edges is not None:
            self.grad_edges.clear()  # the autograd graph is the user's again
