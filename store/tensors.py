"""A run's arrays: :class:`RunArrays` writes and reads them through a storage backend.

The layout and the bytes of chunks and shards are :mod:`.format`'s; codecs are
:mod:`.codecs`' objects; where the bytes live is a :class:`~.backend.ByteStore`
(:class:`~.local.LocalBackend` by default, :class:`~.backend.MemoryBackend` in tests).

- **Writing:** array metadata is written by zarr-python (through the backend's
  ``zarr_store``); chunks are encoded by :mod:`.format` and put straight into the
  backend by the writer's worker threads while the forward goes on, with the GIL
  released in zstd, CRC32C and the system calls, their durability left to a
  :class:`~.backend.Pending` that the writer closes before the run is committed.
- **Reading:** own arrays through zarr-python, which checks every checksum; packs by
  :meth:`RunArrays.read_packed` (shard index, inner chunk, checksum, zstd: the decoding
  the metadata declares, without zarr's per-read overhead), through a process-wide cache
  of decoded inner chunks keyed by the backend's version token of the shard, so that a
  shard that changed (damaged, rewritten) is never served from the cache.

The names other modules imported from here before the seam existed (dtype helpers,
chunk constants, ``Unsynced``, ``choose_codec``) are re-exported.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import zarr

from tracelake.errors import ChunkCorruptError, ObjectNotFoundError, StoreError

from .backend import ByteStore, Pending
from .codecs import choose_codec
from .dtypes import dtype_name, memory_bits, numpy_dtype, parse_dtype, tensor_from_bytes
from .format import (
    ALIGN,
    ARRAY_NAME,
    CHUNK_BYTES,
    INNER_BYTES,
    INNER_PER_SHARD,
    SHARD_INDEX_BYTES,
    Sources,
    checked_codecs,
    chunk_grid,
    chunk_key,
    chunk_shape,
    decode_inner,
    encode_chunk,
    encode_shard,
    inner_span,
    own_array_spec,
    pack_array_spec,
    pack_codec,
    pack_stream,
    parse_shard_index,
    selection_chunks,
    shard_writer,
)
from .local import LocalBackend, Unsynced

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "RunArrays",
    "Unsynced",
    "choose_codec",
    "chunk_shape",
    "clear_chunk_cache",
    "dtype_name",
    "numpy_dtype",
    "pack_stream",
    "parse_dtype",
    "tensor_from_bytes",
]


class _ChunkCache:
    """Decoded inner chunks and shard indexes of packs, least recently used evicted past
    a byte budget. Keys start with a backend's version token, so entries of an object
    that changed are never found again (they age out)."""

    def __init__(self, budget: int):
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

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.used = 0


_CHUNKS = _ChunkCache(256 << 20)


def clear_chunk_cache() -> None:
    """Forget every decoded chunk this process keeps (benchmarks measure reads cold)."""
    _CHUNKS.clear()


_INDEX = -1  # the cache's slot for a shard's index (inner chunks are 0 and up)


def _check_not_linked(where: str | os.PathLike[str], run: str) -> None:
    """``StoreError`` if a run's tensors directory, its run directory or ``runs/`` is a
    symbolic link: a store may come from someone else, and such a link leads its reads
    and writes outside it. (Links above the store's root are the user's own, and fine.)"""
    here = os.fspath(where)
    for _ in range(3):  # tensors/, runs/<id>/, runs/
        if os.path.islink(here):
            raise StoreError(
                f"refusing the arrays of run {run!r}: {here!r} is a symbolic link, which "
                "may lead outside the store"
            )
        here = os.path.dirname(here)


_TEMPLATES: dict[tuple[str, bool], bytes] = {}


def _template(kind: str, flat: bool = True) -> bytes:
    """The ``zarr.json`` zarr-python writes for a run's group (``"group"``) or a new
    pack (its name; ``flat``: its chunk keys, ``format.chunk_key``), made once per
    process in memory: zarr-python's own create costs a millisecond or two each, a good
    part of a tiny run."""
    data = _TEMPLATES.get((kind, flat))
    if data is None:
        memory: dict[str, Any] = {}
        store = zarr.storage.MemoryStore(memory)
        if kind == "group":
            zarr.create_group(store, zarr_format=3)
        else:
            zarr.create_array(store, **pack_array_spec(kind, flat=flat))
        data = _TEMPLATES[kind, flat] = memory["zarr.json"].to_bytes()
    return data


@functools.lru_cache(maxsize=64)
def _pack_metadata(name: str, nbytes: int, flat: bool) -> bytes:
    """Pack ``name``'s ``zarr.json`` for a length of ``nbytes``: zarr-python's own
    metadata of a new pack, its shape changed as ``resize`` changes it (kept: every run
    writes its packs' first, and most runs' lengths repeat)."""
    metadata = json.loads(_template(name, flat))
    metadata["shape"] = [nbytes]
    return json.dumps(metadata, indent=2).encode()


class RunArrays:
    """The Zarr group of one run: creates, writes and reads its arrays.

    ``where`` is the run's backend, or a directory (a :class:`LocalBackend` on it).
    Safe to use from several writer threads: each pack grows under its own lock.
    ``flat``: whether the run's arrays name their chunks flat (``format.chunk_key``), as
    its store's format says (``StorePaths.flat_chunks``; every run of a store is of the
    store's format): how the arrays it creates name them, and how packs are read (without
    their metadata; an own array's keys come from its ``zarr.json``).
    """

    def __init__(
        self,
        where: ByteStore | str | os.PathLike[str],
        run: str = "",
        create: bool = False,
        made: bool = False,
        *,
        flat: bool,
    ):
        # (``made``: ``where`` is a new directory in directories the caller has just
        # made itself, a batch's run's: nothing there to check, at six lstats a tiny run)
        if not isinstance(where, ByteStore) and not made:
            _check_not_linked(where, run)
        self.backend = where if isinstance(where, ByteStore) else LocalBackend(where, made)
        self.run = run
        self.flat = flat
        self._arrays: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._grow: dict[str, threading.Lock] = {}
        self._pack_bytes: dict[str, int] = {}  # each pack's length, as its metadata says
        self._pack_length: dict[str, int] = {}  # and as its shards written so far make it
        if create:
            self._put_metadata("zarr.json", _template("group"))

    def _put_metadata(self, key: str, data: bytes) -> None:
        """Write Zarr metadata zarr-python made (``_template``): as zarr-python would,
        not synced here; the run's commit makes every file of it durable."""
        self.backend.put_unsynced(key, data)

    # -- writing ---------------------------------------------------------------------------

    def pending(self, sync: bool = True) -> Pending:
        """Writes made durable together, by the time it closes (pass to the writes);
        ``sync=False``: left to the caller (a batch of runs is made durable at once)."""
        return self.backend.pending(sync=sync)

    def _pack(self, name: str) -> threading.Lock:
        """Pack ``name``'s lock for growing it, its metadata written first if need be."""
        with self._lock:
            grow = self._grow.get(name)
            if grow is None:
                metadata = _pack_metadata(name, CHUNK_BYTES, self.flat)
                self._put_metadata(f"{name}/zarr.json", metadata)
                self._pack_bytes[name] = self._pack_length[name] = CHUNK_BYTES
                grow = self._grow[name] = threading.Lock()
            return grow

    def write_pack_chunk(
        self,
        name: str,
        index: int,
        data: np.ndarray,
        pending: Pending | None = None,
        sources: Sources = (),
    ) -> None:
        """Write shard ``index`` of pack ``name``: ``data`` (up to CHUNK_BYTES) in inner
        chunks, each encoded and checksummed, then the shard's index; the whole inner
        chunks at ``sources``' offsets are read from their bytes instead (``encode_shard``;
        on the local disk a raw shard's bytes are written by one compiled call,
        ``shard_writer``). Durable on return, or once ``pending`` closes."""
        grow = self._pack(name)
        end = (index + 1) * CHUNK_BYTES
        with grow:  # packs only ever grow, so concurrent writers cannot lose shards
            if self._pack_length[name] < end:
                self._pack_length[name] = end
        key, codec = chunk_key(name, index, self.flat), pack_codec(name)
        # a local raw shard in one compiled call (no Python object an inner chunk)
        local = self.backend if isinstance(self.backend, LocalBackend) else None
        write = shard_writer(data, codec, sources) if local is not None else None
        if local is not None and write is not None:
            local.put_with(key, write, pending, write.staged, data.nbytes)
        else:
            self.backend.put(key, encode_shard(data, codec, sources), pending)

    def finish_packs(self) -> None:
        """Write the ``zarr.json`` of every pack that grew past its first shard, with its
        length now: once per pack, after its last shard, rather than once per shard (a
        file written for each 4 MiB shard cost GPT-2's workers ~10 ms a run). Until then
        a pack's metadata names its first shard only; nobody reads a run's arrays before
        its commit, which comes after this."""
        with self._lock:
            grown = [
                (name, length)
                for name, length in self._pack_length.items()
                if length > self._pack_bytes[name]
            ]
        for name, length in grown:
            self._put_metadata(f"{name}/zarr.json", _pack_metadata(name, length, self.flat))
            with self._lock:
                self._pack_bytes[name] = length

    def write_array(
        self,
        name: str,
        tensor: torch.Tensor,
        on_chunk: Callable[[torch.Tensor], None] | None = None,
        pending: Pending | None = None,
        reading: Callable[[], AbstractContextManager[torch.Tensor]] | None = None,
    ) -> str:
        """Give ``tensor`` (contiguous, on the CPU) its own array; return the codec's
        catalog name. ``on_chunk`` sees each chunk's part of ``tensor`` just before it is
        encoded, while its bytes are in cache (the parts partition the tensor). Durable
        on return, or once ``pending`` closes. ``reading``, if given, is entered around
        each read and yields the tensor to read then (same dtype and shape: the writer
        may swap the forward's own tensor for a copy of it between chunks)."""

        def read() -> AbstractContextManager[torch.Tensor]:
            return reading() if reading is not None else contextlib.nullcontext(tensor)

        # The tensor read by address (``memory_bits``), inside ``read()`` only: a view
        # would be a handle on the forward's storage that the writer's end of a step
        # counts as a holder outside it (and copies the tensor for)
        shape = tuple(tensor.shape) or (1,)
        with read() as now:
            data = memory_bits(now)
            codec = choose_codec(data)
        bits = data.dtype
        del data
        chunks = chunk_shape(shape, bits.itemsize)
        attributes = {"torch_dtype": dtype_name(tensor.dtype), "torch_shape": list(tensor.shape)}
        zarr.create_array(
            self.backend.zarr_store(name),
            **own_array_spec(shape, chunks, bits, codec, attributes, flat=self.flat),
        )
        own = pending is None
        pending = self.backend.pending(background=False) if pending is None else pending
        try:
            for idx in chunk_grid(shape, chunks):
                sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunks, strict=True))
                with read() as now:  # encoded and written before it may change
                    part = memory_bits(now).reshape(shape)[sel]
                    if on_chunk is not None:  # (a tensor on the numpy array: no handle)
                        on_chunk(torch.from_numpy(part).view(now.dtype))
                    self.backend.put(
                        chunk_key(name, idx, self.flat),
                        encode_chunk(part, chunks, codec),
                        pending,
                    )
                    del part
        finally:
            if own:
                pending.close()
        return codec.name

    def delete(self, name: str) -> None:
        """Remove array ``name`` and its chunks."""
        with self._lock:
            self._arrays.pop(name, None)
            self._grow.pop(name, None)
            self._pack_bytes.pop(name, None)
            self._pack_length.pop(name, None)
        self.backend.delete_prefix(name)

    def commit(self) -> int:
        """Make every array durable, names included; return the bytes stored."""
        return self.backend.commit()

    # -- reading ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The arrays the backend holds (whatever the catalog says)."""
        return [n for n in self.backend.list_dir() if n != "zarr.json"]

    def chunk_key(self, name: str, index: tuple[int, ...]) -> str:
        """The key of chunk ``index`` of array ``name``, as its metadata encodes it."""
        return f"{name}/{self.array(name).metadata.encode_chunk_key(index)}"

    def has_chunk(self, name: str, index: tuple[int, ...]) -> bool:
        return self.backend.exists(self.chunk_key(name, index))

    def check_name(self, name: str, label: str = "?") -> str:
        """``name`` if it is an array name the writer gives (see ``ARRAY_NAME``), else
        ``ChunkCorruptError``: the catalog's ``array`` column is not trusted as a path."""
        if not isinstance(name, str) or not ARRAY_NAME.fullmatch(name):
            raise ChunkCorruptError(
                self.run,
                label,
                repr(name),
                "the catalog names an array tracelake never writes (only pack_<codec> and "
                "t<slot>); refusing it as a path",
            )
        return name

    def array(self, name: str, label: str = "?") -> Any:
        array = self._arrays.get(name)
        if array is None:
            self.check_name(name, label)
            with self._lock:
                array = self._arrays.get(name)
                if array is None:
                    where = f"{name}/zarr.json"
                    try:
                        # (refuses a zarr.json that is a link, before zarr reads it)
                        self.backend.exists(where)
                        array = zarr.open_array(self.backend.zarr_store(name), mode="r")
                    except Exception as exc:
                        raise ChunkCorruptError(
                            self.run, label, where, f"cannot open the array: {exc}"
                        ) from exc
                    wrong = checked_codecs(array.metadata.to_dict())
                    if wrong is not None:
                        raise ChunkCorruptError(self.run, label, where, wrong)
                    self._arrays[name] = array
        return array

    def links(self) -> list[str]:
        """The symbolic links among the run's files (none are written by tracelake)."""
        links: Callable[[], list[str]] | None = getattr(self.backend, "links", None)
        return links() if links is not None else []

    def require_chunks(
        self, name: str, label: str, indexes: list[tuple[int, ...]] | None = None
    ) -> None:
        """``ChunkCorruptError`` unless every chunk ``indexes`` names (None: all of them)
        of array ``name`` exists: zarr-python reads a missing chunk as zeros."""
        for index in self.chunk_indexes(name) if indexes is None else indexes:
            if not self.has_chunk(name, index):
                raise ChunkCorruptError(
                    self.run, label, self.chunk_key(name, index), "the chunk file is missing"
                )

    def _read(self, name: str, label: str, key: Any, chunks: list[tuple[int, ...]]) -> np.ndarray:
        array = self.array(name, label)
        self.require_chunks(name, label, chunks)
        try:
            return np.asarray(array[key])
        except Exception as exc:  # zarr reports a checksum mismatch as a ValueError
            keys = ", ".join(self.chunk_key(name, index) for index in chunks)
            raise ChunkCorruptError(self.run, label, keys or name, str(exc)) from exc

    def _shard_version(self, key: str, label: str) -> Any:
        try:
            return self.backend.version(key)
        except ObjectNotFoundError:
            raise ChunkCorruptError(self.run, label, key, "the shard file is missing") from None
        except StoreError as exc:  # (a link, say)
            raise ChunkCorruptError(self.run, label, key, f"unreadable: {exc}") from exc

    def _get(
        self,
        key: str,
        where: str,
        label: str,
        start: int = 0,
        end: int | None = None,
        suffix: int = 0,
    ) -> bytes:
        try:
            if suffix:
                return self.backend.get_suffix(key, suffix)
            return self.backend.get(key, start, end)
        except ObjectNotFoundError:
            raise ChunkCorruptError(self.run, label, where, "the shard file is missing") from None
        except StoreError as exc:
            raise ChunkCorruptError(self.run, label, where, f"unreadable: {exc}") from exc

    def _shard_index(self, key: str, version: Any, label: str) -> np.ndarray:
        index = _CHUNKS.get((version, _INDEX))
        if index is not None:
            return index
        index = parse_shard_index(self._get(key, key, label, suffix=SHARD_INDEX_BYTES))
        if index is None:
            raise ChunkCorruptError(self.run, label, key, "its index fails its CRC32C")
        _CHUNKS.put((version, _INDEX), index)
        return index

    def _inner(self, name: str, shard: int, j: int, label: str) -> np.ndarray:
        """Inner chunk ``j`` of shard ``shard`` of pack ``name``, decoded and checked,
        from a byte-bounded cache shared by the process.

        Packs are read here rather than through zarr-python, whose per-read overhead
        dominates reading a small tensor; the decoding is the one the array's metadata
        declares, and ``verify()`` reads every shard through zarr-python."""
        key = chunk_key(name, shard, self.flat)
        version = self._shard_version(key, label)
        data = _CHUNKS.get((version, j))
        if data is not None:
            return data
        where = f"{key} (inner chunk {j})"
        span = inner_span(self._shard_index(key, version, label), j)
        if span is None:
            raise ChunkCorruptError(self.run, label, where, "the shard does not hold it")
        offset, nbytes = span
        data = decode_inner(
            self._get(key, where, label, offset, offset + nbytes), nbytes, pack_codec(name)
        )
        if data is None:
            raise ChunkCorruptError(self.run, label, where, "its CRC32C checksum does not match")
        _CHUNKS.put((version, j), data)
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
        self.check_name(name, label)
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        parts = []
        for position in range(offset // INNER_BYTES, (offset + nbytes - 1) // INNER_BYTES + 1):
            shard, j = divmod(position, INNER_PER_SHARD)
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
        array = self.array(name, label)
        if not shape:  # 0-d tensors are stored as shape (1,)
            data = self._read(name, label, slice(None), [(0,)])
            return tensor_from_bytes(data, dtype, ())
        if key is None:
            key = tuple(slice(0, n, 1) for n in shape)
        keys = selection_chunks(key, array.chunks)
        data = self._read(name, label, key, keys if keys is not None else [])
        return tensor_from_bytes(data, dtype, data.shape)

    def chunk_indexes(self, name: str) -> list[tuple[int, ...]]:
        """Every chunk index array ``name`` must have."""
        array = self.array(name)
        return chunk_grid(array.shape, array.chunks)
