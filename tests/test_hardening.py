"""Hardening (issue 17, items 1-5): nothing lost or silently wrong when the catalog goes
missing or is replaced, ``store.sql`` really read-only, a lost ``catalog.gen`` hides
nothing, a forward that raised is never a step, and a gc() killed half-way leaks
nothing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from model_zoo import BUILDERS
from torch import nn

import tracelake as tl

TESTS = Path(__file__).parent


def _catalog_files(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith("catalog.duckdb")]


def _dirs(root: Path) -> list[str]:
    """The run directories (runs being recorded, or failed, are under ``.staging``; the
    rows of sealed runs under ``.sealed``)."""
    hidden = {".staging", ".sealed"}
    return sorted(p.name for p in (root / "runs").iterdir() if p.name not in hidden)


def _store_with_runs(root: Path, names: list[str]) -> tuple[tl.Store, nn.Module, torch.Tensor]:
    model, (x,) = BUILDERS["mlp"]()
    store = tl.open(root)
    for name in names:
        store.record(model, x, name=name)
    store.flush()  # (their rows in the catalog file, which these tests copy)
    return store, model, x


# -- 1. a missing or replaced catalog ---------------------------------------------------


def test_missing_catalog_refuses_writes_and_gc_and_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store, model, x = _store_with_runs(root, ["a", "b", "c"])
    want = store["a"]["input_1"].out.clone()
    before = _dirs(root)
    saved = tmp_path / "saved"
    saved.mkdir()
    for f in _catalog_files(root):
        shutil.move(f, saved / f.name)
    store = tl.open(root)
    with pytest.raises(tl.StoreError, match=r"catalog.duckdb is missing.*restore"):
        store.record(model, x * 3, name="d")
    with pytest.raises(tl.StoreError, match="no catalog"):
        store.gc()
    report = store.verify()
    assert not report.ok and "catalog.duckdb is missing" in str(report.problems[0])
    with pytest.raises(tl.StoreError, match=r"catalog.duckdb' is missing: restore"):
        store.runs()
    assert _dirs(root) == before  # nothing deleted, nothing reused
    for f in saved.iterdir():  # the recovery the message names
        shutil.move(f, root / f.name)
    store = tl.open(root)
    assert list(store.runs()["name"]) == ["a", "b", "c"]
    assert_bitwise(store["a"]["input_1"].out, want, "run a after the catalog came back")
    assert store.verify().ok
    assert store.record(model, x * 3, name="d").id == 4


def test_an_older_catalog_copy_refuses_writes_and_gc(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store, model, x = _store_with_runs(root, ["a", "b"])
    old = tmp_path / "old"
    old.mkdir()
    for f in _catalog_files(root):
        shutil.copy(f, old / f.name)
    store.record(model, x, name="c")
    store.flush()
    for f in _catalog_files(root):
        f.unlink()
    for f in old.iterdir():
        shutil.copy(f, root / f.name)
    store = tl.open(root)
    with pytest.raises(tl.StoreError, match=r"00000003.*older copy"):
        store.record(model, x, name="d")
    with pytest.raises(tl.StoreError, match="older copy"):
        store.gc()
    assert _dirs(root) == ["00000001", "00000002", "00000003"]


def test_run_ids_are_never_reused_and_unmarked_orphans_are_collected(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store, model, x = _store_with_runs(root, ["a"])
    # What a registration killed before its commit leaves: a directory, no row, no marker.
    (root / "runs" / "00000005").mkdir()
    (root / "runs" / "00000005" / "keep").write_bytes(b"x" * 100)
    run = store.record(model, x, name="b")
    assert run.id == 6 and (root / "runs" / "00000005" / "keep").exists()
    store.flush()  # (its marker is written once its rows are in the catalog)
    marker = json.loads((root / "runs" / "00000006" / "run.json").read_text())
    assert marker["run"] == 6
    done = store.gc()
    assert done["orphans"] == 1 and done["bytes"] >= 100
    assert _dirs(root) == ["00000001", "00000006"]


def test_a_writer_sees_run_directories_made_since_its_last_run(tmp_path: Path) -> None:
    # A writer keeps its listing of runs/ between registrations while nothing moved.
    root = tmp_path / "s"
    store, model, x = _store_with_runs(root, ["a"])
    assert store.record(model, x, name="b").id == 2
    staged = root / "runs" / ".batch-elsewhere"
    staged.mkdir()
    assert store.record(model, x, name="c").id == 3
    # a batch's directory renamed to its id and the batch killed before its commit:
    # runs/ keeps its link count, and the catalog its contents
    os.rename(staged, root / "runs" / "00000004")
    assert store.record(model, x, name="d").id == 5
    (root / "runs" / "00000006").mkdir()  # a registration killed before its commit
    assert store.record(model, x, name="e").id == 7
    assert _dirs(root) == [f"0000000{i}" for i in range(1, 8)]
    assert store.gc()["orphans"] == 2


def test_a_read_checks_its_directory_belongs_to_its_run(tmp_path: Path) -> None:
    _, model, x = _store_with_runs(tmp_path / "one", ["a"])
    two = tl.open(tmp_path / "two")
    two.record(model, x * 5, name="a")
    two.flush()
    for f in _catalog_files(tmp_path / "two"):  # a catalog that is not this store's
        f.unlink()
    for f in _catalog_files(tmp_path / "one"):
        shutil.copy(f, tmp_path / "two" / f.name)
    two = tl.open(tmp_path / "two")
    with pytest.raises(tl.StoreError, match="another run's data"):
        _ = two["a"]["input_1"].out
    assert not two.verify().ok
    # A directory without a marker (stores written before markers) still reads.
    (tmp_path / "one" / "runs" / "00000001" / "run.json").unlink()
    assert_bitwise(tl.open(tmp_path / "one")["a"]["input_1"].out, x, "unmarked run")


# -- 2. store.sql is read-only ----------------------------------------------------------

_WRITES = [
    "with x as (delete from ops returning *) select count(*) from x",
    "with x as (update runs set name = 'forged' returning *) select count(*) from x",
    "with x as (insert into runs (id, name, status) values (99, 'f', 'complete') "
    "returning *) select * from x",
    "with x as (delete from runs returning *) select * from ops",
    "create table t as select 1",
    "attach ':memory:' as other",
    "copy ops to 'out.csv'",
    "pragma disable_optimizer",
    "set threads = 7",
    "call checkpoint()",
    "delete from ops",
    "select 1; delete from ops",
]


@pytest.mark.parametrize("sql", _WRITES)
def test_store_sql_refuses_every_write(tmp_path: Path, sql: str) -> None:
    store, _, _ = _store_with_runs(tmp_path / "s", ["a", "b"])
    snapshot = {t: store.sql(f"select * from {t} order by all") for t in ("runs", "ops")}
    with pytest.raises(tl.QueryError):
        store.sql(sql)
    for table, before in snapshot.items():
        after = store.sql(f"select * from {table} order by all")
        assert after.equals(before), table
    assert list(store.runs()["name"]) == ["a", "b"]
    assert len(store.query("select label from ops where run = 'a'").df()) > 0
    assert not (tmp_path / "s" / "out.csv").exists()


def test_store_sql_still_answers_selects(tmp_path: Path) -> None:
    store, _, _ = _store_with_runs(tmp_path / "s", ["a"])
    df = store.sql("with r as (select * from runs) select name from r")
    assert list(df["name"]) == ["a"]
    assert store.sql("select count(*) as n from ops")["n"][0] > 0


# -- 3. a missing catalog.gen -----------------------------------------------------------


def test_a_missing_generation_file_hides_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    store, model, x = _store_with_runs(root, ["a"])
    (root / "catalog.gen").unlink()
    store = tl.open(root)
    assert list(store.runs()["name"]) == ["a"]
    report = store.verify()
    assert not report.ok and any("catalog.gen" in str(p) for p in report.problems)
    from tracelake.cli import main

    assert main(["verify", str(root)]) != 0
    capsys.readouterr()
    store.record(model, x, name="b")  # a writer makes it again, readers follow
    assert (root / "catalog.gen").exists() and store.verify().ok
    assert list(tl.open(root).runs()["name"]) == ["a", "b"]


# -- 4. a forward that raised is not a step ---------------------------------------------


class Flaky(nn.Module):
    """A forward that raises half-way when asked, after saving a large tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        big = torch.ones(1 << 20) * h.sum()  # 4 MiB: an array of its own
        if self.fail:
            raise ValueError("boom")
        return h * 2 + big.mean()


@pytest.mark.parametrize("how", ["called", "explicit"])
def test_a_forward_that_raised_is_not_a_step(tmp_path: Path, how: str) -> None:
    model = Flaky()
    store = tl.open(tmp_path / "s")
    inputs = [torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)]
    with store.recording("r", model) as rec:
        for k, inp in enumerate(inputs):
            model.fail = k == 1
            with contextlib.suppress(ValueError):
                model(inp) if how == "called" else rec.record(model, inp)
    model.fail = False
    run = store["r"]
    kept = [inputs[0], inputs[2]]
    assert run.num_steps == 2
    for k, inp in enumerate(kept):
        step = run.step(k)
        assert_bitwise(step["input_1"].out, inp, f"step {k} input")
        assert_bitwise(step.find(func="relu")[0].out, torch.relu(model.lin(inp)), f"step {k}")
        assert_bitwise(step["output_1"].out, model(inp), f"step {k} output")
    steps = store.sql("select distinct step from ops order by step")["step"].tolist()
    assert steps == [0, 1]
    assert store.verify().ok  # no array or tensor row of the failed forward is left


# -- 5. a gc() killed half-way ----------------------------------------------------------

_GC_DIES = """
import os, shutil, signal, sys
import tracelake as tl

real = shutil.rmtree

def half(path, *args, **kwargs):
    files = sorted(p for p in __import__("pathlib").Path(path).rglob("*") if p.is_file())
    for f in files[: len(files) // 2]:
        f.unlink()
    os.kill(os.getpid(), signal.SIGKILL)

shutil.rmtree = half
tl.open(sys.argv[1]).gc()
"""

_GC = """
import json, sys
import tracelake as tl
print(json.dumps(tl.open(sys.argv[1]).gc()))
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=TESTS,
        timeout=300,
    )


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_gc_killed_while_removing_leaks_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store, _, _ = _store_with_runs(root, ["keep", "gone"])
    gone = root / "runs" / "00000002"
    assert _bytes_under(gone) > 0
    store.delete("gone")
    killed = _python(_GC_DIES, str(root))
    assert killed.returncode == -9, killed.stderr
    assert not gone.exists()  # renamed before any file went
    assert any(n.startswith(".trash-") for n in _dirs(root))
    done = _python(_GC, str(root))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bytes"] > 0
    assert _dirs(root) == ["00000001"]
    assert _bytes_under(root / "runs") == _bytes_under(root / "runs" / "00000001")
    assert tl.open(root).verify().ok


def test_gc_removes_directories_of_runs_it_collected_but_did_not_remove(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    store, _, _ = _store_with_runs(root, ["keep", "gone"])
    store.delete("gone")
    kept = tmp_path / "kept"
    shutil.copytree(root / "runs" / "00000002", kept)
    store.gc()
    shutil.copytree(kept, root / "runs" / "00000002")  # as if killed before its rename
    assert os.path.isdir(root / "runs" / "00000002")
    done = store.gc()
    assert done["orphans"] == 1 and done["bytes"] > 0
    assert _dirs(root) == ["00000001"]
