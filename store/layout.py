"""The store's directory: its format marker, locks, run directories, durable writes.

::

    STORE/
      tracelake.json        {"format": 2, ...}: what this directory is, in which format
      catalog.duckdb        the catalog (runs, ops, tensors, edges, modules)
      catalog.lock          flock: writers hold it exclusively for a moment, readers shared
      catalog.gen           bumped after every catalog change: readers re-sync when it moves
      catalog.shadow        catalog.duckdb as the last completed change left it (duckfile.py):
                            what a catalog a killed writer left unreadable is restored from
      catalog.duckdb.unreadable-<time>  such an unreadable catalog, kept after the restore
      catalog.duckdb.new    a new store's catalog while its first transaction makes it
                            (renamed to catalog.duckdb once whole; a killed one's is
                            removed by the next, its rows being still sealed)
      runs/<id>/            one directory per run, named by its numeric id, never by its name
        run.json            {"run": id, "created": microseconds}: which catalog row owns it
        writing.lock        flock held by the live writing process
      runs/.staging/<pid>-*/  a run not yet committed (renamed to runs/<id> by its
                            commit; gc() removes one whose writer died)
        staged.json         {"name", "created", ...}: what listing it shows (with "error"
                            once its recording failed)
        writing.lock        flock held by the live writing process
      runs/.staging/<pid>-*/  or an open batch: its writing.lock, one directory <k>/ a
                            run (renamed to runs/<id> by the batch's commit; gc()
                            removes a batch whose process died, runs and all)
        staged.jsonl        a line a run of the batch: {"dir": "<k>", "name", ...}
      runs/.sealed/<id>     the catalog rows of run <id>, recorded and durable, not yet in
                            catalog.duckdb (sealed.py): the next catalog transaction of
                            any writer or reader inserts them, then removes this file
      runs/.trash-<id>-*    a run directory gc() is removing (renamed first, so a gc
                            killed half-way leaves it for the next one to finish)
        tensors/            a Zarr v3 group: packed small tensors and large tensors' arrays,
                            each chunk a file beside its array's zarr.json (format 2;
                            format 1's under c/: format.CHUNK_KEY_ENCODING)

Run names live only in the catalog, so no name ever becomes a path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from tracelake.errors import (
    InvalidRunNameError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    TraceLakeWarning,
)

__all__ = [
    "ARRAYS_FILE",
    "DEFAULT_MAX_INFLIGHT",
    "FORMAT",
    "RESERVE_BYTES",
    "StorePaths",
    "check_run_marker",
    "disk_full",
    "fsync_tree",
    "full_hint",
    "is_utf8",
    "keep_reserve",
    "libc_function",
    "locked",
    "release_reserve",
    "remove_run_dir",
    "remove_tree",
    "trash_run_dir",
    "try_lock",
    "validate_name",
    "write_run_marker",
]

#: How many bytes of saved tensors may wait to be written before the forward pass waits
#: (``max_inflight=``; here, beside the store's other settings, for the facade to name
#: without loading the write path).
DEFAULT_MAX_INFLIGHT = 256 << 20
#: The on-disk format this code writes into a store it creates; a store with a larger
#: number is refused. 2: arrays name their chunks flat (``format.CHUNK_KEY_ENCODING``); a
#: store of format 1 keeps taking format 1's runs (``StorePaths.flat_chunks``), which the
#: tracelake that made it reads.
FORMAT = 2
#: The first format whose arrays name their chunks flat.
_FLAT_CHUNKS = 2
_MARKER = "tracelake.json"
#: Where the directories of runs not yet committed are made (under ``runs/``): a
#: directory of their own, so that making one leaves ``runs/`` (whose stat tells a
#: writer its listing of run ids still holds) untouched.
STAGING = ".staging"
#: Where the rows of sealed runs wait for the catalog (under ``runs/``), a file a run
#: named by its id (``store/sealed.py``).
SEALED = ".sealed"
#: In a run's staged directory while it is sealed: its rows, then moved to ``SEALED``.
SEALED_ROWS = "rows.sealed"
#: How such directories began in stores written before (directly under ``runs/``).
_OLD_STAGING = ".batch-"
#: In a staged run's directory: its name and what ``runs(all=True)`` lists of it.
STAGED_FILE = "staged.json"
#: In a batch's staging directory: the same for each of its runs, a line each (one
#: file a batch, not one a run: on a busy filesystem each new inode costs ~0.1-1 ms).
STAGED_LINES = "staged.jsonl"
#: In the store's directory and in each run's: where the arrays live when they are on
#: object storage (``store/remote.py``); absent, they are under ``tensors/``.
ARRAYS_FILE = "arrays.json"
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
    if not is_utf8(name):
        raise InvalidRunNameError(
            f"invalid run name {name!r}: it holds a lone surrogate (text that is not "
            "Unicode: often a file name decoded with errors='surrogateescape'), which "
            "cannot be stored"
        )
    return name


def is_utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StorePaths:
    """Where each part of a store lives."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().absolute()
        self.marker = self.root / _MARKER
        self.catalog = self.root / "catalog.duckdb"
        self.catalog_new = self.root / "catalog.duckdb.new"
        self.lock = self.root / "catalog.lock"
        self.gen = self.root / "catalog.gen"
        self.shadow = self.root / "catalog.shadow"
        self.runs = self.root / "runs"
        self.reserve = self.root / "catalog.reserve"
        self.sealed = self.runs / SEALED
        #: the store's format, as ``check`` finds (or makes) it; 1 until then (a
        #: DuckLake store's scratch directory has no marker: its runs keep format 1's
        #: layout, which every tracelake reads)
        self.format = 1

    @property
    def flat_chunks(self) -> bool:
        """Whether new runs' arrays name their chunks flat (``format.chunk_key``)."""
        return self.format >= _FLAT_CHUNKS

    def run_dir(self, run_id: int) -> Path:
        return self.runs / f"{int(run_id):08d}"

    def run_marker(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "run.json"

    def trash(self, run_id: int) -> Path:
        return self.runs / f".trash-{int(run_id):08d}-{os.urandom(4).hex()}"

    def run_dir_ids(self) -> list[int]:
        """The ids of the run directories on disk, sorted."""
        return sorted(int(n) for n in self._run_entries() if n.isdigit())

    def _run_entries(self) -> list[str]:
        """The names under ``runs/``, sorted (none before the first run)."""
        try:
            return sorted(os.listdir(self.runs))
        except FileNotFoundError:
            return []

    def sealed_ids(self) -> list[int]:
        """The ids of the sealed runs (recorded, their rows not yet in the catalog),
        sorted."""
        try:
            return sorted(int(n) for n in os.listdir(self.sealed) if n.isdigit())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def sealed_rows(self, run_id: int) -> Path:
        return self.sealed / f"{int(run_id):08d}"

    def make_sealed(self) -> None:
        """Make ``runs/.sealed`` if missing, refused where it is a symbolic link."""
        self._refuse_link(self.sealed)
        self.sealed.mkdir(exist_ok=True)

    def _refuse_link(self, place: Path) -> None:
        if place.is_symlink():
            raise StoreError(
                f"refusing to write to the store at {str(self.root)!r}: "
                f"{place.relative_to(self.root)} is a symbolic link, which may lead "
                "outside the store"
            )

    def staging(self) -> Path:
        """A new directory name for a run being recorded: it becomes ``runs/<id>`` when
        the run (or its batch) commits."""
        return self.runs / STAGING / f"{os.getpid()}-{os.urandom(6).hex()}"

    def new_staging(self) -> Path:
        """Make a new directory for a run being recorded (:meth:`staging`); ``runs/`` and
        ``runs/.staging`` are made if missing, and refused where either is a symbolic
        link (``mkdir`` would follow it out of the store)."""
        staged = self.staging()
        for place in (self.runs, staged.parent):
            self._refuse_link(place)
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.mkdir()
        return staged

    def staging_dirs(self, old: bool = False) -> list[Path]:
        """Directories of runs being recorded, or whose writer died before committing
        them (``old``: also those of stores written before, directly under ``runs/``,
        which takes a listing of every run directory)."""
        staging = self.runs / STAGING
        try:
            found = [staging / n for n in sorted(os.listdir(staging))]
        except (FileNotFoundError, NotADirectoryError):
            found = []
        if old:
            found += [self.runs / n for n in self._run_entries() if n.startswith(_OLD_STAGING)]
        return found

    def trash_dirs(self) -> list[Path]:
        """Run directories a ``gc()`` began to remove and did not finish."""
        return [self.runs / n for n in self._run_entries() if n.startswith(".trash-")]

    def tensors(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "tensors"

    def writing_lock(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "writing.lock"

    # -- opening ---------------------------------------------------------------------------

    def check(self, create: bool) -> None:
        """Make sure a store of a format we read is here, creating one if asked."""
        if self.marker.exists():
            self.format = self._check_format()
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
        _open_lock(self.lock).close()  # (O_NOFOLLOW: never through a planted link)
        marker = {"format": FORMAT, "what": "tracelake store"}
        tmp = self.root / f".{_MARKER}.{os.getpid()}"
        write_new(tmp, json.dumps(marker).encode())
        fsync_file(tmp)
        os.replace(tmp, self.marker)  # two processes creating at once: the last one's stays
        fsync_dir(self.root)
        self.format = self._check_format()  # (an older tracelake's, if it won: format 1)

    def _check_format(self) -> int:
        try:
            marker = json.loads(read_small(self.marker))
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
        return version


def read_small(path: Path, limit: int = 1 << 16) -> str:
    """A small file of the store's own (a marker) as text: ``O_NOFOLLOW`` (a link
    planted at its name is an ``OSError``, never followed out of the store), at most
    ``limit`` bytes, decoded strictly (garbage is a ``ValueError``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path.name} is larger than a marker ({limit} bytes)")
    return data.decode("utf-8")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fsync_file(path)


def durable_trees(roots: list[Path], last: Callable[[list[int]], str] | None = None) -> list[int]:
    """Make every file and directory under each of ``roots`` durable; return the bytes
    of each one's files. ``last``: writes one more file under the roots, given those
    bytes (a sealed run's rows, which say the run's size), and returns its path; it is
    made durable with the others and not counted. Up to :data:`_FSYNC_FILES` files and
    directories, an fsync of each, all at once (:func:`fsync_all`); past that one
    ``syncfs`` of their filesystem where Linux offers it (a batch of runs: one call,
    where hundreds of fsyncs cost more even at once)."""
    sizes, files, dirs = _trees(roots, last)
    if _syncfs is None or len(files) + len(dirs) <= _FSYNC_FILES:
        fsync_all(files, dirs)
    else:
        _sync_filesystem(os.open(roots[0], os.O_RDONLY | os.O_DIRECTORY), roots[0])
    return sizes


def begin_durable_trees(roots: list[Path]) -> tuple[list[int], Callable[[], None]]:
    """:func:`durable_trees` begun, not waited for: the bytes of each root's files, and
    a function that waits until every file and directory under the roots is durable
    (raising what syncing them raised), for the caller to call before anything that
    needs them durable (a commit), doing other work meanwhile (a batch's tables built,
    its catalog transaction begun). What is synced is opened here, so the roots may be
    renamed meanwhile; the syncs run on :func:`fsync_all`'s threads, which close it."""
    sizes, files, dirs = _trees(roots)
    if _syncfs is None or len(files) + len(dirs) <= _FSYNC_FILES:
        opened: list[tuple[int, bool]] = []
        try:
            for path in files:
                opened.append((os.open(path, os.O_RDONLY), False))
            for path in dirs:
                with contextlib.suppress(OSError):  # (as fsync_dir: some cannot be)
                    opened.append((os.open(path, os.O_RDONLY), True))
        except BaseException:
            for fd, _ in opened:
                os.close(fd)
            raise
        futures = _fsync_streams(opened)
    else:
        fd = os.open(roots[0], os.O_RDONLY | os.O_DIRECTORY)
        futures = [_fsync_pool().submit(_sync_filesystem, fd, roots[0])]
    return sizes, lambda: _waited(futures)


def _trees(
    roots: list[Path], last: Callable[[list[int]], str] | None = None
) -> tuple[list[int], list[str], list[str]]:
    """The bytes of each root's files, and the files and directories under the roots
    (``last``: as in :func:`durable_trees`)."""
    sizes: list[int] = []
    files: list[str] = []
    dirs: list[str] = []
    for root in roots:
        sizes.append(_walk_tree(root, files, dirs))
    if last is not None:
        files.append(last(sizes))
    return sizes, files, dirs


def _sync_filesystem(fd: int, root: Path) -> None:
    """``syncfs`` of the filesystem of ``fd`` (``root``, opened), then close it."""
    try:
        if _syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs failed: {os.strerror(err)}", str(root))
    finally:
        os.close(fd)


#: Up to this many files and directories, fsyncs of each at once cost less than a
#: ``syncfs`` (which also waits for whatever else on the filesystem is dirty); past it,
#: more. Measured side by side (development machine, ext4, load ~5): 5 files of 2 KB and
#: a directory 1.2 ms at once against 3.6 for syncfs; 40 of 4 MiB 92 against 122; 100 of
#: 64 KiB 19 against 11; 450 of 2 KB 136 against 9.
_FSYNC_FILES = 48


def fsync_all(files: Sequence[str], dirs: Sequence[str] = ()) -> None:
    """fsync every one of ``files`` and ``dirs`` (a directory that cannot be fsync'd is
    passed over, as in :func:`fsync_dir`), at once from a pool of threads: the
    filesystem commits concurrent requests together (ext4's journal), so a run's dozen
    files cost about one device flush rather than one each (5 files and a directory:
    1.2 ms against 20 one after another, in the measurement above). In at most
    :data:`_FSYNC_STREAMS` sequences at once, not a thread each: a thread's Python per
    fsync (a task, a wake-up, the GIL taken back) cost more CPU than the fsync itself.
    The first error is raised once all are done."""
    jobs = [(path, False) for path in files] + [(path, True) for path in dirs]
    if len(jobs) <= 1:
        _fsync_each(jobs)
        return
    _waited(_fsync_streams(jobs))


def _fsync_streams(jobs: Sequence[tuple[str | int, bool]]) -> list[Future[None]]:
    """``jobs`` (each a path or an open descriptor, which is closed, and whether it is a
    directory) fsync'd in :data:`_FSYNC_STREAMS` sequences on the pool's threads."""
    streams = max(1, min(len(jobs), _FSYNC_STREAMS))
    return [_fsync_pool().submit(_fsync_each, jobs[k::streams]) for k in range(streams)]


def _waited(futures: list[Future[None]]) -> None:
    """Wait for every one of ``futures``, then raise the first one's error."""
    wait(futures)
    for future in futures:
        future.result()


#: How many sequences of fsyncs :func:`fsync_all` runs at once. GPT-2's run (31 shards
#: of 4 MiB, written back already, and a dozen small files and directories), in one
#: process, interleaved, load ~1.3: a thread each 5.1-6.2 ms and 5.9-7.6 ms of CPU,
#: four sequences 4.2-4.5 ms and 4.2-4.4 ms of CPU.
_FSYNC_STREAMS = 4


def _fsync_each(jobs: Sequence[tuple[str | int, bool]]) -> None:
    """fsync each of ``jobs`` in turn, every one even after a failure (a descriptor is
    closed whatever happens); raise the first error."""
    error: OSError | None = None
    for path, is_dir in jobs:
        try:
            _fsync_one(path, is_dir)
        except OSError as exc:
            error = error or exc
    if error is not None:
        raise error


def _fsync_one(path: str | int, is_dir: bool) -> None:
    if isinstance(path, int):  # (opened: begin_durable_trees)
        try:
            if is_dir:
                with contextlib.suppress(OSError):  # (as fsync_dir)
                    os.fsync(path)
            else:
                os.fsync(path)
        finally:
            os.close(path)
    elif is_dir:
        fsync_dir(Path(path))
    else:
        fsync_file(Path(path))


#: The pool of fsync_all's threads (they wait on the disk, not a core), with the process
#: that made it: a forked child, whose copy has no threads, makes its own.
_FSYNC_POOL: tuple[int, ThreadPoolExecutor] | None = None
_FSYNC_THREADS = 16


def _fsync_pool() -> ThreadPoolExecutor:
    global _FSYNC_POOL
    pid = os.getpid()
    if _FSYNC_POOL is None or _FSYNC_POOL[0] != pid:
        _FSYNC_POOL = (pid, ThreadPoolExecutor(_FSYNC_THREADS, "tracelake-fsync"))
    return _FSYNC_POOL[1]


def libc_function(name: str, *argtypes: Any) -> Any:
    """Linux libc's function ``name`` through ctypes (which lets the GIL go for each
    call; errno kept), returning an int, with ``argtypes`` if given; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes:
        function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_syncfs = libc_function("syncfs")


def fsync_tree(root: Path) -> int:
    """fsync every file and directory under ``root`` (all at once: :func:`fsync_all`);
    return the bytes of the files."""
    files: list[str] = []
    dirs: list[str] = []
    total = _walk_tree(root, files, dirs)
    fsync_all(files, dirs)
    return total


def _walk_tree(root: Path, files: list[str], dirs: list[str]) -> int:
    """Add the files and directories under ``root`` to ``files`` and ``dirs``; return
    the bytes of the files."""
    # (``os.scandir`` itself, not ``os.walk``: that lstats each directory once more,
    # and a batched tiny run's tree is four directories and four files)
    total = 0
    stack = [os.fspath(root)]
    while stack:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue  # (as os.walk: one it cannot list is passed over)
        dirs.append(here)
        for entry in entries:
            if entry.is_dir():  # (a link to one is neither walked nor synced, as os.walk)
                if not entry.is_symlink():
                    stack.append(entry.path)
            else:
                files.append(entry.path)
                total += entry.stat(follow_symlinks=False).st_size
    return total


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW


def _open_lock(path: Path, create: bool = True) -> io.FileIO:
    """Open (creating) lock file ``path``; ``O_NOFOLLOW``: a symbolic link planted at
    its name is refused with ``StoreError``, never created or written through. A file
    object, not a bare descriptor: its descriptor is owned from the moment it exists, so
    an interrupt (Ctrl-C) between there and its holder leaks no lock (collected, it
    closes)."""
    try:
        flags = _LOCK_FLAGS if create else _LOCK_FLAGS & ~os.O_CREAT
        return io.FileIO(path, "r+", opener=lambda p, _: os.open(p, flags, 0o644))
    except OSError as exc:
        if path.is_symlink():
            raise StoreError(
                f"refusing the lock file {str(path)!r}: it is a symbolic link, which may "
                "lead outside the store"
            ) from exc
        raise


def write_new(path: Path, data: Any) -> None:
    """Write ``data`` (bytes, or a sequence of buffers written one after the other) as
    the temporary file ``path`` (the caller renames it into place): whatever is at that
    name first (a file a killed process left, or a planted link) is removed, not
    followed, and the file is created anew (``O_EXCL``, ``O_NOFOLLOW``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        writev_all(fd, [data] if isinstance(data, bytes | bytearray | memoryview) else data)
    finally:
        os.close(fd)


_WRITEV_MAX = 512  # pieces per writev call, well under IOV_MAX


def writev_all(fd: int, pieces: Sequence[Any]) -> int:
    """Write ``pieces`` (buffers) one after the other at ``fd``, with as few ``writev``
    calls as short writes allow; return how many bytes."""
    views = [memoryview(p).cast("B") for p in pieces]
    nbytes = sum(v.nbytes for v in views)
    at = 0
    while at < len(views):
        written = os.writev(fd, views[at : at + _WRITEV_MAX])
        while at < len(views) and written >= views[at].nbytes:  # short writes: finish them
            written -= views[at].nbytes
            at += 1
        if written:
            views[at] = views[at][written:]
    return nbytes


#: Disk space a store keeps in ``catalog.reserve`` (blocks allocated, not a sparse
#: file), given up when a catalog change that frees space (``delete``, ``gc``, marking
#: a run failed) meets a full disk: so space can always be reclaimed through tracelake.
#: A few of DuckDB's 256 KiB blocks: what such a change writes.
RESERVE_BYTES = 2 << 20


def keep_reserve(paths: StorePaths) -> None:
    """Make ``catalog.reserve`` if it is missing (hold the catalog lock). A disk too
    full for it leaves none, quietly: the next change tries again."""
    try:
        if paths.reserve.stat(follow_symlinks=False).st_size == RESERVE_BYTES:
            return
    except FileNotFoundError:
        pass
    temp = paths.root / f".reserve.{os.getpid()}"
    try:
        write_new(temp, b"")
        fd = os.open(temp, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
        os.replace(temp, paths.reserve)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def release_reserve(paths: StorePaths) -> bool:
    """Give ``catalog.reserve``'s space back to the disk; whether there was any."""
    try:
        os.unlink(paths.reserve)  # (a link planted there: the link goes, not its target)
    except OSError:
        return False
    return True


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OS or DuckDB error, or one caused by either) says the disk
    is full."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def full_hint(exc: BaseException) -> str:
    """What to add to an error's message when ``exc`` says the disk is full."""
    if not disk_full(exc):
        return ""
    return (
        " (the disk holding the store is full: free space, e.g. store.delete(name) then "
        "store.gc(), which work on a full disk, and try again)"
    )


#: A :class:`Scratch` directory's name ends so: only those are ever removed as abandoned
#: (a directory of another make, or of an older tracelake, is never taken for one).
_HELD = ".held"
#: A scratch directory younger than this is left alone whether or not it is held: its
#: maker may not have taken the lock yet (it does so at once).
SCRATCH_GRACE_S = 60.0


class Scratch:
    """A private temporary directory (``name``, under ``tempfile.gettempdir()``), removed by
    :meth:`cleanup`, when it is garbage collected or at exit (as
    ``tempfile.TemporaryDirectory`` is), and where its process was killed before any of
    those, by the next one made on the machine: each holds an flock on itself while its
    process lives (the kernel drops it with the process), and a new one first removes
    those of its ``prefix`` that no one holds (:func:`_remove_abandoned`)."""

    def __init__(self, prefix: str) -> None:
        _remove_abandoned(Path(tempfile.gettempdir()), prefix)
        self.name = tempfile.mkdtemp(prefix=prefix, suffix=_HELD)
        held = os.open(self.name, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new: no one else holds it)
        self._finalizer = weakref.finalize(self, _remove_scratch, self.name, held)

    def cleanup(self) -> None:
        """Remove the directory (once; later calls do nothing)."""
        self._finalizer()


def _remove_scratch(name: str, held: int) -> None:
    try:
        shutil.rmtree(name, ignore_errors=True)
    finally:
        os.close(held)  # (after: the directory is never unheld while it exists)


def _remove_abandoned(root: Path, prefix: str) -> None:
    """Remove the :class:`Scratch` directories of ``prefix`` in ``root`` that no process
    holds and that are older than :data:`SCRATCH_GRACE_S`: those of processes killed
    before their clean-up. Others' (another user's, unreadable) are left alone."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(_HELD)):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime < SCRATCH_GRACE_S:
                continue
            held = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            os.close(held)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(held)


@contextlib.contextmanager
def locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold an flock on ``path`` (created if absent) for the block. The kernel releases
    it if the process dies, so a killed writer never leaves the store locked."""
    with _open_lock(path) as file:  # closing releases the lock
        fcntl.flock(file.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def lock_held(path: Path) -> bool:
    """Whether a process holds the flock of lock file ``path`` (False: it is free, or
    there is no such file; none is made, and the lock is not kept)."""
    held = try_lock(path, create=False)
    if held is None:  # (held, or no such file)
        return path.exists()
    held.close()
    return False


def try_lock(path: Path, create: bool = True) -> io.FileIO | None:
    """Take an exclusive flock without waiting: the open lock file (close it to release),
    or ``None`` if another process holds it (``create=False``: or there is no such
    file)."""
    try:
        file = _open_lock(path, create)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        return None
    return file


# -- a run directory's identity, and its removal -------------------------------------

_EPOCH = datetime(1970, 1, 1)


def micros(value: Any) -> int:
    """A ``created`` timestamp (datetime or pandas Timestamp, naive UTC) in whole
    microseconds: how the run's identity marker records it, exactly."""
    if hasattr(value, "to_pydatetime"):
        value = value.to_pydatetime()
    return int((value.replace(tzinfo=None) - _EPOCH) // timedelta(microseconds=1))


def from_micros(value: int) -> datetime:
    """The ``created`` timestamp :func:`micros` gave ``value`` for."""
    return _EPOCH + timedelta(microseconds=value)


def write_run_marker(paths: StorePaths, run_id: int, created: datetime) -> None:
    """Write run ``run_id``'s identity marker (best effort: a run without one reads as
    a store made before markers existed). Not synced here: the commit syncs every file
    of the run before it becomes visible, this one included."""
    marker = paths.run_marker(run_id)
    try:
        tmp = marker.with_name(f".run.json.{os.getpid()}")
        write_new(tmp, json.dumps({"run": run_id, "created": micros(created)}).encode())
        os.replace(tmp, marker)
    except OSError as exc:
        warnings.warn(f"could not write {marker}: {exc}", TraceLakeWarning, stacklevel=2)


def check_run_marker(paths: StorePaths, run_id: int, name: str, created: Any) -> None:
    """``StoreError`` unless run ``run_id``'s directory belongs to the catalog row with
    this id and ``created`` time. A directory without a marker (a store written before
    markers existed, or one whose marker write failed) passes."""
    try:
        marker = json.loads(read_small(paths.run_marker(run_id)))
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        raise StoreError(f"the identity marker of run {name!r} is unreadable: {exc}") from exc
    if not isinstance(marker, dict):
        raise StoreError(f"the identity marker of run {name!r} is not a JSON object")
    want = {"run": run_id, "created": None if created is None else micros(created)}
    got = {"run": marker.get("run"), "created": marker.get("created")}
    if created is None:
        got["created"] = None
    if got != want:
        raise StoreError(
            f"the directory {str(paths.run_dir(run_id))!r} holds another run's data than "
            f"the catalog's run {name!r} (id {run_id}): catalog.duckdb does not belong to "
            "these run directories; restore the store's own catalog"
        )


def write_staged(staged: Path, about: dict[str, Any]) -> None:
    """Write what listing the staged run in ``staged`` shows (its name, created time,
    model class, ..., and once its recording failed its ``error``), replacing what was
    there in one rename. Not synced: lost, the run lists as interrupted."""
    tmp = staged / f".{STAGED_FILE}.{os.getpid()}"
    write_new(tmp, json.dumps(about).encode())
    os.replace(tmp, staged / STAGED_FILE)


def open_staged_lines(batch: Path) -> int:
    """The batch directory ``batch``'s :data:`STAGED_LINES`, opened (created) for
    :func:`note_staged`: once a batch, not once a run."""
    return os.open(
        batch / STAGED_LINES, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644
    )


def note_staged(lines: int, run: Path, about: dict[str, Any]) -> None:
    """Add what listing the run staged in ``run`` (a directory of a batch's) shows to
    that batch's :data:`STAGED_LINES`, open at ``lines`` (:func:`open_staged_lines`),
    appended whole in one write; not synced. Where the run's directory is gone (a run
    of the batch that failed) its line is passed over."""
    os.write(lines, json.dumps({**about, "dir": run.name}).encode() + b"\n")


def read_staged(staged: Path) -> dict[str, Any] | None:
    """What :func:`write_staged` wrote in ``staged`` (None: nothing readable there: a
    directory being made, one a killed writer left half-made, or one of a store
    written before staged runs were listed)."""
    try:
        return _staged_about(json.loads(read_small(staged / STAGED_FILE)))
    except (OSError, ValueError):
        return None


def _staged_about(about: Any) -> dict[str, Any] | None:
    """``about`` if it is what a staged run's record holds (a name, a created time)."""
    if not isinstance(about, dict) or not isinstance(about.get("name"), str):
        return None
    return about if isinstance(about.get("created"), int) else None


def staged_runs(entry: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The runs a staging directory (``StorePaths.staging_dirs``) holds, with what
    their ``staged.json`` says: itself (a run recorded on its own), or the runs of a
    batch (``<k>/``, under the batch's one ``writing.lock``); none that can be read."""
    about = read_staged(entry)
    if about is not None:
        return [(entry, about)]
    try:
        lines = read_small(entry / STAGED_LINES, limit=1 << 26).splitlines()
    except (OSError, ValueError):
        return []
    found: list[tuple[Path, dict[str, Any]]] = []
    for line in lines:
        with contextlib.suppress(ValueError):  # (a line a killed writer left half-written)
            noted = _staged_about(json.loads(line))
            run = noted.get("dir") if noted is not None else None
            if (
                noted is not None
                and isinstance(run, str)
                and run.isdigit()
                and (entry / run).is_dir()
            ):
                found.append((entry / run, noted))
    return found


def trash_run_dir(paths: StorePaths, run_id: int) -> Path | None:
    """Rename run ``run_id``'s directory to a ``.trash-`` name (atomic) and return it
    (None if it is gone already): a gc() killed while removing it then leaves a name
    the next gc() finishes, never a half run directory."""
    trash = paths.trash(run_id)
    try:
        os.rename(paths.run_dir(run_id), trash)
    except FileNotFoundError:  # another gc took it, or it was never made
        return None
    fsync_dir(paths.runs)  # the new name survives a power loss too
    return trash


#: A staged directory still empty this long after it was made was made by a writer that
#: died before creating its lock file in it (a writer does so right after the ``mkdir``).
ABANDONED_EMPTY_S = 60.0


def trash_staged(paths: StorePaths, staged: Path) -> bool:
    """Move the directory of a staged run whose writer is gone (its ``writing.lock``
    held by nobody: its recording failed, or its process died before committing it) to
    a ``.trash-`` name; False where a writer holds it, or it has no lock file yet (being
    made: one left empty for :data:`ABANDONED_EMPTY_S` is removed, and True), or is
    gone."""
    lock = try_lock(staged / "writing.lock", create=False)
    if lock is None:
        return _drop_abandoned(staged)
    try:
        os.rename(staged, paths.runs / f".trash-s{staged.name.removeprefix(_OLD_STAGING)}")
    except FileNotFoundError:
        return False
    finally:
        lock.close()
    fsync_dir(paths.runs)
    return True


def _drop_abandoned(staged: Path) -> bool:
    """Remove ``staged`` if it is an empty directory made over :data:`ABANDONED_EMPTY_S`
    ago (a writer killed between its ``mkdir`` and its lock file; ``rmdir`` removes
    only an empty one, so a writer that made its lock file meanwhile keeps it)."""
    try:
        if time.time() - os.lstat(staged).st_mtime < ABANDONED_EMPTY_S:
            return False
        os.rmdir(staged)
    except OSError:  # (gone, not empty, or not a directory: not this case)
        return False
    return True


def remove_run_dir(paths: StorePaths, run_id: int) -> int:
    """Remove run ``run_id``'s directory (through :func:`trash_run_dir`); return the
    bytes it held."""
    trash = trash_run_dir(paths, run_id)
    return 0 if trash is None else remove_tree(trash)


def remove_tree(path: Any) -> int:
    """Remove a directory; return the bytes it held (files another process removes
    meanwhile count nothing). Links are removed, never followed: a run directory that
    is a symbolic link (planted, or made by hand) loses the link, its target stays."""
    path = Path(path)
    if path.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return 0
    size = 0
    for dirpath, _dirs, files in os.walk(path):  # (os.walk does not follow links)
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(dirpath, name))
                size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    shutil.rmtree(path, ignore_errors=True)  # (unlinks links inside, does not follow)
    return size
