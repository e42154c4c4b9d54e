"""What a writer has in flight: byte buffers, and large tensors read where they are.

Bytes in flight are capped (``Buffers``); a large CPU tensor is written by the workers
from the forward's own memory (``Live``), copied only if something may write it before
they are done.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tracelake.recorder.forks import fork_safe_lock

from .dtypes import memory_at
from .layout import libc_function

__all__ = [
    "Buffers",
    "Live",
    "Overwritten",
    "Packed",
    "alias_version",
    "gather_version",
    "storage_holders",
]

_TENSOR = torch.Tensor

# madvise() advice for fresh buffers: huge pages, then populate them for writing in one
# call (MADV_POPULATE_WRITE, 23 on Linux >= 5.14; Python 3.11's mmap does not name it).
_ADVICE = tuple(
    a
    for a in (
        getattr(mmap, "MADV_HUGEPAGE", None),
        getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None),
    )
    if a is not None
)


#: libc's madvise, through ctypes, which lets the GIL go for the call (``mmap.madvise``
#: holds it: populating a 4 MiB buffer, zeroing it, then stalled the writer's threads
#: behind the forward's).
_MADVISE = libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _advise(memory: mmap.mmap, array: np.ndarray) -> None:
    """Give a fresh buffer ``_ADVICE`` (each may fail: older kernels, no huge pages)."""
    for advice in _ADVICE:
        if _MADVISE is not None:
            _MADVISE(array.ctypes.data, array.nbytes, advice)  # (a failure: -1, ignored)
        else:
            with contextlib.suppress(OSError):
                memory.madvise(advice)


class Buffers:
    """Bytes on their way to disk: buffers (pack chunks, copies of large tensors),
    reused, and large tensors read where they are (``hold`` / ``release``).

    At most ``cap`` bytes are in flight: ``hold`` and ``take`` wait while more would be
    (one item larger than the cap still goes, alone). Written buffers are kept for reuse
    while in flight + kept stays within the cap (fresh memory costs page faults, several
    times the copy itself; a reused buffer costs none), so the writer never holds more
    than ``cap`` bytes at once. Buffers are anonymous maps (huge pages where the system
    has them), returned to the system as soon as they are dropped."""

    def __init__(self, cap: int):
        self.cap = cap
        self.used = 0  # in flight
        self.kept = 0  # free, kept for reuse
        self.peak = 0
        self.waits = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._cond = threading.Condition()

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` more in flight, once there is room for them."""
        with self._cond:
            self._hold(nbytes)
            self._trim()

    def _hold(self, nbytes: int) -> None:
        if self.used and self.used + nbytes > self.cap:
            self.waits += 1
            self._cond.wait_for(lambda: not self.used or self.used + nbytes <= self.cap)
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def fits(self, nbytes: int) -> bool:
        """Whether ``hold(nbytes)`` would go on without waiting."""
        with self._cond:
            return not self.used or self.used + nbytes <= self.cap

    def try_hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` more in flight if there is room for them now; never waits."""
        with self._cond:
            if self.used + nbytes > self.cap:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self._trim()
            return True

    def _trim(self) -> None:
        """Drop kept buffers while in flight + kept would pass the cap (under the lock)."""
        while self.kept and self.used + self.kept > self.cap:
            size = next(n for n, bufs in self._free.items() if bufs)
            self._free[size].pop()
            self.kept -= size

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``, counted in flight (``give`` it back)."""
        with self._cond:
            self._hold(nbytes)  # (a kept buffer of that size is reused, not dropped)
        return self.buffer(nbytes)

    def buffer(self, nbytes: int) -> np.ndarray:
        """A buffer for ``nbytes`` already counted in flight: a kept one if one of this
        size is free, else a new one, after dropping kept ones that no longer fit."""
        with self._cond:
            free = self._free.get(nbytes)
            if free:
                self.kept -= nbytes
                return free.pop()
            self._trim()
        spare = _spare(nbytes)
        if spare is not None:
            return spare
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(memory, dtype=np.uint8)
        # Huge pages, populated in one call rather than fault by fault (the second advice:
        # MADV_POPULATE_WRITE, Linux 5.14): huge pages faulted in one by one can make the
        # kernel compact memory for each, and 4 KiB pages faulted one by one cost most.
        _advise(memory, array)
        return array

    def give(self, buffer: np.ndarray) -> None:
        with self._cond:
            self.used -= buffer.nbytes
            if self.used + self.kept + buffer.nbytes <= self.cap:  # else (one too large): dropped
                self._free.setdefault(buffer.nbytes, []).append(buffer)
                self.kept += buffer.nbytes
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            spare = self._free.get(_SPARE_BYTES, [])
            with _SPARE_LOCK:
                while spare and len(_SPARE) < _SPARE_KEPT:
                    _SPARE.append(spare.pop())
            self._free.clear()
            self.kept = 0


#: Pack-chunk buffers (4 MiB, ``format.CHUNK_BYTES``) the writers of this process let go,
#: kept for the next writer (at most eight: 32 MiB): a run of a few small tensors then
#: costs no fresh map, which must be faulted in, a good part of a tiny run's time; nor
#: does a run of mid-size ones (GPT-2's writer has six in use at once: with two kept it
#: mapped and zeroed four a run, ~2 ms each on the forward thread).
_SPARE_BYTES = 4 << 20
_SPARE_KEPT = 8
_SPARE: list[np.ndarray] = []
_SPARE_LOCK = fork_safe_lock()  # (a writer in a forked child takes it too)


def _spare(nbytes: int) -> np.ndarray | None:
    if nbytes != _SPARE_BYTES or not _SPARE:
        return None
    with _SPARE_LOCK:
        return _SPARE.pop() if _SPARE else None


class Overwritten(Exception):
    """A tensor being stored was written in place by something tracelake did not see."""


@dataclass(eq=False)
class Live:
    """A large tensor on its way to disk, read by a worker one chunk at a time under
    ``lock``: the forward's own tensor (``version`` set: an alias, no copy made) until
    something may write it, then a copy (in ``buffer``)."""

    source: torch.Tensor | None
    nbytes: int
    version: int | None = None
    buffer: np.ndarray | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[torch.Tensor]:
        """The tensor to read now, held still while the block reads it."""
        with self.lock:
            assert self.source is not None
            yield self.source
            if self.version is not None and self.source._version != self.version:
                raise Overwritten


@dataclass(eq=False)
class Packed(Live):
    """The whole inner chunks a packed tensor covers in its pack's open chunk, written by
    a worker from the forward's own memory (``source``, bytes ``skip`` onwards) rather than
    copied into the chunk's buffer on the forward thread; ``region`` is where in that
    buffer they go if something may write the tensor first (``copy``). ``nbytes``: how
    many, counted in flight while they are referenced.

    ``gather``: a strided (not contiguous) tensor, whose bytes are not a plain range of
    its memory: ``region`` is all of its place in the buffer, and the worker gathers it
    there (``copy``, the forward thread's copy done later) before writing the chunk, as
    anyone who may write it first does; ``nbytes`` is then its storage's size, all of
    which it keeps alive."""

    slot: int = -1
    start: int = 0  # their byte offset in the chunk (a multiple of INNER_BYTES)
    skip: int = 0
    region: np.ndarray | None = None
    gather: bool = False

    def referenced(self) -> np.ndarray | None:
        """The bytes to write now (a uint8 view of the tensor), ``None`` once copied into
        ``region`` (or done), and for a tensor to gather. Call under ``lock``."""
        if self.source is None or self.version is None or self.gather:
            return None
        # By address, not a view: a view is one more handle on the storage while the
        # worker writes, which the end of the step (``storage_holders``) counts as a
        # holder outside the writer, and then waits for this chunk's write to copy what
        # it finds written. The array keeps ``source`` (the object) alive.
        return memory_at(self.source.data_ptr() + self.skip, self.nbytes, self.source)

    def copy(self) -> bool:
        """Copy the referenced bytes into ``region`` (gather them there), if still
        referenced and unchanged; whether it did (its bytes in flight then count in the
        chunk's buffer). Call under ``lock``."""
        source = self.source
        if source is None or self.version is None or self.region is None:
            return False
        if source._version != self.version:  # written behind our back already:
            return False  # the worker finds out and drops it
        if self.gather:
            place = torch.from_numpy(self.region).view(source.dtype).view(source.shape)
            place.copy_(source)
        else:
            self.region[:] = self.referenced()
        self.source = self.version = None
        return True


#: A strided tensor is gathered by a worker (``Packed.gather``) only where its storage is
#: at most this many times its own bytes (the storage stays alive, counted in flight, until
#: then): GPT-2's per-head views of its attention's joint query/key/value output hold a
#: third of their storage.
GATHER_STORAGE = 4


def gather_version(tensor: torch.Tensor, nbytes: int) -> tuple[int, int] | None:
    """The version and storage size of a CPU tensor a worker may gather later
    (``Packed.gather``): one whose storage is at most ``GATHER_STORAGE`` times its
    ``nbytes`` (``_unchanging``); else ``None``: copy it now."""
    return _unchanging(tensor, nbytes, GATHER_STORAGE, contiguous=False)


def alias_version(tensor: torch.Tensor, nbytes: int) -> int | None:
    """The version of a tensor the workers may read in place (a plain contiguous CPU
    tensor with a version counter, not a small view keeping a larger storage alive),
    else ``None``: copy it."""
    known = _unchanging(tensor, nbytes, 2, contiguous=True)
    return None if known is None else known[0]


def _unchanging(
    tensor: torch.Tensor, nbytes: int, factor: int, contiguous: bool
) -> tuple[int, int] | None:
    """(version, storage bytes) of a plain ``torch.Tensor`` on the CPU whose version
    counter tells any write torch makes (neither bit, negative or conjugate, set;
    ``contiguous`` where asked) and whose storage is at most ``factor`` times its
    ``nbytes``; else ``None``."""
    if (
        not (tensor.is_cpu and type(tensor) is _TENSOR)
        or (contiguous and not tensor.is_contiguous())
        or tensor.is_neg()
        or tensor.is_conj()
    ):
        return None
    try:
        version = int(tensor._version)
        storage = tensor.untyped_storage().nbytes()
    except (RuntimeError, AttributeError, NotImplementedError):  # inference tensors
        return None
    return (version, storage) if storage <= factor * nbytes else None


def storage_holders(live: Live) -> int | None:
    """How many tensors and handles share a live tensor's storage, if torch says.

    Without ``live.lock``, which a worker holds while it writes a chunk of the tensor
    (a 4 MiB write: the forward thread's end of step waited ~12 ms a GPT-2 run on
    them): ``source`` is read once, and a worker only ever sets it to None, once done
    (the forward thread, this one, is what replaces it with a copy); the tensor read
    keeps its storage's count as it was."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    source = live.source
    if count is None or source is None:
        return None
    return int(count(source.untyped_storage()._cdata)) - 1  # minus the handle just taken
