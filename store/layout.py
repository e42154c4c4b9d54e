"""The store's directory: its format marker, locks, run directories, durable writes.

::

    STORE/
      tracelake.json        {"format": 1, ...}: what this directory is, in which format
      catalog.duckdb        the catalog (runs, ops, tensors, edges, modules)
      catalog.lock          flock: writers hold it exclusively for a moment, readers shared
      catalog.gen           bumped after every catalog change: readers re-sync when it moves
      runs/<id>/            one directory per run, named by its numeric id, never by its name
        run.json            {"run": id, "created": microseconds}: which catalog row owns it
        writing.lock        flock held by the live writing process
      runs/.trash-<id>-*    a run directory gc() is removing (renamed first, so a gc
                            killed half-way leaves it for the next one to finish)
        tensors/            a Zarr v3 group: packed small tensors and large tensors' arrays

Run names live only in the catalog, so no name ever becomes a path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from tracelake.errors import InvalidRunNameError, StoreFormatError, StoreNotFoundError

__all__ = [
    "FORMAT",
    "StorePaths",
    "fsync_tree",
    "locked",
    "try_lock",
    "validate_name",
]

#: The on-disk format this code writes; a store with a larger number is refused.
FORMAT = 1
_MARKER = "tracelake.json"
_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,200}")


def validate_name(name: object) -> str:
    """A run name: 1 to 200 printable characters (it is data, never a path)."""
    if not isinstance(name, str):
        raise InvalidRunNameError(f"a run name is a str, not {type(name).__name__}")
    if not _NAME.fullmatch(name) or name != name.strip():
        raise InvalidRunNameError(
            f"invalid run name {name!r}: use 1 to 200 printable characters, without "
            "leading or trailing spaces"
        )
    return name


class StorePaths:
    """Where each part of a store lives."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().absolute()
        self.marker = self.root / _MARKER
        self.catalog = self.root / "catalog.duckdb"
        self.lock = self.root / "catalog.lock"
        self.gen = self.root / "catalog.gen"
        self.runs = self.root / "runs"

    def run_dir(self, run_id: int) -> Path:
        return self.runs / f"{int(run_id):08d}"

    def run_marker(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "run.json"

    def trash(self, run_id: int) -> Path:
        return self.runs / f".trash-{int(run_id):08d}-{os.urandom(4).hex()}"

    def run_dir_ids(self) -> list[int]:
        """The ids of the run directories on disk, sorted."""
        try:
            names = os.listdir(self.runs)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def trash_dirs(self) -> list[Path]:
        """Run directories a ``gc()`` began to remove and did not finish."""
        try:
            names = os.listdir(self.runs)
        except FileNotFoundError:
            return []
        return [self.runs / n for n in sorted(names) if n.startswith(".trash-")]

    def tensors(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "tensors"

    def writing_lock(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "writing.lock"

    # -- opening ---------------------------------------------------------------------------

    def check(self, create: bool) -> None:
        """Make sure a store of a format we read is here, creating one if asked."""
        if self.marker.exists():
            self._check_format()
            return
        if not create:
            raise StoreNotFoundError(
                f"no tracelake store at {str(self.root)!r}; tl.open(path) creates one"
            )
        if self.root.exists() and any(self.root.iterdir()):
            raise StoreFormatError(
                f"{str(self.root)!r} exists and is not a tracelake store (it has no "
                f"{_MARKER}); choose an empty or new directory"
            )
        self.runs.mkdir(parents=True, exist_ok=True)
        self.lock.touch()
        marker = {"format": FORMAT, "what": "tracelake store"}
        tmp = self.root / f".{_MARKER}.{os.getpid()}"
        tmp.write_text(json.dumps(marker))
        fsync_file(tmp)
        os.replace(tmp, self.marker)  # two processes creating at once: both write the same
        fsync_dir(self.root)

    def _check_format(self) -> None:
        try:
            marker = json.loads(self.marker.read_text())
            version = int(marker["format"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreFormatError(
                f"{str(self.marker)!r} is unreadable ({exc}); this is not a tracelake store "
                "or it is damaged"
            ) from exc
        if version > FORMAT:
            raise StoreFormatError(
                f"the store at {str(self.root)!r} has format {version}, newer than this "
                f"tracelake reads ({FORMAT}); upgrade tracelake to open it"
            )


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fsync_file(path)


def fsync_tree(root: Path) -> int:
    """fsync every file and directory under ``root``; return the bytes of the files."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            total += path.stat().st_size
            fsync_file(path)
        fsync_dir(Path(dirpath))
    return total


@contextlib.contextmanager
def locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold an flock on ``path`` (created if absent) for the block. The kernel releases
    it if the process dies, so a killed writer never leaves the store locked."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def try_lock(path: Path) -> int | None:
    """Take an exclusive flock without waiting: the open descriptor (close it to release),
    or ``None`` if another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
