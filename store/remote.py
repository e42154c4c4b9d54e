"""A store whose run arrays live on object storage (issue 15, item 2): the catalog, the
locks and each run's directory stay in a local directory; the bytes of the arrays go
to ``URL/runs/<random id>/`` (the same Zarr v3 layout as ``runs/<id>/tensors/`` on
disk) through :class:`~tracelake.store.objstore.ObjectBackend`.

- ``STORE/arrays.json`` names the URL (written when the store is first opened with
  one; later opens read it, so ``tl.open(STORE)`` alone reopens such a store).
  Credentials are never written: they come from the environment or ``storage_options``.
- ``runs/<id>/arrays.json`` names the run's object prefix. It is written, and made
  durable, before the run's first object: every object of a run is named by a run
  directory while it exists, and a run directory is removed only after its objects
  (:meth:`RemoteArrays.remove`), so removal restarts like the rest of ``gc()`` and no
  object is left behind that no directory names. The prefix is random (no counter is
  shared with anyone): two catalogs over one URL never write the same keys.
- A run is committed to the catalog only after its writer has finished, and every PUT
  is durable (and visible whole) when it returns: a complete run's arrays are all on
  the object store.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracelake.errors import StoreError

from .layout import ARRAYS_FILE, fsync_dir, fsync_file
from .objstore import ObjectBackend, is_url, open_object_store

__all__ = ["RemoteArrays"]


def _write_durably(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


class RemoteArrays:
    """Where the runs of one store keep their arrays on object storage."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self._store = open_object_store(self.url, storage_options)

    @classmethod
    def open(
        cls,
        root: Path,
        url: str | None,
        storage_options: Mapping[str, Any] | None,
        create: bool,
    ) -> RemoteArrays | None:
        """The store at ``root``'s remote arrays: ``url`` (recorded in ``root``'s
        ``arrays.json`` the first time), or the URL recorded there; None for a store
        whose arrays are on disk."""
        marker = root / ARRAYS_FILE
        recorded = json.loads(marker.read_text())["url"] if marker.exists() else None
        if url is None and recorded is None:
            if storage_options:
                raise StoreError(
                    f"storage_options were given, but the store at {str(root)!r} keeps its "
                    "arrays on disk (open it with its object-store URL to put them there)"
                )
            return None
        if url is not None and not is_url(url):
            raise StoreError(f"{url!r} is not an object-store URL (s3://bucket/prefix)")
        if recorded is not None and url is not None and recorded != url.rstrip("/"):
            raise StoreError(
                f"the store at {str(root)!r} keeps its arrays at {recorded!r}, not {url!r}"
            )
        if recorded is None:
            if not create:
                raise StoreError(f"the store at {str(root)!r} keeps its arrays on disk")
            assert url is not None
            _write_durably(marker, {"url": url.rstrip("/")})
        return cls(recorded or url or "", storage_options)

    def backend(self, prefix: str) -> ObjectBackend:
        return ObjectBackend(self._store, prefix, self.url)

    def new_run(self, run_dir: Path) -> ObjectBackend:
        """A new run's objects, under a prefix of its own, named in ``run_dir`` (durably)
        before anything is written there."""
        prefix = f"runs/{uuid.uuid4().hex}"
        _write_durably(run_dir / ARRAYS_FILE, {"prefix": prefix})
        return self.backend(prefix)

    def of_run(self, run_dir: Path) -> ObjectBackend | None:
        """The objects ``run_dir`` names (None: it names none, its run wrote nothing)."""
        try:
            prefix = json.loads((run_dir / ARRAYS_FILE).read_text())["prefix"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{run_dir / ARRAYS_FILE} is unreadable: {exc}") from exc
        if not isinstance(prefix, str) or not prefix.startswith("runs/"):
            raise StoreError(f"{run_dir / ARRAYS_FILE} names no run prefix: {prefix!r}")
        return self.backend(prefix)

    def remove(self, run_dir: Path) -> int:
        """Delete the objects ``run_dir`` names (before the directory itself goes);
        return their bytes."""
        backend = self.of_run(run_dir)
        if backend is None:
            return 0
        freed = backend.commit()  # (the bytes stored)
        backend.delete_prefix("")
        return freed
