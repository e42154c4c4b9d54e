"""A reader's mirror copies a run's rows only once a query needs them: a query that names
its runs (``run = X``, ``run in (...)``) loads those, one over every run loads all, and
answers are the same as from a mirror that holds everything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_zoo import mlp

import tracelake as tl
from tracelake.query import compile_query
from tracelake.store.format import chunk_key

NAMES = ["r0", "r1", "r2", "r3"]


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    store = tl.open(tmp_path / "store")
    model, (x,) = mlp()
    with torch.no_grad():
        for k, name in enumerate(NAMES):
            store.record(model, x * (k + 1), name=name, meta={"k": k})
    return tmp_path / "store"


def _loaded(store: tl.Store) -> set[str]:
    mirror = store.catalog
    return {mirror.run_names[i] for i in mirror._loaded}


def _rows(result: object) -> list[dict]:
    return [
        {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in row.items()}
        for row in result
    ]  # type: ignore[attr-defined]


QUERIES = [
    ("select run, label, out from ops where run = 'r1' order by idx", {"r1"}),
    (
        "select run, label from ops where label = 'relu_1_2' and run in ('r0', 'r2') order by run",
        {"r0", "r2"},
    ),
    ("select run, count(*) from ops where run = :r and func = 'relu' group by run", {"r3"}),
    ("select run, steps from runs where meta.k >= 2 order by run", set()),
    ("select out from ops where run = :nosuch", set()),  # (written out: RunNotFoundError)
    ("select out from ops where run in :none", set()),
]


@pytest.mark.parametrize(("text", "loads"), QUERIES)
def test_a_query_loads_the_runs_it_names(root: Path, text: str, loads: set[str]) -> None:
    lazy = tl.open(root, create=False)
    params = {"r": "r3", "none": [], "nosuch": "nosuch"}
    params = {k: v for k, v in params.items() if f":{k}" in text}
    got = lazy.query(text, **params)
    assert _loaded(lazy) == loads
    full = tl.open(root, create=False)
    full.query("select count(*) from ops")  # every run's rows
    assert _loaded(full) == set(NAMES)
    want = full.query(text, **params)
    assert _rows(got) == _rows(want)


@pytest.mark.parametrize(
    "text",
    [
        "select run, label from ops where func = 'relu'",
        "select run from ops where run = 'r1' or func = 'relu'",
        "select run from ops where not run = 'r1'",
        "select run from ops where run != 'r1'",
        "select run from ops where run not in ('r1')",
        "select run, label from modules",
    ],
)
def test_other_queries_read_every_run(root: Path, text: str) -> None:
    store = tl.open(root, create=False)
    mirror = store.catalog
    mirror.refresh(runs=())
    assert compile_query(text, None, mirror.run_ids).runs is None
    store.query(text)
    assert _loaded(store) == set(NAMES)


def test_scoped_mirror_follows_new_deleted_and_overwritten_runs(root: Path) -> None:
    store = tl.open(root, create=False)
    count = "select count(*) as n from ops where run = :r"
    n = list(store.query(count, r="r0"))
    assert _loaded(store) == {"r0"}
    other = tl.open(root, create=False)
    model, (x,) = mlp()
    with torch.no_grad():
        other.record(model, x, name="new")
        other.record(model, x * 7, name="r0", overwrite=True)
    assert list(store.query(count, r="new")) == n  # the same model: as many ops
    assert _loaded(store) == {"new"}  # the old r0 dropped, the new one not asked for
    out = store.query("select out from ops where run = 'r0' and label = 'output_1'")
    assert torch.equal(out.tensors()[0], model(x * 7))
    assert _loaded(store) == {"r0", "new"}
    other.delete("new")
    assert list(store.query(count, r="new")) == [{"n": 0}]
    assert "new" not in _loaded(store)
    per_run = store.query("select run, count(*) as n from ops group by run order by run")
    assert [(row["run"], row["n"]) for row in per_run] == [(name, n[0]["n"]) for name in NAMES]
    assert _loaded(store) == set(NAMES)


def test_listing_runs_and_reading_one_copy_only_that_run(root: Path) -> None:
    store = tl.open(root, create=False)
    assert store.runs()["name"].tolist() == NAMES
    assert len(store) == 4 and "r2" in store and "nosuch" not in store
    assert _loaded(store) == set()
    run = store["r2"]
    model, (x,) = mlp()
    assert torch.equal(run["relu_1_2"].out, torch.relu(model[0](x * 3)))
    assert _loaded(store) == {"r2"}
    with pytest.raises(tl.RunNotFoundError):
        store["nosuch"]
    assert _loaded(store) == {"r2"}
    assert store.verify().ok
    assert _loaded(store) == set(NAMES)  # verify reads each run's rows


def test_loading_another_run_of_an_unchanged_catalog_keeps_its_runs_table(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run read for the first time while the catalog did not change copies that run's
    rows only: the runs table is not read again (the explorer's first comparison of two
    runs); after a writer's change it is."""
    from tracelake.store.catalog import CatalogMirror

    reads: list[str] = []
    runs_sql = CatalogMirror._runs_sql
    monkeypatch.setattr(
        CatalogMirror,
        "_runs_sql",
        lambda self, present: reads.append("runs") or runs_sql(self, present),
    )
    store = tl.open(root, create=False)
    assert [r["n"] for r in store.query("select count(*) as n from ops where run = 'r0'")]
    assert reads == ["runs"] and _loaded(store) == {"r0"}
    pair = store.compare("r1", "r2", tensors=False)
    assert len(pair) > 0 and _loaded(store) == {"r0", "r1", "r2"}
    assert reads == ["runs"]  # two more runs' rows, the same runs table
    model, (x,) = mlp()
    with torch.no_grad():
        tl.open(root, create=False).record(model, x, name="new", meta={"k": 9})
    got = store.query("select run from runs where meta.k = 9")
    assert [r["run"] for r in got] == ["new"] and reads == ["runs", "runs"]


# -- past MIRROR_OPS: queries over every run read the catalog file -----------------------


@pytest.fixture()
def large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every catalog counts as too large to mirror whole."""
    from tracelake.store import catalog

    monkeypatch.setattr(catalog, "MIRROR_OPS", 0)


EVERY_RUN = [
    "select run, label, absmax from ops where func = 'relu' and absmax > 0.1 "
    "order by absmax desc limit 5",
    "select run, count(*) as n, avg(l2) as l2 from ops group by run order by run",
    "select run, label, out from ops where label = 'relu_1_2' order by run",
    "select run, mean(out) from ops where func = 'linear' and meta.k >= 2 order by run, idx",
    "select run, label from modules order by run, label",
    "select a.run, b.run as other, a.label from ops a join ops b using (key) "
    "where a.label = 'output_1' and a.run < b.run order by a.run, other",
]


@pytest.mark.parametrize("text", EVERY_RUN)
def test_a_large_catalog_answers_from_the_file_as_the_mirror_would(
    root: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _rows(tl.open(root, create=False).query(text))
    from tracelake.store import catalog

    monkeypatch.setattr(catalog, "MIRROR_OPS", 0)
    store = tl.open(root, create=False)
    got = _rows(store.query(text))
    assert _loaded(store) == set()  # nothing copied
    assert got == want and got
    assert _rows(store.query(text)) == want  # hot, the same
    # a query that names its run still reads the mirror (and the op index)
    one = "select out from ops where run = 'r2' and label = 'relu_1_2'"
    first, second = store.query(one).tensors()[0], store.query(one).tensors()[0]
    model, (x,) = mlp()
    assert torch.equal(first, torch.relu(model[0](x * 3))) and torch.equal(first, second)
    assert _loaded(store) == {"r2"}


def test_a_large_catalog_never_shows_deleted_partial_or_unknown_runs(
    root: Path, large: None
) -> None:
    store = tl.open(root, create=False)
    per_run = "select run, count(*) as n from ops group by run order by run"
    n = _rows(store.query(per_run))[0]["n"]
    assert _rows(store.query(per_run)) == [{"run": name, "n": n} for name in NAMES]
    other = tl.open(root, create=False)
    model, (x,) = mlp()
    with torch.no_grad(), other.recording("partial") as rec:  # registered, not committed
        rec.record(model, x)
        assert [r["run"] for r in store.query(per_run)] == NAMES
        assert int(store.sql("select count(*) from ops").iloc[0, 0]) == 4 * n
    other.delete("r1")  # its rows stay in the file until gc()
    with torch.no_grad():
        other.record(model, x * 9, name="r2", overwrite=True)  # the old r2's rows stay too
    names = ["partial", "r0", "r2", "r3"]
    assert _rows(store.query(per_run)) == [{"run": name, "n": n} for name in names]
    out = store.query("select run, out from ops where label = 'output_1' order by run")
    assert [r["run"] for r in out] == names
    assert torch.equal(out.tensors()[2], model(x * 9))  # the new r2
    assert int(store.sql("select count(*) from ops").iloc[0, 0]) == 4 * n
    assert sorted(store.sql("select distinct run_id from ops")["run_id"]) == sorted(
        store.catalog.run_ids[name] for name in names
    )
    other.gc()
    assert _rows(store.query(per_run)) == [{"run": name, "n": n} for name in names]
    assert _loaded(store) == set()
    assert store.verify().ok


@pytest.mark.parametrize("batch_ops", [1, 10**9])
def test_verify_reads_tensor_rows_in_batches_over_every_run(
    root: Path, large: None, batch_ops: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify() reads the tensors' catalog rows of several runs in one statement over
    every run (past MIRROR_OPS from the file, so no run is copied into the mirror), and a
    damaged chunk is reported under its own run and label, whether each run is a batch
    of its own or all are one."""
    from tracelake.store import verify

    monkeypatch.setattr(verify, "BATCH_OPS", batch_ops)
    store = tl.open(root, create=False)
    report = store.verify()
    assert report.ok and report.runs == len(NAMES) and report.tensors > 0
    assert _loaded(store) == set()
    run = store["r2"]
    where = run["relu_1_2"].array._slot.array
    chunk = root / "runs" / f"{run.id:08d}" / "tensors" / chunk_key(where, 0)
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0x40
    chunk.write_bytes(bytes(data))
    report = tl.open(root, create=False).verify()
    assert {p.run for p in report.problems} == {"r2"} and report.runs == len(NAMES)
    assert any("relu_1_2" in p.label for p in report.problems)


def test_a_large_catalogs_raw_sql_stays_read_only_and_limited(root: Path, large: None) -> None:
    store = tl.open(root, create=False)
    for table in ("ops", "catalog.main.ops"):  # (the file's own table, by its full name)
        with pytest.raises(tl.QueryError, match=r"read-only|base table"):
            store.sql(f"with gone as (delete from {table} returning *) select count(*) from gone")
    with pytest.raises(tl.QueryError):
        store.sql("select * from read_csv('/etc/passwd')")  # no file outside the catalog
    before = tl.set_query_limits(seconds=0.5)
    try:
        with pytest.raises(tl.QueryLimitError, match="time limit"):
            store.sql("select count(*) from ops, range(1000000000000)")
        tl.set_query_limits(seconds=None, memory="64MB")  # (set as the file is opened)
        with pytest.raises(tl.QueryLimitError, match="out of memory"):
            store.sql("select list(range) from ops, range(100000000)")
    finally:
        tl.set_query_limits(seconds=before.seconds, memory=before.memory)
    # the file was let go: a writer commits, and the reader sees it
    with torch.no_grad():
        tl.open(root, create=False).record(*_mlp_args(), name="after")
    assert "after" in [r["run"] for r in store.query("select distinct run from ops")]


def _mlp_args() -> tuple:
    model, (x,) = mlp()
    return model, x
