"""Codecs as objects: each knows its Zarr v3 metadata, encodes and decodes.

An array's chunks are stored as Zarr v3 declares them: C-order ``bytes``, then the
array's compressors (:class:`Zstd` or none), then :class:`Crc32c`, the checksum of what
is stored, appended little-endian. A :class:`Chain` is one such sequence; its ``name``
is what the catalog's ``codec`` column holds (``"raw"``, ``"zstd"``), and
:func:`codec_named` turns it back into the chain. Adding a codec is one class and one
entry in :data:`CHAINS`; nothing else switches on names.

The zarr-python codec objects a chain returns (:meth:`Chain.zarr_codecs`) are the ones
the arrays' ``zarr.json`` files were always written with, so metadata stays
byte-identical and zarr-python decodes what tracelake encodes. zstd and CRC32C run in C
with the GIL released, so writer threads encode in parallel with the forward pass.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import google_crc32c
import numpy as np
from numcodecs import Zstd as _NumcodecsZstd
from zarr.codecs import Crc32cCodec, ZstdCodec

from tracelake.errors import StoreError

__all__ = [
    "CHAINS",
    "CRC32C",
    "RAW",
    "ZSTD",
    "ZSTD_MIN_RATIO",
    "Buffer",
    "Chain",
    "Compressor",
    "Crc32c",
    "Zstd",
    "choose_codec",
    "codec_named",
]

#: zstd is used when a sample compresses at least this well (bytes in / bytes out).
ZSTD_MIN_RATIO = 1.3
_SAMPLE_BYTES = 1 << 16
_CRC = struct.Struct("<I")
#: Anything exporting the buffer protocol (bytes, memoryview, a numpy array).
Buffer: TypeAlias = Any


class Compressor(Protocol):
    """A bytes-to-bytes codec that changes the payload (the checksum is not one)."""

    def encode(self, data: Buffer) -> Buffer: ...

    def decode(self, data: Buffer) -> Buffer: ...

    def zarr_codec(self) -> Any: ...


@dataclass(frozen=True)
class Zstd:
    """zstd at ``level`` (Zarr v3 ``zstd`` codec, no checksum of its own)."""

    level: int = 1

    def encode(self, data: Buffer) -> Buffer:
        return _numcodecs_zstd(self.level).encode(data)  # type: ignore[no-any-return]

    def decode(self, data: Buffer) -> Buffer:
        return _numcodecs_zstd(0).decode(data)  # type: ignore[no-any-return]

    def zarr_codec(self) -> Any:
        return ZstdCodec(level=self.level)


_ZSTD_BY_LEVEL: dict[int, Any] = {}


def _numcodecs_zstd(level: int) -> Any:
    codec = _ZSTD_BY_LEVEL.get(level)
    if codec is None:  # stateless: one per level is shared by every thread
        codec = _ZSTD_BY_LEVEL[level] = _NumcodecsZstd(level=level)
    return codec


class Crc32c:
    """The Zarr v3 ``crc32c`` codec: CRC32C (Castagnoli) of the payload, 4 bytes
    little-endian after it. The one place tracelake computes a checksum."""

    SIZE = 4

    @staticmethod
    def checksum(data: Buffer) -> bytes:
        if not isinstance(data, bytes | np.ndarray):  # what google_crc32c takes, uncopied
            data = np.frombuffer(data, dtype=np.uint8)
        return _CRC.pack(google_crc32c.value(data))

    def strip(self, stored: bytes) -> np.ndarray | None:
        """The payload of ``stored`` (payload + checksum) as a uint8 view of it, or
        ``None`` when the checksum does not match (or ``stored`` cannot hold one)."""
        if len(stored) < self.SIZE:
            return None
        payload = np.frombuffer(stored, dtype=np.uint8, count=len(stored) - self.SIZE)
        if self.checksum(payload) != stored[-self.SIZE :]:
            return None
        return payload

    def zarr_codec(self) -> Any:
        return Crc32cCodec()


CRC32C = Crc32c()


@dataclass(frozen=True)
class Chain:
    """The bytes-to-bytes codecs of one array: ``compressors``, then :data:`CRC32C`.

    ``name`` is the catalog's ``codec`` column; the chain is what that name means."""

    name: str
    compressors: tuple[Compressor, ...] = ()

    def zarr_codecs(self) -> list[Any]:
        """zarr-python's codec objects for ``create_array(compressors=...)``."""
        return [c.zarr_codec() for c in self.compressors] + [CRC32C.zarr_codec()]

    def encode(self, data: Buffer) -> list[Buffer]:
        """``data``'s stored form as pieces to write one after the other (the payload
        is not copied to append its checksum)."""
        payload = data
        for compressor in self.compressors:
            payload = compressor.encode(payload)
        return [payload, CRC32C.checksum(payload)]

    def decode(self, stored: bytes) -> np.ndarray | None:
        """The bytes ``stored`` encodes (a read-only uint8 array), or ``None`` when its
        checksum does not match."""
        payload: Buffer | None = CRC32C.strip(stored)
        if payload is None:
            return None
        for compressor in reversed(self.compressors):
            payload = compressor.decode(payload)
        return np.frombuffer(payload, dtype=np.uint8)


RAW = Chain("raw")
ZSTD = Chain("zstd", (Zstd(level=1),))
#: Every chain a store may name, by its catalog name.
CHAINS: dict[str, Chain] = {c.name: c for c in (RAW, ZSTD)}


def codec_named(name: str) -> Chain:
    try:
        return CHAINS[name]
    except KeyError:
        raise StoreError(
            f"the store names a codec this tracelake lacks: {name!r} (known: {sorted(CHAINS)})"
        ) from None


def choose_codec(data: np.ndarray) -> Chain:
    """:data:`ZSTD` if a sample of ``data``'s bytes compresses by ZSTD_MIN_RATIO, else
    :data:`RAW`."""
    flat = data.reshape(-1).view(np.uint8)
    if flat.nbytes <= _SAMPLE_BYTES:
        sample = flat
    else:  # three spread-out windows: the start alone is often padding or a prefix
        step = _SAMPLE_BYTES // 3
        starts = (0, flat.nbytes // 2, flat.nbytes - step)
        sample = np.concatenate([flat[s : s + step] for s in starts])
    packed = ZSTD.compressors[0].encode(np.ascontiguousarray(sample))
    return ZSTD if sample.nbytes >= ZSTD_MIN_RATIO * memoryview(packed).nbytes else RAW
