"""A store shared by hosts: the catalog on DuckLake (its metadata in PostgreSQL, its data
files as Parquet on the object store), the runs' arrays on the same object store
(issue 15; ``docs/architecture.md``, "A shared catalog on DuckLake").

``tl.open("s3://bucket/prefix", catalog="postgresql://user@host:port/db",
storage_options={...})``. Nothing is kept on local disk; no lock is shared by writers:

- **Run ids need no shared counter**: a random id, checked unused (leases and runs) when
  the run is registered and again in its commit.
- **In-progress runs are leases**, rows of an insert-only ``leases`` table (DuckLake
  makes concurrent UPDATEs of one table conflict; inserts never do): registering a run
  inserts one, a thread of the writer inserts a renewal every third of the lease, a
  writer that gives up inserts a ``failed`` row. A run whose newest lease expired
  without a commit is *interrupted*; ``gc()`` collects it.
- **A run is visible atomically, and only once its arrays are durable**: every PUT of
  its arrays returned (so the object store holds it whole) before one DuckLake
  transaction inserts its rows and its ``runs`` row. A commit whose lease expired is
  refused (``gc()`` may have removed its objects).
- **Deletion is an insert too** (``tombstones``); a run committed again under a name
  (``overwrite=True``) shadows the older one, which then reads as deleted. ``gc()``
  deletes the rows and objects of deleted, failed and expired runs and inserts
  ``collected`` rows.
- **Readers** keep the local store's in-memory mirror and op index, keyed on the lake's
  snapshot id (``SELECT id FROM lake.current_snapshot()``).

DuckDB loads the ``ducklake``, ``postgres_scanner`` and ``httpfs`` extensions from the
files of the ``ducklake`` extra's wheels (no network); that extra pins the DuckDB they
were built for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import duckdb

from tracelake.errors import MissingExtraError, RunExistsError, StoreError

from .boundary import duckdb_errors, guarded
from .catalog import (
    COLLECTED,
    COMPLETE,
    DELETED,
    FAILED,
    INTERRUPTED,
    QUERY_LIMITS,
    RECORDING,
    CatalogMirror,
    CatalogWriter,
    StagedRun,
    _at_run_ids,
    _concat,
    _now,
    run_table_views,
    runs_row,
)
from .layout import Scratch, StorePaths
from .schema import (
    RUN_TABLES,
    TABLES,
    accept_rows,
    arrow_schema,
    create_schema,
    insert,
    present_columns,
    select_list,
)
from .store import Batch, OpenRuns, Store

__all__ = ["LEASE_SECONDS", "LakeCatalog", "LakeMirror", "LakeStore", "open_lake"]

#: How long a writer's lease lasts unless renewed (``TRACELAKE_LEASE_SECONDS`` overrides
#: it): a run whose writer died is collected this long after its last renewal. Keep it
#: far above the clock skew between hosts.
LEASE_SECONDS = 60.0
#: DuckLake retries a commit that lost a race for the next snapshot id this many times
#: (its default, 10, runs out with a handful of concurrent writers).
MAX_RETRIES = 1000
#: The lake's own tables besides the catalog's (insert-only: see the module's doc).
LAKE_DDL = {
    "leases": "run_id BIGINT, name VARCHAR, state VARCHAR, stamped TIMESTAMP, "
    "expires TIMESTAMP, host VARCHAR, pid BIGINT, error VARCHAR, info VARCHAR",
    "tombstones": "run_id BIGINT, stamped TIMESTAMP",
    "collected": "run_id BIGINT, stamped TIMESTAMP",
}
_EXTENSIONS = ("postgres_scanner", "httpfs", "ducklake")
#: A DuckLake store's local scratch directories (its mirror of the catalog, its runs
#: before they are uploaded): ``layout.Scratch``, so a killed process's is removed by the
#: next one made.
SCRATCH_PREFIX = "tracelake-lake-"
_LAKE = "lake"
#: Ids are drawn from here: at least 2**30 (above any local store's), within the
#: catalog's 32-bit id columns.
_ID_LOW, _ID_HIGH = 1 << 30, (1 << 31) - 1


def lease_seconds() -> float:
    return float(os.environ.get("TRACELAKE_LEASE_SECONDS", LEASE_SECONDS))


def _libpq(url: str) -> str:
    """``postgresql://user:password@host:port/db`` as libpq's ``key=value`` string."""
    parts = urlsplit(url)
    keys = {
        "host": parts.hostname,
        "port": parts.port,
        "user": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "dbname": parts.path.lstrip("/") or None,
    }
    return " ".join(f"{k}={v}" for k, v in keys.items() if v is not None)


def _extension_file(name: str) -> str:
    """The extension's file inside its wheel's package (``duckdb_extension_<name>``)."""
    package = f"duckdb_extension_{name}"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("a catalog on DuckLake", "ducklake", package)
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.glob(f"extensions/v{duckdb.__version__}/{name}.duckdb_extension"))
    if not found:
        raise MissingExtraError(
            f"a catalog on DuckLake (DuckDB {duckdb.__version__}: {package} has no build for it)",
            "ducklake",
            package,
        )
    return str(found[0])


def _s3_secret(url: str, options: Mapping[str, Any]) -> str:
    """DuckDB's S3 secret from obstore's ``storage_options`` (or the AWS_* environment)."""
    env = os.environ
    key = options.get("access_key_id", env.get("AWS_ACCESS_KEY_ID"))
    secret = options.get("secret_access_key", env.get("AWS_SECRET_ACCESS_KEY"))
    token = options.get("session_token", options.get("token", env.get("AWS_SESSION_TOKEN")))
    region = options.get("region", env.get("AWS_REGION", env.get("AWS_DEFAULT_REGION")))
    endpoint = options.get("endpoint", options.get("endpoint_url", env.get("AWS_ENDPOINT_URL")))
    items: dict[str, Any] = {"KEY_ID": key, "SECRET": secret, "SESSION_TOKEN": token}
    items["REGION"] = region
    if endpoint:
        split = urlsplit(str(endpoint))
        items["ENDPOINT"] = split.netloc or split.path
        items["URL_STYLE"] = "path"
        items["USE_SSL"] = split.scheme != "http"
    scope = url.rstrip("/") + "/"

    def literal(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else "'" + str(v).replace("'", "''") + "'"

    body = ", ".join(f"{k} {literal(v)}" for k, v in items.items() if v is not None)
    return f"CREATE OR REPLACE SECRET tl_lake_s3 (TYPE s3, {body}, SCOPE {literal(scope)})"


def open_lake(url: str, catalog: str, options: Mapping[str, Any]) -> duckdb.DuckDBPyConnection:
    """A DuckDB (in memory) with the lake attached as ``lake`` and in use: catalog
    ``catalog`` (PostgreSQL), data files under ``url``/catalog/."""
    files = [_extension_file(name) for name in _EXTENSIONS]
    con = duckdb.connect(
        ":memory:",
        config={"autoinstall_known_extensions": False, "autoload_known_extensions": False},
    )
    try:
        for path in files:
            con.execute(f"LOAD '{path}'")
        con.execute(_s3_secret(url, options))
        con.execute(f"SET ducklake_max_retry_count = {MAX_RETRIES}")
        con.execute("SET ducklake_retry_wait_ms = 20")
        con.execute("SET ducklake_retry_backoff = 1.2")
        con.execute("SET threads = 2")
        con.execute("SET enable_progress_bar = false")
        data = url.rstrip("/") + "/catalog/"
        con.execute(f"ATTACH 'ducklake:postgres:{_libpq(catalog)}' AS {_LAKE} (DATA_PATH '{data}')")
        con.execute(f"USE {_LAKE}")
        accept_rows(con)
    except BaseException:
        con.close()
        raise
    return con


def _described(url: str, catalog: str) -> Any:
    """What the catalog's errors call it (``boundary.guarded`` reads ``paths.catalog``):
    the lake's URLs without a password."""
    parts = urlsplit(catalog)
    where = f"{parts.hostname}:{parts.port}{parts.path}"
    return SimpleNamespace(catalog=f"(the DuckLake of {url} in postgresql://{where})")


#: The runs as the lake holds them, every status derived from the insert-only tables:
#: committed runs (complete; deleted when tombstoned or shadowed by a later commit of
#: the name; collected), and runs that never committed, from their leases (recording
#: while a lease is current, else interrupted; failed; collected).
_RUNS_SQL = """
WITH shadow AS (
  SELECT id, row_number() OVER (PARTITION BY name ORDER BY seq DESC) > 1 AS shadowed FROM runs
  WHERE id NOT IN (SELECT run_id FROM tombstones)
)
SELECT {columns} FROM (
  SELECT r.* REPLACE (CASE
    WHEN r.id IN (SELECT run_id FROM collected) THEN '{collected}'
    WHEN r.id IN (SELECT run_id FROM tombstones) THEN '{deleted}'
    WHEN (SELECT shadowed FROM shadow s WHERE s.id = r.id) THEN '{deleted}'
    ELSE r.status END AS status)
  FROM runs r
  {leases}
)
"""
_LEASE_RUNS = """
  UNION ALL BY NAME
  SELECT run_id AS id, arg_min(name, stamped) AS name,
    CASE WHEN run_id IN (SELECT run_id FROM collected) THEN '{collected}'
      WHEN bool_or(state = '{failed}') THEN '{failed}'
      WHEN max(expires) > TIMESTAMP '{now}' THEN '{recording}' ELSE '{interrupted}' END AS status,
    min(stamped) AS created, max(CASE WHEN state = '{failed}' THEN stamped END) AS finished,
    0 AS steps, 0 AS op_count, 0 AS bytes,
    arg_min(json_extract_string(info, '$.model_class'), stamped) AS model_class,
    arg_min(json_extract_string(info, '$.torch_version'), stamped) AS torch_version,
    arg_min(json_extract(info, '$.meta')::VARCHAR, stamped) AS meta,
    arg_min(host, stamped) AS host, arg_min(pid, stamped)::INTEGER AS pid,
    max(error) AS error, NULL::BIGINT AS seq
  FROM leases WHERE run_id NOT IN (SELECT id FROM runs) GROUP BY run_id
"""
_STATUSES = {
    "collected": COLLECTED,
    "deleted": DELETED,
    "failed": FAILED,
    "recording": RECORDING,
    "interrupted": INTERRUPTED,
}


def runs_sql(present: dict[str, set[str]], leases: bool) -> str:
    """Every run's ``runs`` row, statuses derived (``leases``: the runs never committed
    too, a lease current as of now)."""
    columns = select_list(TABLES["runs"], present["runs"])
    extra = _LEASE_RUNS.format(now=_now().isoformat(sep=" "), **_STATUSES) if leases else ""
    return _RUNS_SQL.format(columns=columns, leases=extra, **_STATUSES)


#: What registering a run asks (``LakeCatalog.reserve``), in one statement: whether
#: its name is a complete run's (the newest commit of a name not deleted nor collected:
#: ``_complete``), whether a live writer records one of that name (a lease current and
#: recording, no ``runs`` row yet), and whether the id drawn is used by a run or a lease.
_RESERVE_SQL = """
SELECT
  (SELECT count(*) FROM runs WHERE name = ? AND id NOT IN (SELECT run_id FROM tombstones)
     AND id NOT IN (SELECT run_id FROM collected)),
  (SELECT count(*) FROM (SELECT run_id FROM leases WHERE name = ?
     AND run_id NOT IN (SELECT id FROM runs) GROUP BY run_id
     HAVING max(expires) > ? AND bool_and(state = ?))),
  (SELECT count(*) FROM runs WHERE id = ?) + (SELECT count(*) FROM leases WHERE run_id = ?)
"""


class Lease:
    """Registered runs' leases: renewed together, in one transaction, by a thread of
    their own until ``close()``; a run's own, or a batch's runs' (each :meth:`add`-ed
    as it begins and :meth:`drop`-ped once committed or failed)."""

    def __init__(self, catalog: LakeCatalog, run_id: int, name: str):
        self._catalog = catalog
        self._runs = {run_id: name}
        self._runs_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="tracelake-lease", daemon=True)
        self._thread.start()

    def add(self, run_id: int, name: str) -> None:
        with self._runs_lock:
            self._runs[run_id] = name

    def drop(self, run_id: int) -> None:
        with self._runs_lock:
            self._runs.pop(run_id, None)

    def _renew(self) -> None:
        period = lease_seconds() / 3
        while not self._stop.wait(period):
            with self._runs_lock:
                runs = list(self._runs.items())
            with contextlib.suppress(Exception):  # the next renewal, or the commit, says
                self._catalog._renew(runs)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class _Member:
    """A batch's run's share of the batch's :class:`Lease`: closing it (the run
    committed or failed) stops renewing that run's lease alone."""

    def __init__(self, lease: Lease, run_id: int):
        self._lease, self._run_id = lease, run_id

    def close(self) -> None:
        self._lease.drop(self._run_id)


class LakeCatalog(CatalogWriter):
    """The writers' side of a DuckLake catalog: the same operations as the local
    catalog's :class:`CatalogWriter`, each one DuckLake transaction of inserts; a run
    is registered first (:meth:`reserve`, with a lease), then committed."""

    stages_runs = False

    def __init__(self, url: str, catalog: str, options: Mapping[str, Any]):
        self.url, self._catalog_url, self._options = url, catalog, dict(options)
        self._lock = threading.Lock()
        self._con: tuple[int, duckdb.DuckDBPyConnection] | None = None
        self._schema = False
        self._reserved: dict[int, dict[str, Any]] = {}
        #: What errors name (``guarded``): the lake, without its credentials.
        self.paths = _described(url, catalog)  # type: ignore[assignment]

    def connection(self) -> duckdb.DuckDBPyConnection:
        pid = os.getpid()
        if self._con is None or self._con[0] != pid:  # (a forked child makes its own)
            self._con = (pid, open_lake(self.url, self._catalog_url, self._options))
            self._schema = False
        return self._con[1]

    @contextlib.contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            con = self.connection()
            if not self._schema:
                ensure_schema(con)
                self._schema = True
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(duckdb.Error):
                    con.execute("ROLLBACK")
                raise

    def _lease(self, run_id: int, name: str, state: str, error: str | None = None) -> None:
        """Insert a lease row (the run's end: ``failed``)."""
        with self.transaction() as con:
            self._insert_lease(con, run_id, name, state, error)

    def _renew(self, runs: list[tuple[int, str]]) -> None:
        """Renew the leases of ``runs`` (id, name), in one transaction."""
        if runs:
            with self.transaction() as con:
                for run_id, name in runs:
                    self._insert_lease(con, run_id, name, RECORDING)

    @staticmethod
    def _insert_lease(
        con: duckdb.DuckDBPyConnection,
        run_id: int,
        name: str,
        state: str,
        error: str | None = None,
        info: Any = None,
    ) -> None:
        now = _now()
        con.execute(
            "INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                run_id,
                name,
                state,
                now,
                now + timedelta(seconds=lease_seconds()),
                socket.gethostname(),
                os.getpid(),
                error,
                json.dumps(info) if info is not None else None,
            ],
        )

    def _complete(self, con: duckdb.DuckDBPyConnection, name: str) -> list[int]:
        """The complete run named ``name`` (the newest commit of the name not deleted
        nor collected; older ones are shadowed), as a list of none or one id."""
        row = con.execute(
            "SELECT id FROM runs WHERE name = ? AND id NOT IN (SELECT run_id FROM tombstones) "
            "AND id NOT IN (SELECT run_id FROM collected) ORDER BY seq DESC LIMIT 1",
            [name],
        ).fetchone()
        return [] if row is None else [int(row[0])]

    @guarded("cannot register the run in the catalog")
    def reserve(
        self, name: str, overwrite: bool, info: dict[str, Any], lease: Lease | None = None
    ) -> tuple[int, Lease]:
        """Register a run: a new random id, unused by any run or lease, and its first
        lease (renewed until the run commits or fails), in one transaction; return the
        id and its :class:`Lease` (``lease``'s, where given: a batch's, which renews it
        from now on)."""
        created = _now()
        meta = {k: info.get(k) for k in ("model_class", "torch_version", "meta")}
        with self.transaction() as con:
            while True:  # (one statement a try: each costs the lake's round trips)
                run_id = _ID_LOW + secrets.randbelow(_ID_HIGH - _ID_LOW)
                ((clash, live, used),) = con.execute(
                    _RESERVE_SQL, [name, name, created, RECORDING, run_id, run_id]
                ).fetchall()
                if (clash or live) and not overwrite:
                    what = COMPLETE if clash else RECORDING
                    raise RunExistsError(
                        f"the store already has a run named {name!r} ({what}); choose "
                        "another name, or pass overwrite=True to replace it"
                    )
                if not used:
                    break
            self._insert_lease(con, run_id, name, RECORDING, info=meta)
        self._reserved[run_id] = {**meta, "created": created}
        if lease is None:
            return run_id, Lease(self, run_id, name)
        lease.add(run_id, name)
        return run_id, lease

    @guarded("cannot commit the run to the catalog")
    def commit(
        self,
        run_id: int,
        name: str,
        overwrite: bool,
        tables: dict[str, Any],
        summary: dict[str, Any],
    ) -> dict[str, Any]:
        """Insert the run's rows and its ``runs`` row in one transaction."""
        staged = StagedRun(Path(str(run_id)), name, overwrite, _now(), {}, tables, summary)
        return self._commit_runs([staged])[0]

    @guarded("cannot commit the batch's runs to the catalog")
    def commit_batch(
        self,
        runs: list[StagedRun],
        built: Sequence[dict[str, Any]] = (),
        durable: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Insert the rows of a batch's registered runs (each ``staged`` directory is
        named by its id) and their ``runs`` rows in one transaction: one data file a
        table for the batch, not one a run. ``built``: tables of several of the runs at
        once, whose ``run_id`` holds each row's run's position in ``runs``. ``durable``
        (as ``CatalogWriter.commit_batch``'s): waited for first."""
        if durable is not None:
            durable()
        return self._commit_runs(runs, built)

    def _commit_runs(
        self, runs: list[StagedRun], built: Sequence[dict[str, Any]] = ()
    ) -> list[dict[str, Any]]:
        from . import arrow

        ids = [int(run.staged.name) for run in runs]
        infos = [self._reserved.pop(run_id, {}) for run_id in ids]
        incoming: dict[str, list[Any]] = {table: [] for table in RUN_TABLES}
        for run in runs:
            for table, data in run.tables.items():
                if data is not None and data.num_rows:
                    incoming[table].append(data)
        for tables in built:
            for table, data in tables.items():
                if data is not None and data.num_rows:
                    incoming[table].append(_at_run_ids(data, ids))
        with self.transaction() as con:
            self._check_commits(con, runs, ids)
            for table, parts in incoming.items():
                if parts:
                    insert(con, table, _concat(parts))
            first = time.time_ns() // 1000
            rows = [
                self._runs_row(run, run_id, info, first + k)
                for k, (run, run_id, info) in enumerate(zip(runs, ids, infos, strict=True))
            ]
            insert(con, "runs", arrow.table(rows, arrow_schema(TABLES["runs"])))
        return rows

    def _check_commits(
        self, con: duckdb.DuckDBPyConnection, runs: list[StagedRun], ids: list[int]
    ) -> None:
        """That the registered runs (``ids``) may commit now, with three queries however
        many they are: no name taken since they began (unless ``overwrite``; a name twice
        in the batch, only with ``overwrite`` on the later), and each one's lease its own
        and healthy."""
        names = sorted({run.name for run in runs})
        taken_names = {
            name
            for (name,) in con.execute(
                "SELECT DISTINCT name FROM runs WHERE name IN (SELECT unnest(?::VARCHAR[])) "
                "AND id NOT IN (SELECT run_id FROM tombstones) "
                "AND id NOT IN (SELECT run_id FROM collected)",
                [names],
            ).fetchall()
        }
        # a healthy writer renewed within the last third of the lease: one with less
        # than a third left stalled, and gc() may be about to judge it dead
        margin = _now() + timedelta(seconds=lease_seconds() / 3)
        leases = {
            int(run_id): (int(n), int(ended), bool(healthy))
            for run_id, n, ended, healthy in con.execute(
                "SELECT run_id, count(*), count(*) FILTER (WHERE state != ?), "
                "coalesce(max(expires) > ?, false) FROM leases "
                "WHERE run_id IN (SELECT unnest(?::BIGINT[])) GROUP BY run_id",
                [RECORDING, margin, ids],
            ).fetchall()
        }
        committed = {
            int(i)
            for (i,) in con.execute(
                "SELECT id FROM runs WHERE id IN (SELECT unnest(?::BIGINT[]))", [ids]
            ).fetchall()
        }
        named: set[str] = set()
        for run, run_id in zip(runs, ids, strict=True):
            if run.name in named and not run.overwrite:
                raise RunExistsError(
                    f"this batch recorded two runs named {run.name!r}; pass "
                    "overwrite=True to the later to replace the earlier"
                )
            if run.name in taken_names and run.name not in named and not run.overwrite:
                raise RunExistsError(
                    f"a run named {run.name!r} was committed while this one was recording; "
                    "pass overwrite=True to replace it"
                )
            named.add(run.name)
            n, ended, healthy = leases.get(run_id, (0, 0, False))
            if not n or ended or run_id in committed:
                raise StoreError(
                    f"run {run.name!r} (id {run_id}) has no lease of its own to commit"
                )
            if not healthy:
                raise StoreError(
                    f"run {run.name!r}'s lease expired before its commit (its writer "
                    f"stalled for over {lease_seconds():g} s), so gc() may have removed "
                    "its arrays: record it again"
                )

    @staticmethod
    def _runs_row(run: StagedRun, run_id: int, info: dict[str, Any], seq: int) -> dict[str, Any]:
        """The ``runs`` row of a committed run (``info``: what its registration kept)."""
        return runs_row(run, run_id, seq, _now(), info, info.get("created", _now()))

    def fold(self) -> None:
        """(A DuckLake catalog seals no runs: each commits in a transaction of its own.)"""

    @guarded("cannot change the run's status in the catalog")
    def set_status(self, run_id: int, status: str, error: str | None = None) -> None:
        self._reserved.pop(run_id, None)
        self._lease(run_id, "", status, error)  # (the name: the first lease's)

    @guarded("cannot delete the run from the catalog")
    def delete(self, name: str) -> int:
        with self.transaction() as con:
            found = self._complete(con, name)
            if not found:
                return -1
            con.execute("INSERT INTO tombstones VALUES (?, ?)", [found[0], _now()])
            return found[0]

    @guarded("cannot collect runs in the catalog")
    def dead(self) -> list[int]:
        """The runs ``gc()`` may collect: deleted, failed and interrupted ones."""
        with self.transaction() as con:
            rows = con.execute(
                f"SELECT id FROM ({runs_sql(present_columns(con), True)}) "
                "WHERE status IN (?, ?, ?)",
                [DELETED, FAILED, INTERRUPTED],
            ).fetchall()
        return sorted(int(r[0]) for r in rows)

    @guarded("cannot collect runs in the catalog")
    def forget(self, dead: list[int]) -> None:
        """Delete the rows of ``dead`` runs (their objects are gone) and mark them
        collected, in one transaction."""
        from .schema import RUN_TABLES

        if not dead:
            return
        marks = ", ".join("?" * len(dead))
        now = _now()
        with self.transaction() as con:
            present = present_columns(con)
            for table in RUN_TABLES:
                if table in present:
                    con.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", dead)
            con.executemany("INSERT INTO collected VALUES (?, ?)", [[i, now] for i in dead])

    @guarded("cannot read the catalog")
    def rows(self, where: str, params: list[Any]) -> list[dict[str, Any]]:
        """``runs`` rows of every status (``where``: a condition on them), oldest first."""
        with self.transaction() as con:
            cursor = con.execute(
                f"SELECT * FROM ({runs_sql(present_columns(con), True)}) WHERE {where} "
                "ORDER BY created, id",
                params,
            )
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self) -> None:
        if self._con is not None and self._con[0] == os.getpid():
            with contextlib.suppress(duckdb.Error):
                self._con[1].close()
        self._con = None


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """The catalog's tables and the lake's own, where missing (a new lake)."""
    present = present_columns(con)
    missing = [t for t in TABLES if t not in present] + [t for t in LAKE_DDL if t not in present]
    if not missing and all(set(f.name for f in TABLES[t].columns) <= present[t] for t in TABLES):
        return
    con.execute("BEGIN TRANSACTION")
    try:
        create_schema(con)
        for table, columns in LAKE_DDL.items():
            if table not in present:
                con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
        con.execute("COMMIT")
    except duckdb.TransactionException:  # another writer created them meanwhile
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise


class _SnapshotToken:
    """The lake's change token: its current snapshot id."""

    def __init__(self, mirror: LakeMirror):
        self._mirror = mirror

    def token(self) -> str | None:
        row = self._mirror.lake().execute(f"SELECT id FROM {_LAKE}.current_snapshot()").fetchone()
        return None if row is None else str(row[0])

    def bump(self) -> None:  # (writers' commits move it)
        pass


class LakeMirror(CatalogMirror):
    """A reader's mirror of a DuckLake catalog: the local mirror, refreshed from the lake
    when its snapshot id moved."""

    def __init__(self, url: str, catalog: str, options: Mapping[str, Any]):
        self._scratch = Scratch(SCRATCH_PREFIX)
        super().__init__(StorePaths(self._scratch.name))
        self._args = (url, catalog, dict(options))
        self.paths = _described(url, catalog)
        self._lake: duckdb.DuckDBPyConnection | None = None
        self._lake_lock = threading.RLock()
        #: The lake's connection, the cursor with the views of ``_on_file`` and the
        #: snapshot they were made for.
        self._views: tuple[Any, duckdb.DuckDBPyConnection, str | None] | None = None
        self.changes = _SnapshotToken(self)

    def lake(self) -> duckdb.DuckDBPyConnection:
        if self._lake is None:
            self._lake = open_lake(*self._args)
            ensure_schema(self._lake)
        return self._lake

    #: Past ``MIRROR_OPS`` ops, queries over every run read the lake itself
    #: (:meth:`_on_file`), as a local store's read its file; ``store.sql`` does not
    #: (external access is on where the lake is attached): it copies the rows.
    sql_on_file = False

    @contextlib.contextmanager
    def _refresh_source(self) -> Iterator[tuple[duckdb.DuckDBPyConnection, dict[str, set[str]]]]:
        with self._lake_lock:
            con = self.lake()
            con.execute("BEGIN TRANSACTION")  # one snapshot for the token and the rows
            try:
                yield con, present_columns(con)
            finally:
                with contextlib.suppress(duckdb.Error):
                    con.execute("ROLLBACK")

    def _token(self) -> str | None:
        with self._lake_lock:
            return self.changes.token()

    def _made(self) -> bool:
        return True  # (the lake's catalog is made with the store)

    def _runs_sql(self, present: dict[str, set[str]]) -> str:
        return runs_sql(present, False)

    def _runs_where(self, run_ids: list[int]) -> tuple[str, list[Any]]:
        # the ids as literals (integers from the lake's own rows): DuckLake prunes files
        # by them, where a parameter list made it read each file's rows 30x slower
        return f"run_id IN ({', '.join(str(int(i)) for i in run_ids)})", []

    @contextlib.contextmanager
    def _on_file(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The lake itself, for a query over every run of a catalog too large to mirror:
        a cursor of the lake's DuckDB whose temporary views, named like the catalog's
        tables, hold the rows of the complete runs the mirror knows (the lake's Parquet
        files hold deleted runs' rows too, until ``gc()``, and never a partial run's) and
        ``runs`` as the mirror reads it. DuckDB reads only the columns a query needs, and
        keeps what it read from the object store in its cache for the next query."""
        with duckdb_errors("cannot read the catalog"), self._lake_lock:
            con = self.lake()
            memory = QUERY_LIMITS.memory
            con.execute(f"SET memory_limit = '{memory}'" if memory else "RESET memory_limit")
            if self._views is None or self._views[0] is not con:
                self._views = (con, con.cursor(), None)
            cursor, made = self._views[1], self._views[2]
            if made != self._gen:
                present = present_columns(con)
                # ``runs`` as the mirror holds it (a table: no query reads the lake's three)
                cursor.register(
                    "tl_runs", self._reader().sql("SELECT * FROM runs").to_arrow_table()
                )
                cursor.execute("CREATE OR REPLACE TEMP TABLE runs AS SELECT * FROM tl_runs")
                cursor.unregister("tl_runs")
                ids = ", ".join(str(int(i)) for i in sorted(self._complete)) or "NULL"
                run_table_views(cursor, present, f"{_LAKE}.main.", f" WHERE run_id IN ({ids})")
                self._views = (con, cursor, self._gen)
            yield cursor

    def close(self) -> None:
        self._views = None
        if self._lake is not None:
            with contextlib.suppress(duckdb.Error):
                self._lake.close()
            self._lake = None
        super().close()
        self._scratch.cleanup()


class LakeBatch(Batch):
    """``store.batch()`` on a DuckLake catalog. Each run registers as it begins (an id
    and a lease, as a run on its own: ``LakeCatalog.reserve``), one thread renewing the
    leases of all the batch's runs; its arrays go to the object store as it records
    (durable as each write returns); the batch commits every run's rows in one DuckLake
    transaction: one data file a table for the batch, where runs on their own make one
    a run each. A crash before that commit loses the open batch's runs, whose leases
    then expire and ``gc()`` removes their arrays, as a lone run's."""

    def __init__(self, store: Store):
        super().__init__(store)
        self._lease: Lease | None = None

    def reserve(self, name: str, overwrite: bool, info: dict[str, Any]) -> tuple[int, Any]:
        self._refuse_taken(name, overwrite)  # (the lake's complete runs: reserve checks)
        catalog = cast(LakeCatalog, self.store._catalog)
        run_id, lease = catalog.reserve(name, overwrite, info, self._lease)
        self._lease = lease
        self._names.add(name)
        return run_id, _Member(lease, run_id)

    def _begin_durable(self, runs: list[StagedRun]) -> tuple[list[int], Callable[[], None] | None]:
        # every PUT was durable when it returned: nothing to wait for
        return [self.store._durable(run.staged) for run in runs], None

    def _let_go(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()


class LakeStore(Store):
    """A store whose catalog is a DuckLake and whose arrays are objects under the same
    URL (``URL/runs/<id>/``, the local store's Zarr v3 layout): the local store's API,
    with the catalog's operations on the lake and no files of its own on local disk
    (runs register with an empty scratch directory, made and removed by this process)."""

    _batch_class = LakeBatch

    def __init__(
        self,
        url: str,
        catalog: str,
        storage_options: Mapping[str, Any] | None,
        create: bool = True,
    ):
        from .objstore import is_url
        from .remote import RemoteArrays

        if not is_url(url):
            raise StoreError(f"{url!r} is not an object-store URL (s3://bucket/prefix)")
        self.url = url.rstrip("/")
        options = dict(storage_options or {})
        self._scratch = Scratch(SCRATCH_PREFIX)
        self.paths = StorePaths(self._scratch.name)
        self.paths.runs.mkdir()
        self._args = (self.url, catalog, options)
        self._catalog: LakeCatalog = LakeCatalog(*self._args)  # type: ignore[assignment]
        self._mirror: CatalogMirror | None = None
        self._open_arrays = OpenRuns()
        self._batch = None
        self._remote = RemoteArrays(self.url, options)
        for name in _EXTENSIONS:  # (the extra's missing: said at once)
            _extension_file(name)
        if not create:
            with self._catalog._lock:
                if not present_columns(self._catalog.connection()).get("runs"):
                    where = self._catalog.paths.catalog
                    raise StoreError(f"no tracelake store in {where} (create=True makes one)")

    def _objects(self, run_id: int) -> Any:
        assert self._remote is not None
        return self._remote.backend(f"runs/{run_id}")

    def _arrays_at(self, run_dir: Path, new: bool = False) -> Any:
        if new:
            run_dir.mkdir(parents=True, exist_ok=True)
        return self._objects(int(run_dir.name))

    def _durable(self, run_dir: Path) -> int:
        # every PUT was durable when it returned: what is left is their size
        return int(self._objects(int(run_dir.name)).commit())

    def _begin_durable(self, run_dir: Path) -> tuple[int, Callable[[], None] | None]:
        return self._durable(run_dir), None

    @property
    def path(self) -> str:
        return self.url

    @property
    def catalog(self) -> CatalogMirror:
        if self._mirror is None:
            self._mirror = LakeMirror(*self._args)
        return self._mirror

    def arrays(self, run_id: int, name: str | None = None, created: Any = None) -> Any:
        from .tensors import RunArrays

        return self._open_arrays.get(
            run_id,
            lambda: RunArrays(
                self._objects(run_id), name or str(run_id), flat=self.paths.flat_chunks
            ),
        )

    def _listed(self, all: bool) -> list[dict[str, Any]]:
        where = "status = ?" if not all else "status != ?"
        return self._catalog.rows(where, [COMPLETE if not all else COLLECTED])

    def gc(self, progress: bool | None = None) -> dict[str, int]:
        """Collect deleted, failed and interrupted (lease expired) runs: their objects
        first, then their rows (one transaction). A ``gc()`` killed between the two is
        finished by the next one."""
        dead = self._catalog.dead()
        freed = 0
        for run_id in dead:
            objects = self._objects(run_id)
            freed += int(objects.commit())
            objects.delete_prefix("")
        self._catalog.forget(dead)
        return {"runs": len(dead), "orphans": 0, "bytes": freed}

    def verify(self, tensors: bool = True, progress: bool | None = None) -> Any:
        """Check every complete run's arrays (``tensors=False``: only that each exists)."""
        from .verify import Problem, VerifyReport, tensor_rows, verify_run

        report = VerifyReport()
        cursor = self._query("SELECT * FROM runs WHERE status = ? ORDER BY id", [COMPLETE], ())
        names = [d[0] for d in cursor.description]
        infos = [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]
        pairs = tensor_rows(self._query, infos) if tensors else ((i, []) for i in infos)
        for info, tensor_list in pairs:
            if not tensors:
                report.runs += 1
                if not self._objects(info["id"]).exists("zarr.json"):
                    report.problems.append(
                        Problem(info["name"], "-", "the run's arrays are missing")
                    )
                continue
            verify_run(self._open_run(info), tensor_list, report)
        return report

    def close(self) -> None:
        super().close()
        self._catalog.close()
