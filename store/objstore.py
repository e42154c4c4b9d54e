"""Run arrays on object storage (S3 and what speaks its protocol; GCS, Azure): a
:class:`~tracelake.store.backend.ByteStore` over `obstore <https://developmentseed.org/obstore>`_.

The keys are the same as on disk, below the store's URL prefix, so the bucket holds the
same Zarr v3 layout, which plain zarr-python reads (``zarr.storage.ObjectStore`` over an
obstore store of the same URL). A ``put`` is one PUT of the whole object: the object
store makes it durable, and visible whole, before it answers, so :meth:`commit` has
nothing left to wait for. Credentials come from the usual environment (``AWS_*``) or
``storage_options`` (obstore's config keys: ``endpoint``, ``region``, ``access_key_id``,
``secret_access_key``, ...; ``allow_http``, ``timeout`` and the other client options,
and ``retry_config``, may be given in the same dict). obstore retries a failed or
stalled request for up to three minutes by default; ``retry_config`` (obstore's:
``max_retries``, ``retry_timeout``, ``backoff``: ``init_backoff``, ``max_backoff``,
``base``; durations as seconds or ``timedelta``) bounds that.

obstore comes with the ``scale`` extra and is imported only when a URL store is opened.
"""

from __future__ import annotations

import builtins
import datetime
import itertools
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from tracelake.errors import MissingExtraError, ObjectNotFoundError, StoreError

from .backend import ByteStore, Pending, _check_range, check_key, check_prefix

__all__ = ["CLIENT_OPTIONS", "ObjectBackend", "is_url", "open_object_store"]

#: ``storage_options`` keys that are obstore *client* options, not the store's config.
CLIENT_OPTIONS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "timeout",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "user_agent",
        "http1_only",
        "http2_only",
    }
)
_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "memory")
_UIDS = itertools.count()


def is_url(where: object) -> bool:
    """Whether ``where`` names object storage (``s3://bucket/prefix``) rather than a
    directory."""
    return isinstance(where, str) and urlsplit(where).scheme in _SCHEMES


def open_object_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """obstore's store for ``url`` (bucket and prefix) with ``storage_options``;
    :class:`MissingExtraError` without the ``scale`` extra."""
    try:
        from obstore.store import from_url
    except ImportError as exc:
        raise MissingExtraError(
            "a store on object storage", "scale", exc.name or "obstore"
        ) from exc
    options: Any = dict(storage_options or {})
    client: Any = {k: options.pop(k) for k in list(options) if k in CLIENT_OPTIONS}
    retry = _retry_config(options.pop("retry_config", None))
    try:
        return from_url(  # type: ignore[call-overload, unused-ignore]
            url, config=options or None, client_options=client or None, retry_config=retry
        )
    except Exception as exc:  # obstore: a bad URL or option
        raise StoreError(f"cannot open the object store {url!r}: {exc}") from exc


#: The durations of obstore's ``retry_config`` (``backoff``'s, and its own).
_DURATIONS = frozenset({"retry_timeout", "init_backoff", "max_backoff"})


def _retry_config(given: Any) -> Any:
    """obstore's ``retry_config`` from ``storage_options``'s, its durations given as
    seconds made ``timedelta`` (what obstore takes; a number is what JSON and the
    command line can give)."""
    if given is None:
        return None
    if not isinstance(given, Mapping):
        raise StoreError(
            f"storage_options' retry_config must be a dict (max_retries, retry_timeout, "
            f"backoff), not {type(given).__name__}"
        )

    return _with_durations(given)


def _with_durations(items: Mapping[str, Any]) -> dict[str, Any]:
    """``items`` (and the mappings in it) with the numbers of :data:`_DURATIONS` keys as
    seconds' ``timedelta``s."""
    out: dict[str, Any] = {}
    for key, value in items.items():
        if isinstance(value, Mapping):
            value = _with_durations(value)
        elif key in _DURATIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = datetime.timedelta(seconds=value)
        out[key] = value
    return out


class ObjectBackend(ByteStore):
    """Objects under ``prefix`` of an obstore store (``store``: ``open_object_store``'s,
    shared by every run of a store: one connection pool)."""

    def __init__(self, store: Any, prefix: str = "", url: str = ""):
        import obstore

        self._obstore = obstore
        self.store = store
        self.prefix = check_prefix(prefix)
        self.url = url
        self._uid = f"object-{next(_UIDS)}"  # version tokens unique in the process

    def __repr__(self) -> str:
        return f"ObjectBackend({self.url!r}, {self.prefix!r})"

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _failed(self, key: str, exc: Exception) -> StoreError:
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(key, repr(self))
        return StoreError(f"object store {self!r}: cannot access {key}: {exc}")

    def put(self, key: str, pieces: Sequence[Any], pending: Pending | None = None) -> None:
        path = self._path(key)
        data = b"".join(memoryview(p).cast("B") for p in pieces)
        try:
            self._obstore.put(self.store, path, data)
        except Exception as exc:
            raise self._failed(key, exc) from exc

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        _check_range(start, end)
        path = self._path(key)
        try:
            if end is None and start == 0:
                return bytes(self._obstore.get(self.store, path).bytes())
            if end is None or start >= end:
                size = self.size(key)  # (also: ObjectNotFoundError for a missing key)
                end = size if end is None else end
                if start >= min(end, size):
                    return b""
            return bytes(self._obstore.get_range(self.store, path, start=start, end=end))
        except FileNotFoundError as exc:
            raise self._failed(key, exc) from None
        except StoreError:
            raise
        except Exception as exc:  # a range starting past the end: 416
            if start >= self.size(key):
                return b""
            raise self._failed(key, exc) from exc

    def get_suffix(self, key: str, nbytes: int) -> bytes:
        _check_range(0, nbytes)
        path = self._path(key)
        if nbytes == 0:
            self.size(key)
            return b""
        try:
            got = self._obstore.get(self.store, path, options={"range": {"suffix": nbytes}})
            return bytes(got.bytes())
        except Exception as exc:
            raise self._failed(key, exc) from exc

    def _head(self, key: str) -> dict[str, Any]:
        path = self._path(key)
        try:
            head: Any = self._obstore.head(self.store, path)
            return dict(head)
        except Exception as exc:
            raise self._failed(key, exc) from exc

    def size(self, key: str) -> int:
        return int(self._head(key)["size"])

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ObjectNotFoundError:
            return False
        return True

    def version(self, key: str) -> Any:
        head = self._head(key)
        return (self._uid, key, head.get("e_tag"), head.get("version"), head["size"])

    def _objects(self, prefix: str) -> builtins.list[Any]:
        prefix = check_prefix(prefix)
        full = self._path(prefix) if prefix else self.prefix
        try:
            return [
                meta for batch in self._obstore.list(self.store, full or None) for meta in batch
            ]
        except Exception as exc:
            raise self._failed(prefix or "/", exc) from exc

    def _key(self, path: str) -> str:
        return path[len(self.prefix) + 1 :] if self.prefix else path

    def list(self, prefix: str = "") -> builtins.list[str]:
        keys = [self._key(meta["path"]) for meta in self._objects(prefix)]
        if prefix and self.exists(check_prefix(prefix)):  # (a prefix listing is "dir/")
            keys.append(check_prefix(prefix))
        return sorted(keys)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        prefix = check_prefix(prefix)
        full = self._path(prefix) if prefix else self.prefix
        try:
            listed = self._obstore.list_with_delimiter(self.store, full or None)
        except Exception as exc:
            raise self._failed(prefix or "/", exc) from exc
        names = [p.rsplit("/", 1)[-1] for p in listed["common_prefixes"]]
        names += [meta["path"].rsplit("/", 1)[-1] for meta in listed["objects"]]
        return sorted(names)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self._obstore.delete(self.store, path)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._failed(key, exc) from exc

    def delete_prefix(self, prefix: str) -> None:
        paths = [meta["path"] for meta in self._objects(prefix)]
        for start in range(0, len(paths), 1000):  # S3's DeleteObjects takes 1,000 a call
            try:
                self._obstore.delete(self.store, paths[start : start + 1000])
            except Exception as exc:
                raise self._failed(prefix or "/", exc) from exc

    def commit(self) -> int:
        """Every put is durable on return: only the bytes stored are left to say."""
        return sum(int(meta["size"]) for meta in self._objects(""))
