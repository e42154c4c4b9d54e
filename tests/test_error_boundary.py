"""No DuckDB (or filesystem) exception crosses a public call: each becomes a
``TraceLakeError`` at one boundary, with the original as its ``__cause__``, and the store
works normally afterwards.

Failures are injected by wrapping every DuckDB connection tracelake makes: a statement
whose text matches raises ``duckdb.IOException``, as a disk gone bad would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from model_zoo import BUILDERS

import tracelake as tl
from tracelake.cli import main
from tracelake.store import boundary, catalog

INJECTED = "injected: the disk went away"


class Faults:
    """Which statements fail: any whose SQL contains ``match`` while ``on``."""

    def __init__(self) -> None:
        self.match: str | None = None
        self.on = False
        self.hits = 0

    def check(self, sql: Any) -> None:
        text = str(getattr(sql, "query", sql))
        if self.on and self.match is not None and self.match in text:
            self.hits += 1
            raise duckdb.IOException(INJECTED)


class Faulty:
    """A DuckDB connection (or cursor) whose statements may fail."""

    def __init__(self, con: Any, faults: Faults):
        self._con = con
        self._faults = faults

    def execute(self, sql: Any, *args: Any, **kwargs: Any) -> Faulty:
        self._faults.check(sql)
        self._con.execute(sql, *args, **kwargs)
        return self

    def sql(self, sql: Any, *args: Any, **kwargs: Any) -> Any:
        self._faults.check(sql)
        return self._con.sql(sql, *args, **kwargs)

    def cursor(self) -> Faulty:
        return Faulty(self._con.cursor(), self._faults)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    """Every DuckDB connection made from now on is :class:`Faulty` (the writers' engine
    is made afresh for it, and put back afterwards)."""
    state = Faults()
    connect = duckdb.connect
    monkeypatch.setattr(duckdb, "connect", lambda *a, **k: Faulty(connect(*a, **k), state))
    monkeypatch.setattr(catalog, "_ENGINE", catalog._Engine())
    yield state
    catalog._ENGINE.reset()


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A store with one run, ``a``, recorded before any fault is injected."""
    model, inputs = BUILDERS["mlp"]()
    root = tmp_path / "s"
    with tl.open(root) as store:  # (closed: its fold makes the catalog file)
        store.record(model, *inputs, name="a")
    return root, model, inputs


def _record(store: tl.Store, model: Any, inputs: Any) -> Any:
    return store.record(model, *inputs, name="b")


def _recording(store: tl.Store, model: Any, inputs: Any) -> Any:
    with store.recording("b", model):
        model(*inputs)


def _record_then_flush(store: tl.Store, model: Any, inputs: Any) -> Any:
    _record(store, model, inputs)
    store.flush()


def _recording_then_flush(store: tl.Store, model: Any, inputs: Any) -> Any:
    _recording(store, model, inputs)
    store.flush()


def _read_run(store: tl.Store, model: Any, inputs: Any) -> Any:
    return store["a"]["relu_1_2"].out


#: (entry point, the statement that fails, what is done, the error expected)
CASES: list[tuple[str, str, Callable[[tl.Store, Any, Any], Any], type[Exception]]] = [
    # a new store object's first run reads the complete runs' names (then knows them)
    ("record: names", "SELECT name FROM runs WHERE status", _record, tl.CatalogError),
    # a run is sealed without DuckDB; the transaction that inserts its rows (its fold)
    ("record: fold", 'INSERT INTO "runs"', _record_then_flush, tl.CatalogError),
    ("recording: fold", 'INSERT INTO "calls"', _recording_then_flush, tl.CatalogError),
    ("runs", '"seq" FROM runs', lambda s, m, x: s.runs(), tl.CatalogError),
    (
        "runs all",
        "FROM runs) WHERE status != ?",  # listing runs reads the catalog file itself
        lambda s, m, x: s.runs(all=True),
        tl.CatalogError,
    ),
    ("len", "SELECT count(*) FROM runs", lambda s, m, x: len(s), tl.CatalogError),
    ("in", "SELECT * FROM runs WHERE name", lambda s, m, x: "a" in s, tl.CatalogError),
    ("[name]", "SELECT * FROM runs WHERE name", lambda s, m, x: s["a"], tl.CatalogError),
    ("iter", "FROM runs) WHERE status = ?", lambda s, m, x: list(s), tl.CatalogError),
    ("delete", "UPDATE runs SET status = ?, seq", lambda s, m, x: s.delete("a"), tl.CatalogError),
    ("gc: collect", "WHERE status NOT IN", lambda s, m, x: s.gc(), tl.CatalogError),
    ("gc: orphans", "FROM runs) WHERE status != ?", lambda s, m, x: s.gc(), tl.CatalogError),
    ("verify", "LEFT JOIN ops", lambda s, m, x: s.verify(), tl.CatalogError),
    ("run reads", "FROM ops", _read_run, tl.CatalogError),
    ("run tensors", "FROM tensors", _read_run, tl.CatalogError),
    # reading the catalog fails under a query: the catalog's error
    (
        "query: catalog",
        '"seq" FROM runs',  # the mirror's refresh reading the runs table
        lambda s, m, x: s.query("select label from ops"),
        tl.CatalogError,
    ),
    # the query's own statement fails: the query's error
    (
        "query: statement",
        '"func" = ',
        lambda s, m, x: s.query("select label from ops where func = 'relu'"),
        tl.QueryError,
    ),
    ("sql: catalog", '"seq" FROM runs', lambda s, m, x: s.sql("select 1"), tl.CatalogError),
    (
        "sql: statement",
        "the_users_own",
        lambda s, m, x: s.sql("select label as the_users_own from ops"),
        tl.QueryError,
    ),
]


@pytest.mark.parametrize(("what", "match", "action", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_duckdb_failure_becomes_a_tracelake_error(
    faults: Faults,
    recorded: tuple[Path, torch.nn.Module, tuple[torch.Tensor, ...]],
    what: str,
    match: str,
    action: Callable[[tl.Store, Any, Any], Any],
    expected: type[Exception],
) -> None:
    root, model, inputs = recorded
    store = tl.open(root)
    faults.match, faults.on = match, True
    with pytest.raises(tl.TraceLakeError) as caught:
        action(store, model, inputs)
    assert faults.hits, f"{what}: the fault never fired ({match!r})"
    assert type(caught.value) is expected, caught.value
    assert isinstance(caught.value.__cause__, duckdb.Error)
    assert INJECTED in str(caught.value)
    faults.on = False
    _works_normally(store, model, inputs)
    _works_normally(tl.open(root), model, inputs)


def _works_normally(store: tl.Store, model: torch.nn.Module, inputs: Any) -> None:
    """The run recorded before is intact, and the store takes and serves new ones."""
    expected = tl.trace(model, *inputs)
    assert "a" in store
    assert torch.equal(store["a"]["relu_1_2"].out, expected["relu_1_2"].out)
    run = store.record(model, *inputs, name="c", overwrite=True)
    assert torch.equal(run["relu_1_2"].out, expected["relu_1_2"].out)
    assert {"a", "c"} <= set(store.runs()["name"])
    assert len(store.query("select label from ops where run = 'c'")) == len(expected)
    assert store.verify().ok


def test_a_failed_transaction_rolls_back(
    faults: Faults, recorded: tuple[Path, torch.nn.Module, tuple[torch.Tensor, ...]]
) -> None:
    """A transaction that failed after some of a sealed run's rows were inserted leaves
    none of them, and the run loses nothing: it is still sealed, complete, and the next
    transaction inserts all its rows. A ``record`` whose own fold fails returns its run
    (sealed, complete) with a warning."""
    root, model, inputs = recorded
    store = tl.open(root)
    store.record(model, *inputs, name="b")  # (sealed)
    faults.match, faults.on = 'INSERT INTO "calls"', True  # (the runs' last rows)
    with pytest.raises(tl.CatalogError):
        store.flush()
    with (
        pytest.warns(tl.TraceLakeWarning, match="could not be added"),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr("tracelake.store.store.FOLD_AFTER", 1)
        run = store.record(model, *inputs, name="c")
    assert run.name == "c" and len(store.paths.sealed_ids()) == 2
    faults.on = False
    fresh = tl.open(root)
    assert list(fresh.runs()["name"]) == ["a", "b", "c"]
    assert fresh.paths.sealed_ids() == []
    counts = fresh.sql(
        "select r.name, r.op_count, count(o.idx) as n from runs r join ops o "
        "on o.run_id = r.id group by all order by r.name"
    )
    assert (counts["n"] == counts["op_count"]).all()
    expected = tl.trace(model, *inputs)
    assert torch.equal(fresh["b"]["relu_1_2"].out, expected["relu_1_2"].out)
    assert fresh.gc()["runs"] == 0 and fresh.verify().ok


@pytest.mark.parametrize(
    "argv",
    [
        ["runs"],
        ["runs", "--all"],
        ["show", "a"],
        ["rm", "a"],
        ["gc"],
        ["verify"],
        ["query", "select label from ops"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_cli_exits_with_a_message_not_a_traceback(
    faults: Faults,
    recorded: tuple[Path, torch.nn.Module, tuple[torch.Tensor, ...]],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    root = recorded[0]
    faults.match, faults.on = "runs", True  # every statement on the runs table
    code = main([argv[0], str(root), *argv[1:]])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(f"tracelake {argv[0]}: ") and INJECTED in err
    faults.on = False
    assert main(["runs", str(root), "--json"]) == 0


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """A store whose catalog file is garbage (overwritten after its first run), without
    the shadow a writer would restore it from (test_hardening_errors.py has that case)."""
    model, inputs = BUILDERS["mlp"]()
    root = tmp_path / "s"
    with tl.open(root) as store:  # (closed: its fold makes the catalog file)
        store.record(model, *inputs, name="a")
    catalog_file = root / "catalog.duckdb"
    catalog_file.write_bytes(b"not a duckdb file" * 1000)
    (root / "catalog.shadow").unlink()
    with contextlib.suppress(FileNotFoundError):
        (root / "catalog.duckdb.wal").unlink()
    (root / "catalog.gen").write_text("moved")
    return root


@pytest.mark.parametrize(
    "action",
    [
        lambda s: s.runs(),
        lambda s: len(s),
        lambda s: s["a"],
        lambda s: "a" in s,
        lambda s: s.query("select label from ops"),
        lambda s: s.sql("select * from runs"),
        lambda s: s.verify(),
        lambda s: s.delete("a"),
        lambda s: s.gc(),
        lambda s: s.record(*BUILDERS["mlp"]()[:1], *BUILDERS["mlp"]()[1], name="b"),
    ],
    ids=["runs", "len", "[name]", "in", "query", "sql", "verify", "delete", "gc", "record"],
)
def test_a_damaged_catalog_is_a_catalog_error(damaged: Path, action: Callable[[Any], Any]) -> None:
    store = tl.open(damaged)  # opening reads no catalog yet
    with pytest.raises(tl.CatalogError) as caught:
        action(store)
    assert isinstance(caught.value.__cause__, duckdb.Error)
    assert "catalog.duckdb" in str(caught.value)


def test_os_errors_opening_a_store_are_store_errors(tmp_path: Path) -> None:
    """A store path that is a file: the filesystem's error, as a ``StoreError``."""
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(tl.StoreError) as caught:
        tl.open(path)
    assert isinstance(caught.value.__cause__, OSError)


def test_only_the_catalog_module_converts_duckdb_errors() -> None:
    """One boundary: the catalog's error names a catalog file or a statement, the DuckDB
    original rides along, and ``duckdb_errors`` is what every such site uses."""
    with pytest.raises(tl.CatalogError) as caught, boundary.duckdb_errors("reading x"):
        raise duckdb.IOException("boom")
    assert str(caught.value) == "reading x: boom"
    assert isinstance(caught.value.__cause__, duckdb.IOException)
    with pytest.raises(tl.QueryError), boundary.duckdb_errors("running", tl.QueryError):
        raise duckdb.BinderException("no such column")
    with pytest.raises(tl.CatalogError), boundary.duckdb_errors("running", tl.QueryError):
        raise PermissionError("catalog.lock")  # files are the catalog's, whoever asked
    with pytest.raises(ValueError), boundary.duckdb_errors("running"):
        raise ValueError("not DuckDB's: passes through")
