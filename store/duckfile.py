"""The catalog's shadow: a copy of ``catalog.duckdb`` as the last completed change left it.

Why: a writer SIGKILLed inside DuckDB's checkpoint once left the catalog unreadable
(``Corrupt database file: computed checksum ... does not match stored checksum ... in
block at location 12288``: DuckDB rewrites its metadata blocks in place, so a change
cut short can spoil the block its last good state still reads). The crash battery
(``benchmarks/crash_battery.py``) met it once in about 220 kills. The shadow makes such
a kill cost only the change it interrupted, which never returned to its caller.

How, with what this module knows of DuckDB's file (and nothing more): the file is
:data:`HEADER_BYTES` of headers, then blocks of a size the database header states, each
starting with the 8-byte checksum of its contents. After each transaction (under the
exclusive catalog lock, the file detached) :func:`sync_shadow` copies the blocks whose
checksum differs from the shadow's, then the headers last: the order DuckDB itself
writes a checkpoint in, so a shadow cut short is still the older good state (its headers
name only blocks it already had). So the bytes copied are the bytes a change changed;
finding them reads each block's checksum (the writer remembers the shadow's,
:class:`Heads`). One ``pread`` a block grew with the file (~1.5-3 us a block: ~3 ms at
10 million ops, 1,760 blocks); a process that syncs a third time reads them through
memory maps of the file that it keeps (:class:`_Maps`: a page fault a block once, ~15 ms
at 10 million ops, then memory reads, ~0.1 ms). A transaction that made no checkpoint
(one whose change stayed in DuckDB's log: most, ``catalog.LOG_BYTES``) reads nothing.

What it does not cover: the shadow is not fsync'd (it guards against a killed process,
whose writes the page cache keeps; DuckDB's own fsyncs cover the catalog against power
loss), and a block DuckDB spoils without being killed is copied like any other.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tracelake.recorder.forks import fork_safe_lock

#: The file's own header and DuckDB's two alternating database headers, 4 KiB each.
HEADER_BYTES = 3 * 4096
#: The file header's magic bytes, and where they are.
_MAGIC, _MAGIC_AT = b"DUCK", 8
#: Where a database header (at 4096 and 8192) keeps its checkpoint iteration and its
#: block allocation size, counted after the header's own 8-byte checksum.
_ITERATION_AT = 8
_BLOCK_SIZE_AT = 8 + 4 * 8
#: Each block starts with the checksum of the rest of it.
_CHECKSUM_BYTES = 8
#: A file's blocks are mapped (:class:`_Maps`) in whole multiples of this many: 16 MiB
#: at DuckDB's 256 KiB. A file with fewer has no map (its checksums: a ``pread`` each).
SEGMENT_BLOCKS = 64
#: How many maps a file may have before they are made one (each holds a descriptor).
_MAPS_EACH = 8
#: How many times a process reads a file's checksums by ``pread`` before it maps the
#: file: a map costs ~4x a ``pread`` a block once (its page faults, and giving back the
#: pages faulted around them), so a process that syncs once or twice (records a run and
#: exits) does not pay it.
_PREAD_READS = 2
#: How many files' maps a process keeps (a store's catalog and its shadow, twice).
_MAPPED_FILES = 4

#: DuckDB's words for a database file it cannot read (as opposed to one it cannot open
#: for another reason: a lock, a permission, a full disk), which the shadow may replace.
CORRUPT = re.compile(
    r"Corrupt database file|Failed to load metadata pointer|No more data remaining in "
    r"MetadataReader|block at location|not a valid DuckDB database file|Could not read "
    r"enough bytes from file",
    re.IGNORECASE,
)


def wal_of(path: Path) -> Path:
    """The write-ahead log DuckDB keeps beside the database file ``path``."""
    return path.with_name(path.name + ".wal")


def is_corrupt(exc: BaseException) -> bool:
    """Whether a DuckDB error says the database file itself is damaged."""
    return bool(CORRUPT.search(str(exc)))


def _open(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


def _write(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


#: What ``copy_file_range`` fails with where the filesystem cannot do it (then: read
#: and write).
_NO_COPY_RANGE = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.ETXTBSY}
)


def _copy_range(src: int, dst: int, at: int, n: int) -> int:
    """Copy ``n`` bytes at ``at`` of ``src`` to the same place in ``dst`` (fewer where
    ``src`` ends first), in the kernel (``copy_file_range``: no pass through Python's
    memory, ~4x faster than a read and a write); the bytes copied."""
    done = 0
    while done < n:
        try:
            step = os.copy_file_range(src, dst, n - done, at + done, at + done)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            data = os.pread(src, n - done, at + done)
            _write(dst, data, at + done)
            return done + len(data)
        if step == 0:  # (the end of src)
            break
        done += step
    return done


def _newest(headers: bytes) -> int:
    return max((4096, 8192), key=lambda at: _u64(headers, at + _ITERATION_AT))


def block_size(headers: bytes) -> int | None:
    """The block size the newer database header states, or None where ``headers`` are
    not a DuckDB file's (too short, no magic, or a size that is not a power of two
    from 4 KiB to 1 GiB)."""
    if len(headers) < HEADER_BYTES or headers[_MAGIC_AT : _MAGIC_AT + 4] != _MAGIC:
        return None
    size = _u64(headers, _newest(headers) + _BLOCK_SIZE_AT)
    if size < 4096 or size > 1 << 30 or size & (size - 1):
        return None
    return size


def damage(path: Path) -> str | None:
    """What makes the DuckDB file ``path`` unreadable, as far as its headers tell
    (cheaply, before DuckDB is asked, which may take a file without headers for a new
    database): None for a file with a DuckDB file's headers, or none at all. (A file
    with fewer blocks than its header counts may be whole: DuckDB trims free blocks off
    its end.)"""
    read = _headers(path)
    if read is None:
        return None
    headers, end = read
    if block_size(headers) is None:
        return f"its headers are not a DuckDB database's ({end} bytes)"
    return None


def iteration(path: Path) -> int | None:
    """The checkpoint iteration of the DuckDB file ``path``: its newer database header's,
    one more at each checkpoint that wrote the file (whichever process made it); None
    where there is no file, or it has no DuckDB headers."""
    read = _headers(path)
    if read is None or block_size(read[0]) is None:
        return None
    return _u64(read[0], _newest(read[0]) + _ITERATION_AT)


def _headers(path: Path) -> tuple[bytes, int] | None:
    """The first :data:`HEADER_BYTES` of ``path`` (fewer where it is shorter) and its
    length; None where there is no such file."""
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _u64(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 8], "little")


class Heads:
    """The block checksums a shadow held when this writer last brought it up to date,
    with its block size and the shadow's stat then. While the shadow's stat is unchanged
    and the writer knows nobody else wrote the catalog since, they stand for the shadow's
    own: a sync then reads only the source's checksums."""

    def __init__(self) -> None:
        self.state: tuple[int, ...] | None = None
        self.size = 0
        #: Each block's 8-byte checksum, one after the other.
        self.sums = b""
        #: The source's identity, length and headers the shadow was brought up to.
        self.source: tuple[int, int, int, bytes] | None = None


def _state(fd: int) -> tuple[int, ...]:
    st = os.fstat(fd)
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Maps:
    """Read-only memory maps of one file's blocks, from the first, in whole multiples of
    :data:`SEGMENT_BLOCKS`, through which every block's leading checksum is read without
    a system call (the blocks past the maps: a ``pread`` each). A process keeps them
    between syncs (:func:`_checksums`), so a block's page is faulted in once, not read
    by a system call at every sync (from the process's third read of the file on,
    :data:`_PREAD_READS`); the file's growth adds a map, and past
    :data:`_MAPS_EACH` of them one map replaces them all (each holds a file descriptor).
    The pages the kernel maps around a faulting one (its "fault-around", 64 KiB) are
    given back at once (``MADV_DONTNEED``): a map holds one page a block, so the
    writer's resident set grows by 1/64 of the file, not 1/4.

    A block is read only if it starts below the file's end as just measured under the
    exclusive catalog lock (reading a mapped page wholly past a file's end is a
    ``SIGBUS``), so a map outlives the file's trimming (DuckDB trims free blocks off its
    end) and serves again once it grew back. A file under another name (a restore puts a
    copy in the catalog's place) is mapped anew."""

    def __init__(self) -> None:
        self.identity: tuple[int, int, int] | None = None
        #: (map, a view of its blocks' checksums, its first block), consecutive.
        self.maps: list[tuple[mmap.mmap, memoryview, int]] = []
        self.blocks = 0  # (how many the maps cover)
        self.reads = 0
        #: Whether ``mmap`` was refused (a filesystem without it): ``pread`` only.
        self.refused = False

    def close(self) -> None:
        while self.maps:
            mm, sums, _ = self.maps.pop()
            sums.release()  # (the view holds the map's buffer)
            with contextlib.suppress(BufferError):  # (never read again either way)
                mm.close()
        self.blocks = 0

    def read(self, fd: int, st: os.stat_result, size: int) -> bytes:
        """The leading checksum of every block of the file open at ``fd`` (``st``: its
        stat now), blocks of ``size`` bytes, one after the other; a block the file's end
        cuts short counts, what it has of a checksum padded with zero bytes."""
        identity = (st.st_ino, st.st_dev, size)
        if identity != self.identity:
            self.close()
            self.identity, self.refused, self.reads = identity, False, 0
        self.reads += 1
        present = max(0, -(-(st.st_size - HEADER_BYTES) // size))  # (starting below the end)
        whole = max(0, (st.st_size - HEADER_BYTES) // size) // SEGMENT_BLOCKS * SEGMENT_BLOCKS
        if whole > self.blocks and not self.refused and self.reads > _PREAD_READS:
            if len(self.maps) >= _MAPS_EACH:
                self.close()
            self._map(fd, whole - self.blocks, size)
        parts = [sums[: max(0, present - first)].tobytes() for _, sums, first in self.maps]
        parts.extend(
            os.pread(fd, _CHECKSUM_BYTES, HEADER_BYTES + k * size).ljust(_CHECKSUM_BYTES, b"\0")
            for k in range(self.blocks, present)
        )
        return b"".join(parts)

    def _map(self, fd: int, blocks: int, size: int) -> None:
        """Map ``blocks`` more blocks, after those mapped."""
        try:
            mm = mmap.mmap(
                fd, blocks * size, prot=mmap.PROT_READ, offset=HEADER_BYTES + self.blocks * size
            )
        except (OSError, ValueError):
            self.refused = True
            return
        sums = memoryview(mm).cast("Q")[:: size // 8]
        sums.tobytes()  # (each block's first page faulted in, and the pages around it:)
        page = mmap.PAGESIZE
        for start in range(page, blocks * size, size):
            mm.madvise(mmap.MADV_DONTNEED, start, size - page)
        self.maps.append((mm, sums, self.blocks))
        self.blocks += blocks


def _changed(new: bytes, old: bytes, blocks: int) -> list[int]:
    """The blocks among the first ``blocks`` whose checksum differs between ``new`` and
    ``old`` (:func:`_checksums`' bytes): compared 64 at once, one by one only where those
    differ."""
    found: list[int] = []
    step = 64 * _CHECKSUM_BYTES
    end = blocks * _CHECKSUM_BYTES
    for at in range(0, end, step):
        stop = min(at + step, end)
        if new[at:stop] != old[at:stop]:
            found.extend(
                k
                for k in range(at // _CHECKSUM_BYTES, stop // _CHECKSUM_BYTES)
                if new[k * _CHECKSUM_BYTES : (k + 1) * _CHECKSUM_BYTES]
                != old[k * _CHECKSUM_BYTES : (k + 1) * _CHECKSUM_BYTES]
            )
    return found


#: The maps each file has (by its path), the most recently read last; and their lock.
_MAPPED: dict[str, _Maps] = {}
_MAPPED_LOCK = fork_safe_lock()  # (a writer in a forked child takes it too)


def _checksums(path: Path, fd: int, size: int) -> bytes:
    """The leading checksum of every block of ``path``, open at ``fd``, one after the
    other (see :class:`_Maps`: through the maps this process keeps of the file, once it
    has :data:`SEGMENT_BLOCKS` blocks and was read twice)."""
    key = str(path)
    with _MAPPED_LOCK:
        maps = _MAPPED.pop(key, None) or _Maps()
        try:
            return maps.read(fd, os.fstat(fd), size)
        finally:
            _MAPPED[key] = maps
            while len(_MAPPED) > _MAPPED_FILES:
                _MAPPED.pop(next(iter(_MAPPED))).close()


def _forget_maps(path: Path) -> None:
    """Close the maps of ``path`` (a file going away: a map would keep its blocks)."""
    with _MAPPED_LOCK:
        maps = _MAPPED.pop(str(path), None)
        if maps is not None:
            maps.close()


def sync_shadow(source: Path, shadow: Path, known: Heads | None = None) -> int:
    """Bring ``shadow`` to ``source``'s bytes (see the module's docstring); the bytes
    copied. Where there is nothing a shadow can hold, it is removed instead: a source
    that is not a DuckDB file, or one whose log still holds changes (the shadow would
    lack them). ``known``: the checksums this writer's last sync left in the shadow
    (trusted only if the shadow's stat is as that sync left it: the caller passes them
    only when no other writer changed the catalog since), updated by this one.

    A log (``.wal``) beside the source is no reason to drop the shadow: the source file
    and its log are one state, and so are the shadow and that log (a restore keeps the
    log, which DuckDB replays onto the copy). A source whose headers (DuckDB's checkpoint
    iteration among them), length and identity are those ``known`` was brought up to,
    with the shadow as that sync left it, had no checkpoint since: nothing is read."""
    was = known.state if known is not None else None
    if known is not None:
        known.state = None  # (until this sync is complete)
    src = _open(source, os.O_RDONLY)
    try:
        headers = os.pread(src, HEADER_BYTES, 0)
        size = block_size(headers)
        if size is None:
            drop_shadow(shadow)
            return 0
        st = os.fstat(src)
        end = st.st_size
        identity = (st.st_ino, st.st_dev, end, headers)
        dst = _open(shadow, os.O_RDWR | os.O_CREAT)
        try:
            have = os.fstat(dst).st_size
            old: bytes | None = None
            if known is not None and was is not None and was == _state(dst):
                if known.source == identity:  # no checkpoint since: the shadow holds it
                    known.state = was
                    return 0
                old = known.sums if known.size == size else None
            sums = _checksums(source, src, size)
            if old is None:
                old = _checksums(shadow, dst, size)
            # a block the shadow holds whole whose checksum is the source's is there
            blocks = len(sums) // _CHECKSUM_BYTES
            same = min(len(old) // _CHECKSUM_BYTES, blocks, max(0, (have - HEADER_BYTES) // size))
            copied = 0
            for k in _changed(sums, old, same) + list(range(same, blocks)):
                at = HEADER_BYTES + k * size
                # the checksum last: a copy cut short keeps the old one, so the next
                # sync sees the block differ and copies it again
                copied += _copy_range(
                    src, dst, at + _CHECKSUM_BYTES, size - _CHECKSUM_BYTES
                ) + _copy_range(src, dst, at, _CHECKSUM_BYTES)
            if have > end:
                os.ftruncate(dst, end)
            _write(dst, headers, 0)  # last: now the shadow names the new blocks
            if known is not None:
                known.size, known.sums, known.source = size, sums, identity
                known.state = _state(dst)
            return copied + len(headers)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def drop_shadow(shadow: Path) -> None:
    """Remove the shadow (it may be stale: a sync failed)."""
    _forget_maps(shadow)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shadow)


def restore_from_shadow(shadow: Path, target: Path, keep_as: Path) -> None:
    """Put the shadow's copy in ``target``'s place. The unreadable file stays at
    ``keep_as`` (a second name), with a copy of its log, for whoever wants to look at
    them. The log itself stays: it holds the changes committed since the checkpoint the
    shadow copies (writers' changes stay in the log until it passes its bound,
    ``catalog.LOG_BYTES``) and, after a kill inside a checkpoint, that checkpoint's
    change, which DuckDB replays onto the copy as it would have onto the file. Killed at any point,
    ``target`` is either still the unreadable file (restored again next time) or the
    complete copy, which is on disk before it takes the name."""
    temp = target.with_name(target.name + ".restoring")
    _copy(shadow, temp)
    with contextlib.suppress(OSError):  # (no second name where links are not allowed)
        os.link(target, keep_as, follow_symlinks=False)
    with contextlib.suppress(FileNotFoundError):
        _copy(wal_of(target), wal_of(keep_as))
    os.replace(temp, target)


@contextmanager
def shadow_with_log(shadow: Path, target: Path) -> Iterator[Path]:
    """A path at which the shadow opens with ``target``'s log (what a restore would make
    of them, for a reader while ``target`` is unreadable): copies of both (DuckDB finds
    a log by the real name of its database, so a link to the shadow would not do) in a
    temporary directory, gone when the block ends (a connection opened in it has read
    the log by then). A copy of the whole catalog: only while it is unreadable, until
    the next writer restores it."""
    with tempfile.TemporaryDirectory(prefix="tracelake-shadow-") as where:
        path = Path(where) / target.name
        _copy(shadow, path, sync=False)
        with contextlib.suppress(FileNotFoundError):
            _copy(wal_of(target), wal_of(path), sync=False)
        yield path


def set_log_aside(target: Path, keep_as: Path) -> bool:
    """Move ``target``'s log to ``keep_as``'s (a restored copy DuckDB still cannot open
    with it: the log is what it cannot read); whether there was one."""
    try:
        os.replace(wal_of(target), wal_of(keep_as))
    except FileNotFoundError:
        return False
    return True


def _copy(source: Path, temp: Path, sync: bool = True) -> None:
    """Copy ``source`` to the new file ``temp`` (anything at that name first removed),
    fsync'd (``sync``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)
    src = _open(source, os.O_RDONLY)
    try:
        dst = _open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            offset = 0
            while chunk := os.pread(src, 1 << 20, offset):
                _write(dst, chunk, offset)
                offset += len(chunk)
            if sync:
                os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
