"""The streaming write path: copy on the forward thread, encode and write in the background.

A small saved tensor is copied at once, on the forward thread, straight into the current
4 MiB pack buffer of its stream (the copy no later in-place op can change); of a mid-size
one only the bytes around the whole 64 KiB inner chunks it covers, which the workers write
from its memory as they do large tensors (``inflight.Packed``); a strided mid-size one is
gathered into its place in the buffer by a worker, just before the chunk is written
(``Packed.gather``), under the same rules. A large CPU
tensor is written by the workers from where it is, and copied only if something may
write it first: an in-place op the recorder sees, or the end of the step while anything
else holds it (``inflight.Live``); large tensors elsewhere (GPU, views of larger
storages) are copied at once. Worker threads compute statistics, encode and write; bytes
in flight are capped (``max_inflight``): when the cap is reached the forward pass waits,
so peak memory does not grow with the size of the capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from tracelake.errors import StoreError
from tracelake.recorder import compiled
from tracelake.recorder.backward import GradEdges
from tracelake.recorder.emit import SelectingEmitter, storage_address, tensor_version
from tracelake.recorder.entries import SHAPE, OpTable
from tracelake.recorder.forks import fork_safe_lock
from tracelake.recorder.selectors import Selector
from tracelake.recorder.stats import (
    GATHER_MAX,
    UNSIGNED,
    Stats,
    combine_stats,
    compute_stats,
    fused_stats,
    gatherable,
    gathered_values,
    partial_stats,
    segment_moments,
)

from .dtypes import memory_tensor, numpy_dtype
from .format import ALIGN, CHUNK_BYTES, INNER_BYTES, pack_codec, pack_stream
from .inflight import (
    Buffers,
    Live,
    Overwritten,
    Packed,
    alias_version,
    gather_version,
    storage_holders,
)
from .layout import DEFAULT_MAX_INFLIGHT, full_hint
from .rows import distinct_codes
from .tensors import RunArrays

__all__ = ["DEFAULT_MAX_INFLIGHT", "Location", "StoreEmitter", "TensorWriter"]

_STRIDED = torch.strided
_TENSOR = torch.Tensor
_memmove = ctypes.memmove
_memset = ctypes.memset
# Fields of TensorWriter.slots: one plain tuple per saved tensor (array, byte offset or
# -1, nbytes, shape, dtype, step), appended on the forward thread, so built as cheaply as
# Python allows, and of plain values only: the garbage collector then stops tracking
# them (a torch.Size in each kept every tuple of a run under watch, and made full
# collections of the process frequent and slow).
ARRAY: Final = 0
_OFFSET_FIELD: Final = 1
NBYTES: Final = 2
_OFFSET, _NBYTES, _DTYPE = (operator.itemgetter(k) for k in (1, 2, 4))


class Location(NamedTuple):
    """Where a saved tensor lives: a pack (byte offset) or its own array (offset -1)."""

    array: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    step: int
    codec: str = "raw"


@dataclass(eq=False)
class _Stream:
    """The open chunk of one pack: its buffer (and that buffer's address), where the next
    tensor goes, and the slots of the tensors in it."""

    name: str
    chunk: int = 0
    buffer: np.ndarray | None = None
    address: int = 0
    used: int = 0
    members: list[int] = field(default_factory=list)
    refs: list[Packed] = field(default_factory=list)  # members written from their memory


#: What a writer that ended (closed or aborted) answers a late ``save``: its workers are
#: gone, and bytes its cancelled writes still count in flight would make ``save`` wait
#: for room for ever (a stale hook of an ended recording calling it).
_ENDED = StoreError("this run's recording has ended: its writer takes no more tensors")


class TensorWriter:
    """Saves tensors of one run into its :class:`RunArrays`, in the background.

    ``slots`` holds one tuple per saved tensor, indexed by slot: (array, byte offset or
    -1, nbytes, shape, dtype, step); ``location(slot)`` names the fields."""

    def __init__(
        self,
        arrays: RunArrays,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        workers: int = 2,
        sync: bool = True,
    ):
        """``sync=False``: files are written back and closed here, made durable by the
        caller, many at once (a store's run at its commit, a batch of runs at the
        batch's: ``layout.durable_trees``; ``local.Unsynced``)."""
        if max_inflight < CHUNK_BYTES:
            raise ValueError(f"max_inflight must be at least {CHUNK_BYTES} bytes (one chunk)")
        self.arrays = arrays
        self.slots: list[tuple[str, int, int, Any, torch.dtype, int]] = []
        self.codecs: dict[int, str] = {}  # own arrays' codecs (a pack's follows its name)
        # statistics: tiny packed tensors' in batches (slots, moments), the rest one by one
        self._batches: list[tuple[np.ndarray, np.ndarray]] = []
        self.stats: dict[int, Stats] = {}
        self.step = 0
        self.bytes_written = 0
        self._buffers = Buffers(max_inflight)
        self._unsynced = arrays.pending(sync)  # writes made durable by the end of close()
        self._pool = _worker_pool(workers)
        self._pending: set[Future[None]] = set()
        self._errors: list[BaseException] = []
        self._streams: dict[str, _Stream] = {}
        # dtype -> (its pack's stream, whether a plain byte copy of its memory is exact)
        self._plans: dict[torch.dtype, tuple[_Stream, bool]] = {}
        self._lock = threading.Lock()
        # storage address -> large tensors the workers read from the forward's memory
        self._live: dict[int, list[Live]] = {}
        #: slots whose tensor was written in place, unseen, while being stored: dropped
        self.lost: set[int] = set()
        #: slots that name another slot's bytes with a shape of their own (``alias``)
        self._aliases: dict[int, int] = {}

    # -- the forward thread --------------------------------------------------------------

    def save(self, tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> int:
        """Copy ``tensor`` now and have it written; return its slot number. ``shape``:
        ``tuple(tensor.shape)`` when the caller has it already.

        Runs once per saved tensor on the forward thread: a small CPU tensor costs a few
        attribute reads, one ``memmove`` into its pack's open buffer and one tuple."""
        if self._errors:
            raise self._failure()
        if tensor.layout is not _STRIDED:
            raise StoreError(f"cannot store a {tensor.layout} tensor (only strided tensors)")
        nbytes = tensor.nbytes
        if nbytes >= CHUNK_BYTES:
            return self._save_large(tensor, nbytes)
        dtype = tensor.dtype
        stream, plain = self._plans.get(dtype) or self._plan(dtype)
        start = (stream.used + ALIGN - 1) & -ALIGN
        if start + nbytes > CHUNK_BYTES:
            self._flush(stream)
            start = 0
        if stream.buffer is None:
            self._make_room(CHUNK_BYTES)
            stream.buffer = self._buffers.take(CHUNK_BYTES)
            stream.address = stream.buffer.ctypes.data
        elif start > stream.used:  # the padding: zeros, not what a reused buffer held
            _memset(stream.address + stream.used, 0, start - stream.used)
        slot = len(self.slots)
        if nbytes:
            if (
                plain
                and tensor.is_cpu
                and type(tensor) is _TENSOR
                and tensor.is_contiguous()
                and not tensor.is_neg()
            ):
                # The tensor's bytes as they are, by one ctypes memmove: the cheapest
                # copy per call from Python (numpy's copy and torch's copy_ into a view
                # of the buffer both cost several times more per small tensor). The
                # whole inner chunks of a mid-size one are not copied (``_refer``).
                head = -start % INNER_BYTES
                whole = (nbytes - head) & -INNER_BYTES if nbytes > head else 0
                address = tensor.data_ptr()
                if whole and self._refer(stream, tensor, slot, start + head, head, whole):
                    _memmove(stream.address + start, address, head)
                    rest = head + whole
                    _memmove(stream.address + start + rest, address + rest, nbytes - rest)
                else:
                    _memmove(stream.address + start, address, nbytes)
            elif not (plain and nbytes >= GATHER_BYTES) or not self._gather_later(
                stream, tensor, slot, start
            ):
                region = torch.from_numpy(stream.buffer[start : start + nbytes])
                region.view(dtype).view(tensor.shape).copy_(tensor.detach())
        stream.used = start + nbytes
        stream.members.append(slot)
        self.slots.append(
            (
                stream.name,
                stream.chunk * CHUNK_BYTES + start,
                nbytes,
                tuple(tensor.shape) if shape is None else shape,
                dtype,
                self.step,
            )
        )
        return slot

    def alias(self, slot: int, shape: tuple[int, ...]) -> int:
        """A new slot for the bytes saved in ``slot``, read with ``shape`` (same number
        of elements): a view of a tensor already saved, with its contents unchanged.
        Nothing is copied or written; its statistics are ``slot``'s."""
        array, offset, nbytes, _shape, dtype, _step = self.slots[slot]
        new = len(self.slots)
        self.slots.append((array, offset, nbytes, shape, dtype, self.step))
        self._aliases[new] = self._aliases.get(slot, slot)
        return new

    def _plan(self, dtype: torch.dtype) -> tuple[_Stream, bool]:
        name = pack_stream(dtype)
        stream = self._streams.get(name)
        if stream is None:  # (its metadata: written with its first shard, write_pack_chunk)
            stream = self._streams[name] = _Stream(name)
        # numpy knowing the dtype means its bytes are plain values (not complex: conj bit)
        plain = numpy_dtype(dtype) is not None and not dtype.is_complex
        plan = self._plans[dtype] = (stream, plain)
        return plan

    def _refer(
        self, stream: _Stream, tensor: torch.Tensor, slot: int, start: int, skip: int, whole: int
    ) -> bool:
        """Have the workers write the ``whole`` bytes of ``tensor`` from ``skip`` on (whole
        inner chunks of the open chunk, from ``start``) from the tensor's own memory, as
        large tensors are (``_save_large``): copied into the chunk's buffer only if
        something may write the tensor first (``before_write``, ``settle``). Whether it
        could: a tensor the workers may read in place, and room in flight for its bytes
        now (else it is copied at once, as small ones are)."""
        version = alias_version(tensor, tensor.nbytes)
        if version is None or not self._buffers.try_hold(whole):
            return False
        assert stream.buffer is not None
        region = stream.buffer[start : start + whole]
        self._reference(
            stream,
            tensor,
            Packed(
                tensor.detach(), whole, version, slot=slot, start=start, skip=skip, region=region
            ),
        )
        return True

    def _gather_later(self, stream: _Stream, tensor: torch.Tensor, slot: int, start: int) -> bool:
        """Have a worker gather a strided ``tensor`` (GPT-2's per-head views) into its place
        in the open chunk, from ``start``, just before writing the chunk (``Packed.gather``),
        rather than the forward thread now; under the same rules as ``_refer``: gathered
        sooner by whatever may write it first. Whether it could (else copy it now)."""
        known = gather_version(tensor, tensor.nbytes)
        if known is None or not self._buffers.try_hold(known[1]):
            return False
        assert stream.buffer is not None
        region = stream.buffer[start : start + tensor.nbytes]
        self._reference(
            stream,
            tensor,
            Packed(
                tensor.detach(),
                known[1],
                known[0],
                slot=slot,
                start=start,
                region=region,
                gather=True,
            ),
        )
        return True

    def _reference(self, stream: _Stream, tensor: torch.Tensor, ref: Packed) -> None:
        stream.refs.append(ref)
        self._live.setdefault(tensor.untyped_storage().data_ptr(), []).append(ref)

    def _make_room(self, nbytes: int) -> None:
        """Before the forward thread waits for room in flight: copy the tensors the open
        chunks still read from the forward's memory into those chunks' buffers, where
        their bytes are counted already (they count twice until then), so that no wait
        is for room only the forward itself can give back."""
        if self._buffers.fits(nbytes):
            return
        for stream in self._streams.values():
            for ref in stream.refs:
                self._copy_live(ref)

    def _save_large(self, tensor: torch.Tensor, nbytes: int) -> int:
        """A tensor of a chunk or more, with an array of its own. A plain contiguous CPU
        tensor is not copied: the workers write it from where it is (a copy would cost the
        forward time in proportion to its size, more still into fresh memory), and it is
        copied only if something may write it before they are done: an in-place op the
        recorder sees
        (``before_write``), or the end of the step while anything else holds it
        (``settle``). A write the recorder cannot see moves its version counter: that
        tensor is then dropped, with a warning, never stored wrong."""
        dtype = tensor.dtype
        shape = tuple(tensor.shape)
        slot = len(self.slots)
        version = alias_version(tensor, nbytes)
        self._make_room(nbytes)
        if version is not None:
            self._buffers.hold(nbytes)
            live = Live(tensor.detach(), nbytes, version)
            self._live.setdefault(tensor.untyped_storage().data_ptr(), []).append(live)
        else:
            buffer = self._buffers.take(nbytes)
            try:
                copy = torch.from_numpy(buffer).view(dtype).view(shape)
                copy.copy_(tensor.detach())
            except BaseException:
                self._buffers.give(buffer)
                raise
            live = Live(copy, nbytes, None, buffer)
        self.slots.append((f"t{slot}", -1, nbytes, shape, dtype, self.step))
        self._submit(self._write_array, slot, live)
        return slot

    def before_write(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is about to be written in place: copy what the workers
        still read from it."""
        address = storage_address(tensor) if self._live else None
        for live in self._live.pop(address, ()) if address is not None else ():
            self._copy_live(live)

    def settle(self) -> None:
        """The end of a step: copy what the workers still read from memory anything
        besides this writer holds (the step's output, its inputs, caches), since what
        holds it may write it next; the forward's own temporaries stay uncopied."""
        for address, lives in list(self._live.items()):
            waiting = [live for live in lives if not live.done and live.version is not None]
            holders = storage_holders(waiting[0]) if waiting else 0
            if waiting and (holders is None or holders > len(waiting)):
                for live in waiting:
                    self._copy_live(live)
                waiting = []
            if waiting:
                self._live[address] = waiting
            else:
                del self._live[address]

    def _copy_live(self, live: Live) -> None:
        if isinstance(live, Packed):
            with live.lock:
                copied = live.copy()
            if copied:  # its bytes now in the chunk's buffer, already counted
                self._buffers.release(live.nbytes)
            return
        with live.lock:
            if live.done or live.version is None or live.source is None:
                return
            if live.source._version != live.version:  # already written behind our back
                return  # the worker finds out at its next chunk
            buffer = self._buffers.buffer(live.nbytes)  # its bytes are already counted
            copy = torch.from_numpy(buffer).view(live.source.dtype).view(live.source.shape)
            copy.copy_(live.source)
            live.source, live.buffer, live.version = copy, buffer, None

    def _flush(self, stream: _Stream) -> None:
        if stream.buffer is not None and stream.members:
            self._submit(
                self._write_chunk,
                stream.name,
                stream.chunk,
                stream.buffer,
                stream.used,
                stream.members,
                stream.refs,
            )
            stream.chunk += 1
            stream.buffer = None
        stream.used = 0
        stream.members = []
        stream.refs = []

    def _write_here(self, stream: _Stream) -> None:
        """Write ``stream``'s open chunk on the calling thread (its error kept as a
        worker's would be, raised by ``close``)."""
        buffer, chunk, used, members = stream.buffer, stream.chunk, stream.used, stream.members
        assert buffer is not None
        stream.chunk += 1
        stream.buffer, stream.used, stream.members = None, 0, []
        try:
            self._write_chunk(stream.name, chunk, buffer, used, members, [])
        except Exception as exc:
            self._errors.append(exc)

    def _submit(self, fn: Any, *args: Any) -> None:
        future = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        # its error first: a future no longer pending has its error in _errors
        exc = None if future.cancelled() else future.exception()  # (cancelled: abort())
        if exc is not None and exc not in self._errors:
            self._errors.append(exc)
        with self._lock:
            self._pending.discard(future)

    def _drain(self, cancel: bool = False) -> None:
        """Wait for this writer's work in the shared pool (``cancel``: what has not
        started is dropped), its errors then in ``_errors`` (``wait`` may return before
        a future's done-callback ran: each future's error is read here too)."""
        while True:
            with self._lock:
                futures = list(self._pending)
            if not futures:
                return
            if cancel:
                for future in futures:
                    future.cancel()
            wait(futures)
            for future in futures:
                self._done(future)

    # -- worker threads ---------------------------------------------------------------------

    def _write_chunk(
        self,
        name: str,
        chunk: int,
        buffer: np.ndarray,
        used: int,
        members: list[int],
        refs: list[Packed],
    ) -> None:
        # What reads the forward's tensors (numpy views, the tensors by slot): emptied
        # before they are marked done, so that a done tensor has no holder here left for
        # the end of the step to count (``settle``: it copies one held outside the writer)
        sources: list[tuple[int, np.ndarray, np.ndarray | None]] = []
        tensors: dict[int, torch.Tensor] = {}
        try:
            with contextlib.ExitStack() as locked:
                for ref in refs:  # held still while read: statistics, checksums, write
                    locked.enter_context(ref.lock)
                raw = not pack_codec(name).compressors  # (its checksums: of the bytes)
                known: dict[int, Stats] = {}
                for ref in refs:  # strided ones: gathered into their place, now
                    if ref.gather and ref.copy():
                        self._buffers.release(ref.nbytes)  # (now in the buffer's bytes)
                        if raw:
                            self._checked_gathered(ref, buffer, sources, known)
                for ref in refs:
                    bits = ref.referenced()
                    if bits is not None:
                        assert ref.source is not None
                        crcs = None
                        if raw and ref.source.dtype is torch.float32:
                            crcs, known[ref.slot] = _checked_stats(ref.source, ref.skip, bits)
                        sources.append((ref.start, bits, crcs))
                        if ref.slot not in known:  # (its statistics from a tensor on the
                            tensors[ref.slot] = memory_tensor(ref.source)  # memory: no handle)
                bits = None
                batches, singles = _chunk_stats(
                    buffer, chunk * CHUNK_BYTES, members, self.slots, tensors, known
                )
                self._batches.extend(batches)
                self.stats.update(singles)
                self.arrays.write_pack_chunk(name, chunk, buffer[:used], self._unsynced, sources)
                for ref in refs:  # written in place behind our back, before or while read
                    if ref.source is not None and ref.source._version != ref.version:
                        self.lost.add(ref.slot)
            with self._lock:
                self.bytes_written += used
        finally:
            sources.clear()
            tensors.clear()
            for ref in refs:
                with ref.lock:
                    held = ref.source is not None and ref.version is not None
                    ref.done, ref.source = True, None
                if held:
                    self._buffers.release(ref.nbytes)
            self._buffers.give(buffer)

    def _checked_gathered(
        self,
        ref: Packed,
        buffer: np.ndarray,
        sources: list[tuple[int, np.ndarray, np.ndarray | None]],
        known: dict[int, Stats],
    ) -> None:
        """A float32 tensor just gathered into ``buffer`` (a raw pack's): its statistics
        and the CRC32C of the whole inner chunks it covers in one compiled pass, as for
        one written from its own memory (``_checked_stats``), those inner chunks then
        given to the shard writer with their checksums (``sources``: from the buffer)."""
        _, _, nbytes, shape, dtype, _ = self.slots[ref.slot]
        head = -ref.start % INNER_BYTES
        whole = (nbytes - head) & -INNER_BYTES if nbytes > head else 0
        if dtype is not torch.float32 or not whole:
            return
        placed = torch.from_numpy(buffer[ref.start : ref.start + nbytes]).view(dtype).view(shape)
        bits = buffer[ref.start + head : ref.start + head + whole]
        crcs, known[ref.slot] = _checked_stats(placed, head, bits)
        sources.append((ref.start + head, bits, crcs))

    def _write_array(self, slot: int, live: Live) -> None:
        try:
            partials: list[tuple[float, ...]] = []  # each chunk's, reduced while in cache
            assert live.source is not None
            self.codecs[slot] = self.arrays.write_array(
                f"t{slot}",
                live.source,
                None
                if live.source.is_complex()
                else lambda part: partials.append(partial_stats(part)),
                self._unsynced,
                live.reading,
            )
            with live.reading() as tensor:
                self.stats[slot] = combine_stats(memory_tensor(tensor), partials)
            del tensor
            with self._lock:
                self.bytes_written += live.nbytes
        except Overwritten:
            self.lost.add(slot)
        finally:
            with live.lock:
                live.done = True
                live.source = None
            if live.buffer is not None:
                self._buffers.give(live.buffer)
            else:
                self._buffers.release(live.nbytes)

    # -- the end -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Hand what is buffered to the workers, without waiting (``close`` waits). A
        small last chunk (:func:`_inline`) stays for ``close`` to write."""
        for stream in self._streams.values():
            if not _inline(stream):
                self._flush(stream)  # the last shard: as many inner chunks as it fills

    def close(self) -> None:
        """Write what is buffered, wait for the workers; raise if any write failed. Small
        last chunks are written here, on the calling thread (:func:`_inline`)."""
        small = [stream for stream in self._streams.values() if _inline(stream)]
        self.flush()
        for stream in small:
            self._write_here(stream)
        self._drain()
        self._buffers.clear()
        if not self._errors:
            try:
                self.arrays.finish_packs()
            except (OSError, StoreError) as exc:
                self._errors.append(exc)
        try:
            self._unsynced.close(durable=not self._errors)
        except OSError as exc:
            self._errors.append(exc)
        for slot in self.lost:  # what was written of them is not theirs
            if self.slots[slot][_OFFSET_FIELD] < 0:  # an own array (a pack keeps others)
                self.arrays.delete(f"t{slot}")
        self.lost.update(a for a, slot in self._aliases.items() if slot in self.lost)
        if self._errors:
            raise self._failure()
        self._errors.append(_ENDED)

    def _failure(self) -> StoreError:
        first = self._errors[0]
        if first is _ENDED:
            return StoreError(str(_ENDED))
        error = StoreError(f"writing tensors failed: {first!r}{full_hint(first)}")
        error.__cause__, error.__suppress_context__ = first, True  # (raise ... from first)
        return error

    def abort(self) -> None:
        self._errors.append(_ENDED)
        self._drain(cancel=True)
        self._buffers.clear()
        self._unsynced.close(durable=False)

    def stat_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """Every slot's statistics (after :meth:`close`): a (slots + 1, 9) float64 array,
        columns in :class:`Stats` field order, and where each is defined (False where a
        statistic is ``None``). The extra last row is all undefined, so that index -1
        reads as 'no statistics'."""
        n = len(self.slots)
        values = np.zeros((n + 1, len(_STAT_FIELDS)))
        valid = np.zeros((n + 1, len(_STAT_FIELDS)), dtype=bool)
        for slots, moments in self._batches:
            values[slots, : moments.shape[1]] = moments  # NaN and Inf counts: 0
            valid[slots] = True
        for slot, stats in self.stats.items():
            row = [getattr(stats, name) for name in _STAT_FIELDS]
            values[slot] = [0.0 if v is None else v for v in row]
            valid[slot] = [v is not None for v in row]
        if self._aliases:
            aliases = np.fromiter(self._aliases, np.int64, len(self._aliases))
            sources = np.fromiter(self._aliases.values(), np.int64, len(self._aliases))
            values[aliases], valid[aliases] = values[sources], valid[sources]
        return values, valid

    def codec(self, array: str) -> str:
        """The codec of an array this writer wrote (own arrays are named ``t<slot>``)."""
        if array[0] == "t":
            return self.codecs.get(int(array[1:]), "raw")
        return pack_codec(array).name

    def location(self, slot: int) -> Location:
        return Location(*self.slots[slot], codec=self.codec(self.slots[slot][ARRAY]))

    @property
    def locations(self) -> list[Location]:
        """Every slot's :class:`Location` (built on demand, not on the forward thread)."""
        return [self.location(slot) for slot in range(len(self.slots))]

    @property
    def peak_inflight(self) -> int:
        return self._buffers.peak

    @property
    def budget_waits(self) -> int:
        return self._buffers.waits


_STAT_FIELDS = tuple(f.name for f in fields(Stats))

#: A stream's last chunk up to this size, holding only copied bytes, is written by
#: ``close`` on its own thread: handing it to a worker (a future, a wake-up, the GIL
#: passed back and forth) costs more than writing it, most of a tiny run's writing.
INLINE_BYTES: Final = 256 << 10


def _inline(stream: _Stream) -> bool:
    """Whether ``stream``'s open chunk is one ``close`` writes itself."""
    return (
        stream.buffer is not None
        and bool(stream.members)
        and not stream.refs
        and stream.used <= INLINE_BYTES
    )


def _checked_stats(
    tensor: torch.Tensor, skip: int, whole: np.ndarray
) -> tuple[np.ndarray | None, Stats]:
    """The CRC32C of each inner chunk of ``whole`` (a contiguous float32 tensor's bytes
    from ``skip`` on) and the tensor's statistics, in one compiled pass over its memory
    (``_hot.crc_moments_f32``: each 64 KiB checksummed and reduced while in cache; two
    passes cost a run's workers ~a quarter more CPU, memory read twice). The checksums
    are None where the compiled pass is missing (``encode_shard`` computes them)."""
    hot = compiled.hot()
    if hot is None or not hasattr(hot, "crc_moments_f32"):
        return None, compute_stats(tensor)
    layout = (tensor.data_ptr(), tensor.numel(), 1, tensor.numel())
    crcs = np.empty(whole.nbytes // INNER_BYTES, dtype=np.uint32)
    moments = hot.crc_moments_f32(
        layout[0], layout[1], skip, len(crcs), INNER_BYTES, crcs.ctypes.data
    )
    return crcs, fused_stats(tensor, layout, moments)


# A chunk's statistics: (slots, their (k, 7) moments from segment_moments) per batch,
# and the tensors computed one by one.
_ChunkStats = tuple[list[tuple[np.ndarray, np.ndarray]], dict[int, Stats]]
#: Up to this many members, a chunk whose tensors are all tiny and of one dtype gathers
#: their bytes by slices (a Python loop each), not by an index array.
_FEW: Final = 64


def _chunk_stats(
    buffer: np.ndarray,
    base: int,
    members: list[int],
    slots: list[tuple[str, int, int, Any, torch.dtype, int]],
    tensors: dict[int, torch.Tensor] | None = None,
    known: dict[int, Stats] | None = None,
) -> _ChunkStats:
    """Statistics of every tensor packed in one chunk (the one at byte ``base`` of its
    pack): per dtype, one gather of all the tiny tensors' elements and a few segmented
    reductions (``segment_moments``); larger and odd ones (complex, empty, NaN/Inf,
    mean-dominated) one by one. The members' fields come out as arrays, not through a
    Python loop (a chunk holds up to 65,536 tensors). ``tensors``: members whose bytes
    are not all in ``buffer`` (written from their own memory), by slot; ``known``: members
    whose statistics are computed already."""
    singles: dict[int, Stats] = {}
    raw = torch.from_numpy(buffer)

    def single(slot: int) -> Stats:
        if known and slot in known:
            return known[slot]
        _, offset, nbytes, shape, dtype, _ = slots[slot]
        if tensors and slot in tensors:
            return compute_stats(tensors[slot])
        if not nbytes:
            return compute_stats(torch.empty(shape, dtype=dtype))
        start = offset - base
        return compute_stats(raw[start : start + nbytes].view(dtype).view(shape))

    rows = list(map(slots.__getitem__, members))
    if not any(0 < row[NBYTES] <= GATHER_MAX for row in rows):  # none to gather (mid-size
        return [], {slot: single(slot) for slot in members}  # ones: GPT-2's chunks)
    count = len(rows)
    dtype = rows[0][4]
    if (
        count <= _FEW
        and gatherable(dtype)
        and all(row[4] is dtype and 0 < row[NBYTES] <= GATHER_MAX for row in rows)
    ):  # (a few tiny tensors of one dtype, a small run's: the same values, gathered by
        # one concatenate of their bytes rather than ~15 numpy calls building an index)
        item = dtype.itemsize
        bits = np.concatenate(
            [buffer[row[1] - base : row[1] - base + row[NBYTES]] for row in rows]
        ).view(UNSIGNED[item])
        counts = np.fromiter((row[NBYTES] // item for row in rows), np.int64, count)
        moments, good = segment_moments(gathered_values(bits, dtype), counts)
        chosen = np.array(members, dtype=np.int64)
        return [(chosen[good], moments[good])], {
            slot: single(slot) for slot in chosen[~good].tolist()
        }
    offsets = np.fromiter(map(_OFFSET, rows), np.int64, count) - base
    sizes = np.fromiter(map(_NBYTES, rows), np.int64, count)
    dtypes, dtype_of = distinct_codes(list(map(_DTYPE, rows)))
    chosen = np.array(members, dtype=np.int64)
    # Gathering pays for tiny tensors (one numpy pass instead of torch calls each); a
    # larger one is cheaper through compute_stats's reductions on its own view.
    tiny = (sizes > 0) & (sizes <= GATHER_MAX)
    batches = []
    for code, dtype in enumerate(dtypes):
        mine = dtype_of == code if len(dtypes) > 1 else np.ones(count, dtype=bool)
        batch = mine & tiny if gatherable(dtype) else np.zeros(count, dtype=bool)
        for k in np.flatnonzero(mine & ~batch).tolist():
            singles[members[k]] = single(members[k])
        if not batch.any():
            continue
        item = dtype.itemsize
        starts, counts = offsets[batch] // item, sizes[batch] // item
        ends = np.cumsum(counts)
        index = np.arange(int(ends[-1])) + np.repeat(starts - (ends - counts), counts)
        bits = buffer.view(UNSIGNED[item])[index]
        moments, good = segment_moments(gathered_values(bits, dtype), counts)
        batch_slots = chosen[batch]
        batches.append((batch_slots[good], moments[good]))
        for slot in batch_slots[~good].tolist():
            singles[slot] = single(slot)
    return batches, singles


class StoreEmitter(SelectingEmitter):
    """The emitter of one step of a stored run: selected tensors go to a
    :class:`TensorWriter`; module entries point at the slots they were saved in."""

    def __init__(
        self,
        selector: Selector,
        stats: str,
        table: OpTable,
        writer: TensorWriter,
        grads: GradEdges | None = None,
    ):
        super().__init__(selector, stats, table, grads)
        self._writer = writer
        self._save = writer.save
        self._rows = table.rows
        self._versions: dict[int, int] = {}
        # the bytes of saved packed tensors: (address, nbytes, dtype, device) -> (the
        # tensor, its version then, its slot), for tensors reshaped from them (_same_bytes)
        self._bytes: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], int, int]] = {}
        hot = compiled.hot()
        if hot is not None and self.saves_all and grads is None:
            # The common small tensor's entry compiled (recorder/_hot.c, ``Packer``): what
            # on_entry -> _keep -> TensorWriter.save do for it, without their frames; any
            # other entry goes to the Python below, the reference.
            self.on_entry = hot.Packer(  # type: ignore[method-assign]
                self.on_entry,
                writer,
                writer.slots,
                writer._plans,
                writer._errors,
                self._rows,
                self.op_slots,
                self._versions,
                _TENSOR,
                _STRIDED,
                (CHUNK_BYTES, ALIGN, ALIAS_BYTES),
            )

    def before_write(self, tensor: torch.Tensor) -> None:
        self._writer.before_write(tensor)

    def on_entry(self, index: int, tensor: torch.Tensor, same_as: int) -> None:
        if self.saves_all and same_as < 0:  # saving all, a new tensor: straight on
            if self.grad_edges is not None:
                self.grad_edges.add(index, tensor)
            self.op_slots[index] = self._keep(tensor, self._rows[index][SHAPE])
        else:
            super().on_entry(index, tensor, same_as)

    def _keep(self, tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> int:
        try:
            version = tensor._version
        except (RuntimeError, AttributeError):  # inference tensors track no version
            return self._save(tensor, shape)
        key = _bytes_key(tensor)
        if key is not None:
            same = self._same_bytes(key, tensor, version)
            if same is not None:  # a reshape of bytes saved already: written once
                slot = self._writer.alias(same, tuple(tensor.shape) if shape is None else shape)
                self._versions[slot] = version
                return slot
        slot = self._save(tensor, shape)
        self._versions[slot] = version
        if key is not None and self._writer.slots[slot][_OFFSET_FIELD] >= 0:
            self._bytes[key] = (weakref.ref(tensor), version, slot)
        return slot

    def _same_bytes(self, key: tuple[Any, ...], tensor: torch.Tensor, version: int) -> int | None:
        """The slot of a packed tensor saved in this step whose bytes are ``tensor``'s
        now: the same contiguous bytes (address, length, dtype) of the same base tensor
        (so one version counter), with no write since it was saved; else None. (GPT-2's
        ``view`` of each linear layer's input and output: 51 of its 185 saved tensors,
        41 of its 159 MiB.)"""
        known = self._bytes.get(key)
        if known is None:
            return None
        ref, when, slot = known
        first = ref()
        if first is None or when != version:
            return None
        base = tensor._base if tensor._base is not None else tensor
        if base is not (first._base if first._base is not None else first):
            return None
        return slot if first._version == version else None

    def _holds(self, slot: int, tensor: torch.Tensor) -> bool:
        version = self._versions.get(slot)
        return version is not None and version == tensor_version(tensor)


#: Strided packed tensors from this size on, of dtypes numpy knows (not complex: a copy
#: that may fail, a quantized tensor's, fails at ``save`` as before), are gathered into
#: their pack's buffer by a worker (``TensorWriter._gather_later``), not by the forward
#: thread; a smaller one's copy costs less than the bookkeeping.
GATHER_BYTES: Final = INNER_BYTES

#: Tensors from this size on that reshape the bytes of one saved before are stored as
#: an alias of its slot (``StoreEmitter._same_bytes``); below it, looking costs about
#: what the copy does.
ALIAS_BYTES: Final = INNER_BYTES


def _bytes_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What identifies the bytes of a plain contiguous strided tensor of ``ALIAS_BYTES``
    or more (address, length, dtype, device), else None."""
    if (
        type(tensor) is not _TENSOR
        or tensor.layout is not _STRIDED
        or tensor.nbytes < ALIAS_BYTES
        or not tensor.is_contiguous()
        or tensor.is_neg()
        or tensor.is_conj()
    ):
        return None
    return (tensor.data_ptr(), tensor.nbytes, tensor.dtype, tensor.device)


#: The workers' threads, shared by the process's writers (by their number): a run's
#: writer starting threads of its own cost ~1.5 ms a thread, most of a tiny run's
#: writing in a batch. Made again in a forked child (the parent's have no threads there).
_POOLS: dict[int, tuple[int, ThreadPoolExecutor]] = {}
_POOLS_LOCK = fork_safe_lock()


def _worker_pool(workers: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        known = _POOLS.get(workers)
        if known is None or known[0] != os.getpid():
            known = _POOLS[workers] = (
                os.getpid(),
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tracelake-w"),
            )
        return known[1]
