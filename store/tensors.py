"""Tensors on disk: one Zarr v3 group per run, readable by plain zarr-python.

- **Small tensors** (under :data:`CHUNK_BYTES`) are packed, 64-byte aligned, into a few
  1-D ``uint8`` arrays per run (``pack_raw``, ``pack_zstd``), sharded: one 4 MiB shard
  file written at a time, holding 64 KiB inner chunks (so reading one small tensor
  decodes 64 KiB, not 4 MiB); the catalog records array, byte offset, shape and dtype.
  Creating one Zarr array per op would cost ~2 ms and several metadata files each.
- **Large tensors** get their own N-d array (``t<slot>``), chunked along the leading
  dimensions to about 4 MiB so that a slice reads few chunks.
- **Bits, not values:** dtypes numpy lacks (bfloat16, float8, ...) are stored as
  unsigned integers of the same width and the torch dtype is recorded beside them
  (the array attribute ``torch_dtype`` and the catalog), so every dtype round-trips
  bitwise.
- **Codecs,** set explicitly per array: every array ends in a CRC32C checksum; zstd
  level 1 only where it pays (:func:`choose_codec`).
- **Writing:** array metadata is written by zarr-python; chunks are encoded here and
  written straight to their files (``bytes`` [→ ``zstd``] → ``crc32c``, exactly as
  the array's metadata declares, full-size edge chunks as Zarr v3 requires), each with
  one ``writev`` and an ``fdatasync``, by the worker threads while the forward goes on,
  with the GIL released in zstd, CRC32C and the system calls (the commit's fsync of the
  run then finds little left to wait for). Through zarr-python's pipeline the same chunks
  went at 0.2-0.4x the disk's speed (``benchmarks/zarr_pipelines.py``), since its
  synchronous API funnels every call through one event-loop thread and copies each
  chunk to append the checksum. Own arrays are read through zarr-python, which checks
  every checksum; packs by :meth:`RunArrays.read_packed` (shard index, inner chunk,
  checksums, zstd: the same decoding, without zarr's per-read overhead).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import torch
import zarr
from numcodecs import Zstd
from zarr.codecs import Crc32cCodec, ZstdCodec

from tracelake.errors import ChunkCorruptError, StoreError

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "RunArrays",
    "Unsynced",
    "choose_codec",
    "chunk_shape",
    "dtype_name",
    "numpy_dtype",
    "pack_stream",
    "parse_dtype",
    "tensor_from_bytes",
]

#: Chunk size of packs, and the size from which a tensor gets its own array.
CHUNK_BYTES = 4 << 20
#: Inner chunk of a pack's shards: what reading one small tensor decodes.
INNER_BYTES = 64 << 10
#: Alignment of tensors inside a pack (so that any dtype can be viewed in place).
ALIGN = 64
#: zstd is used when a sample compresses at least this well (bytes in / bytes out).
ZSTD_MIN_RATIO = 1.3
_SAMPLE_BYTES = 1 << 16
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ZSTD_STREAM_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    }
)
_ZARR_CONFIG: Any = {"write_empty_chunks": True}  # a missing chunk file then always means damage


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"the store names a dtype this torch lacks: {name!r}")
    return dtype


@functools.cache
def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """numpy's dtype for ``dtype`` when numpy has one, else ``None`` (store the bits)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def pack_stream(dtype: torch.dtype) -> str:
    """Which pack a small tensor goes to: half floats, integers and bools usually
    compress (1.3x and more); float32/64 activations rarely do (about 1.08x)."""
    return "pack_zstd" if dtype in _ZSTD_STREAM_DTYPES else "pack_raw"


class _ChunkCache:
    """Decoded inner chunks and shard indexes of packs, least recently used evicted past
    a byte budget."""

    def __init__(self, budget: int):
        from collections import OrderedDict

        self.budget = budget
        self.used = 0
        self._items: OrderedDict[tuple[Any, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, int]) -> np.ndarray | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: tuple[Any, int], data: np.ndarray) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = data
            self.used += data.nbytes
            while self.used > self.budget and self._items:
                _, old = self._items.popitem(last=False)
                self.used -= old.nbytes


_CHUNKS = _ChunkCache(256 << 20)


def pack_codec(name: str) -> str:
    return "zstd" if name.startswith("pack_zstd") else "raw"


def choose_codec(data: np.ndarray) -> str:
    """``"zstd"`` if a sample of ``data``'s bytes compresses by ZSTD_MIN_RATIO, else ``"raw"``."""
    flat = data.reshape(-1).view(np.uint8)
    if flat.nbytes <= _SAMPLE_BYTES:
        sample = flat
    else:  # three spread-out windows: the start alone is often padding or a prefix
        step = _SAMPLE_BYTES // 3
        starts = (0, flat.nbytes // 2, flat.nbytes - step)
        sample = np.concatenate([flat[s : s + step] for s in starts])
    packed = Zstd(level=1).encode(np.ascontiguousarray(sample))
    return "zstd" if sample.nbytes >= ZSTD_MIN_RATIO * len(packed) else "raw"


_START_WRITEBACK = hasattr(os, "posix_fadvise")


def write_chunk_file(
    path: Path, data: np.ndarray, codec: str, pending: Unsynced | None = None
) -> None:
    """Encode one chunk as its array declares (C-order bytes, zstd if asked, then the
    CRC32C of what is stored, little-endian) and write it: durably, or into
    ``pending`` (durable by the time that closes)."""
    payload: Any = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if codec == "zstd":
        payload = Zstd(level=1).encode(payload)
    checksum = struct.pack("<I", google_crc32c.value(payload))  # numpy array or bytes
    _write_all(path, [payload, checksum], pending)


class Unsynced:
    """Files written whose data is not durable yet. Their writeback starts at once (the
    device writes while the workers encode the next chunks); a thread of its own makes
    them durable, oldest first, so that no worker waits on an ``fdatasync`` (each one is
    a flush of the device's cache, slow on a virtual disk) while it could encode; at most
    ``window`` wait, then ``add`` waits too. ``close`` makes them all durable and raises
    what syncing raised. Safe to share between threads; ``background=False``: the thread
    that adds one too many syncs the oldest itself."""

    def __init__(self, window: int = 16, background: bool = True):
        self.window = window
        self._fds: deque[int] = deque()
        self._busy = 0  # being made durable now
        self._error: OSError | None = None
        self._cond = threading.Condition()
        self._background = background
        self._thread: threading.Thread | None = None

    def add(self, fd: int) -> None:
        if _START_WRITEBACK:  # on dirty pages: start their writeback, do not wait
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with self._cond:
            self._fds.append(fd)
            if not self._background:
                due = [self._fds.popleft() for _ in range(len(self._fds) - self.window)]
            else:
                due = []
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, daemon=True, name="tracelake-sync"
                    )
                    self._thread.start()
                self._cond.notify_all()
                self._cond.wait_for(
                    lambda: len(self._fds) + self._busy <= self.window or self._error is not None
                )
        _all_durable(due)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._fds) or self._thread is None)
                if not self._fds:
                    return  # closed, nothing left
                fd = self._fds.popleft()
                self._busy += 1
            try:
                _durable(fd)
            except OSError as exc:
                with self._cond:
                    self._error = self._error or exc
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def close(self, durable: bool = True) -> None:
        """Make every file durable (or, not ``durable``: just close them)."""
        with self._cond:
            if not durable:
                for fd in self._fds:
                    os.close(fd)
                self._fds.clear()
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join()  # it drains what is left, then ends
        with self._cond:
            due = list(self._fds)
            self._fds.clear()
            error, self._error = self._error, None
        if durable:
            _all_durable(due)
        if error is not None and durable:
            raise error


def _all_durable(fds: list[int]) -> None:
    try:
        for k, fd in enumerate(fds):
            _durable(fd)
            fds[k] = -1
    finally:
        for fd in fds:  # an error above: close the rest, durable or not
            if fd >= 0:
                os.close(fd)


def _durable(fd: int) -> None:
    """Wait for ``fd``'s data to be on disk, let the kernel drop its pages (a capture
    larger than RAM stays cheap), close it."""
    try:
        os.fdatasync(fd)
        if _START_WRITEBACK:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_shard_file(
    path: Path, data: np.ndarray, codec: str, pending: Unsynced | None = None
) -> None:
    """One Zarr v3 ``sharding_indexed`` shard of a 1-D uint8 pack: the inner chunks
    covering ``data`` (each C-order bytes [→ zstd] → crc32c, the last padded to full
    size), then the index ((offset, nbytes) little-endian uint64 per inner chunk of the
    shard, absent ones all ones) and the index's crc32c, as the array's metadata
    declares (``index_location: end``)."""
    inner = CHUNK_BYTES // INNER_BYTES
    index = np.full((inner, 2), np.iinfo(np.uint64).max, dtype="<u8")
    pieces: list[Any] = []
    offset = 0
    for j in range(-(-data.nbytes // INNER_BYTES)):
        part = data[j * INNER_BYTES : (j + 1) * INNER_BYTES]
        if part.nbytes < INNER_BYTES:
            full = np.zeros(INNER_BYTES, dtype=np.uint8)
            full[: part.nbytes] = part
            part = full
        payload: Any = Zstd(level=1).encode(part) if codec == "zstd" else part
        checksum = struct.pack("<I", google_crc32c.value(payload))
        size = len(payload) + 4
        index[j] = (offset, size)
        offset += size
        pieces += [memoryview(payload).cast("B"), checksum]
    table = index.tobytes()
    pieces += [table, struct.pack("<I", google_crc32c.value(table))]
    _write_all(path, pieces, pending)


def _write_all(path: Path, pieces: list[Any], pending: Unsynced | None = None) -> None:
    """Write ``pieces`` as the file ``path``, made durable here, on the worker thread,
    while the forward pass goes on (the commit's fsync of the run then finds little left
    to wait for), or handed to ``pending``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        views = [memoryview(p).cast("B") for p in pieces]
        while views:
            written = os.writev(fd, views[:512])
            while views and written >= views[0].nbytes:  # short writes: finish them
                written -= views[0].nbytes
                views.pop(0)
            if written:
                views[0] = views[0][written:]
    except BaseException:
        os.close(fd)
        raise
    if pending is None:
        _durable(fd)
    else:
        pending.add(fd)


def _compressors(codec: str) -> list[Any]:
    if codec == "zstd":
        return [ZstdCodec(level=1), Crc32cCodec()]
    return [Crc32cCodec()]


def chunk_shape(shape: Sequence[int], itemsize: int, target: int = CHUNK_BYTES) -> tuple[int, ...]:
    """Chunks of about ``target`` bytes: whole trailing dimensions, then part of the next
    one, leading dimensions one at a time, so that ``x[i]`` and ``x[i, :, a:b]`` read
    few chunks."""
    chunks = [1] * len(shape)
    inner = itemsize
    for axis in range(len(shape) - 1, -1, -1):
        size = max(int(shape[axis]), 1)
        if inner * size <= target:
            chunks[axis] = size
            inner *= size
        else:
            chunks[axis] = max(1, target // inner)
            break
    return tuple(chunks)


def tensor_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as numpy, in numpy's dtype or as same-width unsigned bits."""
    if numpy_dtype(tensor.dtype) is None:
        tensor = tensor.view(_BITS[tensor.element_size()])
        return tensor.numpy().view(_NUMPY_BITS[tensor.element_size()])
    return tensor.numpy()


def tensor_from_bytes(data: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` from its raw bytes (an owned uint8 array)."""
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    if dtype.itemsize != 1 or dtype is not torch.uint8:
        raw = raw.view(dtype)
    return raw.reshape(tuple(shape))


class RunArrays:
    """The Zarr group of one run: creates, writes and reads its arrays.

    Safe to use from several writer threads: each pack grows under its own lock.
    """

    def __init__(self, path: Path, run: str = "", create: bool = False):
        self.path = path
        self.run = run
        self._arrays: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._grow: dict[str, threading.Lock] = {}
        if create:
            zarr.create_group(str(path), zarr_format=3, overwrite=False)

    # -- writing ---------------------------------------------------------------------------

    def prepare_pack(self, name: str) -> None:
        """Create pack ``name``'s array (its metadata: ~10 ms) ahead of its first shard."""
        self._pack(name)

    def _pack(self, name: str) -> Any:
        with self._lock:
            array = self._arrays.get(name)
            if array is None:
                array = self._arrays[name] = zarr.create_array(
                    str(self.path / name),
                    shape=(CHUNK_BYTES,),
                    chunks=(INNER_BYTES,),
                    shards=(CHUNK_BYTES,),
                    dtype="uint8",
                    fill_value=0,
                    compressors=_compressors(pack_codec(name)),
                    attributes={"tracelake": "pack"},
                )
                self._grow[name] = threading.Lock()
            return array

    def write_pack_chunk(
        self, name: str, index: int, data: np.ndarray, pending: Unsynced | None = None
    ) -> None:
        """Write shard ``index`` of pack ``name``: ``data`` (up to CHUNK_BYTES) in
        64 KiB inner chunks, each encoded and checksummed, then the shard's index. A
        last, partly filled shard simply has fewer inner chunks (a small run costs what
        it holds, rounded up to 64 KiB). Durable on return, or once ``pending`` closes."""
        array = self._pack(name)
        start = index * CHUNK_BYTES
        with self._grow[name]:  # packs only ever grow, so concurrent writers cannot lose shards
            if array.shape[0] < start + CHUNK_BYTES:
                array.resize((start + CHUNK_BYTES,))
        write_shard_file(self.path / name / "c" / str(index), data, pack_codec(name), pending)

    def write_array(
        self,
        name: str,
        tensor: torch.Tensor,
        on_chunk: Callable[[torch.Tensor], None] | None = None,
        pending: Unsynced | None = None,
        reading: Callable[[], AbstractContextManager[torch.Tensor]] | None = None,
    ) -> str:
        """Give ``tensor`` (contiguous, on the CPU) its own array; return the codec used.
        ``on_chunk`` sees each chunk's part of ``tensor`` just before it is encoded, while
        its bytes are in cache (the parts partition the tensor). Durable on return, or
        once ``pending`` closes. ``reading``, if given, is entered around each read and
        yields the tensor to read then (same dtype and shape: the writer may swap the
        forward's own tensor for a copy of it between chunks)."""

        def read() -> AbstractContextManager[torch.Tensor]:
            return reading() if reading is not None else contextlib.nullcontext(tensor)

        shape = tuple(tensor.shape) or (1,)
        with read() as now:
            data = tensor_bits(now)
            codec = choose_codec(data)
        chunks = chunk_shape(shape, data.dtype.itemsize)
        zarr.create_array(
            str(self.path / name),
            shape=shape,
            chunks=chunks,
            dtype=data.dtype,
            fill_value=0,
            compressors=_compressors(codec),
            config=_ZARR_CONFIG,
            attributes={"torch_dtype": dtype_name(tensor.dtype), "torch_shape": list(tensor.shape)},
        )
        root = self.path / name / "c"
        own = pending is None
        pending = Unsynced(background=False) if pending is None else pending
        try:
            for idx in _product(
                [range(math.ceil(n / c)) for n, c in zip(shape, chunks, strict=True)]
            ):
                sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunks, strict=True))
                with read() as now:  # encoded and written before it may change
                    if on_chunk is not None:
                        on_chunk(now.reshape(shape)[sel])
                    part = tensor_bits(now).reshape(shape)[sel]
                    if part.shape != chunks:  # an edge chunk: padded to full size with zeros
                        full = np.zeros(chunks, dtype=part.dtype)
                        full[tuple(slice(0, n) for n in part.shape)] = part
                        part = full
                    write_chunk_file(root.joinpath(*map(str, idx)), part, codec, pending)
        finally:
            if own:
                pending.close()
        return codec

    # -- reading ---------------------------------------------------------------------------

    def array(self, name: str) -> Any:
        array = self._arrays.get(name)
        if array is None:
            with self._lock:
                array = self._arrays.get(name)
                if array is None:
                    try:
                        array = zarr.open_array(str(self.path / name), mode="r")
                    except Exception as exc:
                        raise ChunkCorruptError(
                            self.run, "?", f"{name}/zarr.json", f"cannot open the array: {exc}"
                        ) from exc
                    self._arrays[name] = array
        return array

    def _missing(self, name: str, chunk_keys: list[str]) -> str | None:
        for key in chunk_keys:
            if not os.path.exists(self.path / name / "c" / key):
                return f"{name}/c/{key}"
        return None

    def _read(self, name: str, label: str, key: Any, chunk_keys: list[str]) -> np.ndarray:
        missing = self._missing(name, chunk_keys)
        if missing is not None:
            raise ChunkCorruptError(self.run, label, missing, "the chunk file is missing")
        array = self.array(name)
        try:
            return np.asarray(array[key])
        except Exception as exc:  # zarr reports a checksum mismatch as a ValueError
            raise ChunkCorruptError(self.run, label, f"{name} {chunk_keys}", str(exc)) from exc

    def _shard_stamp(self, name: str, shard: int, label: str) -> tuple[str, tuple[Any, ...]]:
        """The shard's path, and what identifies its current contents (cache entries of
        a file that changed since, e.g. damaged on disk, are never used). Runs once per
        tensor read: plain strings, no pathlib."""
        path = os.path.join(self.path, name, "c", str(shard))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ChunkCorruptError(
                self.run, label, f"{name}/c/{shard}", "the shard file is missing"
            ) from None
        return path, (path, st.st_mtime_ns, st.st_size, st.st_ino)

    def _shard_index(self, name: str, shard: int, label: str) -> np.ndarray:
        path, stamp = self._shard_stamp(name, shard, label)
        key = (stamp, -1)
        index = _CHUNKS.get(key)
        if index is not None:
            return index
        size = (CHUNK_BYTES // INNER_BYTES) * 16
        where = f"{name}/c/{shard}"
        try:
            with open(path, "rb") as f:
                f.seek(-(size + 4), os.SEEK_END)
                raw = f.read(size + 4)
        except FileNotFoundError:
            raise ChunkCorruptError(self.run, label, where, "the shard file is missing") from None
        except OSError as exc:
            raise ChunkCorruptError(self.run, label, where, f"unreadable: {exc}") from exc
        if len(raw) != size + 4 or struct.pack("<I", google_crc32c.value(raw[:-4])) != raw[-4:]:
            raise ChunkCorruptError(self.run, label, where, "its index fails its CRC32C")
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(-1, 2)
        _CHUNKS.put(key, index)
        return index

    def _inner(self, name: str, shard: int, j: int, label: str) -> np.ndarray:
        """Inner chunk ``j`` of shard ``shard`` of pack ``name``, decoded and checked,
        from a byte-bounded cache shared by the process (committed files never change).

        Packs are read here rather than through zarr-python, whose per-read overhead
        (~ms) dominates reading a 4 KiB tensor; the decoding is the one the array's
        metadata declares, and ``verify()`` reads every shard through zarr-python."""
        path, stamp = self._shard_stamp(name, shard, label)
        key = (stamp, j)
        data = _CHUNKS.get(key)
        if data is not None:
            return data
        offset, nbytes = (int(v) for v in self._shard_index(name, shard, label)[j])
        where = f"{name}/c/{shard} (inner chunk {j})"
        if offset == np.iinfo(np.uint64).max:
            raise ChunkCorruptError(self.run, label, where, "the shard does not hold it")
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.read(nbytes)
        if len(raw) != nbytes or struct.pack("<I", google_crc32c.value(raw[:-4])) != raw[-4:]:
            raise ChunkCorruptError(self.run, label, where, "its CRC32C checksum does not match")
        if pack_codec(name) == "zstd":
            data = np.frombuffer(Zstd().decode(raw[:-4]), dtype=np.uint8)
        else:
            data = np.frombuffer(raw, dtype=np.uint8, count=nbytes - 4)
        _CHUNKS.put(key, data)
        return data

    def read_packed(
        self,
        name: str,
        offset: int,
        nbytes: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        label: str,
    ) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        parts = []
        for position in range(offset // INNER_BYTES, (offset + nbytes - 1) // INNER_BYTES + 1):
            shard, j = divmod(position, CHUNK_BYTES // INNER_BYTES)
            chunk = self._inner(name, shard, j, label)
            lo = max(offset - position * INNER_BYTES, 0)
            hi = min(offset + nbytes - position * INNER_BYTES, INNER_BYTES)
            parts.append(chunk[lo:hi])
        data = parts[0] if len(parts) == 1 else np.concatenate(parts)
        as_numpy = numpy_dtype(dtype)
        if as_numpy is not None:  # typed and copied out of the cached chunk in one step
            return torch.from_numpy(data.view(as_numpy).reshape(shape).copy())
        return tensor_from_bytes(data.copy(), dtype, shape)

    def read_array(
        self,
        name: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        label: str,
        key: tuple[Any, ...] | None = None,
    ) -> torch.Tensor:
        """All of array ``name``, or the basic-index selection ``key`` of it (normalised:
        ints and slices with non-negative bounds, one per dimension)."""
        array = self.array(name)
        if not shape:  # 0-d tensors are stored as shape (1,)
            data = self._read(name, label, slice(None), ["0"])
            return tensor_from_bytes(data, dtype, ())
        if key is None:
            key = tuple(slice(0, n, 1) for n in shape)
        keys = _chunk_keys(key, array.chunks)
        data = self._read(name, label, key, keys if keys is not None else [])
        out_shape = data.shape
        return tensor_from_bytes(data, dtype, out_shape)

    def chunk_keys(self, name: str) -> list[str]:
        """Every chunk key array ``name`` must have."""
        array = self.array(name)
        grid = [range(math.ceil(n / c)) for n, c in zip(array.shape, array.chunks, strict=True)]
        return ["/".join(map(str, idx)) for idx in _product(grid)]


def _chunk_keys(key: tuple[Any, ...], chunks: Sequence[int]) -> list[str] | None:
    """Chunk keys a normalised basic selection touches (``None`` when there are too many
    to list cheaply; zarr's checksums still guard what is read)."""
    ranges = []
    count = 1
    for k, c in zip(key, chunks, strict=True):
        if isinstance(k, int):
            ranges.append(range(k // c, k // c + 1))
        else:
            start, stop, step = k.start, k.stop, k.step or 1
            if stop <= start:
                return []
            last = start + ((stop - 1 - start) // step) * step
            ranges.append(range(start // c, last // c + 1))
        count *= len(ranges[-1])
        if count > 4096:
            return None
    return ["/".join(map(str, idx)) for idx in _product(ranges)]


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out
