"""The catalog's log (issue 16, items 3 and 5): a writer's transaction is committed by
appending it to DuckDB's log (``catalog.duckdb.wal``) and fsyncing that, and the log is
checkpointed into the file only once it is past ``catalog.LOG_BYTES``. Everyone who
opens the catalog (readers, queries on the file, the next writer, a restore from the
shadow) sees the runs the log holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from model_zoo import BUILDERS
from test_store import run_python

import tracelake as tl
from tracelake.store import catalog
from tracelake.store.duckfile import wal_of

TESTS = Path(__file__).parent


def _log_size(root: Path) -> int:
    wal = wal_of(root / "catalog.duckdb")
    return wal.stat().st_size if wal.exists() else 0


def _outputs(i: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = BUILDERS["mlp"]()
    return model, tuple(x + i for x in inputs)


def _commit(store: tl.Store, model: torch.nn.Module, inputs: tuple, name: str) -> None:
    """Record a run and insert its rows into the catalog at once: a transaction of its
    own, as this module's tests of the log want (``record`` seals the run, whose rows
    reach the catalog with the next transaction)."""
    store.record(model, *inputs, name=name)
    store.flush()


def reads_back(store: tl.Store, runs: int) -> None:
    """Runs ``r0`` .. of ``_outputs`` read back bit for bit, and the store verifies."""
    for i in range(runs):
        model, inputs = _outputs(i)
        assert_bitwise(store[f"r{i}"]["output_1"].out, model(*inputs), f"r{i}")
    assert store.verify().ok


_COUNT = """
import sys
import tracelake as tl
store = tl.open(sys.argv[1], create=False)
print(",".join(store.runs()["name"]))
"""


def _names_in_another_process(root: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _COUNT, str(root)],
        capture_output=True,
        text=True,
        cwd=TESTS,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [n for n in done.stdout.strip().split(",") if n]


def test_small_commits_stay_in_the_log_until_it_is_past_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the log is under its bound a run's commit leaves the catalog file and its
    shadow as they were (no checkpoint); the transaction that takes the log past the
    bound checkpoints it, and the log never stays past it. Every run is visible to a
    reader of another process as soon as ``record`` returned."""
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = _outputs(0)
    _commit(store, model, inputs, "r0")
    assert _log_size(root) == 0  # the fold that made the catalog left it whole
    model, inputs = _outputs(1)
    _commit(store, model, inputs, "r1")
    one_run = _log_size(root)
    assert one_run > 0  # the next run is in the log only
    monkeypatch.setattr(catalog, "LOG_BYTES", one_run * 3)
    catalog_file, shadow = root / "catalog.duckdb", root / "catalog.shadow"
    logged = checkpoints = 0
    for i in range(2, 12):
        before = (catalog_file.read_bytes(), shadow.read_bytes(), _log_size(root))
        model, inputs = _outputs(i)
        _commit(store, model, inputs, f"r{i}")
        size = _log_size(root)
        assert size <= catalog.LOG_BYTES
        if size > before[2]:  # logged: neither the file nor its shadow was written
            logged += 1
            assert catalog_file.read_bytes() == before[0]
            assert shadow.read_bytes() == before[1]
        else:  # checkpointed: the shadow is the file again
            checkpoints += 1
            assert catalog_file.read_bytes() != before[0]
            assert shadow.read_bytes() == catalog_file.read_bytes()
        if i % 4 == 1:
            assert _names_in_another_process(root) == [f"r{k}" for k in range(i + 1)]
    assert logged >= 4 and checkpoints >= 2, (logged, checkpoints)
    reads_back(tl.open(root, create=False), 12)


def test_a_commit_larger_than_the_bound_is_checkpointed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = _outputs(0)
    _commit(store, model, inputs, "first")  # (the fold making the catalog: no log)
    _commit(store, model, inputs, "small")
    assert _log_size(root) > 0
    monkeypatch.setattr(catalog, "LOG_BYTES", 1)  # any run's rows are larger
    _commit(store, model, inputs, "large")
    assert _log_size(root) == 0  # checkpointed, with the log before it
    assert (root / "catalog.shadow").read_bytes() == (root / "catalog.duckdb").read_bytes()
    assert sorted(tl.open(root, create=False).runs()["name"]) == ["first", "large", "small"]


def test_queries_on_the_catalog_file_see_the_runs_in_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MIRROR_OPS, queries over every run read the catalog file itself (no copy of
    every run into the mirror): DuckDB replays the log there too."""
    root = tmp_path / "s"
    store = tl.open(root)
    for i in range(3):
        model, inputs = _outputs(i)
        _commit(store, model, inputs, f"r{i}")
    assert _log_size(root) > 0
    monkeypatch.setattr(catalog, "MIRROR_OPS", 0)
    reader = tl.open(root, create=False)
    model, inputs = _outputs(0)
    ops = len(tl.trace(model, *inputs))
    got = reader.query("select run, count(*) as n from ops group by run order by run").df()
    assert got["run"].tolist() == ["r0", "r1", "r2"] and set(got["n"]) == {ops}
    assert int(reader.sql("select count(*) from ops").iloc[0, 0]) == 3 * ops
    assert reader.catalog._direct  # (the file was read, not the mirror)
    # a run committed after the reader's last look is seen by its next query
    model, inputs = _outputs(3)
    _commit(store, model, inputs, "r3")
    assert int(reader.sql("select count(*) from ops").iloc[0, 0]) == 4 * ops


def test_delete_and_gc_with_runs_in_the_log(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    for i in range(3):
        model, inputs = _outputs(i)
        _commit(store, model, inputs, f"r{i}")
    store.delete("r1")
    assert _log_size(root) > 0  # the delete too
    assert _names_in_another_process(root) == ["r0", "r2"]
    collected = store.gc()
    assert collected["runs"] == 1
    reader = tl.open(root, create=False)
    assert reader.runs(all=True)["name"].tolist() == ["r0", "r2"]
    assert sorted(p.name for p in (root / "runs").iterdir()) == [
        ".sealed",
        ".staging",
        "00000001",
        "00000003",
    ]
    assert reader.verify().ok


def test_a_batch_reads_the_names_it_checks_without_telling_readers_of_a_change(
    tmp_path: Path,
) -> None:
    """A batch reads the complete runs' names once, as a writer (no reader's open, no
    mirror): readers see no change from that read, and a name taken in the store is
    still refused when its run begins."""
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = _outputs(0)
    store.record(model, *inputs, name="r0")
    store.delete("r0")
    store.record(model, *inputs, name="r1")
    token = catalog.FileChangeToken(store.paths).token()
    with store.batch():
        with pytest.raises(tl.RunExistsError):
            store.record(model, *inputs, name="r1")
        assert catalog.FileChangeToken(store.paths).token() == token
        store.record(model, *inputs, name="r0")  # (deleted: free again)
    assert sorted(_names_in_another_process(root)) == ["r0", "r1"]


def _row_groups(root: Path, table: str) -> int:
    import duckdb

    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    try:
        sql = f"SELECT count(DISTINCT row_group_id) FROM pragma_storage_info('{table}')"
        return int(con.execute(sql).fetchone()[0])  # type: ignore[index]
    finally:
        con.close()


def test_small_row_groups_are_merged_every_so_many_checkpoints_and_at_gc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that is not the file's VACUUM_EVERY-th leaves each commit's rows in
    row groups of their own (not merging the tables' last row groups again at every
    commit); the VACUUM_EVERY-th merges them, and so does a gc()'s. Every run reads back
    whole throughout, from this process and another."""
    root = tmp_path / "s"
    store = tl.open(root)
    monkeypatch.setattr(catalog, "LOG_BYTES", 1)  # every commit checkpoints
    monkeypatch.setattr(catalog, "VACUUM_EVERY", 4)
    counts = []
    for i in range(9):
        model, inputs = _outputs(i)
        _commit(store, model, inputs, f"r{i}")
        counts.append(_row_groups(root, "runs"))
    assert max(counts) <= 4 and counts.count(1) >= 2  # (merged, and again)
    assert max(counts) > 1  # (not merged at every one)
    assert _names_in_another_process(root) == [f"r{i}" for i in range(9)]
    store.delete("r1")
    assert store.gc()["runs"] == 1
    assert _row_groups(root, "runs") == 1
    reader = tl.open(root, create=False)
    assert reader.runs()["name"].tolist() == [f"r{i}" for i in range(9) if i != 1]
    for i in (0, 8):
        model, inputs = _outputs(i)
        assert_bitwise(reader[f"r{i}"]["output_1"].out, model(*inputs), f"r{i}")
    assert reader.verify().ok


_RECORD = """
import sys
from model_zoo import BUILDERS
import tracelake as tl
model, inputs = BUILDERS["mlp"]()
tl.open(sys.argv[1], create=False).record(model, *inputs, name=sys.argv[2])
"""


def test_ids_and_commit_order_follow_the_commits_of_every_writer(tmp_path: Path) -> None:
    """A writer keeps the highest id and ``seq`` (the commit order) its last commit left,
    trusted only while the catalog is as that commit left it: runs committed by two
    stores of one process, by another process and after a delete (which moves the
    deleted run's ``seq`` to the top) get ids and ``seq`` that rise with every commit."""
    root = tmp_path / "s"
    a, b = tl.open(root), tl.open(root, create=False)
    model, inputs = _outputs(0)

    for name, store in (("a1", a), ("a2", a), ("b1", b), ("a3", a)):
        store.record(model, *inputs, name=name)
    a.delete("a2")
    a.record(model, *inputs, name="a4")
    run_python(_RECORD, str(root), "p1")
    a.record(model, *inputs, name="a5")
    b.record(model, *inputs, name="b2")
    a.record(model, *inputs, name="a6")
    got = tl.open(root, create=False).sql("select name, id, seq, status from runs order by seq")
    assert got["name"].tolist() == ["a1", "b1", "a3", "a2", "a4", "p1", "a5", "b2", "a6"]
    assert got["seq"].is_unique and got["id"].is_unique
    committed = got[got["name"] != "a2"]
    assert committed["id"].tolist() == sorted(committed["id"]) == [1, 3, 4, 5, 6, 7, 8, 9]
    assert got.set_index("name")["status"].to_dict() == {
        **{name: "complete" for name in committed["name"]},
        "a2": "deleted",
    }
