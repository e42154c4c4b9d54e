"""The storage seam: where the bytes of a run's arrays live.

A :class:`ByteStore` holds objects (bytes) under ``/``-separated keys relative to its
root (``pack_raw/0``, ``t12/zarr.json``). Everything above it (the Zarr layout, shard
indexes, codecs, the chunk cache) speaks keys and bytes only, so another backend (object
storage) is one more implementation of this class, checked by the same conformance
suite (``tests/test_storage.py``).

Contract, for every implementation:

- ``put`` writes a whole object (its pieces one after the other). It is *durable* on
  return, or, given a :class:`Pending` from :meth:`ByteStore.pending`, once that closes.
- ``get`` reads a whole object or a byte range of it: ``get(key, start, end)`` is
  ``object[start:end]`` clipped to the object (a range past its end gives fewer bytes,
  never an error: the format's checksums and lengths catch short objects), and
  ``get_suffix(key, n)`` the last ``n`` bytes (all of them when it is shorter).
- A key that holds no object raises :class:`~tracelake.errors.ObjectNotFoundError`
  (a ``KeyError``) from ``get``, ``get_suffix``, ``size`` and ``version``; ``delete``
  of a missing key does nothing.
- ``list(prefix)`` gives every key equal to ``prefix`` or below ``prefix + "/"``
  (``""``: all), sorted; ``list_dir(prefix)`` the names directly below it (objects and
  "directories"); ``delete_prefix`` removes what ``list`` gives.
- ``version(key)`` changes whenever the object may have changed (a rewrite, damage on
  disk): the process-wide chunk cache is keyed by it, so a decoded chunk is never served
  for bytes that are no longer there. It is unique across backends in the process.
- ``commit()`` makes everything written so far durable, names included.
- Keys never leave the store: an empty key, an absolute one, or one with an empty,
  ``.`` or ``..`` segment (or a backslash, or NUL) raises
  :class:`~tracelake.errors.InvalidKeyError`.
"""

from __future__ import annotations

import builtins
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Protocol

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype

from tracelake.errors import InvalidKeyError, ObjectNotFoundError

__all__ = ["ByteStore", "MemoryBackend", "Pending", "ZarrAdapter", "check_key", "check_prefix"]


def check_key(key: str) -> str:
    """``key`` if it names an object inside a store, else :class:`InvalidKeyError`."""
    if key in _GOOD_KEYS:  # every read checks its key: the common ones once
        return key
    if (
        not isinstance(key, str)
        or not key
        or key[0] == "/"
        or "\\" in key
        or "\x00" in key
        or any(part in ("", ".", "..") for part in key.split("/"))
    ):
        raise InvalidKeyError(
            f"invalid storage key {key!r}: keys are relative, '/'-separated, with no empty, "
            "'.' or '..' segment"
        )
    if len(_GOOD_KEYS) >= _GOOD_KEYS_MAX:
        _GOOD_KEYS.clear()
    _GOOD_KEYS.add(key)
    return key


_GOOD_KEYS: set[str] = set()  # keys that passed: a set of str, whatever thread adds
_GOOD_KEYS_MAX = 1 << 16


def check_prefix(prefix: str) -> str:
    """A prefix: ``""`` (the whole store) or a key (a trailing ``/`` is dropped)."""
    if prefix == "":
        return prefix
    return check_key(prefix.removesuffix("/") if isinstance(prefix, str) else prefix)


class Pending(Protocol):
    """Writes handed over to be made durable later (:meth:`ByteStore.pending`)."""

    def close(self, durable: bool = True) -> None:
        """Make every write handed over durable (or, not ``durable``: drop the wait)
        and raise what making them durable raised."""


class _Immediate:
    """A :class:`Pending` for backends whose every put is durable on return."""

    def close(self, durable: bool = True) -> None:
        pass


class ByteStore(ABC):
    """Objects under keys: the bytes of one run's arrays (see the module docstring)."""

    @abstractmethod
    def put(self, key: str, pieces: Sequence[Any], pending: Pending | None = None) -> None:
        """Write the object ``key`` as ``pieces`` (buffers) one after the other."""

    @abstractmethod
    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """``object[start:end]``, clipped to the object (``end=None``: to its end)."""

    @abstractmethod
    def get_suffix(self, key: str, nbytes: int) -> bytes:
        """The last ``nbytes`` of the object (all of it when it is shorter)."""

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def version(self, key: str) -> Any:
        """A hashable value that changes whenever the object may have changed."""

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]: ...

    @abstractmethod
    def list_dir(self, prefix: str = "") -> builtins.list[str]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abstractmethod
    def commit(self) -> int:
        """Make everything written so far durable; return the bytes stored."""

    def put_unsynced(self, key: str, data: bytes) -> None:
        """Write the small object ``key``, left to the caller to make durable (with the
        rest of a run, at its commit): ``put`` with a ``pending(sync=False)``."""
        self.put(key, [data], self.pending(sync=False))

    def pending(self, window: int = 16, background: bool = True, sync: bool = True) -> Pending:
        """A set of writes made durable together, at most ``window`` waiting at a time,
        by a thread of its own (``background``) or by the writer that adds one too many.
        ``sync=False``: the caller makes them durable later (a batch of runs)."""
        return _Immediate()

    def zarr_store(self, prefix: str = "") -> Any:
        """What zarr-python opens for the objects under ``prefix`` (a ``StoreLike``):
        by default a :class:`ZarrAdapter` over this store."""
        return ZarrAdapter(self, check_prefix(prefix))


def _check_range(start: int, end: int | None) -> None:
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range [{start}, {end}): use 0 <= start <= end")


_UIDS = itertools.count()


class MemoryBackend(ByteStore):
    """Objects in a dict (for tests, and to run the format code without a disk)."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._versions: dict[str, int] = {}
        self._uid = f"memory-{next(_UIDS)}"  # version tokens unique in the process
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _object(self, key: str) -> bytes:
        try:
            return self._objects[check_key(key)]
        except KeyError:
            raise ObjectNotFoundError(key, self._uid) from None

    def put(self, key: str, pieces: Sequence[Any], pending: Pending | None = None) -> None:
        data = b"".join(memoryview(p).cast("B") for p in pieces)
        with self._lock:
            self._objects[check_key(key)] = data
            self._versions[key] = next(self._counter)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        _check_range(start, end)
        return self._object(key)[start:end]

    def get_suffix(self, key: str, nbytes: int) -> bytes:
        _check_range(0, nbytes)
        data = self._object(key)
        return data[max(len(data) - nbytes, 0) :]

    def size(self, key: str) -> int:
        return len(self._object(key))

    def exists(self, key: str) -> bool:
        return check_key(key) in self._objects

    def version(self, key: str) -> Any:
        self._object(key)
        return (self._uid, key, self._versions[key])

    def list(self, prefix: str = "") -> builtins.list[str]:
        prefix = check_prefix(prefix)
        below = prefix + "/"
        with self._lock:
            keys = list(self._objects)
        return sorted(k for k in keys if not prefix or k == prefix or k.startswith(below))

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        prefix = check_prefix(prefix)
        skip = len(prefix) + 1 if prefix else 0
        names = {k[skip:].split("/", 1)[0] for k in self.list(prefix) if k != prefix}
        return sorted(names)

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)
            self._versions.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self.delete(key)

    def commit(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._objects.values())


class ZarrAdapter(Store):
    """zarr-python's ``Store`` over a :class:`ByteStore`'s objects under ``prefix``, so
    that zarr-python reads and writes the same bytes tracelake does (its own calls run
    synchronously: the backends here do no network I/O)."""

    supports_writes = True
    supports_deletes = True
    supports_listing = True

    def __init__(self, store: ByteStore, prefix: str = "", *, read_only: bool = False):
        super().__init__(read_only=read_only)
        self.store = store
        self.prefix = check_prefix(prefix)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ZarrAdapter)
            and other.store is self.store
            and other.prefix == self.prefix
        )

    def __hash__(self) -> int:
        return hash((id(self.store), self.prefix))

    def with_read_only(self, read_only: bool = False) -> ZarrAdapter:
        return ZarrAdapter(self.store, self.prefix, read_only=read_only)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        full = self._key(key)
        try:
            if byte_range is None:
                data = self.store.get(full)
            elif isinstance(byte_range, RangeByteRequest):
                data = self.store.get(full, byte_range.start, byte_range.end)
            elif isinstance(byte_range, OffsetByteRequest):
                data = self.store.get(full, byte_range.offset)
            elif isinstance(byte_range, SuffixByteRequest):
                data = self.store.get_suffix(full, byte_range.suffix)
            else:
                raise TypeError(f"unexpected byte range {byte_range!r}")
        except ObjectNotFoundError:
            return None
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def exists(self, key: str) -> bool:
        return self.store.exists(self._key(key))

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        self.store.put(self._key(key), [value.as_numpy_array()])

    async def delete(self, key: str) -> None:
        self._check_writable()
        self.store.delete(self._key(key))

    async def list(self) -> AsyncIterator[str]:
        for key in self._strip(self.store.list(self.prefix)):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._strip(self.store.list(self.prefix)):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        for name in self.store.list_dir(self._key(prefix.rstrip("/")) if prefix else self.prefix):
            yield name

    def _strip(self, keys: builtins.list[str]) -> builtins.list[str]:
        skip = len(self.prefix) + 1 if self.prefix else 0
        return [k[skip:] for k in keys if k != self.prefix]
