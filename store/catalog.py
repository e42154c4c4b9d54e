"""The catalog: DuckDB tables of runs, ops, tensors, edges and modules.

DuckDB lets one process hold a database file read-write, and then no other process can
open it at all, not even read-only. So nobody holds ``catalog.duckdb`` for long:

- **Writers** open it read-write only inside an exclusive ``flock`` on ``catalog.lock``,
  for one short transaction: committing a run (its id given, its staged directory
  renamed and its rows inserted as Arrow tables, status ``complete``, in one
  transaction, after its tensors are fsync'd). Then they close it and bump
  ``catalog.gen``. Recording itself never touches the catalog.
- **Readers** keep an in-memory DuckDB mirror. Before answering, a reader looks at
  ``catalog.gen``; if it moved, it takes the lock shared, attaches the file read-only,
  copies the rows of runs committed since its last look (and drops deleted ones), and
  lets go. A notebook that keeps a store open for hours holds no lock in between.

A writer killed at any moment leaves either its whole commit or none of it (DuckDB's
write-ahead log is replayed by the next opener); the flock dies with the process. A
transaction's change stays in that log (one fsync) until the log passes ``LOG_BYTES``,
when one transaction checkpoints it into the file.

Every DuckDB call here runs behind the DuckDB boundary (``boundary.py``), so what
leaves is a ``CatalogError`` (or, for a statement that is the caller's, the error class
the caller names), with DuckDB's exception as its ``__cause__``. A transaction that
fails is rolled back and its DuckDB connection thrown away, so the next operation
starts clean.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import functools
import json
import logging
import os
import re
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import duckdb

from tracelake.errors import (
    CatalogError,
    QueryError,
    QueryLimitError,
    RunExistsError,
    StoreError,
    TraceLakeError,
    TraceLakeWarning,
)

from .boundary import CatalogCursor, duckdb_errors, guarded
from .duckfile import (
    Heads,
    damage,
    drop_shadow,
    is_corrupt,
    iteration,
    restore_from_shadow,
    set_log_aside,
    shadow_with_log,
    sync_shadow,
    wal_of,
)
from .layout import (
    SEALED_ROWS,
    StorePaths,
    disk_full,
    from_micros,
    fsync_all,
    fsync_dir,
    fsync_file,
    keep_reserve,
    lock_held,
    locked,
    micros,
    release_reserve,
    write_new,
    write_run_marker,
)
from .points import FIELDS as POINT_FIELDS
from .points import OpIndex
from .schema import (
    RUN_TABLES,
    TABLES,
    accept_rows,
    arrow_schema,
    create_schema,
    ident,
    insert,
    present_columns,
    select_list,
)
from .sealed import read_sealed, remove_sealed

__all__ = [
    "COMPLETE",
    "QUERY_LIMITS",
    "TABLES",
    "CatalogMirror",
    "CatalogWriter",
    "ChangeToken",
    "FileChangeToken",
    "QueryLimits",
    "StagedRun",
    "set_query_limits",
    "writer_alive",
]

log = logging.getLogger("tracelake.store")

COMPLETE = "complete"
RECORDING = "recording"
FAILED = "failed"
DELETED = "deleted"
INTERRUPTED = "interrupted"  # shown for 'recording' runs whose writer is gone
COLLECTED = "collected"  # gc() removed its data; the row stays so that ids never repeat

_ATTACHED = "tl_catalog"  # the catalog file's name inside a writer's DuckDB
#: Results of fewer rows come back as Python rows: for a few rows, DuckDB's Arrow export
#: (a statement of its own) costs more than the rows (``benchmarks/`` times both).
_FEW_ROWS = 64
#: How many SQL texts a mirror keeps parsed.
_PREPARED = 256
#: The mirror's own in-memory database.
_MIRROR_DB = "mirror"
#: Up to this many runs are left out of a query on the catalog file by a list of ids;
#: more, by a join.
_LISTED = 256
#: Past this many ops in the complete runs, a reader's queries over every run read the
#: catalog file itself rather than copy every run's rows into its mirror first: the copy
#: grows with the catalog (2-9 s and ~440 MiB a million ops, on 2 loaded cores), a scan of
#: the file's columns far less, but each such query then opens the file (~250 ms at a
#: million ops, where the mirror answers in 10-50 ms: ``benchmarks/big_catalog.py``).
MIRROR_OPS = 1_000_000
#: How large DuckDB's log (``catalog.duckdb.wal``) may grow before a writer's transaction
#: checkpoints it into the file. A change that fits is committed by appending it to the
#: log (one fsync); a checkpoint writes blocks and headers (four fsyncs) and brings the
#: shadow up to the file (each block's checksum compared: ``duckfile.py``), so it is paid
#: once per this many bytes of changes (three or four tiny runs), not per change. Small,
#: because everyone who opens the file replays the log first: each writer's ``ATTACH``
#: (two a run; ~0.5-1 ms a logged tiny run, where a checkpoint costs ~15-20 ms), each
#: reader's refresh and each query on the file (a read-only open: ~33 ms with no log,
#: ~39 with one registration, ~47 with the log at this bound; 2026-12-01, load ~3.5).
#: A GPT-2 run's rows (~100 KB) pass it alone: such a commit checkpoints at once.
LOG_BYTES = 16 << 10
#: DuckDB's ``checkpoint_threshold`` while no checkpoint is due: never by its own
#: judgement (which puts even a tiny run's commit at hundreds of KB), only by this
#: module's (CatalogWriter._transaction).
_NO_CHECKPOINT = "1TB"
#: A writer's checkpoint merges the tables' small row groups (DuckDB's vacuum) only at
#: every this many checkpoints of the file (by its checkpoint iteration, which every
#: writer reads alike), and at a ``gc()``'s. DuckDB's rule merges a table's last row
#: groups whenever they hold fewer than 2,048 rows together: a commit's rows start a row
#: group of their own, so with a merge at every checkpoint each commit rewrote the last
#: ~2,048 rows of every table it touched (``runs`` and ``calls``: a row a run), a cost
#: that rose with the runs up to that bound, and now and then far larger row groups, as
#: merges of merged ones reach twice their size. Between merges each table gains a row
#: group a checkpoint, at most this many.
VACUUM_EVERY = 16
#: DuckDB's ``max_vacuum_tasks`` when a checkpoint merges (its default), and otherwise.
_VACUUM_TASKS, _NO_VACUUM = 100, 0
#: A writer folds the sealed runs (``sealed.py``) into the catalog once this many wait:
#: one transaction for them all, where each took one of its own (an ``ATTACH``, an
#: insert a table, a ``COMMIT`` into the log and every few runs a checkpoint: ~10 ms of a
#: tiny run's ~19). Any other transaction (a batch's commit, a delete, ``gc()``), a
#: reader's refresh, a store's ``close()`` and its process's exit fold them sooner.
FOLD_AFTER = 16
#: The most bytes of sealed runs' tables a writer keeps for its fold (``_unfolded``): a
#: 1,000-op chain's 20 steps make 8.3 MB, so most of a fold of such runs.
UNFOLDED_BYTES = 128 << 20
#: How many times a seal reads the catalog's names again when another writer changed it
#: between that read and the seal's lock (each time: another writer's commit).
_SEAL_TRIES = 8


#: How a reader opens the catalog file: read-only, and unable to touch any other file or
#: load an extension, and unable to change that (a store may come from someone else;
#: what its catalog holds must not reach outside it).
_SOURCE_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "lock_configuration": True,
}


def check_objects(con: duckdb.DuckDBPyConnection, database: str | None = None) -> None:
    """``CatalogError`` unless ``database`` holds the catalog's tables as base tables,
    and no views or macros: tracelake makes none, so any is planted, and a view named
    like a table (or a macro named like a function) would run its own SQL where
    tracelake reads or writes a table. ``None``: the connection's current database."""
    params = [database]
    views = [
        r[0]
        for r in con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal "
            "AND database_name = coalesce(?, current_database())",
            params,
        ).fetchall()
    ]
    macros = [
        r[0]
        for r in con.execute(
            "SELECT DISTINCT function_name FROM duckdb_functions() WHERE NOT internal "
            "AND database_name = coalesce(?, current_database()) "
            "AND function_type IN ('macro', 'table_macro')",
            params,
        ).fetchall()
    ]
    if views or macros:
        named = [f"view {n!r}" for n in sorted(views)] + [f"macro {n!r}" for n in sorted(macros)]
        shown = ", ".join(named[:8]) + (", ..." if len(named) > 8 else "")
        raise CatalogError(
            "refusing the catalog: it holds objects tracelake never creates "
            f"({shown}); they may read or run what the store's owner chose. Is this store "
            "from someone else? Its catalog.duckdb has been tampered with"
        )


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def writer_alive(paths: StorePaths, run_id: int) -> bool:
    """Whether the process recording run ``run_id`` still holds its writing lock."""
    return lock_held(paths.writing_lock(run_id))


def _refuse_links(paths: StorePaths, reading: bool = False) -> None:
    """``StoreError`` if a file a writer opens in place (the catalog, its log, ``runs/``)
    is a symbolic link: DuckDB and ``mkdir`` follow links, so a planted one would make
    tracelake write outside the store (``reading``: read, for a reader's catalog and
    log)."""
    wal = wal_of(paths.catalog)
    files = (paths.catalog, wal, paths.shadow)
    for path in files if reading else (*files, paths.runs):
        if path.is_symlink():
            doing = "read the store" if reading else "write to the store"
            raise StoreError(
                f"refusing to {doing} at {str(paths.root)!r}: {path.name} is a symbolic "
                f"link, and {doing.split()[0]}ing through it would leave the store"
            )


class _Engine:
    """The in-memory DuckDB into which writers attach the catalog file, one transaction
    at a time: starting a DuckDB costs far more than attaching a file, and every run
    takes two transactions. One per process (like the chunk cache of tensors.py), made
    on first use, made again in a forked child (a parent's DuckDB is not for it) and
    after a transaction failed (a DuckDB that failed once is not trusted again)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._con: tuple[int, duckdb.DuckDBPyConnection] | None = None
        #: Whether the last transaction may have left the catalog attached (it failed
        #: to detach): the next one detaches it first.
        self.attached = False

    def connection(self) -> duckdb.DuckDBPyConnection:
        """The engine's connection; hold ``lock`` while using it."""
        pid = os.getpid()
        if self._con is None or self._con[0] != pid:
            self._let_go()
            con = duckdb.connect(":memory:")
            # Checkpoints only where CatalogWriter._transaction asks for one.
            con.execute(f"SET checkpoint_threshold = '{_NO_CHECKPOINT}'")
            con.execute(f"SET max_vacuum_tasks = {_NO_VACUUM}")  # (CatalogWriter._checkpoint)
            # One thread: a writer's statements are small, so a second thread only adds
            # coordination (slower, not faster, on a loaded machine), and writers of
            # several processes at once would each bring one more to share the cores.
            con.execute("SET threads = 1")
            # A DETACH leaves DuckDB's log as it is: a change stays in the log (one
            # fsync, where a checkpoint takes three more) until the log is past
            # LOG_BYTES (CatalogWriter._transaction).
            con.execute("PRAGMA disable_checkpoint_on_shutdown")
            accept_rows(con)
            self._con = (pid, con)
        return self._con[1]

    def reset(self) -> None:
        """Forget the connection (after a failure): the next transaction makes a new one.
        Closing it lets go of any file it still had attached."""
        if self._con is not None and self._con[0] == os.getpid():  # (not a parent's)
            with contextlib.suppress(duckdb.Error):
                self._con[1].close()
        self._let_go()
        self._con = None

    def _let_go(self) -> None:
        """Forget a connection a parent process made (this is a forked child): it is
        kept, never freed here, since freeing it touches the parent's DuckDB threads
        and locks, which the child does not have (a segmentation fault)."""
        if self._con is not None and self._con[0] != os.getpid():
            _INHERITED.append(self._con[1])
            self._con = None
        self.attached = False


#: Connections made by a parent process, in a forked child: never freed (_let_go).
_INHERITED: list[Any] = []
_ENGINE = _Engine()
_T = TypeVar("_T")


def _detach(con: duckdb.DuckDBPyConnection, quietly: bool) -> None:
    """Detach the catalog file from the engine: no handle left (and no checkpoint: the
    transaction made its own, or its change stays in the log).
    ``quietly``: another error is on its way out (it says more than this one would);
    a failed detach then throws the engine's connection away instead."""
    try:
        con.execute("USE memory")
        con.execute(f"DETACH {_ATTACHED}")
    except duckdb.Error:
        if not quietly:
            raise
        _ENGINE.reset()
        return
    _ENGINE.attached = False


def _dir_state(path: Path) -> tuple[int, ...]:
    """A directory's identity and change stamps, and its link count (which moves with
    every subdirectory made or removed, even within one tick of the clock)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ()
    return (st.st_ino, st.st_dev, st.st_nlink, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _file_state(paths: StorePaths) -> tuple[tuple[int, ...], ...] | None:
    """The catalog file's and its log's identity and change stamps (None if the file is
    missing): equal values mean nobody wrote either since."""
    states: list[tuple[int, ...]] = []
    for path in (paths.catalog, wal_of(paths.catalog)):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not states:
                return None
            states.append(())
            continue
        states.append((st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(states)


class CatalogWriter:
    """Short, exclusive, transactional changes to ``catalog.duckdb``: each attaches the
    file to the process's writing DuckDB (:class:`_Engine`), commits into DuckDB's log
    (checkpointed once past :data:`LOG_BYTES`) and detaches it (no handle left) before
    letting the lock go."""

    #: A run is recorded into a staged directory and committed by :meth:`seal` (its
    #: rows inserted by the next transaction), with no catalog row before (DuckLake's
    #: catalog registers it first: ``reserve``).
    stages_runs = True

    def __init__(self, paths: StorePaths):
        self.paths = paths
        self._has_schema = False
        #: The catalog file's and its log's stat as this writer's last transaction left
        #: them (checked then, and changed by nobody else while they stay so).
        self._checked: tuple[tuple[int, ...], ...] | None = None
        #: Whether the running transaction found the file as this writer's last one left
        #: it (no other writer committed since).
        self._unchanged = False
        #: The run directory ids on disk, with ``runs/``'s stat, as this writer's last
        #: registration left them: listing ``runs/`` for each run costs in proportion to
        #: the runs (~10-100 ms at 10,000).
        self._listing: tuple[tuple[int, ...], list[int]] | None = None
        #: How readers learn that a transaction committed.
        self.changes: ChangeToken = FileChangeToken(paths)
        #: The block checksums this writer's last transaction left in the shadow.
        self._heads = Heads()
        #: The log file (inode, device) whose name this writer made durable.
        self._durable_log: tuple[int, int] | None = None
        #: The complete runs' names as this writer's last transaction left them (None:
        #: not known); trusted while the files are as that transaction left them.
        self._names: set[str] | None = None
        #: The highest run id and ``seq`` in ``runs`` as this writer's last commit left
        #: them (None: not known); trusted while the files are as that commit left them
        #: (any other transaction of this writer forgets them: ``delete`` moves ``seq``).
        self._top: tuple[int, int] | None = None
        #: ``_top`` as the running transaction found it (None: read it from the file).
        self._known_top: tuple[int, int] | None = None
        #: The sealed runs' names by id, as this writer last listed them.
        self._sealed: dict[int, str] = {}
        #: The tables of runs this writer sealed, by id, up to :data:`UNFOLDED_BYTES`
        #: in all: its fold inserts them rather than read back (and decompress into
        #: new memory, ~1 ms a MB here) the file it wrote them to.
        self._unfolded: dict[int, tuple[dict[str, Any], int]] = {}
        #: ``_top`` as the running transaction's fold left it (None: it folded nothing).
        self._fold_top: tuple[int, int] | None = None

    @contextmanager
    def _transaction(
        self,
        then: list[Callable[[], None]] | None = None,
        size: int = 0,
        durable: bool = True,
        read: bool = False,
        vacuum: bool = False,
    ) -> Iterator[duckdb.DuckDBPyConnection]:
        """One transaction on the catalog file. Callers are public methods behind the
        DuckDB boundary (``guarded``); a DuckDB failure anywhere rolls back and
        throws the engine's connection away. ``then``: actions the block adds, run once
        the transaction committed, while the lock is still held.

        The change stays in DuckDB's log (``catalog.duckdb.wal``): its ``COMMIT``
        appends it there and fsyncs that, no checkpoint (which fsyncs three more times,
        writes the file's blocks and headers, and makes the shadow sync compare every
        block's checksum). A change that would take the log past :data:`LOG_BYTES`
        (``size``: about how many bytes it adds, its rows' Arrow size) is checkpointed
        into the file at its ``COMMIT``, with the log before it (the change's rows
        written once, not to the log and again); one that took the log past it anyway
        is followed by a ``CHECKPOINT``. So the log stays small: every opener replays it
        (writers' ``ATTACH``, readers in memory); a restore from the shadow keeps it
        (``duckfile.py``). ``durable``: see :meth:`_bound_log`. ``read``: the block only
        reads, so readers are told of a change only if the files did change (a log
        checkpointed, a schema completed). ``vacuum``: a checkpoint the transaction makes
        merges small row groups whether or not one is due (:meth:`_checkpoint`).

        Every transaction that may write folds the sealed runs first (:meth:`_fold`),
        so that it sees them as the complete runs they are.

        A catalog file that is missing while run directories exist is never made anew:
        a fresh catalog would hand out the ids of runs on disk again."""
        then = [] if then is None else then
        with _ENGINE.lock, locked(self.paths.lock, exclusive=True):
            self._refuse_lost_catalog()
            _refuse_links(self.paths)
            made = False
            try:
                con = _ENGINE.connection()
                if _ENGINE.attached:  # forget what a failed transaction left attached
                    con.execute("USE memory")
                    con.execute(f"DETACH DATABASE IF EXISTS {_ATTACHED}")
                if not self.paths.catalog.exists():
                    self._has_schema = False
                seen = _file_state(self.paths)
                # no file and no log: the ATTACH below makes an empty catalog (under the
                # lock), which holds nothing to check. It is made under another name and
                # renamed once complete (_made_whole): killed half-way, the ATTACH
                # leaves a file without DuckDB's headers, which no one could open.
                made = seen is None and not os.path.lexists(wal_of(self.paths.catalog))
                file = self.paths.catalog_new if made else self.paths.catalog
                if made:  # (a killed first fold's: it held only what is still sealed)
                    for leftover in (file, wal_of(file)):
                        with contextlib.suppress(FileNotFoundError):
                            leftover.unlink()
                con = self._attach(con, str(file).replace("'", "''"))
                try:
                    # Before any statement reads a table; skipped when the file is, by
                    # its stat, as this writer's own last transaction left it, or new
                    # (listing DuckDB's functions for macros costs more than a small
                    # commit: ~35 ms, a sixth of a GPT-2 run recorded into a new store).
                    self._unchanged = seen is not None and seen == self._checked
                    if not self._unchanged:
                        self._names = None
                    self._known_top, self._top = self._top if self._unchanged else None, None
                    if not made and not self._unchanged:
                        check_objects(con, _ATTACHED)
                    if made:  # (the ATTACH made the file: no runs, so none by name)
                        self._names, self._known_top = set(), (0, 0)
                    self._checked = None
                    con.execute(f"USE {_ATTACHED}")
                    try:  # (BEGIN inside: a Ctrl-C right after it still rolls it back,
                        con.execute("BEGIN TRANSACTION")  # or the DETACH below waits on it)
                        if not self._has_schema:  # once per writer and file, in the
                            create_schema(con, empty=made)  # transaction: one commit
                        folded = 0 if read else self._fold(con, then)
                        yield con
                        self._commit(con, seen, size + folded, vacuum)
                    except BaseException:
                        with contextlib.suppress(duckdb.Error):  # the first error says more
                            con.execute("ROLLBACK")
                        raise
                    self._has_schema = True
                    if made:  # all of it in the file (unless the COMMIT checkpointed
                        if os.path.exists(wal_of(file)):  # it): no log to rename with it
                            self._checkpoint(con, "CHECKPOINT", vacuum)
                    else:
                        if not read:
                            self._tell_readers()
                        self._bound_log(con, durable, vacuum)
                except BaseException:
                    _detach(con, quietly=True)
                    raise
                _detach(con, quietly=False)
                if made:
                    self._made_whole()
                    if not read:
                        self._tell_readers()
                self._checked = _file_state(self.paths)
                if read and self._checked != seen:
                    self._tell_readers()
                self._keep_shadow()
                # What the change lets happen on disk happens only now that the shadow
                # holds it (with the log, which a restore keeps): a catalog restored
                # from the shadow never lacks a change whose consequences (a run's
                # marker, a removed directory) are there.
                for action in then or ():
                    action()
                keep_reserve(self.paths)
            except BaseException as exc:
                # after a DuckDB failure or an interrupt (Ctrl-C) half-way through a
                # statement, the engine may still hold the file: a new one, next time
                if not isinstance(exc, TraceLakeError):
                    _ENGINE.reset()
                if made and not self.paths.catalog.exists():  # (a file this transaction
                    _ENGINE.reset()  # began: on a full disk, cut short and unreadable;
                    for path_made in (file, wal_of(file)):  # the sealed runs hold it all)
                        with contextlib.suppress(OSError):
                            path_made.unlink()
                raise

    def _made_whole(self) -> None:
        """Put the catalog a new store's first transaction made (complete, checkpointed,
        detached) in its place, durably: readers see no catalog until it is whole."""
        fsync_file(self.paths.catalog_new)
        os.replace(self.paths.catalog_new, self.paths.catalog)
        fsync_dir(self.paths.root)

    def _refuse_lost_catalog(self) -> None:
        """``StoreError`` where the catalog file is missing while run directories it
        made exist: those with an identity marker (written once a run's rows committed),
        not a sealed run's (its rows not in any catalog yet) nor one a writer killed
        before its seal or commit left (an orphan, no marker)."""
        if self.paths.catalog.exists():
            return
        made = _committed_without_catalog(self.paths)
        if made:
            raise StoreError(
                f"the store at {str(self.paths.root)!r} has run directories but no "
                f"catalog ({self.paths.catalog.name} is missing), so tracelake will "
                "not write to it or collect anything: restore catalog.duckdb (and its "
                ".wal, if any) from where it went, or, to start afresh, move the "
                f"directories under {str(self.paths.runs)!r} out of the store"
            )

    def _tell_readers(self) -> None:
        """Bump the change token after a commit. Where that fails (a full disk) the
        change stands: readers' tokens also hold the catalog's and its log's stat, which
        the commit moved (as after a writer killed between its commit and its bump); an
        error here would have the caller retry a change that is done."""
        try:
            self.changes.bump()
        except OSError as exc:
            log.warning(
                "could not bump the readers' change token (they see the change by "
                "the catalog's stat): %s",
                exc,
            )

    def _commit(
        self,
        con: duckdb.DuckDBPyConnection,
        seen: tuple[tuple[int, ...], ...] | None,
        size: int,
        vacuum: bool,
    ) -> None:
        """``COMMIT``, checkpointing at once where the change (``size`` bytes, about)
        would take the log past :data:`LOG_BYTES`."""
        logged = seen[1][2] if seen is not None and seen[1] else 0
        if logged + size <= LOG_BYTES:
            con.execute("COMMIT")
            return
        con.execute("SET checkpoint_threshold = '0B'")  # (DuckDB's: the COMMIT checkpoints)
        self._checkpoint(con, "COMMIT", vacuum)
        con.execute(f"SET checkpoint_threshold = '{_NO_CHECKPOINT}'")

    def _checkpoint(self, con: duckdb.DuckDBPyConnection, statement: str, vacuum: bool) -> None:
        """Run ``statement``, which checkpoints the file: merging small row groups only
        where ``vacuum`` or :data:`VACUUM_EVERY` says so (the rest of the time DuckDB's
        ``max_vacuum_tasks`` is 0, :class:`_Engine`)."""
        vacuum = vacuum or ((iteration(self.paths.catalog) or 0) + 1) % VACUUM_EVERY == 0
        if vacuum:
            con.execute(f"SET max_vacuum_tasks = {_VACUUM_TASKS}")
        con.execute(statement)
        if vacuum:
            con.execute(f"SET max_vacuum_tasks = {_NO_VACUUM}")

    def _bound_log(self, con: duckdb.DuckDBPyConnection, durable: bool, vacuum: bool) -> None:
        """After a ``COMMIT``: checkpoint the log if it is past :data:`LOG_BYTES` (the
        change was larger than its ``size`` said). ``durable``: the change must outlive
        a power loss once this returns, so the log's name is made durable too (DuckDB
        fsyncs the log's contents, not the directory entry of a log it made), once per
        log file. A run's registration need not be: lost, it leaves a directory without
        a row, which ``gc()`` removes, and its commit makes the log durable."""
        try:
            st = os.stat(wal_of(self.paths.catalog))
        except FileNotFoundError:
            return  # (the COMMIT checkpointed: the change is in the file)
        if st.st_size > LOG_BYTES:
            self._checkpoint(con, "CHECKPOINT", vacuum)
        elif durable and self._durable_log != (st.st_ino, st.st_dev):
            fsync_dir(self.paths.root)
            self._durable_log = (st.st_ino, st.st_dev)

    def _attach(self, con: duckdb.DuckDBPyConnection, path: str) -> duckdb.DuckDBPyConnection:
        """Attach the catalog file; one that is damaged (by its headers, or by DuckDB's
        word) is first restored from the shadow, with a warning, if there is one. The
        connection to go on with (a new one after a restore)."""
        damaged = damage(self.paths.catalog) if self.paths.shadow.exists() else None
        if damaged is None:
            try:
                con.execute(f"ATTACH '{path}' AS {_ATTACHED}")
                _ENGINE.attached = True
                return con
            except duckdb.Error as exc:
                if not (is_corrupt(exc) and self.paths.shadow.exists()):
                    raise
                damaged = str(exc)
            _ENGINE.reset()  # (a DuckDB that failed once is not trusted again)
            con = _ENGINE.connection()
        kept = self.paths.catalog.with_name(
            f"{self.paths.catalog.name}.unreadable-{_now():%Y%m%dT%H%M%S.%f}"
        )
        restore_from_shadow(self.paths.shadow, self.paths.catalog, kept)
        fsync_dir(self.paths.root)
        self._checked = None  # (a file not as this writer left it: checked anew)
        self._heads.state = None
        warnings.warn(
            f"the catalog {str(self.paths.catalog)!r} could not be read ({damaged}); it "
            "was restored from catalog.shadow, the copy of it the last completed change "
            "left (a change cut short by a killed process is all that is lost, and it "
            f"never returned). The unreadable file is kept as {kept.name}",
            TraceLakeWarning,
            stacklevel=2,
        )
        try:
            con.execute(f"ATTACH '{path}' AS {_ATTACHED}")
        except duckdb.Error as exc:  # the log it kept is what DuckDB cannot read: aside
            if not (is_corrupt(exc) and set_log_aside(self.paths.catalog, kept)):
                raise
            _ENGINE.reset()
            con = _ENGINE.connection()
            con.execute(f"ATTACH '{path}' AS {_ATTACHED}")
        _ENGINE.attached = True
        return con

    def _keep_shadow(self) -> None:
        """Bring the shadow up to the file the transaction left (see ``duckfile.py``).
        Where that fails (a full disk) the shadow goes rather than stay behind: a stale
        one would lose changes if it were ever restored. The shadow's checksums as this
        writer's last sync left them are trusted only when the transaction found the
        catalog as that one left it (no other writer, no restore, since)."""
        if not self._unchanged:
            self._heads.state = None
        try:
            sync_shadow(self.paths.catalog, self.paths.shadow, self._heads)
        except OSError:
            drop_shadow(self.paths.shadow)

    @guarded("cannot read the catalog")
    def complete_names(self) -> Collection[str]:
        """The names of the complete runs, sealed ones included (read-only: this writer
        keeps it), read as a writer reads (no new DuckDB, and the file checked only if
        another writer changed it since this one's last transaction: a reader's open
        costs several times more); without a transaction where this writer's last one
        left the files as they are and knew the names."""
        sealed = self._sealed_names().values()
        state = _file_state(self.paths)
        if state is None:
            return set(sealed)
        if self._names is None or state != self._checked:
            self._learn()
        assert self._names is not None
        return _Both(self._names, frozenset(sealed)) if sealed else self._names

    def _check_disk(
        self, con: duckdb.DuckDBPyConnection, cached: bool = False, top: int | None = None
    ) -> int:
        """The highest run directory id on disk, after making sure the catalog knows
        every marked run directory above its own highest id (``StoreError`` if not: the
        catalog was replaced by an older copy, and writing would hide or reuse runs).
        ``cached``: the ids as this writer's last registration left them, if neither the
        catalog nor ``runs/`` changed since (only a writer, under the exclusive lock,
        makes a run id's directory; one that died before committing still moved
        ``runs/``'s link count); the listing is kept for the next one."""
        state = _dir_state(self.paths.runs)
        listing = self._listing
        if cached and self._unchanged and listing is not None and listing[0] == state:
            ids = listing[1]
        else:
            ids = self.paths.run_dir_ids()
        self._listing = (state, ids) if cached else None
        if not ids:
            return 0
        if top is None:  # (the catalog's highest id, unless the caller read it)
            row = con.execute("SELECT coalesce(max(id), 0) FROM runs").fetchone()
            top = int(row[0]) if row else 0
        self._refuse_older_catalog(ids, top)
        return ids[-1]

    def _refuse_older_catalog(self, ids: list[int], top: int, sealed: Collection[int] = ()) -> None:
        """``StoreError`` if a marked run directory (its rows committed once) is above the
        catalog's highest id ``top`` (``ids``: the directories, sorted; ``sealed``: the
        sealed runs', whose rows are in no catalog yet)."""
        above = ids[bisect.bisect_right(ids, top) :]
        lost = [i for i in above if i not in sealed and self.paths.run_marker(i).exists()]
        if lost:
            shown = ", ".join(self.paths.run_dir(i).name for i in lost[:5])
            raise StoreError(
                f"the catalog of {str(self.paths.root)!r} does not know run directories "
                f"it made ({shown}{', ...' if len(lost) > 5 else ''}): catalog.duckdb "
                "was replaced by an older copy, so tracelake will not write to the store "
                "or collect anything. Restore the newest catalog.duckdb, or move those "
                f"directories out of {str(self.paths.runs)!r}"
            )

    def _freeing(self, change: Callable[[], _T]) -> _T:
        """Run ``change`` (a catalog transaction that lets space be reclaimed); if the
        disk is full, give up the store's reserve (``catalog.reserve``) and run it once
        more: so ``delete`` and ``gc`` work on a full disk."""
        try:
            return change()
        except (duckdb.Error, OSError) as exc:
            if not disk_full(exc) or not release_reserve(self.paths):
                raise
        return change()

    @guarded("cannot commit the batch's runs to the catalog")
    def commit_batch(
        self,
        runs: list[StagedRun],
        built: Sequence[dict[str, Any]] = (),
        durable: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Make the runs of a batch visible, all in one transaction; return their
        ``runs`` rows (every column, as inserted: what a read of them would return).
        Each run's directory (``runs/.staging/*``) is renamed to its id's name inside
        the transaction, before ``COMMIT``; a crash before the commit leaves those
        directories without rows, which ``gc()`` removes. Nothing of a batch is in the
        catalog before this. ``built``: tables of several of the runs at once
        (``rows.runs_tables``), whose ``run_id`` holds each row's run's position in
        ``runs``. ``durable``: waits until the runs' files are durable (their syncs,
        ``layout.begin_durable_trees``, going on meanwhile), called before the
        ``COMMIT``; None: they are durable already."""
        return self._commit_staged(runs, built, durable)

    def _commit_staged(
        self,
        runs: list[StagedRun],
        built: Sequence[dict[str, Any]] = (),
        durable: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        then: list[Callable[[], None]] = []
        size = _nbytes(
            [t for run in runs for t in run.tables.values()]
            + [t for tables in built for t in tables.values()]
        )
        with self._transaction(then, size) as con:
            top, seq = self._top_now(con)
            on_disk = self._check_disk(con, cached=True, top=top)
            next_id = max(top, on_disk) + 1
            ids = list(range(next_id, next_id + len(runs)))
            moved: list[tuple[Path, Path]] = []
            try:
                for run, run_id in zip(runs, ids, strict=True):
                    os.rename(run.staged, self.paths.run_dir(run_id))
                    moved.append((run.staged, self.paths.run_dir(run_id)))
                # the listing, with the new directories (the highest; only a writer
                # under the exclusive lock makes a run id's directory)
                listed = self._listing
                if listed is not None:
                    listed[1].extend(ids)  # (in place: a copy costs ~30 us a 10,000)
                    self._listing = (_dir_state(self.paths.runs), listed[1])
                fsync_dir(self.paths.runs)  # the new names, durable before the rows are
                added = self._insert_runs(con, list(zip(ids, runs, strict=True)), seq, then, built)
                if durable is not None:  # the runs' files, durable before the COMMIT
                    durable()
            except BaseException:
                # nothing is committed (the COMMIT comes after this block): the runs
                # are staged again, as they were (listed failed; gc() removes them)
                for staged, run_dir in reversed(moved):
                    with contextlib.suppress(OSError):
                        os.rename(run_dir, staged)
                raise
        # (committed: the transaction is over)
        self._top = (ids[-1] if ids else top, seq + len(ids))
        return added.to_pylist()  # type: ignore[no-any-return]

    def _top_now(self, con: duckdb.DuckDBPyConnection) -> tuple[int, int]:
        """The highest run id and ``seq`` in ``runs``, in the running transaction."""
        if self._known_top is not None:  # (as this writer's last commit left them)
            return self._known_top
        # (fetchall: a result left unfinished makes DuckDB refuse inserts)
        ((top, seq),) = con.execute(
            "SELECT coalesce(max(id), 0), coalesce(max(seq), 0) FROM runs"
        ).fetchall()
        return int(top), int(seq)

    def _insert_runs(
        self,
        con: duckdb.DuckDBPyConnection,
        runs: list[tuple[int, StagedRun]],
        seq: int,
        then: list[Callable[[], None]],
        built: Sequence[dict[str, Any]] = (),
        sealed: bool = False,
    ) -> Any:
        """Insert the rows of ``runs`` (each with its id, its directory ``runs/<id>``
        already) with status complete, marking deleted the complete runs they replace;
        return their ``runs`` rows (an Arrow table). ``seq``: the highest before them.
        A name complete in the catalog (or earlier in ``runs``) is refused unless the
        run replaces it (``overwrite``); a ``sealed`` run replaces it all the same (its
        name was checked when it was sealed, and it has no caller left to refuse)."""
        from . import arrow  # (not at import: listing runs needs no Arrow)

        rows: list[dict[str, Any]] = []  # the runs' rows
        named: dict[str, int] = {}  # these runs by name, the latest one
        incoming: dict[str, list[Any]] = {table: [] for table in RUN_TABLES}
        finished = _now()
        complete: dict[str, list[int]] = {}  # the complete runs of these names
        names = sorted({run.name for _, run in runs})
        # (none, where the names this writer keeps, valid in this transaction, say so)
        if self._names is None or not self._names.isdisjoint(names):
            for i, name in con.execute(
                "SELECT id, name FROM runs WHERE status = ? AND name IN "
                "(SELECT unnest(?::VARCHAR[]))",
                [COMPLETE, names],
            ).fetchall():
                complete.setdefault(name, []).append(int(i))
        for run_id, run in runs:
            clash = complete.pop(run.name, [])
            earlier = named.get(run.name)  # (replaced before it is inserted: deleted)
            if (clash or earlier is not None) and not run.overwrite:
                if not sealed:
                    raise RunExistsError(
                        f"a run named {run.name!r} was committed while this one was "
                        "recording; pass overwrite=True to replace it"
                    )
                log.warning("sealed run %d replaces the run named %r", run_id, run.name)
            if earlier is not None:
                rows[earlier]["status"] = DELETED
            named[run.name] = len(rows)
            if clash:
                marks = ", ".join("?" * len(clash))
                con.execute(f"UPDATE runs SET status = '{DELETED}' WHERE id IN ({marks})", clash)
            rows.append(runs_row(run, run_id, seq + len(rows) + 1, run.finished or finished))
            for table, data in run.tables.items():
                if data is not None and data.num_rows:
                    incoming[table].append(_with_run_id(data, run_id))
        ids = [run_id for run_id, _ in runs]
        for tables in built:
            for table, data in tables.items():
                if data is not None and data.num_rows:
                    incoming[table].append(_at_run_ids(data, ids))
        added = arrow.table(rows, arrow_schema(TABLES["runs"]))
        insert(con, "runs", added)
        for table, parts in incoming.items():
            if parts:
                insert(con, table, _concat(parts))
        for run_id, run in runs:
            then.append(functools.partial(write_run_marker, self.paths, run_id, run.created))
        if self._names is not None:  # (known as this writer's last transaction left them)
            self._names.update(named)
        return added

    # -- sealed runs: durable and visible at once, their rows in the catalog a moment later

    @guarded("cannot commit the run")
    def seal(self, run: StagedRun) -> dict[str, Any]:
        """Commit the staged run ``run`` without a catalog transaction: its files are
        durable, its rows too (in its directory's ``SEALED_ROWS``: :func:`sealed_header`,
        written with its files); here, under the catalog lock, its name is checked
        against the complete and sealed runs', it gets the next id, its directory
        becomes ``runs/<id>`` and its rows ``runs/.sealed/<id>``, both names durable, and
        readers are told. From then on it is a complete run: the next transaction of
        any writer, or a reader's refresh, inserts its rows first (:meth:`_fold`).
        Returns its ``runs`` row (``seq`` is given when its rows are inserted)."""
        for _ in range(_SEAL_TRIES):
            if self._known() is None:  # (another writer changed the catalog)
                self._learn()
            with locked(self.paths.lock, exclusive=True):
                _refuse_links(self.paths)
                known = self._known()
                if known is not None:
                    return self._seal(run, *known)
        raise StoreError(
            f"run {run.name!r} could not be committed: other writers changed the catalog "
            f"{_SEAL_TRIES} times while it was; record it again"
        )

    def _known(self) -> tuple[Collection[str], int] | None:
        """The complete runs' names and the highest id in the catalog, where this writer
        knows them as the files are now (None: read them)."""
        state = _file_state(self.paths)
        if state is None:  # no catalog yet (a missing one, with runs, refused)
            self._refuse_lost_catalog()
            return set(), 0
        if state == self._checked and self._names is not None and self._top is not None:
            return self._names, self._top[0]
        return None

    def _learn(self) -> None:
        """Read the complete runs' names and the highest id and ``seq`` (a transaction
        that writes nothing: they are kept while the files stay as it left them)."""
        with self._transaction(read=True) as con:
            rows = con.execute("SELECT name FROM runs WHERE status = ?", [COMPLETE]).fetchall()
            names = {name for (name,) in rows}
            top = self._top_now(con)
        self._names, self._top = names, top

    def _seal(self, run: StagedRun, names: Collection[str], top: int) -> dict[str, Any]:
        sealed = self._sealed_names()
        if not run.overwrite and (run.name in names or run.name in sealed.values()):
            raise RunExistsError(
                f"a run named {run.name!r} was committed while this one was recording; "
                "pass overwrite=True to replace it"
            )
        listed = self._listing
        if listed is not None and listed[0] == _dir_state(self.paths.runs):
            ids = listed[1]
        else:
            ids = self.paths.run_dir_ids()
        self._refuse_older_catalog(ids, top, sealed)
        run_id = max(top, ids[-1] if ids else 0, max(sealed, default=0)) + 1
        if top == 0 and not self.paths.catalog.exists():
            # a new store's: the reserve its first fold may give up to make the catalog
            # on a full disk (a transaction makes it otherwise, after its commit)
            keep_reserve(self.paths)
        self.paths.make_sealed()
        run_dir = self.paths.run_dir(run_id)
        os.rename(run.staged, run_dir)
        try:
            os.rename(run_dir / SEALED_ROWS, self.paths.sealed_rows(run_id))
        except BaseException:
            with contextlib.suppress(OSError):  # (staged again: listed failed)
                os.rename(run_dir, run.staged)
            raise
        ids.append(run_id)  # (this writer's own list: no copy of 10,000 ids a seal)
        self._listing = (_dir_state(self.paths.runs), ids)
        self._sealed[run_id] = run.name
        self._keep_unfolded(run_id, run.tables)
        _SEALERS.add(self)
        fsync_all((), (str(self.paths.runs), str(self.paths.sealed)))  # durable at return
        self._tell_readers()
        return runs_row(run, run_id, None, run.finished or _now())

    def _keep_unfolded(self, run_id: int, tables: dict[str, Any]) -> None:
        kept = [t for t in tables.values() if t is not None and t.num_rows]
        size = sum(t.get_total_buffer_size() for t in kept)
        held = sum(size for _, size in self._unfolded.values())
        if held + size <= UNFOLDED_BYTES:
            self._unfolded[run_id] = (tables, size)

    def _sealed_names(self) -> dict[int, str]:
        """The sealed runs' names by id (each file's header read once by this writer:
        a sealed run's rows never change)."""
        ids = self.paths.sealed_ids()
        known = self._sealed
        for run_id in set(known).difference(ids):
            del known[run_id]
            self._unfolded.pop(run_id, None)
        for run_id in ids:
            if run_id not in known:
                try:
                    header, _ = read_sealed(self.paths.sealed_rows(run_id), tables=False)
                except StoreError:  # (folded meanwhile, or unreadable: the fold says so)
                    continue
                known[run_id] = str(header["name"])
        return dict(known)

    @property
    def sealed_waiting(self) -> int:
        """How many sealed runs wait for their rows to reach the catalog, as this writer
        last listed them (its own seals since, included; a reader's refresh may have
        folded them)."""
        return len(self._sealed)

    @guarded("cannot insert the sealed runs into the catalog")
    def fold(self) -> None:
        """Insert the rows of every sealed run into the catalog, in one transaction (none
        where no run is sealed); on a full disk with the store's reserve given up, as a
        ``delete`` is (the runs are complete: so that they are seen as such)."""
        if not self.paths.sealed_ids():
            self._sealed.clear()
            self._unfolded.clear()
            return
        self._freeing(self._fold_all)
        if self._fold_top is not None:
            self._top = self._fold_top

    def _fold_all(self) -> None:
        with self._transaction():
            pass

    def _fold(self, con: duckdb.DuckDBPyConnection, then: list[Callable[[], None]]) -> int:
        """Inside a transaction that may write: insert the sealed runs' rows, and once
        it commits (``then``), write their markers and remove their rows' files. A
        sealed file whose run is in the catalog already (a fold killed before it removed
        it), or whose directory is missing (a power loss before the seal that moved it
        returned), is removed. Returns the bytes of the rows, about."""
        self._fold_top = None
        ids = self.paths.sealed_ids()
        if not ids:
            return 0
        present = {
            int(i)
            for (i,) in con.execute(
                "SELECT id FROM runs WHERE id IN (SELECT unnest(?::BIGINT[]))", [ids]
            ).fetchall()
        }
        runs: list[tuple[int, StagedRun]] = []
        for run_id in ids:
            if run_id in present or not self.paths.run_dir(run_id).is_dir():
                continue
            kept = self._unfolded.pop(run_id, None)
            if kept is None:
                header, tables = read_sealed(self.paths.sealed_rows(run_id))
            else:  # (its file's header: the tables are those written with it)
                header, _ = read_sealed(self.paths.sealed_rows(run_id), tables=False)
                tables = kept[0]
            runs.append((run_id, unsealed(self.paths.run_dir(run_id), header, tables)))
        size = 0
        if runs:
            top, seq = self._top_now(con)
            self._insert_runs(con, runs, seq, then, sealed=True)
            self._fold_top = self._known_top = (max(top, runs[-1][0]), seq + len(runs))
            size = _nbytes([t for _, run in runs for t in run.tables.values()])
        for run_id in ids:
            then.append(functools.partial(remove_sealed, self.paths.sealed_rows(run_id)))
        then.append(functools.partial(self._forget_sealed, ids))
        return size

    def _forget_sealed(self, ids: list[int]) -> None:
        for run_id in ids:
            self._sealed.pop(run_id, None)
            self._unfolded.pop(run_id, None)

    @guarded("cannot delete the run from the catalog")
    def delete(self, name: str) -> int:
        """Mark the complete run ``name`` deleted; return its id (or -1 if none)."""
        return self._freeing(lambda: self._delete(name))

    def _delete(self, name: str) -> int:
        with self._transaction() as con:
            row = con.execute(
                "SELECT id FROM runs WHERE name = ? AND status = ?", [name, COMPLETE]
            ).fetchone()
            if row is None:
                return -1
            con.execute(
                "UPDATE runs SET status = ?, seq = (SELECT max(seq) + 1 FROM runs) WHERE id = ?",
                [DELETED, row[0]],
            )
            if self._names is not None:
                self._names.discard(name)
            return int(row[0])

    @guarded("cannot collect runs in the catalog")
    def collect(self) -> list[int]:
        """Forget deleted, failed and interrupted runs; return their ids (their
        directories are the caller's to remove, after this commits)."""
        return self._freeing(self._collect)

    def _collect(self) -> list[int]:
        with self._transaction(vacuum=True) as con:  # (its checkpoint frees what it can)
            self._check_disk(con)
            rows = con.execute(
                "SELECT id, status FROM runs WHERE status NOT IN (?, ?)", [COMPLETE, COLLECTED]
            ).fetchall()
            dead = [i for i, s in rows if s != RECORDING or not writer_alive(self.paths, i)]
            if dead:
                marks = ", ".join("?" * len(dead))
                for table in RUN_TABLES:
                    con.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", dead)
                con.execute(f"UPDATE runs SET status = '{COLLECTED}' WHERE id IN ({marks})", dead)
            return dead


@dataclass
class StagedRun:
    """A run of a batch, recorded and written (not yet durable): where its directory is,
    its catalog rows (with any ``run_id``: the batch's commit gives the id) and its
    ``runs`` row's values."""

    staged: Path
    name: str
    overwrite: bool
    created: datetime
    info: dict[str, Any]
    tables: dict[str, Any]
    summary: dict[str, Any]
    #: Its steps (``rows.RunSteps``), where its op tables are yet to be built: the
    #: batch builds those of its small runs together (``built`` of
    #: :meth:`CatalogWriter.commit_batch`).
    steps: Any = None
    #: When it finished (a sealed run's: when it was sealed; else its commit's time).
    finished: datetime | None = None
    #: The host and process that recorded it (a sealed run's; else the committer's).
    origin: tuple[str, int] | None = None


def runs_row(
    run: StagedRun,
    run_id: int,
    seq: int | None,
    finished: datetime,
    info: dict[str, Any] | None = None,
    created: datetime | None = None,
) -> dict[str, Any]:
    """The ``runs`` row of run ``run`` committed as ``run_id`` (``info``: its model
    class, torch version and meta, default the run's own; ``created``: default its
    own)."""
    info = run.info if info is None else info
    summary = run.summary
    host, pid = run.origin or (socket.gethostname(), os.getpid())
    return {
        "id": run_id,
        "name": run.name,
        "status": COMPLETE,
        "created": run.created if created is None else created,
        "finished": finished,
        "steps": summary["steps"],
        "op_count": summary["op_count"],
        "bytes": summary["bytes"],
        "model_class": info.get("model_class"),
        "param_fingerprint": summary.get("param_fingerprint"),
        "input_fingerprint": summary.get("input_fingerprint"),
        "torch_version": info.get("torch_version"),
        "device": summary.get("device"),
        "meta": json.dumps(info.get("meta")),
        "host": host,
        "pid": pid,
        "error": None,
        "seq": seq,
    }


def sealed_header(run: StagedRun) -> dict[str, Any]:
    """What a sealed run's file keeps of ``run`` besides its tables (``sealed.py``):
    JSON values, read back by :func:`unsealed`."""
    return {
        "name": run.name,
        "overwrite": run.overwrite,
        "created": micros(run.created),
        "finished": micros(run.finished or _now()),
        "info": {key: run.info.get(key) for key in ("model_class", "torch_version", "meta")},
        "summary": run.summary,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def unsealed(run_dir: Path, header: dict[str, Any], tables: dict[str, Any]) -> StagedRun:
    """The staged run a sealed run's file describes (its directory ``run_dir``)."""
    return StagedRun(
        run_dir,
        str(header["name"]),
        bool(header["overwrite"]),
        from_micros(int(header["created"])),
        dict(header["info"]),
        tables,
        dict(header["summary"]),
        finished=from_micros(int(header["finished"])),
        origin=(str(header["host"]), int(header["pid"])),
    )


#: The writers of this process that sealed runs: at its exit each folds what it knows
#: to wait.
_SEALERS: weakref.WeakSet[CatalogWriter] = weakref.WeakSet()


@atexit.register
def _fold_at_exit() -> None:
    for writer in list(_SEALERS):
        if writer.sealed_waiting:
            try:
                writer.fold()
            except Exception as exc:  # (they stay sealed: the next transaction folds them)
                log.warning("could not fold the sealed runs at exit: %s", exc)


def _nbytes(tables: Collection[Any]) -> int:
    """The Arrow size of a change's tables (what it adds to DuckDB's log, about): their
    buffers' sizes (Arrow's ``nbytes``, which leaves out what a slice does not use,
    costs ~20 times more, ~0.1 ms a table, and the tables are not slices). Counted only
    until past :data:`LOG_BYTES`, the one size it is compared with (``_commit``); a
    table whose rows alone are far past it (a batch's: its count walks thousands of
    buffers, a millisecond) is taken as past it uncounted."""
    total = 0
    for table in tables:
        if table is None:
            continue
        if table.num_rows * table.num_columns > LOG_BYTES:  # (nearly every value a byte or more)
            return total + table.num_rows * table.num_columns
        total += int(table.get_total_buffer_size())
        if total > LOG_BYTES:
            break
    return total


class _Both(Collection[str]):
    """Two collections of names read as one, without copying the larger (a store's
    10,000 complete names, against each record's few sealed ones: a union copied them
    each time, ~0.5 ms a run at that size)."""

    def __init__(self, first: Collection[str], second: Collection[str]):
        self._first, self._second = first, second

    def __contains__(self, name: object) -> bool:
        return name in self._first or name in self._second

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (name for name in self._second if name not in self._first)

    def __len__(self) -> int:
        return len(self._first) + sum(name not in self._first for name in self._second)


def _with_run_id(table: Any, run_id: int) -> Any:
    import numpy as np

    from . import arrow

    k = table.schema.get_field_index("run_id")
    field = table.schema.field(k)
    return table.set_column(k, field, arrow.array(np.full(table.num_rows, run_id), field.type))


def _at_run_ids(table: Any, ids: list[int]) -> Any:
    """``table`` with each ``run_id`` (a position in ``ids``) replaced by the id there."""
    import numpy as np

    from . import arrow

    k = table.schema.get_field_index("run_id")
    field = table.schema.field(k)
    at = arrow.numbers(table.column(k)).astype(np.int64)
    return table.set_column(k, field, arrow.array(np.asarray(ids, np.int64)[at], field.type))


def _concat(parts: list[Any]) -> Any:
    import pyarrow as pa

    return parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")


class ChangeToken(Protocol):
    """What a catalog backend offers readers: a value that moves whenever the catalog
    may have changed (readers compare it whole), ``None`` while nothing was ever
    committed. A catalog that is not a local file supplies its own."""

    def token(self) -> str | None: ...

    def bump(self) -> None:
        """Move the token: a writer committed a change."""


class FileChangeToken:
    """The token of a catalog in a local DuckDB file: the writers' generation file
    (``catalog.gen``, rewritten after every change), and the database and its log as
    the filesystem sees them, so that a writer killed between its commit and its bump is
    still noticed."""

    def __init__(self, paths: StorePaths):
        wal = wal_of(paths.catalog)
        self._gen = paths.gen
        self._watched = (str(paths.gen), str(paths.catalog), str(wal))

    def bump(self) -> None:
        """A new value every time, even for deletes (readers compare it whole; what it
        says is for people)."""
        tmp = self._gen.with_name(f".gen.{os.getpid()}")
        write_new(tmp, f"{_now().isoformat()} {os.getpid()} {os.urandom(8).hex()}".encode())
        os.replace(tmp, self._gen)

    def token(self) -> str | None:
        parts = []
        for path in self._watched:  # before every query: plain strings and os calls
            try:
                st = os.stat(path)
            except FileNotFoundError:
                parts.append("-")
                continue
            parts.append(f"{st.st_mtime_ns}:{st.st_size}:{st.st_ino}")
        if parts[0] == "-" == parts[1]:
            return None  # nothing was ever committed
        if parts[0] == "-":
            # The generation file is gone (deleted by hand, or a copy of the store
            # without it): the database's own stat still says when it moved, so the
            # runs stay visible rather than the store looking empty.
            return "|".join(parts)
        try:  # (never through a link, nor more than a generation's few bytes: a crafted
            # store's catalog.gen may be a link to anything, /dev/zero or a FIFO)
            fd = os.open(self._watched[0], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                data = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:  # removed since the stat, or a link: the stat alone, as above
            return "|".join(parts)
        return f"{data.hex()}|{'|'.join(parts)}"


@dataclass
class QueryLimits:
    """What one query (``store.query``, ``store.sql``) may use: ``seconds`` of time
    (``None``: no limit) and DuckDB ``memory`` (its ``memory_limit`` setting, e.g.
    ``"8GB"``; ``None``: DuckDB's default, 80% of the machine's memory). Past either,
    the query stops with ``QueryLimitError``. Change them with
    :func:`tracelake.set_query_limits`."""

    seconds: float | None = 300.0
    memory: str | None = None


#: The limits every reader's queries run under (one process-wide setting).
QUERY_LIMITS = QueryLimits()


def set_query_limits(
    seconds: float | Any | None = ..., memory: str | Any | None = ...
) -> QueryLimits:
    """Set the time (``seconds``) and DuckDB memory (``memory``, e.g. ``"8GB"``) one
    query may use, for every store of this process; an argument left out keeps its
    setting, ``None`` lifts the limit. Returns the limits as they were before."""
    before = QueryLimits(QUERY_LIMITS.seconds, QUERY_LIMITS.memory)
    if seconds is not ...:
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0
        ):
            raise ValueError(f"seconds= takes a positive number or None, not {seconds!r}")
        QUERY_LIMITS.seconds = None if seconds is None else float(seconds)
    if memory is not ...:
        if memory is not None and not (isinstance(memory, str) and _MEMORY.fullmatch(memory)):
            raise ValueError(f"memory= takes a size such as '8GB' or None, not {memory!r}")
        QUERY_LIMITS.memory = memory
    return before


_MEMORY = re.compile(r"\s*[0-9]+(\.[0-9]+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*", re.I)


class _Watchdog:
    """One thread that interrupts the DuckDB cursors of queries past their deadline
    (a timer thread per query would cost a point lookup more than the lookup)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: dict[int, tuple[float, duckdb.DuckDBPyConnection]] = {}
        self.fired: set[int] = set()
        self._next = 0
        self._thread: threading.Thread | None = None

    def start(self, seconds: float, cursor: duckdb.DuckDBPyConnection) -> int:
        with self._cond:
            self._next += 1
            self._running[self._next] = (time.monotonic() + seconds, cursor)
            if self._thread is None or not self._thread.is_alive():  # (or after a fork)
                self._thread = threading.Thread(target=self._watch, daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def stop(self, ticket: int) -> bool:
        """End the query's watch; whether it was interrupted."""
        with self._cond:
            self._running.pop(ticket, None)
            if ticket in self.fired:
                self.fired.discard(ticket)
                return True
            return False

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for ticket, (deadline, cursor) in list(self._running.items()):
                    if deadline <= now:
                        del self._running[ticket]
                        self.fired.add(ticket)
                        cursor.interrupt()  # (under the lock: the query is still running)
                soonest = min((d for d, _ in self._running.values()), default=now + 60)
                self._cond.wait(max(soonest - now, 0.001))


_WATCHDOG = _Watchdog()


@contextmanager
def read_source(
    paths: StorePaths, memory: str | None = None, check: bool = True
) -> Iterator[tuple[duckdb.DuckDBPyConnection, dict[str, set[str]]]]:
    """The catalog file opened read-only, checked (:func:`check_objects`; ``check=False``:
    the caller checked it as it is now), with the columns its tables have; the caller
    holds the catalog lock shared. ``CatalogError`` if the file was lost (callers read
    it where :func:`catalog_made`). ``memory``: the connection's ``memory_limit`` (its
    configuration is locked once open)."""
    if not paths.catalog.exists():  # committed to once, so it was lost
        raise CatalogError(
            f"the catalog {str(paths.catalog)!r} is missing: restore it (and "
            "its .wal, if any); the store refuses writes until then"
        )
    _refuse_links(paths, reading=True)
    config = dict(_SOURCE_CONFIG)
    if memory is not None:
        config["memory_limit"] = memory
    # A catalog left unreadable (a writer killed in DuckDB's checkpoint): until the next
    # writer restores it, readers read the shadow with the log, which is what it will be
    # restored to (the log holds the changes since the shadow's checkpoint).
    shadow = paths.shadow.exists()
    if shadow and damage(paths.catalog):
        src = _open_shadow(paths, config)
    else:
        try:
            src = duckdb.connect(str(paths.catalog), read_only=True, config=config)
        except duckdb.Error as exc:
            if not (shadow and is_corrupt(exc)):
                raise
            src = _open_shadow(paths, config)
    try:
        if check:
            check_objects(src)
        yield src, present_columns(src)
    finally:
        src.close()


def _open_shadow(paths: StorePaths, config: dict[str, Any]) -> duckdb.DuckDBPyConnection:
    """The shadow opened read-only with the catalog's log replayed onto it, as a writer
    will restore them; without the log where DuckDB cannot read it (as a restore sets
    it aside)."""
    with shadow_with_log(paths.shadow, paths.catalog) as path:
        try:
            return duckdb.connect(str(path), read_only=True, config=config)
        except duckdb.Error as exc:
            if not is_corrupt(exc):
                raise
    return duckdb.connect(str(paths.shadow), read_only=True, config=config)


def _committed_without_catalog(paths: StorePaths) -> list[int]:
    """The ids of the run directories whose rows were committed once (with an identity
    marker), not sealed ones' (their rows in no catalog yet): where the catalog file is
    missing, runs it made, so it was lost."""
    sealed = set(paths.sealed_ids())
    return [i for i in paths.run_dir_ids() if i not in sealed and paths.run_marker(i).exists()]


def catalog_made(paths: StorePaths) -> bool:
    """Whether the catalog file is there to be read, or should be: it exists, or runs
    it made do (it was lost: reading it says so). Not yet where a new store's runs are
    all sealed, waiting for the fold that makes it (one that could not: a full disk)."""
    return paths.catalog.exists() or bool(_committed_without_catalog(paths))


def fold_or_warn(fold: Callable[[], None]) -> None:
    """Insert the sealed runs' rows into the catalog (``fold``: a writer's
    :meth:`CatalogWriter.fold`), before a read or after a seal. Where that cannot be
    done (a full disk past the reserve, a store this process may not write), a warning
    and no error: the runs are complete and durable, and the next transaction that can
    inserts them; a read goes on without them until then."""
    try:
        fold()
    except StoreError as exc:
        warnings.warn(
            f"runs recorded into the store could not be added to its catalog file yet "
            f"({exc}); they are kept, complete, and added by the next transaction that "
            "can (until then a read that cannot add them does not see them)",
            TraceLakeWarning,
            stacklevel=3,
        )


def read_runs(
    paths: StorePaths, where: str, params: list[Any], fold: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """Rows of the ``runs`` table (``where``: a condition on its columns), straight from
    the catalog file: what listing runs needs, without a reader's mirror (no rows are
    copied; the command line's ``tracelake runs`` is this and little else). ``fold``:
    inserts the sealed runs' rows into the file first, if any wait (a writer's
    :meth:`CatalogWriter.fold`; None: the caller did)."""
    if fold is not None and paths.sealed_ids():
        fold_or_warn(fold)
    if FileChangeToken(paths).token() is None or not catalog_made(paths):
        return []  # (no run ever committed, or none the fold could insert yet)
    with (
        duckdb_errors(f"cannot read the catalog {paths.catalog}"),
        locked(paths.lock, exclusive=False),
        read_source(paths) as (src, present),
    ):
        cursor = src.execute(
            f"SELECT * FROM (SELECT {select_list(TABLES['runs'], present['runs'])} FROM runs) "
            f"WHERE {where} ORDER BY id",
            params,
        )
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


class CatalogMirror:
    """A reader's in-memory copy of the catalog's complete runs, refreshed when the
    catalog changed. Holds no lock and no handle on the file between refreshes.

    What the query room reads (``Store.catalog`` hands it over): ``refresh``,
    ``run_ids`` / ``run_names``, ``query`` / ``arrow`` (``error=QueryError`` for the
    user's statements), ``read_only_df`` (``store.sql``: the user's raw SELECT, in a
    read-only transaction), ``is_select``, ``points`` (the op index), ``knows`` /
    ``typed``.
    Every method is behind the DuckDB boundary (:func:`duckdb_errors`); a refresh that
    failed changed nothing, and the next one tries again."""

    #: Whether queries over every run may read the catalog file itself (past
    #: ``MIRROR_OPS``): a catalog that is a local DuckDB file. (``lake.py``'s is not.)
    reads_file = True
    #: Whether ``store.sql`` does too (else it copies every complete run's rows).
    sql_on_file = True

    #: What inserts the sealed runs' rows into the catalog file before a refresh reads
    #: it, when its token moved and some wait (a writer's ``CatalogWriter.fold``).
    _fold: Callable[[], None] | None = None

    @guarded("cannot start the in-memory mirror of the catalog")
    def __init__(self, paths: StorePaths, fold: Callable[[], None] | None = None):
        self.paths = paths
        self._fold = fold
        # The mirror never touches files itself (rows arrive as Arrow tables read through
        # a separate, short-lived read-only connection), so user SQL on it can run with
        # DuckDB's external access off: no file reads, no ATTACH of files, no extensions.
        # The rows live in an in-memory database that DuckDB compresses at each
        # checkpoint: a fraction of the memory, and scans (queries that filter by label
        # or function) read less; only the first load pays for compressing.
        self.con = duckdb.connect(":memory:")
        self._compressed = _attach_compressed(self.con)
        # no spilling to a temporary directory (DuckDB's default: .tmp in the working
        # directory): past its memory limit a query fails (QueryLimitError)
        self.con.execute("SET temp_directory = ''")
        self.con.execute("SET enable_external_access = false")
        create_schema(self.con, empty=True)  # (a new in-memory database)
        accept_rows(self.con)
        self._local = threading.local()  # each thread's reading cursor
        self._memory: str | None = None  # the memory limit set, as QUERY_LIMITS says
        self._gen: str | None = None
        self._loaded: set[int] = set()  # runs whose rows are in the mirror
        self._complete: set[int] = set()  # the complete runs, as of the last refresh
        self._everything = False  # whether every complete run's rows are to be loaded
        #: Whether queries over every run read the catalog file (the complete runs hold
        #: more than MIRROR_OPS ops), as of the last refresh; runs named stay mirrored.
        self._direct = False
        #: The catalog file's stat when this mirror last checked it (check_objects).
        self._checked: tuple[tuple[int, ...], ...] | None = None
        self.changes: ChangeToken = FileChangeToken(paths)
        #: The complete runs' ids by name, and names by id, as of the last refresh
        #: (queries filter ops by run id rather than join ``runs`` for a name).
        self.run_ids: dict[str, int] = {}
        self.run_names: dict[int, str] = {}
        #: The complete runs' ``created`` by id (what their identity markers hold), as
        #: of the last refresh: opening a run's arrays checks its marker against it.
        self.run_created: dict[int, Any] = {}
        # (SQL, parameter types) -> DuckDB's parsed statement and its result's schema
        self._prepared: dict[tuple[str, tuple[type, ...]], tuple[Any, Any]] = {}
        #: Where each op's tensor lies, by run id and label, as of the last refresh.
        self.points = OpIndex(self._op_rows)

    def _token(self) -> str | None:
        return self.changes.token()

    def _made(self) -> bool:
        """Whether the catalog holds rows to read (:func:`catalog_made`), once its token
        moved and the sealed runs were folded."""
        return catalog_made(self.paths)

    @contextmanager
    def _refresh_source(self) -> Iterator[tuple[duckdb.DuckDBPyConnection, dict[str, set[str]]]]:
        """Where a refresh reads rows from, with the columns its tables have: the
        catalog file, read-only, under the catalog lock held shared. (A catalog that
        is not a local file, ``lake.py``'s, supplies its own.)"""
        with locked(self.paths.lock, exclusive=False), self._source() as source:
            yield source

    def _runs_sql(self, present: dict[str, set[str]]) -> str:
        """The SELECT of the source's ``runs`` rows, every status."""
        return f"SELECT {select_list(TABLES['runs'], present['runs'])} FROM runs"

    def _runs_where(self, run_ids: list[int]) -> tuple[str, list[Any]]:
        """The condition (and its parameters) that picks these runs' rows in the source."""
        return f"run_id IN ({', '.join('?' * len(run_ids))})", run_ids

    @guarded("cannot read the catalog")
    def refresh(self, runs: Collection[int] | None = None) -> None:
        """Catch up with the catalog: the ``runs`` table, and the rows of ``runs`` (run
        ids; ``None``: of every complete run, from now on). A mirror loads a run's rows
        only once something asks for them, so that listing the runs of a large store, or
        reading one of them, does not copy all the others first. Past ``MIRROR_OPS``
        ops, ``None`` copies none: such queries read the file (``direct``)."""
        gen = self._token()
        # (a seal moves the token: its runs are complete, to be read; a new store's
        # seal that could not make its token, on a full disk, left none at all)
        fold = (gen is None or gen != self._gen) and self._fold is not None
        if fold and self.paths.sealed_ids():
            fold_or_warn(self._fold)  # type: ignore[arg-type]
            gen = self._token()
        if gen is None or (gen != self._gen and not self._made()):
            return  # (the fold that makes the catalog could not, yet: tried again next time)
        if gen == self._gen:
            if runs is None and self._direct:
                return
            everything = runs is None or self._everything
            wanted = self._complete if everything else self._complete.intersection(runs or ())
            if wanted <= self._loaded:
                return
        with self._refresh_source() as (src, present):
            gen = self._token()
            table = None
            if gen == self._gen:
                # The catalog as last read, only more runs' rows wanted (a run opened
                # for the first time): the mirror's runs table is the file's already.
                complete, direct, run_ids = self._complete, self._direct, self.run_ids
                created = self.run_created
            else:
                # a meta that is not valid JSON (a crafted store's, or a lone surrogate
                # an older tracelake wrote) reads as none, so that meta.* queries of
                # the other runs still work
                table = src.sql(
                    "SELECT * REPLACE (CASE WHEN json_valid(meta) THEN meta END AS meta) "
                    f"FROM ({self._runs_sql(present)})"
                ).to_arrow_table()
                ids, names, statuses = (
                    table.column(c).to_pylist() for c in ("id", "name", "status")
                )
                complete = {i for i, st in zip(ids, statuses, strict=True) if st == COMPLETE}
                counts = table.column("op_count").to_pylist()
                direct = self.reads_file and (
                    sum(n or 0 for n, i in zip(counts, ids, strict=True) if i in complete)
                    > MIRROR_OPS
                )
                run_ids = {
                    name: i
                    for i, name, st in zip(ids, names, statuses, strict=True)
                    if st == COMPLETE
                }
                created = {
                    i: when
                    for i, when, st in zip(
                        ids, table.column("created").to_pylist(), statuses, strict=True
                    )
                    if st == COMPLETE
                }
            everything = not direct and (runs is None or self._everything)
            kept = self._loaded & complete
            wanted = complete if everything else kept | complete.intersection(runs or ())
            gone = sorted(self._loaded - complete)
            new = sorted(wanted - kept)
            incoming = {}
            if new:
                where, params = self._runs_where(new)
                for name in RUN_TABLES:
                    if name not in present:  # a table declared since it was written
                        continue
                    columns = select_list(TABLES[name], present[name])
                    incoming[name] = src.sql(
                        f"SELECT {columns} FROM {ident(name)} WHERE {where}", params=params
                    ).to_arrow_table()
        con = self.con
        con.execute("BEGIN TRANSACTION")
        try:
            if table is not None:
                con.execute("DELETE FROM runs")
                insert(con, "runs", table)
            for name in RUN_TABLES:
                if gone:
                    con.execute(
                        f"DELETE FROM {name} WHERE run_id IN ({', '.join('?' * len(gone))})", gone
                    )
                if name in incoming:
                    insert(con, name, incoming[name])
            con.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(duckdb.Error):  # the first error says more
                con.execute("ROLLBACK")
            raise
        # What the mirror holds now, before anything else may fail: a failed checkpoint
        # must not make the next refresh load these rows again.
        if gone:
            self.points.drop(gone)
        self.points.add(new)
        self._loaded = kept | set(new)
        self._complete = complete
        self._direct, self._everything = direct, everything
        self.run_ids = run_ids
        self.run_names = {i: name for name, i in run_ids.items()}
        self.run_created = created
        self._gen = gen
        if self._compressed and (gone or new):
            con.execute(f"CHECKPOINT {_MIRROR_DB}")  # compresses the row groups that changed

    def query(
        self,
        sql: str,
        params: list[Any] | None = None,
        runs: Collection[int] | None = None,
        *,
        error: type[TraceLakeError] = CatalogError,
    ) -> CatalogCursor:
        """Run ``sql`` on the refreshed mirror, in a cursor of its own (DuckDB lets one
        connection have one unfinished result at a time). ``runs``: the only runs whose
        rows ``sql`` reads (``()``: the ``runs`` table alone); ``None``: any. A failure of
        the statement is raised as ``error``; one of reading the catalog as
        ``CatalogError``."""
        self.refresh(runs)
        what = "the SQL could not run" if error is not CatalogError else "cannot read the catalog"
        if runs is None and self._direct:  # the rows, read out before the lock goes
            table = self._file_arrow(sql, params or [], error, limited=False)
            with duckdb_errors(what, error):
                con = duckdb.connect(":memory:", config=_SOURCE_CONFIG)
                con.register("result", table)
                return CatalogCursor(con.execute("SELECT * FROM result"), what, error)
        with duckdb_errors(what, error):
            return CatalogCursor(self._cursor().execute(sql, params or []), what, error)

    def read_only_df(self, sql: str) -> Any:
        """The caller's one SELECT ``sql`` (see :meth:`is_select`) on the refreshed
        mirror, as a DataFrame, inside a read-only DuckDB transaction: DuckDB itself
        refuses any write, a ``DELETE ... RETURNING`` in a CTE included, so the text is
        not trusted to be read-only. Any failure is a ``QueryError``."""
        if not self.is_select(sql):
            raise QueryError("store.sql runs exactly one read-only SELECT statement")
        self.refresh()
        if self._direct and not self.sql_on_file:
            self.refresh(self._complete)
        if self._direct and self.sql_on_file:
            with self._on_file() as src:
                return self._read_only_df(src, sql, memory=False)
        with duckdb_errors("the SQL could not run", QueryError):
            cursor = self._cursor()
        try:
            return self._read_only_df(cursor, sql)
        finally:
            cursor.close()

    def _read_only_df(
        self, cursor: duckdb.DuckDBPyConnection, sql: str, memory: bool = True
    ) -> Any:
        with self._limited(cursor, memory), duckdb_errors("the SQL could not run", QueryError):
            try:
                cursor.execute("BEGIN TRANSACTION READ ONLY")
                try:
                    return cursor.execute(sql).df()
                finally:
                    cursor.execute("ROLLBACK")
            except duckdb.TransactionException as exc:
                if "read-only" not in str(exc):
                    raise
                raise QueryError(
                    f"store.sql is read-only and this statement writes: {exc}"
                ) from exc

    @staticmethod
    def is_select(sql: str) -> bool:
        """Whether ``sql`` is exactly one SELECT statement, by DuckDB's own parser; text
        DuckDB cannot split into statements raises ``QueryError``."""
        with duckdb_errors("invalid SQL", QueryError):
            statements = duckdb.extract_statements(sql)
        return len(statements) == 1 and statements[0].type == duckdb.StatementType.SELECT

    @contextmanager
    def _limited(
        self, cursor: duckdb.DuckDBPyConnection, memory_set: bool = True
    ) -> Iterator[None]:
        """Run the block's statements (the user's: a query, ``store.sql``) on
        ``cursor`` under :data:`QUERY_LIMITS`: past the time limit the cursor is
        interrupted; that, or DuckDB running out of its memory limit, is a
        ``QueryLimitError``. ``memory_set``: set the mirror's memory limit (a
        connection to the file had it set when opened)."""
        seconds, memory = QUERY_LIMITS.seconds, QUERY_LIMITS.memory
        if memory_set and memory != self._memory:  # (a setting of the whole database)
            with duckdb_errors("cannot set the query memory limit", QueryError):
                self.con.execute(
                    f"SET memory_limit = '{memory}'" if memory else "RESET memory_limit"
                )
            self._memory = memory
        ticket = _WATCHDOG.start(seconds, cursor) if seconds else 0
        try:
            yield
        except BaseException as exc:
            if ticket and _WATCHDOG.stop(ticket):
                # DuckDB's interrupt (the boundary made it a KeyboardInterrupt)
                raise QueryLimitError(
                    f"the query ran past its time limit of {seconds:g} s and was stopped; "
                    "narrow it (where run = ..., limit), or raise the limit: "
                    "tl.set_query_limits(seconds=...) (None: no limit)"
                ) from exc
            if isinstance(exc.__cause__, duckdb.OutOfMemoryException):
                first = str(exc.__cause__).split("\n")[0]  # (not DuckDB's SET advice)
                raise QueryLimitError(
                    f"the query ran out of memory ({first}); narrow it, or raise "
                    "the limit: tl.set_query_limits(memory='...GB') (None: DuckDB's own)"
                ) from exc.__cause__
            raise
        if ticket and _WATCHDOG.stop(ticket):
            # interrupted just as it finished: the result stands, the cursor (which
            # may still carry the interrupt) does not
            self._local.cursor = None

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """A new cursor, on the mirror's database (a cursor starts on DuckDB's own)."""
        cursor = self.con.cursor()
        if self._compressed:
            cursor.execute(f"USE {_MIRROR_DB}")
        return cursor

    def _reader(self) -> duckdb.DuckDBPyConnection:
        """This thread's cursor for results read out at once, kept between queries."""
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self._local.cursor = self._cursor()
        return cursor

    def arrow(
        self,
        sql: str,
        params: list[Any] | None = None,
        refresh: bool = True,
        *,
        runs: Collection[int] | None = None,
        error: type[TraceLakeError] = CatalogError,
    ) -> Any:
        """``sql``'s result as an Arrow table (``refresh=False``: on the rows as of the
        last refresh, e.g. the ones ``run_ids`` describes). ``runs``: the only runs whose
        rows ``sql`` reads, as for :meth:`query`. A failure of the statement is
        raised as ``error``; one of reading the catalog as ``CatalogError``.

        A query's SQL is the same text whatever values it binds, so each text is parsed
        by DuckDB once and the first result's schema kept. A small result then comes back
        as rows typed by that schema: DuckDB's Arrow export runs a statement of its own,
        which costs more than a few rows (for a point lookup, most of its time)."""
        if refresh:
            self.refresh(runs)
        if runs is None and self._direct:
            return self._file_arrow(sql, params or [], error, limited=error is not CatalogError)
        if error is CatalogError:  # tracelake's own statement
            with duckdb_errors("cannot read the catalog", error):
                return self._arrow(sql, params or [])
        with self._limited(self._reader()), duckdb_errors("the query could not run", error):
            return self._arrow(sql, params or [])

    def _arrow(self, sql: str, params: list[Any]) -> Any:
        import pyarrow as pa

        cursor = self._reader()
        key = (sql, tuple(type(p) for p in params))  # what fixes the result's types
        known = self._prepared.get(key)
        if known is None:
            statements = duckdb.extract_statements(sql)
            if len(statements) != 1:
                return cursor.sql(sql, params=params).to_arrow_table()
            statement, schema, rows = statements[0], None, []
            cursor.execute(statement, params)
        else:
            statement, schema = known
            cursor.execute(statement, params)
            rows = cursor.fetchmany(_FEW_ROWS)
            if len(rows) < _FEW_ROWS:
                table = _typed(pa, rows, schema)
                if table is not None:
                    return table
                return cursor.sql(statement, params=params).to_arrow_table()
        with warnings.catch_warnings():  # "an extra copy of the rows": of the rest, yes
            warnings.filterwarnings("ignore", message="Arrow output on a DB-API result")
            rest = cursor.to_arrow_table()  # None when the rows were all fetched
        if schema is None:  # the first time: all of it came as Arrow
            if rest is None:  # (nothing was fetched before, so DuckDB gave a table)
                rest = cursor.sql(statement, params=params).to_arrow_table()
            if len(self._prepared) >= _PREPARED:
                self._prepared.clear()
            self._prepared[key] = (statement, rest.schema)
            return rest
        head = _typed(pa, rows, schema if rest is None else rest.schema)
        if head is None:
            return cursor.sql(statement, params=params).to_arrow_table()
        return head if rest is None else pa.concat_tables([head, rest])

    @contextmanager
    def _on_file(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The catalog file itself, for a query over every run of a catalog too large to
        mirror: opened read-only (external access off) under the shared lock, which the
        block holds (writers wait for it), with its run tables shadowed by views of the
        rows of the complete runs the mirror knows, and ``runs`` as the file has it (a
        run's rows commit with its status, so no partial run is ever there)."""
        with (
            duckdb_errors("cannot read the catalog"),
            locked(self.paths.lock, exclusive=False),
            self._source(QUERY_LIMITS.memory) as (src, present),
        ):
            row = src.execute("SELECT current_database()").fetchone()
            assert row is not None
            db = ident(str(row[0]))
            # Rows belong to complete runs and to deleted ones (until gc() collects
            # them): those of runs the mirror does not know as complete are left out.
            unknown = [
                int(r[0])
                for r in src.execute(
                    f"SELECT id FROM {db}.main.runs WHERE status IN (?, ?)", [COMPLETE, DELETED]
                ).fetchall()
                if r[0] not in self._complete
            ]
            where = ""
            if len(unknown) > _LISTED:
                src.execute(
                    "CREATE TEMP TABLE tl_unknown AS SELECT unnest(?::INTEGER[]) AS id", [unknown]
                )
                where = " WHERE run_id NOT IN (SELECT id FROM tl_unknown)"
            elif unknown:  # (ids, as integers: compared as literals, no join)
                where = f" WHERE run_id NOT IN ({', '.join(map(str, unknown))})"
            src.execute(
                "CREATE TEMP VIEW runs AS SELECT * REPLACE (CASE WHEN json_valid(meta) THEN "
                f"meta END AS meta) FROM (SELECT {select_list(TABLES['runs'], present['runs'])} "
                f"FROM {db}.main.runs)"
            )
            run_table_views(src, present, f"{db}.main.", where)
            yield src

    @contextmanager
    def on_file(self) -> Iterator[Callable[..., CatalogCursor]]:
        """SQL (``query(sql, params)``) on the catalog file itself while the block runs,
        the shared lock held (:meth:`_on_file`): a few runs' rows read once without
        copying them into the mirror (the explorer's first comparison of two runs)."""
        with self._on_file() as src:
            yield lambda sql, params=None: CatalogCursor(
                src.execute(sql, params or []), "cannot read the catalog", CatalogError
            )

    @contextmanager
    def _source(
        self, memory: str | None = None
    ) -> Iterator[tuple[duckdb.DuckDBPyConnection, dict[str, set[str]]]]:
        """:func:`read_source`, checking the file only if it changed since this mirror
        last did (the caller holds the lock shared: nobody changes it meanwhile)."""
        state = _file_state(self.paths)
        with read_source(self.paths, memory, check=state is None or state != self._checked) as (
            src,
            present,
        ):
            self._checked = state
            yield src, present

    def _file_arrow(
        self, sql: str, params: list[Any], error: type[TraceLakeError], limited: bool
    ) -> Any:
        """``sql``'s result on the catalog file (:meth:`_on_file`) as an Arrow table;
        ``limited``: under :data:`QUERY_LIMITS` (the user's query)."""
        what = "the query could not run" if error is not CatalogError else "cannot read the catalog"
        with self._on_file() as src:
            limits = self._limited(src, memory_set=False) if limited else contextlib.nullcontext()
            with limits, duckdb_errors(what, error):
                return src.sql(sql, params=params).to_arrow_table()

    @guarded("cannot read the catalog")
    def _op_rows(self, run_ids: list[int]) -> Any:
        """The op index's columns of these runs' ops."""
        where, params = "", []
        if set(run_ids) != self._loaded:  # (the first time: every run, no filter)
            where, params = f" WHERE run_id IN ({', '.join('?' * len(run_ids))})", run_ids
        columns = ", ".join(
            "CAST(shape AS VARCHAR) AS shape" if f == "shape" else ident(f) for f in POINT_FIELDS
        )
        return (
            self._reader().sql(f"SELECT {columns} FROM ops{where}", params=params).to_arrow_table()
        )

    def knows(self, sql: str, params: list[Any]) -> bool:
        """Whether DuckDB ran ``sql`` with parameters of these types (see ``typed``)."""
        return (sql, tuple(type(p) for p in params)) in self._prepared

    def typed(self, sql: str, params: list[Any], rows: list[tuple[Any, ...]]) -> Any:
        """``rows`` as the Arrow table ``sql`` returns with ``params``, typed by the schema
        DuckDB gave its result before; None if it has not run yet, or a value does not
        convert. For results computed without DuckDB (the op index)."""
        known = self._prepared.get((sql, tuple(type(p) for p in params)))
        if known is None:
            return None
        import pyarrow as pa

        return _typed(pa, rows, known[1])

    @guarded("cannot close the mirror of the catalog")
    def close(self) -> None:
        self.con.close()


def run_table_views(
    con: duckdb.DuckDBPyConnection, present: dict[str, set[str]], source: str, where: str
) -> None:
    """Temporary views named like the run tables, over the rows of the tables of
    ``source`` (``db.main.``) that ``where`` (`` WHERE ...`` or empty) keeps, with every
    column the catalog declares (one the source lacks: its default)."""
    for name in RUN_TABLES:
        columns = select_list(TABLES[name], present.get(name, set()))
        rows = (
            f"FROM {source}{ident(name)}{where}"
            if name in present
            else "WHERE false"  # a table declared since the source was written
        )
        con.execute(f"CREATE OR REPLACE TEMP VIEW {ident(name)} AS SELECT {columns} {rows}")


def _attach_compressed(con: duckdb.DuckDBPyConnection) -> bool:
    """Make a compressed in-memory database the connection's default (and that of its
    cursors); False where this DuckDB cannot, and the plain one stays."""
    try:
        con.execute(f"ATTACH ':memory:' AS {_MIRROR_DB} (COMPRESS)")
        con.execute(f"USE {_MIRROR_DB}")
    except duckdb.Error:
        return False
    return True


def _typed(pa: Any, rows: list[tuple[Any, ...]], schema: Any) -> Any:
    """Rows as an Arrow table of ``schema``; None where a value does not convert. Types
    ``arrow.py`` builds are built from buffers (no pandas import); others are converted
    by ``pa.array``, as one array of structs (a third of the time of one per column)."""
    from . import arrow

    try:
        if all(arrow.builds(field.type) for field in schema):
            return arrow.table(rows, schema).replace_schema_metadata(schema.metadata)
        structs = pa.array(rows, type=pa.struct(list(schema)))
        return pa.Table.from_struct_array(structs).replace_schema_metadata(schema.metadata)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
