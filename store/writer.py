"""The streaming write path: copy on the forward thread, encode and write in the background.

A saved tensor is copied off the live graph at once, on the forward thread (the copy
in-place ops cannot change): a small one straight into the current 4 MiB pack buffer of
its stream, a large one into a contiguous CPU copy. Full buffers and large copies go to
worker threads, which compute their statistics, encode and write them. Bytes in flight
are capped (``max_inflight``): when the cap is reached the forward pass waits, so peak
memory does not grow with the size of the capture.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tracelake.errors import StoreError
from tracelake.recorder.emit import SelectingEmitter, tensor_version
from tracelake.recorder.entries import OpTable
from tracelake.recorder.selectors import Selector
from tracelake.recorder.stats import Stats, compute_stats, segment_stats

from .tensors import (
    ALIGN,
    CHUNK_BYTES,
    RunArrays,
    numpy_dtype,
    pack_codec,
    pack_stream,
)

__all__ = ["DEFAULT_MAX_INFLIGHT", "Location", "StoreEmitter", "TensorWriter"]

DEFAULT_MAX_INFLIGHT = 256 << 20
_STRIDED = torch.strided
_TENSOR = torch.Tensor
# dtype -> (its pack, whether a plain numpy byte copy is exact for it)
_PLANS: dict[torch.dtype, tuple[str, bool]] = {}


@dataclass(slots=True)
class Location:
    """Where a saved tensor lives: a pack (byte offset) or its own array (offset -1)."""

    array: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    step: int
    codec: str = "raw"


class _Budget:
    """Bytes in flight, capped: ``take`` waits while the cap would be exceeded (one item
    larger than the cap still goes, alone)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.used = 0
        self.peak = 0
        self.waits = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> None:
        with self._cond:
            if self.used and self.used + nbytes > self.cap:
                self.waits += 1
                self._cond.wait_for(lambda: not self.used or self.used + nbytes <= self.cap)
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def give(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


@dataclass
class _Stream:
    """The open chunk of one pack: its buffer, where the next tensor goes, who is in it."""

    name: str
    chunk: int = 0
    buffer: np.ndarray | None = None
    used: int = 0
    members: list[tuple[int, int, int, torch.dtype, tuple[int, ...]]] = field(
        default_factory=list)


class TensorWriter:
    """Saves tensors of one run into its :class:`RunArrays`, in the background."""

    def __init__(self, arrays: RunArrays, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 workers: int = 2):
        if max_inflight < CHUNK_BYTES:
            raise ValueError(f"max_inflight must be at least {CHUNK_BYTES} bytes (one chunk)")
        self.arrays = arrays
        self.locations: list[Location] = []
        self.stats: dict[int, Stats] = {}
        self.step = 0
        self.bytes_written = 0
        self._budget = _Budget(max_inflight)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tracelake-w")
        self._pending: set[Future[None]] = set()
        self._errors: list[BaseException] = []
        self._streams: dict[str, _Stream] = {}
        self._free: list[np.ndarray] = []
        self._large_free: dict[int, list[torch.Tensor]] = {}
        self._large_pooled = 0
        self._lock = threading.Lock()

    # -- the forward thread --------------------------------------------------------------

    def save(self, tensor: torch.Tensor) -> int:
        """Copy ``tensor`` now and have it written; return its slot number.

        Runs once per saved tensor on the forward thread: few torch attribute reads, and
        per-dtype decisions (pack, fast copy) looked up, not recomputed."""
        if self._errors:
            raise StoreError(f"writing tensors failed: {self._errors[0]!r}") from self._errors[0]
        if tensor.layout is not _STRIDED:
            raise StoreError(f"cannot store a {tensor.layout} tensor (only strided tensors)")
        dtype = tensor.dtype
        shape: Any = tensor.shape
        nbytes = tensor.nbytes
        slot = len(self.locations)
        if nbytes >= CHUNK_BYTES:
            shape = tuple(shape)
            self._budget.take(nbytes)
            raw = self._large_buffer(nbytes)
            copy = raw.view(dtype).view(shape)
            copy.copy_(tensor.detach())
            self.locations.append(Location(f"t{slot}", -1, nbytes, shape, dtype, self.step))
            self._submit(self._write_array, slot, copy, raw)
            return slot
        plan = _PLANS.get(dtype)
        if plan is None:
            plan = _PLANS[dtype] = (pack_stream(dtype), numpy_dtype(dtype) is not None
                                    and not dtype.is_complex)
        name, plain = plan
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = _Stream(name)
        start = -(-stream.used // ALIGN) * ALIGN
        if start + nbytes > CHUNK_BYTES:
            self._flush(stream)
            start = 0
        if stream.buffer is None:
            stream.buffer = self._buffer()
        if nbytes:
            source = tensor.detach() if tensor.requires_grad else tensor
            copied = False
            if plain and type(source) is _TENSOR and source.is_contiguous() and \
                    source.device.type == "cpu":
                try:  # a plain byte copy through numpy: a third of torch's per-call cost
                    data = source.numpy()  # refuses tensors with the negative bit set
                    stream.buffer[start:start + nbytes] = data.reshape(-1).view(np.uint8)
                    copied = True
                except RuntimeError:
                    pass
            if not copied:
                region = torch.from_numpy(stream.buffer[start:start + nbytes])
                region.view(dtype).view(shape).copy_(source)
        shape = tuple(shape)
        stream.used = start + nbytes
        stream.members.append((slot, start, nbytes, dtype, shape))
        self.locations.append(Location(name, stream.chunk * CHUNK_BYTES + start, nbytes,
                                       shape, dtype, self.step, pack_codec(name)))
        return slot

    def _large_buffer(self, nbytes: int) -> torch.Tensor:
        """A byte buffer for a large copy: one that was written already if one of this
        size is free (freshly allocated memory costs page faults: 4x a copy into warm
        memory here), else a new one."""
        with self._lock:
            free = self._large_free.get(nbytes)
            if free:
                self._large_pooled -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def _buffer(self) -> np.ndarray:
        self._budget.take(CHUNK_BYTES)
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(CHUNK_BYTES, dtype=np.uint8)

    def _flush(self, stream: _Stream) -> None:
        if stream.buffer is not None and stream.members:
            self._submit(self._write_chunk, stream.name, stream.chunk, stream.buffer,
                         stream.used, stream.members)
            stream.chunk += 1
            stream.buffer = None
        stream.used = 0
        stream.members = []

    def _submit(self, fn: Any, *args: Any) -> None:
        future = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)
        exc = future.exception()
        if exc is not None:
            self._errors.append(exc)

    # -- worker threads ---------------------------------------------------------------------

    def _write_chunk(self, name: str, chunk: int, buffer: np.ndarray, used: int,
                     members: list[tuple[int, int, int, torch.dtype, tuple[int, ...]]]) -> None:
        try:
            self.stats.update(_chunk_stats(buffer, members))
            self.arrays.write_pack_chunk(name, chunk, buffer[:used])
            self.bytes_written += used
        finally:
            with self._lock:
                self._free.append(buffer)
            self._budget.give(CHUNK_BYTES)

    def _write_array(self, slot: int, copy: torch.Tensor, raw: torch.Tensor) -> None:
        nbytes = raw.numel()
        try:
            self.stats[slot] = compute_stats(copy)
            self.locations[slot].codec = self.arrays.write_array(f"t{slot}", copy)
            self.bytes_written += nbytes
        finally:
            with self._lock:  # keep it for the next copy of this size, within a quarter cap
                if self._large_pooled + nbytes <= self._budget.cap // 4:
                    self._large_free.setdefault(nbytes, []).append(raw)
                    self._large_pooled += nbytes
            self._budget.give(nbytes)

    # -- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """Write what is buffered, wait for the workers; raise if any write failed."""
        for stream in self._streams.values():
            self._flush(stream)  # the last shard: as many inner chunks as it fills
        self._pool.shutdown(wait=True)
        if self._errors:
            raise StoreError(f"writing tensors failed: {self._errors[0]!r}") from self._errors[0]

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def peak_inflight(self) -> int:
        return self._budget.peak


_Member = tuple[int, int, int, torch.dtype, tuple[int, ...]]  # slot, start, nbytes, dtype, shape
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_GATHER_MAX = 16 << 10  # bytes


def _chunk_stats(buffer: np.ndarray, members: list[_Member]) -> dict[int, Stats]:
    """Statistics of every tensor packed in one chunk: per dtype, one gather of all their
    elements and a few segmented reductions (``segment_stats``); the odd ones (complex,
    empty, NaN/Inf, mean-dominated) one by one."""
    out: dict[int, Stats] = {}
    groups: dict[torch.dtype, list[_Member]] = {}
    raw = torch.from_numpy(buffer)

    def single(member: _Member) -> Stats:
        _, start, nbytes, dtype, shape = member
        if not nbytes:
            return compute_stats(torch.empty(shape, dtype=dtype))
        return compute_stats(raw[start:start + nbytes].view(dtype).view(shape))

    for member in members:
        dtype = member[3]
        # Gathering pays for tiny tensors (one numpy pass instead of torch calls each);
        # a larger one is cheaper through compute_stats's reductions on its own view.
        if 0 < member[2] <= _GATHER_MAX and not dtype.is_complex and dtype.itemsize in _UNSIGNED:
            groups.setdefault(dtype, []).append(member)
        else:
            out[member[0]] = single(member)
    for dtype, group in groups.items():
        item = dtype.itemsize
        starts = np.fromiter((m[1] // item for m in group), np.int64, len(group))
        counts = np.fromiter((m[2] // item for m in group), np.int64, len(group))
        ends = np.cumsum(counts)
        index = np.arange(int(ends[-1])) + np.repeat(starts - (ends - counts), counts)
        bits = buffer.view(_UNSIGNED[item])[index]
        native = numpy_dtype(dtype)
        if native is not None and dtype is not torch.bool:
            values = bits.view(native).astype(np.float64)
        else:  # bfloat16, float8, bool: torch knows them
            values = torch.from_numpy(bits).view(dtype).to(torch.float64).numpy()
        for member, stats in zip(group, segment_stats(values, counts), strict=True):
            out[member[0]] = stats if stats is not None else single(member)
    return out


class StoreEmitter(SelectingEmitter):
    """The emitter of one step of a stored run: selected tensors go to a
    :class:`TensorWriter`; module entries point at the slots they were saved in."""

    def __init__(self, selector: Selector, stats: str, table: OpTable, writer: TensorWriter):
        super().__init__(selector, stats, table)
        self._writer = writer
        self._versions: dict[int, int | None] = {}

    def _keep(self, tensor: torch.Tensor) -> int:
        slot = self._writer.save(tensor)
        self._versions[slot] = tensor_version(tensor)
        return slot

    def _holds(self, slot: int, tensor: torch.Tensor) -> bool:
        version = self._versions.get(slot)
        return version is not None and version == tensor_version(tensor)

    @property
    def op_slots(self) -> dict[int, int]:
        return self._op_slot

    @property
    def unsaved_stats(self) -> dict[int, Stats]:
        return self._stats
