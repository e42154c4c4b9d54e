"""The local-filesystem :class:`~.backend.ByteStore`: one file per object under a root.

Writes are the fast path of recording. A file of :data:`DIRECT_BYTES` or more (a
shard, a large tensor's chunk) is written with ``O_DIRECT`` where the filesystem takes
it (:data:`DIRECT`): its bytes are gathered into a page-aligned staging buffer (a
shard's layout, a 4-byte checksum after each 64 KiB inner chunk, is not aligned) and
its whole blocks go from there to the device, the last partial block through the page
cache. That costs the writer's threads a plain copy where the page cache cost the
kernel's copy, page allocation, dirty accounting and writeback, and the cores are
what a recording on a small machine lacks. Other files are written with one ``writev``
(the payload and its checksum are separate pieces, never joined into a copy), their
writeback started at once (``posix_fadvise``) so that the device writes while the
workers encode the next chunks. Either way a file is made durable with ``fdatasync``
on the spot or by :class:`Unsynced`, a thread that syncs the oldest files first so
that no worker waits on a device cache flush while it could encode. Where the caller
makes the whole tree durable at once (a store's run at its commit:
``layout.durable_trees``), that thread only waits for each buffered file's writeback
(``sync_file_range``: no journal commit and device flush a file) and drops its pages,
and a file written directly is closed at once (its blocks are on the device already;
its metadata, its last block and the device's cache wait for the commit like every
other file's). Names become durable in :meth:`commit`, which fsyncs every file and
directory under the root; a run is committed to the catalog only after that.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import shutil
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracelake.errors import ObjectNotFoundError, StoreError
from tracelake.recorder.forks import fork_safe_lock

from .backend import ByteStore, Pending, check_key, check_prefix
from .layout import fsync_tree, libc_function, writev_all

__all__ = ["DIRECT", "DIRECT_ALIGN", "DIRECT_BYTES", "STAGE_BYTES", "LocalBackend", "Unsynced"]

_START_WRITEBACK = hasattr(os, "posix_fadvise")
#: Files left to the caller's durability (``Unsynced(sync=False)``) from this size on are
#: written back and dropped from the page cache as they go; smaller ones (metadata, a
#: tiny run's shard) are just closed.
_WRITEBACK_BYTES = 1 << 20

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Whether files of ``DIRECT_BYTES`` or more are written with ``O_DIRECT`` (where the
#: filesystem refuses it, as tmpfs does, they are written through the page cache as
#: any other). ``TRACELAKE_BUFFERED_WRITES=1`` in the environment: never (A/B
#: measurements). Read at the moment of use (tests switch it).
DIRECT = bool(_O_DIRECT) and not os.environ.get("TRACELAKE_BUFFERED_WRITES")
#: From this size a file is written directly: smaller ones (metadata, a tiny run's shard)
#: would wait on the device for each write where the page cache takes them at once.
DIRECT_BYTES = _WRITEBACK_BYTES
#: ``O_DIRECT``'s alignment of the buffer's address, the file offset and the length: a
#: multiple of every logical block size Linux filesystems use (512 or 4096).
DIRECT_ALIGN = 4096
#: A staging buffer's bytes: a whole shard fits (``format.CHUNK_BYTES`` with its inner
#: chunks' checksums and its index; tests/test_storage.py checks), a large tensor's chunk
#: file goes through in pieces of this size.
STAGE_BYTES = (4 << 20) + (8 << 10)
_STAGES_KEPT = 4  # staging buffers kept for reuse (the workers and the forward thread)
_STAGES: list[np.ndarray] = []
_STAGES_LOCK = fork_safe_lock()  # (a writer in a forked child takes it too)


_SYNC_FILE_RANGE = libc_function(
    "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
)
#: SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER: the file's dirty pages written out,
#: and waited for (its metadata and the device's cache are not: not durable).
_WRITE_AND_WAIT = 1 | 2 | 4


class Unsynced:
    """Files written whose data is not durable yet. Their writeback starts at once; a
    thread of its own makes them durable, oldest first, so that no worker waits on an
    ``fdatasync`` while it could encode; at most ``window`` wait, then ``add`` waits
    too. ``close`` makes them all durable and raises what syncing raised. Safe to share
    between threads; ``background=False``: the thread that adds one too many syncs the
    oldest itself.

    ``sync=False``: the caller makes the files durable later, many at once (a store's
    run at its commit, a batch of runs at the batch's: ``layout.durable_trees``, an
    fsync of each at once or one ``syncfs``). Files of ``_WRITEBACK_BYTES`` or more are
    then only written back here
    (their pages written out and waited for, not their metadata or the device's cache:
    an ``fdatasync`` each cost GPT-2's run ~40 journal commits and device flushes) and
    dropped from the page cache; smaller ones are closed at once."""

    def __init__(self, window: int = 16, background: bool = True, sync: bool = True):
        self.window = window
        self.sync = sync
        self._fds: deque[int] = deque()
        self._busy = 0  # being made durable now
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._background = background
        self._thread: threading.Thread | None = None

    def add(self, fd: int, nbytes: int = _WRITEBACK_BYTES) -> None:
        """Hand over ``fd``, a file just written (``nbytes`` long), to be closed here."""
        if not self.sync and nbytes < _WRITEBACK_BYTES:
            os.close(fd)
            return
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
        _all_durable(due, self.sync)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._fds) or self._thread is None)
                if not self._fds:
                    return  # closed, nothing left
                fd = self._fds.popleft()
                self._busy += 1
            try:
                _durable(fd, self.sync)
            except BaseException as exc:  # any: a thread that ended would leave add() waiting
                with self._cond:
                    self._error = self._error or exc
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def close(self, durable: bool = True) -> None:
        """Make every file durable (``sync=False``: written back), or, not ``durable``,
        just close them."""
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
            _all_durable(due, self.sync)
        if error is not None and durable:
            raise error


def _all_durable(fds: list[int], sync: bool = True) -> None:
    try:
        for k, fd in enumerate(fds):
            _durable(fd, sync)
            fds[k] = -1
    finally:
        for fd in fds:  # an error above: close the rest, durable or not
            if fd >= 0:
                os.close(fd)


def _durable(fd: int, sync: bool = True) -> None:
    """Wait for ``fd``'s data to be on disk, let the kernel drop its pages (a capture
    larger than RAM stays cheap; and a page the writer freed is reused at once, where a
    new one costs a fault: in a VM, the host's too), close it. ``sync=False``: its pages
    written out only (``Unsynced``), where the system can say so."""
    try:
        if sync or _SYNC_FILE_RANGE is None:
            os.fdatasync(fd)
        elif _SYNC_FILE_RANGE(fd, 0, 0, _WRITE_AND_WAIT) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"writing a file back failed: {os.strerror(error)}")
        if _START_WRITEBACK:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


#: ``staged(fd, stage)``: a file's bytes written to ``fd``, a new file opened with
#: ``O_DIRECT``, through ``stage`` (``STAGE_BYTES``, page-aligned): returns how many, and
#: whether its whole blocks went to the device directly (``_write_staged``'s contract).
Staged = Callable[[int, np.ndarray], tuple[int, bool]]


#: Small files written before (``put_unsynced``), by their bytes: an open descriptor of
#: the one that holds exactly them. A run's Zarr metadata is mostly the bytes of the
#: run's before it (its group's; a pack's of one shard), and a hard link to that file
#: makes a directory entry where a new file also takes an inode (on a busy filesystem
#: the slow part: two of a tiny run's three new files). The link is made to the open
#: file itself (``/proc/self/fd``, Linux), so whatever is at its old name now (renamed
#: at its run's commit, or something else put there) does not matter. Safe because no
#: such file is ever written in place: ``put_unsynced`` replaces a file (unlinks it) and
#: forgets what it held, so a link never changes another run's (or, in one process,
#: another store's) file. A source deleted (its run collected), another filesystem's,
#: or a filesystem that refuses links is forgotten, the file created as before; so is
#: one someone else wrote into (a user's editor, a script fixing one run's metadata):
#: its bytes are read back before each link, so a new run never links to what it no
#: longer holds.
_SHARED: dict[bytes, tuple[str, int]] = {}  # bytes -> (the path it was made at, its fd)
_SHARED_KEPT = 32  # distinct contents remembered (the oldest forgotten first)
_SHARED_MAX = 64 << 10  # bytes: larger files are never shared
_SHARING = os.path.isdir("/proc/self/fd")  # (where a file can be linked by descriptor)
_PROC_FDS: list[int] = []  # this process's /proc/self/fd, opened once (what links name)
#: Held for the whole of a ``put_unsynced``: no file is replaced between the lookup of a
#: source and the link to it (another thread's pack that grew).
_SHARED_LOCK = fork_safe_lock()


def _forget(data: bytes) -> None:
    _, fd = _SHARED.pop(data)
    os.close(fd)


def _forget_all() -> None:
    for data in list(_SHARED):
        _forget(data)
    while _PROC_FDS:  # (a parent's: its /proc entry, not the child's)
        os.close(_PROC_FDS.pop())


# a forked child's parent goes on replacing files the child would not hear of
os.register_at_fork(after_in_child=_forget_all)


def _put_shared(path: str, data: bytes) -> None:
    """Write the small file ``path`` holding ``data`` (under ``_SHARED_LOCK``): a hard
    link to a file known to hold those bytes where there is one, else a new file,
    remembered. A file already at ``path`` is replaced, never written into (it may be a
    link another run's file shares), and what it held forgotten."""
    for held in [d for d, (at, _) in _SHARED.items() if at == path]:
        _forget(held)
    share = _SHARING and len(data) <= _SHARED_MAX
    known = _SHARED.get(data) if share else None
    if known is not None:
        if os.pread(known[1], len(data) + 1, 0) == data and _linked(path, known[1]):
            return
        _forget(data)
    fd = _create_new(path)
    try:
        writev_all(fd, [data])
    except BaseException:
        os.close(fd)
        raise
    if not share:
        os.close(fd)
        return
    _SHARED[data] = (path, fd)  # (kept open: what a later file of these bytes links to)
    while len(_SHARED) > _SHARED_KEPT:
        _forget(next(iter(_SHARED)))


def _linked(path: str, fd: int) -> bool:
    """Make ``path`` a hard link to the open file ``fd`` (a file already at ``path``
    replaced); whether it did (nothing is left at ``path`` where not). As many calls as
    a creation where the directory is new: a failed try, its ``mkdir``, the link."""
    if not _PROC_FDS:
        _PROC_FDS.append(os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    made = False
    for _ in range(3):
        try:  # (linkat with AT_SYMLINK_FOLLOW: the descriptor's file, not the /proc link)
            os.link(str(fd), path, src_dir_fd=_PROC_FDS[0], follow_symlinks=True)
            return True
        except FileExistsError:
            os.unlink(path)  # (replaced, not written into: it may be a link itself)
        except FileNotFoundError:
            if made:  # the directory is there: the source is deleted
                return False
            made = True
            try:
                os.mkdir(os.path.dirname(path))
            except FileExistsError:  # (it was there: the source is deleted)
                return False
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError:  # no link: another filesystem's file, too many links, none at all
            return False
    return False


def _create_new(path: str) -> int:
    """``_create``, but a file already at ``path`` is replaced (unlinked first), never
    truncated: it may be a hard link another run's file shares (``_SHARED``). Opened for
    reading too: ``_SHARED`` reads its bytes back before a link to it."""
    try:
        return _create(Path(path), os.O_EXCL | os.O_RDWR)
    except FileExistsError:
        os.unlink(path)
        return _create(Path(path), os.O_EXCL | os.O_RDWR)


def _create(path: Path, extra: int = 0) -> int:
    """The new (truncated) file ``path`` opened for writing (``extra``: more flags; with
    ``O_RDWR``, for reading too), its directory made if missing (only then: no mkdir a
    shard). ``O_NOFOLLOW``: a symbolic link planted at the name is refused (ELOOP), never
    written through."""
    access = 0 if extra & os.O_RDWR else os.O_WRONLY
    flags = access | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | extra
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, 0o644)


def _write_with(path: Path, write: Callable[[int], int], pending: Unsynced | None) -> None:
    """Create the file ``path``, ``write(fd)`` its bytes (returning how many), then make
    it durable here (on the calling worker thread, while the forward pass goes on) or
    hand it to ``pending``."""
    fd = _create(path)
    try:
        nbytes = write(fd)
    except BaseException:
        os.close(fd)
        raise
    if pending is None:
        _durable(fd)
    else:
        pending.add(fd, nbytes)


def _write_direct(path: Path, staged: Staged, pending: Unsynced | None) -> bool:
    """``_write_with`` for a file opened with ``O_DIRECT`` and written by ``staged``;
    ``False`` (nothing written) where the filesystem refuses ``O_DIRECT`` at the open.
    A file whose blocks went directly and that ``pending`` leaves to the caller's
    durability is closed at once: it has no writeback to wait for."""
    try:
        fd = _create(path, _O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # (tmpfs, some FUSE filesystems)
            return False
        raise
    try:
        with _staging() as stage:
            nbytes, direct = staged(fd, stage)
    except BaseException:
        os.close(fd)
        raise
    if pending is None:
        _durable(fd)
    elif direct and not pending.sync:
        os.close(fd)
    else:
        pending.add(fd, nbytes)
    return True


_HUGE_PAGE = 2 << 20


@contextlib.contextmanager
def _staging() -> Iterator[np.ndarray]:
    """A staging buffer of ``STAGE_BYTES``: a kept one, else a new one, kept afterwards
    while fewer than ``_STAGES_KEPT`` are."""
    with _STAGES_LOCK:
        stage = _STAGES.pop() if _STAGES else None
    if stage is None:
        stage = _new_stage()
    try:
        yield stage
    finally:
        with _STAGES_LOCK:
            if len(_STAGES) < _STAGES_KEPT:
                _STAGES.append(stage)


def _new_stage() -> np.ndarray:
    """An anonymous map's ``STAGE_BYTES`` from a huge-page boundary, its whole huge pages
    advised to be huge (where the system has them): the device's direct reads pin a
    few pages where they pinned a thousand, and the copies into it cost fewer TLB
    misses."""
    memory = mmap.mmap(-1, STAGE_BYTES + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(memory, dtype=np.uint8)
    skip = -whole.ctypes.data % _HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            memory.madvise(advice, skip, STAGE_BYTES - STAGE_BYTES % _HUGE_PAGE)
    return whole[skip : skip + STAGE_BYTES]


def _write_staged(fd: int, pieces: Sequence[Any], stage: np.ndarray) -> tuple[int, bool]:
    """Write ``pieces`` one after the other to ``fd`` (opened ``O_DIRECT``, at its start)
    through ``stage``: whole ``DIRECT_ALIGN`` blocks directly, the last partial block
    through the page cache (``O_DIRECT`` cleared), and all of it so where the
    filesystem refuses the first direct write (EINVAL). Returns how many bytes, and
    whether the blocks went directly."""
    room = stage.nbytes - stage.nbytes % DIRECT_ALIGN
    at = total = 0
    direct = True
    for piece in pieces:
        view = np.frombuffer(memoryview(piece).cast("B"), dtype=np.uint8)
        start = 0
        while start < view.nbytes:
            n = min(room - at, view.nbytes - start)
            stage[at : at + n] = view[start : start + n]
            at, start = at + n, start + n
            if at == room:
                direct = _write_blocks(fd, stage[:at], direct, first=not total)
                total, at = total + at, 0
    head = at - at % DIRECT_ALIGN
    if head:
        direct = _write_blocks(fd, stage[:head], direct, first=not total)
    _buffered(fd)
    _write_all(fd, stage[head:at])
    return total + at, direct


def _write_blocks(fd: int, blocks: np.ndarray, direct: bool, first: bool) -> bool:
    """Write ``blocks`` (aligned) to ``fd``, directly if ``direct``; a refusal of the
    file's first direct write clears ``O_DIRECT`` and writes them buffered. Whether the
    file is still written directly."""
    if direct:
        try:
            _write_all(fd, blocks)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL or not first or os.lseek(fd, 0, os.SEEK_CUR):
                raise
            _buffered(fd)
    _write_all(fd, blocks)
    return False


def _buffered(fd: int) -> None:
    """Clear ``O_DIRECT`` on ``fd``: what follows goes through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _write_all(fd: int, data: np.ndarray) -> None:
    view = data.data.cast("B")
    while view.nbytes:  # (short writes: finish them)
        view = view[os.write(fd, view) :]


class LocalBackend(ByteStore):
    """Objects as files under ``root`` (keys are their relative paths)."""

    def __init__(self, root: str | os.PathLike[str], made: bool = False):
        self.root = Path(root)
        self._root = str(self.root)  # reads build paths with plain string joins
        # A store may come from someone else: no key may lead out of the root through a
        # symbolic link. The last component is opened or stat'ed without following
        # links; each directory below the root on the way is looked at (lstat) once it
        # exists (a root reached through a link of the user's own is fine). ``made``:
        # the root is new, made by the caller (a batch's run's), and only this backend
        # makes directories below it: none to look at.
        self._dirs_ok: set[str] = set()
        self._made = made
        self._direct = True  # until the filesystem refuses O_DIRECT (tmpfs)

    def __repr__(self) -> str:
        return f"LocalBackend({self._root!r})"

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _file(self, key: str) -> str:
        key = check_key(key)
        parent = key.rpartition("/")[0]
        if parent and not self._made and parent not in self._dirs_ok:
            self._check_dir(key, parent)
        return os.path.join(self._root, key)

    def _check_dir(self, key: str, parent: str) -> None:
        """``StoreError`` if directory ``parent`` (of ``key``) is, or lies under, a
        symbolic link: reading or writing through it would leave the store. (One
        ``lstat`` a directory not checked yet, where ``realpath`` cost a run's writing
        ~0.1 ms; a missing one is checked again once made.)"""
        prefix = ""
        for part in parent.split("/"):
            prefix = f"{prefix}/{part}" if prefix else part
            if prefix in self._dirs_ok:
                continue
            try:
                mode = os.lstat(os.path.join(self._root, prefix)).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return  # (nothing below it yet: no link either)
            if stat.S_ISLNK(mode):
                raise StoreError(
                    f"refusing {key} in {self._root}: {parent} is or passes through a "
                    "symbolic link, which would lead outside the store"
                )
            if not stat.S_ISDIR(mode):
                return  # (the open that follows fails: not a directory)
            if len(self._dirs_ok) < 1 << 16:
                self._dirs_ok.add(prefix)

    def _link_error(self, key: str) -> StoreError:
        return StoreError(
            f"refusing {key} in {self._root}: it is a symbolic link, and a store's objects "
            "are never read or written through links (they may lead outside the store)"
        )

    def put(self, key: str, pieces: Sequence[Any], pending: Pending | None = None) -> None:
        nbytes = sum(memoryview(p).nbytes for p in pieces)
        self.put_with(
            key,
            lambda fd: writev_all(fd, pieces),
            pending,
            lambda fd, stage: _write_staged(fd, pieces, stage),
            nbytes,
        )

    def put_with(
        self,
        key: str,
        write: Callable[[int], int],
        pending: Pending | None = None,
        staged: Staged | None = None,
        nbytes: int = 0,
    ) -> None:
        """``put`` of the bytes ``write(fd)`` writes into the new file (returning how
        many): a writer that needs no list of pieces (``format.shard_writer``).
        ``staged``: the same bytes written through a staging buffer (``Staged``), used
        for a file of ``nbytes`` >= ``DIRECT_BYTES`` where ``DIRECT``."""
        if pending is not None and not isinstance(pending, Unsynced):
            raise TypeError(f"a local put takes its own pending writes, not {pending!r}")
        path = Path(self._file(key))  # (refuses a key under a linked directory)
        try:
            direct = staged is not None and nbytes >= DIRECT_BYTES and DIRECT and self._direct
            if direct and staged is not None and not _write_direct(path, staged, pending):
                self._direct = direct = False  # refused at the open: not asked again
            if not direct:
                _write_with(path, write, pending)
        except OSError as exc:
            raise self._write_error(key, path, exc) from exc

    def put_unsynced(self, key: str, data: bytes) -> None:
        # (a file created, written and closed, and no more: a tiny run writes two, the
        # same bytes as the run before's: shared by a hard link where it can, _SHARED)
        path = self._file(key)
        try:
            with _SHARED_LOCK:
                _put_shared(path, data)
        except OSError as exc:
            raise self._write_error(key, Path(path), exc) from exc

    def _write_error(self, key: str, path: Path, exc: OSError) -> StoreError:
        """The error to raise for ``exc``, met writing ``key`` at ``path``."""
        if path.is_symlink():
            return self._link_error(key)
        return StoreError(f"cannot write {key} in {self._root}: {exc}")

    def _read(self, key: str, start: int, nbytes: int | None, from_end: bool = False) -> bytes:
        path = self._file(key)
        try:
            # O_NOFOLLOW: a link at the object's name is refused (ELOOP), not followed.
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                if from_end:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(max(size - (nbytes or 0), 0))
                    return f.read()
                if start:
                    f.seek(start)
                return f.read() if nbytes is None else f.read(nbytes)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(key, self._root) from None
        except OSError as exc:
            if os.path.islink(path):
                raise self._link_error(key) from exc
            raise StoreError(f"cannot read {path}: {exc}") from exc

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if start < 0 or (end is not None and end < start):
            raise ValueError(f"invalid byte range [{start}, {end}): use 0 <= start <= end")
        return self._read(key, start, None if end is None else end - start)

    def get_suffix(self, key: str, nbytes: int) -> bytes:
        if nbytes < 0:
            raise ValueError(f"invalid suffix length {nbytes}")
        return self._read(key, 0, nbytes, from_end=True)

    def _stat(self, key: str) -> os.stat_result:
        try:
            st = os.lstat(self._file(key))
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(key, self._root) from None
        except OSError as exc:
            raise StoreError(f"cannot read {key} in {self._root}: {exc}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise self._link_error(key)
        if not stat.S_ISREG(st.st_mode):  # a "directory" of keys is not an object
            raise ObjectNotFoundError(key, self._root)
        return st

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def exists(self, key: str) -> bool:
        """Whether ``key`` is a plain file; ``StoreError`` for a symbolic link (it says
        what is wrong, where "missing" would not)."""
        path = self._file(key)
        if os.path.islink(path):
            raise self._link_error(key)
        return os.path.isfile(path)

    def links(self) -> builtins.list[str]:
        """Every symbolic link under the root (not followed), for ``verify()``."""
        found = []
        for dirpath, dirs, files in os.walk(self._root):  # (os.walk does not follow links)
            rel = os.path.relpath(dirpath, self._root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            found += [base + n for n in dirs + files if os.path.islink(os.path.join(dirpath, n))]
        return sorted(found)

    def version(self, key: str) -> Any:
        """The file's identity as the filesystem sees it: a rewrite (new inode) or a
        change in place (mtime, size) gives a new token."""
        st = self._stat(key)
        return (self._root, key, st.st_mtime_ns, st.st_size, st.st_ino)

    def list(self, prefix: str = "") -> builtins.list[str]:
        prefix = check_prefix(prefix)
        top = os.path.join(self._root, prefix) if prefix else self._root
        if os.path.isfile(top):
            return [prefix]
        keys = []
        for dirpath, _dirs, files in os.walk(top):
            rel = os.path.relpath(dirpath, self._root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            keys += [base + name for name in files]
        return sorted(keys)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        prefix = check_prefix(prefix)
        try:
            return sorted(os.listdir(os.path.join(self._root, prefix) if prefix else self._root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot delete {key} in {self._root}: {exc}") from exc

    def delete_prefix(self, prefix: str) -> None:
        prefix = check_prefix(prefix)
        top = Path(self._root, prefix) if prefix else self.root
        if top.is_file():
            top.unlink()
        elif prefix:
            shutil.rmtree(top, ignore_errors=True)
        else:  # the whole store: its contents, not its root
            for entry in list(top.iterdir()) if top.is_dir() else []:
                self.delete_prefix(entry.name)

    def commit(self) -> int:
        """fsync every file and directory under the root (a new file's name is durable
        only once its directory is)."""
        return fsync_tree(self.root) if self.root.exists() else 0

    def pending(self, window: int = 16, background: bool = True, sync: bool = True) -> Unsynced:
        return Unsynced(window, background, sync)

    def zarr_store(self, prefix: str = "") -> Any:
        """The directory itself: zarr-python's own local store reads and writes it."""
        prefix = check_prefix(prefix)
        return os.path.join(self._root, prefix) if prefix else self._root
