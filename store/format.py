"""The Zarr v3 layout of a run's arrays: the one owner of keys, shards and chunk bytes.

One Zarr v3 group per run, readable by plain zarr-python:

- **Small tensors** (under :data:`CHUNK_BYTES`) are packed, :data:`ALIGN`-byte aligned,
  into a few 1-D ``uint8`` arrays per run (:func:`pack_stream`), sharded: one shard
  object of :data:`CHUNK_BYTES` written at a time, holding inner chunks of
  :data:`INNER_BYTES`, so reading one small tensor decodes one inner chunk, not a
  shard. The catalog records array, byte offset, shape and dtype. (One Zarr array per
  op would cost its metadata objects and their creation per op.)
- **Large tensors** get their own N-d array (``t<slot>``), chunked along the leading
  dimensions to about :data:`CHUNK_BYTES` (:func:`chunk_shape`) so that a slice reads
  few chunks; edge chunks are stored full size, as Zarr v3 requires.
- Chunks are files beside their array's ``zarr.json`` (:data:`CHUNK_KEY_ENCODING`:
  ``pack_raw/0``, ``t12/3.0``) in a store of format 2 or later; format 1 wrote them
  under Zarr's default ``c/`` prefix (``pack_raw/c/0``, ``t12/c/3/0``), which every
  array's metadata still declares where it was written so (:func:`chunk_key`).
- Every chunk is its array's codec chain applied to its C-order bytes
  (:class:`~.codecs.Chain`: [zstd →] crc32c). A shard (``sharding_indexed``,
  ``index_location: end``) is its inner chunks one after the other, then the index
  (``(offset, nbytes)`` little-endian uint64 per inner chunk, all ones where absent)
  and the index's CRC32C.

Chunks are encoded here rather than by zarr-python's pipeline (its synchronous API
funnels every call through one event-loop thread and copies each chunk to append the
checksum; ``benchmarks/zarr_pipelines.py`` measures the difference); array metadata is
still written by zarr-python, from the specs below.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tracelake.recorder import compiled

from .codecs import CRC32C, RAW, ZSTD, Buffer, Chain

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "CHUNK_KEY_ENCODING",
    "INNER_BYTES",
    "INNER_PER_SHARD",
    "SHARD_INDEX_BYTES",
    "ShardWrite",
    "chunk_grid",
    "chunk_key",
    "chunk_shape",
    "decode_inner",
    "encode_chunk",
    "encode_shard",
    "inner_span",
    "own_array_spec",
    "pack_array_spec",
    "pack_codec",
    "pack_stream",
    "parse_shard_index",
    "selection_chunks",
    "shard_writer",
]

#: Chunk size of packs (one shard), and the size from which a tensor gets its own array.
CHUNK_BYTES = 4 << 20
#: Inner chunk of a pack's shards: what reading one small tensor decodes.
INNER_BYTES = 64 << 10
#: Alignment of tensors inside a pack (so that any dtype can be viewed in place).
ALIGN = 64
INNER_PER_SHARD = CHUNK_BYTES // INNER_BYTES
#: The shard index and its checksum, at the end of every shard.
SHARD_INDEX_BYTES = INNER_PER_SHARD * 16 + CRC32C.SIZE
_ABSENT = np.iinfo(np.uint64).max
#: Own arrays write every chunk, even all-zero ones: a missing chunk object always
#: means damage.
_ZARR_CONFIG: Any = {"write_empty_chunks": True}
#: Half floats, integers and bools usually compress; float32/64 activations rarely do.
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


# -- keys ------------------------------------------------------------------------------------


#: How the arrays of a store of format 2 or later name their chunks: Zarr v3's ``v2``
#: chunk key encoding with ``.`` between a chunk's indexes, so that every chunk is a file
#: beside its array's ``zarr.json``. Zarr's default encoding (format 1's) puts them
#: under ``c/`` and a directory for each index but the last: one more directory a pack
#: (a tiny run made four, each as dear as creating a small file on ext4), and for a
#: large tensor chunked along its leading dimension one for every chunk besides.
CHUNK_KEY_ENCODING: dict[str, Any] = {"name": "v2", "separator": "."}


def chunk_key(array: str, index: Sequence[int] | int, flat: bool = True) -> str:
    """The key of chunk ``index`` (its indexes; an ``int``: shard ``index`` of a pack) of
    ``array``, an array written with :data:`CHUNK_KEY_ENCODING` (``flat``) or Zarr's
    default encoding (format 1's arrays). Where an array's metadata is at hand, its
    ``encode_chunk_key`` says which (``RunArrays.chunk_key``)."""
    if isinstance(index, str):
        raise TypeError(f"a chunk index is an int or a tuple of ints, not {index!r}")
    parts = (index,) if isinstance(index, int) else index
    if flat:
        return f"{array}/{CHUNK_KEY_ENCODING['separator'].join(map(str, parts))}"
    return f"{array}/c/{'/'.join(map(str, parts))}"


def chunk_grid(shape: Sequence[int], chunks: Sequence[int]) -> list[tuple[int, ...]]:
    """Every chunk index of an array of ``shape`` chunked by ``chunks``, in C order."""
    return _product([range(math.ceil(n / c)) for n, c in zip(shape, chunks, strict=True)])


def selection_chunks(key: tuple[Any, ...], chunks: Sequence[int]) -> list[tuple[int, ...]] | None:
    """Chunk indexes a normalised basic selection touches (``None`` when there are too
    many to list cheaply; zarr's checksums still guard what is read)."""
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
    return _product(ranges)


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out


# -- packs -----------------------------------------------------------------------------------


#: The names the writer gives arrays: packs (``pack_raw``, ``pack_zstd``) and tensors'
#: own arrays (``t<slot>``). The catalog's ``array`` column becomes a path, and a store
#: may come from someone else: any other name (absolute, ``..``, a slash) is refused.
ARRAY_NAME = re.compile(r"pack_[a-z0-9]{1,16}|t[0-9]{1,12}")


def checked_codecs(metadata: dict[str, Any]) -> str | None:
    """What is wrong with an array's ``zarr.json`` codecs (its ``to_dict()``), None if
    nothing: every chain tracelake writes ends in ``crc32c`` (a sharded array's inner
    chunks and index too), so that what is read is what was written; an array without
    it would return whatever file its chunks are, unchecked."""
    codecs = metadata.get("codecs")
    if not isinstance(codecs, list | tuple) or not codecs:
        return "its zarr.json declares no codecs"
    chains: list[Any] = [codecs]
    last = codecs[-1]
    if isinstance(last, dict) and last.get("name") == "sharding_indexed":
        config = last.get("configuration") or {}
        chains = [config.get("codecs"), config.get("index_codecs")]
    for chain in chains:
        if not isinstance(chain, list | tuple) or not chain:
            return "its zarr.json declares an empty codec chain"
        end = chain[-1]
        if not isinstance(end, dict) or end.get("name") != "crc32c":
            return "its zarr.json codec chain does not end in the crc32c checksum"
    return None


def pack_stream(dtype: torch.dtype) -> str:
    """Which pack a small tensor of ``dtype`` goes to."""
    return "pack_zstd" if dtype in _ZSTD_STREAM_DTYPES else "pack_raw"


def pack_codec(name: str) -> Chain:
    """The codec chain of pack ``name`` (it follows the pack's name)."""
    return ZSTD if name.startswith("pack_zstd") else RAW


def pack_array_spec(name: str, *, flat: bool) -> dict[str, Any]:
    """``zarr.create_array`` arguments of pack ``name``, before its first shard (``flat``:
    see :func:`chunk_key`)."""
    return {
        "shape": (CHUNK_BYTES,),
        "chunks": (INNER_BYTES,),
        "shards": (CHUNK_BYTES,),
        "dtype": "uint8",
        "fill_value": 0,
        "compressors": pack_codec(name).zarr_codecs(),
        "chunk_key_encoding": _key_encoding(flat),
        "attributes": {"tracelake": "pack"},
    }


def _key_encoding(flat: bool) -> dict[str, Any]:
    return CHUNK_KEY_ENCODING if flat else {"name": "default", "separator": "/"}


#: Whole inner chunks read from elsewhere than a shard's buffer (``encode_shard``): their
#: byte offset in the shard, their bytes, and their CRC32Cs if computed already (uint32,
#: one per inner chunk) or None.
Sources = Sequence[tuple[int, np.ndarray, np.ndarray | None]]


def encode_shard(data: np.ndarray, codec: Chain, sources: Sources = ()) -> list[Buffer]:
    """Shard of a pack holding ``data`` (1-D uint8, up to CHUNK_BYTES): the inner chunks
    covering it (the last padded to full size), then the index and its checksum. A last,
    partly filled shard simply has fewer inner chunks. ``sources``: whole inner chunks
    whose bytes are read there rather than from ``data`` (tensors written from their own
    memory), with their checksums if known (a raw pack's: the payload is the bytes)."""
    index = np.full((INNER_PER_SHARD, 2), _ABSENT, dtype="<u8")
    count = -(-data.nbytes // INNER_BYTES)
    parts = [data[start : start + INNER_BYTES] for start in range(0, data.nbytes, INNER_BYTES)]
    known: dict[int, memoryview] = {}
    for offset, source, crcs in sources:
        first = offset // INNER_BYTES
        given = None if crcs is None else memoryview(crcs.astype("<u4").tobytes())
        for k in range(source.nbytes // INNER_BYTES):
            parts[first + k] = source[k * INNER_BYTES : (k + 1) * INNER_BYTES]
            if given is not None:
                known[first + k] = given[4 * k : 4 * k + 4]
    if count and parts[-1].nbytes < INNER_BYTES:
        full = np.zeros(INNER_BYTES, dtype=np.uint8)
        full[: parts[-1].nbytes] = parts[-1]
        parts[-1] = full
    if not codec.compressors:  # every inner chunk stored as it is, checksum after it
        stored = INNER_BYTES + CRC32C.SIZE
        index[:count, 0] = np.arange(count, dtype="<u8") * stored
        index[:count, 1] = stored
        checksum = CRC32C.checksum
        pieces: list[Buffer] = []
        for j, part in enumerate(parts):
            crc = known.get(j)
            pieces += (part, checksum(part) if crc is None else crc)
        table = index.tobytes()
        return [*pieces, table, checksum(table)]
    pieces = []  # (the checksums are of the compressed payload: known ones are unused)
    offset = 0
    for j, part in enumerate(parts):
        encoded = codec.encode(part)
        size = sum(memoryview(p).nbytes for p in encoded)
        index[j] = (offset, size)
        offset += size
        pieces += encoded
    table = index.tobytes()
    pieces += [table, CRC32C.checksum(table)]
    return pieces


class ShardWrite:
    """Writes a raw shard to a file descriptor in one compiled call with the GIL
    released (``_hot.write_raw_shard``): ``write(fd)`` with ``writev`` from where the
    bytes are (returning how many), ``write.staged(fd, stage)`` gathered into the
    page-aligned ``stage`` first, for a file opened ``O_DIRECT`` (``local.Staged``)."""

    def __init__(self, args: tuple[int, ...], kept: list[Any]):
        self._args = args
        self._kept = kept  # what the addresses in args point into, alive while this is

    def __call__(self, fd: int) -> int:
        return int(_hot_call()(fd, *self._args))

    def staged(self, fd: int, stage: np.ndarray) -> tuple[int, bool]:
        total, direct = _hot_call()(fd, *self._args, stage.ctypes.data, stage.nbytes)
        return int(total), bool(direct)


def _hot_call() -> Any:
    return compiled.hot().write_raw_shard  # (ShardWrite is made only where it exists)


def shard_writer(data: np.ndarray, codec: Chain, sources: Sources = ()) -> ShardWrite | None:
    """A :class:`ShardWrite` of the shard ``encode_shard(data, codec, sources)`` makes,
    byte for byte, in one compiled call with the GIL released (checksums, index, the
    write), without a Python object per inner chunk (a worker's per-shard Python cost
    GPT-2's forward thread the GIL); ``None`` where that call is missing or the codec
    compresses."""
    hot = compiled.hot()
    if codec.compressors or hot is None or not hasattr(hot, "write_raw_shard"):
        return None
    refs = np.zeros((len(sources), 4), dtype=np.int64)
    kept = []  # what the rows' addresses point into, alive while the closure is
    for row, (offset, source, crcs) in zip(refs, sources, strict=True):
        if offset % INNER_BYTES or source.dtype != np.uint8 or not source.flags.c_contiguous:
            return None
        if crcs is not None:
            crcs = np.ascontiguousarray(crcs, dtype=np.uint32)
        kept.append((source, crcs))
        row[:] = (
            offset // INNER_BYTES,
            source.nbytes // INNER_BYTES,
            source.ctypes.data,
            0 if crcs is None else crcs.ctypes.data,
        )
    if data.dtype != np.uint8 or not data.flags.c_contiguous:
        return None
    address = data.ctypes.data if data.nbytes else 0
    args = (address, data.nbytes, INNER_BYTES, INNER_PER_SHARD, refs.ctypes.data, len(refs))
    return ShardWrite(args, [data, refs, kept])


def parse_shard_index(raw: bytes) -> np.ndarray | None:
    """The (INNER_PER_SHARD, 2) index from a shard's last SHARD_INDEX_BYTES, or ``None``
    when they are short or fail their checksum."""
    table = CRC32C.strip(raw) if len(raw) == SHARD_INDEX_BYTES else None
    if table is None:
        return None
    return np.frombuffer(table, dtype="<u8").reshape(-1, 2)


def inner_span(index: np.ndarray, j: int) -> tuple[int, int] | None:
    """(byte offset, stored size) of inner chunk ``j`` in its shard, ``None`` if absent."""
    offset, nbytes = (int(v) for v in index[j])
    return None if offset == _ABSENT else (offset, nbytes)


def decode_inner(raw: bytes, nbytes: int, codec: Chain) -> np.ndarray | None:
    """An inner chunk's bytes from the ``nbytes`` stored for it, ``None`` when they are
    short or fail their checksum."""
    return codec.decode(raw) if len(raw) == nbytes else None


# -- own arrays ------------------------------------------------------------------------------


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


def own_array_spec(
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    dtype: np.dtype,
    codec: Chain,
    attributes: dict[str, Any],
    *,
    flat: bool,
) -> dict[str, Any]:
    """``zarr.create_array`` arguments of a large tensor's own array (``flat``: see
    :func:`chunk_key`)."""
    return {
        "shape": shape,
        "chunks": chunks,
        "dtype": dtype,
        "fill_value": 0,
        "compressors": codec.zarr_codecs(),
        "chunk_key_encoding": _key_encoding(flat),
        "config": _ZARR_CONFIG,
        "attributes": attributes,
    }


def encode_chunk(part: np.ndarray, chunks: tuple[int, ...], codec: Chain) -> list[Buffer]:
    """One chunk of an own array: ``part`` (an edge chunk is padded with zeros to the
    full ``chunks`` shape) as C-order bytes through ``codec``."""
    if part.shape != chunks:
        full = np.zeros(chunks, dtype=part.dtype)
        full[tuple(slice(0, n) for n in part.shape)] = part
        part = full
    return codec.encode(np.ascontiguousarray(part).reshape(-1).view(np.uint8))
