"""Crashes and concurrency: SIGKILL at several moments of a recording, and several
processes recording into one store while others read it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from model_zoo import BUILDERS

import tracelake as tl
from tracelake.store import catalog

TESTS = Path(__file__).parent

# What both children below begin with: die() SIGKILLs the process; die_at_insert()
# makes it die as a fold inserts its rows (after its schema, before its COMMIT).
_DYING = """
import os, signal, sys
import duckdb
import tracelake as tl
from tracelake.store import catalog
from model_zoo import BUILDERS

root, moment = sys.argv[1], sys.argv[2]

def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def die_at_insert():
    connect = duckdb.connect
    class Dying:
        def __init__(self, con):
            self.con = con
        def execute(self, sql, *args):
            if sql.startswith('INSERT INTO "calls"'):
                die()
            return self.con.execute(sql, *args)
        def __getattr__(self, name):
            return getattr(self.con, name)
    duckdb.connect = lambda *a, **k: Dying(connect(*a, **k))
"""

# A child that records run "c" and SIGKILLs itself at the moment named by argv[2].
_DIE_AT = (
    _DYING
    + """
from tracelake.store import local

model, inputs = BUILDERS["cnn"]()
if moment == "mid-forward":
    model.features[4].register_forward_hook(die)
elif moment == "mid-write":  # a worker thread dies half way through writing a file
    def half(path, write, *_rest):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write(fd)
        os.ftruncate(fd, 100)
        die()
    local._write_with = half
elif moment == "before-seal":  # tensors and rows durable, not sealed
    catalog.CatalogWriter.seal = die
elif moment == "mid-seal":  # directory renamed to its id, its rows not moved to .sealed
    rename = os.rename
    def rename_or_die(source, target):
        if ".sealed" in str(target):
            die()
        rename(source, target)
    os.rename = rename_or_die
elif moment == "after-seal":  # sealed (record returns next), readers not yet told
    bump, seal = catalog.FileChangeToken.bump, catalog.CatalogWriter.seal
    sealing = []
    def bump_then_die(self):
        if sealing:
            die()
        bump(self)
    def seal_then_die(self, run):
        sealing.append(1)
        return seal(self, run)
    catalog.FileChangeToken.bump = bump_then_die
    catalog.CatalogWriter.seal = seal_then_die
elif moment == "mid-fold":  # record returned; its rows being inserted (at exit), no COMMIT
    die_at_insert()
elif moment == "after-fold":  # its rows committed, its sealed file not yet removed
    catalog.remove_sealed = die
store = tl.open(root)
store.record(model, *inputs, name="c", meta={"moment": moment})
print("survived")
"""
)


def _killed(script: str, root: Path, moment: str) -> None:
    """Run ``script`` on the store at ``root``; it must die of SIGKILL at ``moment``."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), moment],
        capture_output=True,
        text=True,
        cwd=TESTS,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


def _record_earlier_runs(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    store = tl.open(root)
    expected = {}
    for name, builder in (("a", "mlp"), ("b", "repeated_block")):
        model, inputs = BUILDERS[builder]()
        store.record(model, *inputs, name=name)
        log = tl.trace(model, *inputs)
        expected[name] = {op.label: op.out for op in log}
    store.close()  # (their rows in the catalog file: a session that ended)
    return expected


_MOMENTS = ["mid-forward", "mid-write", "before-seal", "mid-seal", "after-seal"]


@pytest.mark.parametrize("moment", [*_MOMENTS, "mid-fold", "after-fold"])
def test_sigkill_leaves_earlier_runs_intact(tmp_path: Path, moment: str) -> None:
    """A SIGKILL anywhere in a recording leaves every earlier run whole and the store
    openable; a run whose ``record`` returned (or was about to: sealed) is complete
    afterwards, whether or not its rows had reached the catalog file (the next
    transaction inserts them, once)."""
    root = tmp_path / "s"
    expected = _record_earlier_runs(root)
    _killed(_DIE_AT, root, moment)

    store = tl.open(root)  # openable
    committed = moment in ("after-seal", "mid-fold", "after-fold")
    assert sorted(store.runs()["name"]) == (["a", "b", "c"] if committed else ["a", "b"])
    for name, outs in expected.items():  # every earlier run, bit for bit
        run = store[name]
        for label, tensor in outs.items():
            assert_bitwise(run[label].out, tensor, f"{name} {label}")
    listed = store.runs(all=True).set_index("name")["status"].to_dict()
    if committed:
        assert listed["c"] == "complete" and store["c"].meta == {"moment": moment}
    elif moment == "mid-seal":  # its directory has its id, it was never sealed
        assert "c" not in store and "c" not in listed, listed
    else:  # staged, its writer gone
        assert "c" not in store
        assert listed["c"] == "interrupted", listed
    assert store.verify().ok
    collected = store.gc()
    assert collected["runs"] == (1 if moment in ("mid-forward", "mid-write", "before-seal") else 0)
    assert collected["orphans"] == (1 if moment == "mid-seal" else 0)
    assert store.paths.sealed_ids() == []
    if committed:  # once, with its rows, bit for bit
        assert store.runs()["name"].tolist().count("c") == 1
        model, inputs = BUILDERS["cnn"]()
        assert_bitwise(store["c"]["output_1"].out, model(*inputs), "c")
    assert "c" not in store.runs(all=True)["name"].tolist() or committed
    # the store takes new runs afterwards, under the interrupted run's name too
    model, inputs = BUILDERS["mlp"]()
    store.record(model, *inputs, name="c", overwrite=committed)
    assert store.verify().ok


# A child that records two runs into a new store (sealed: no catalog yet), then closes
# it, its fold making the catalog, and SIGKILLs itself at the moment named by argv[2].
_FIRST_FOLD_DIES = (
    _DYING
    + """
if moment == "after-attach":  # the new file's headers written, nothing in it
    attach = catalog.CatalogWriter._attach
    catalog.CatalogWriter._attach = lambda self, con, path: die(attach(self, con, path))
elif moment == "mid-fold":  # schema made, rows being inserted, no COMMIT
    die_at_insert()
elif moment == "before-rename":  # committed, checkpointed, synced: not in its place
    replace = os.replace
    def replace_or_die(source, target):
        if str(target).endswith("catalog.duckdb"):
            die()
        replace(source, target)
    os.replace = replace_or_die
store = tl.open(root)
for name, builder in (("a", "mlp"), ("b", "cnn")):
    model, inputs = BUILDERS[builder]()
    store.record(model, *inputs, name=name)
assert not store.paths.catalog.exists()
store.close()
print("survived")
"""
)


@pytest.mark.parametrize("moment", ["after-attach", "cut", "mid-fold", "before-rename"])
def test_a_new_stores_first_fold_killed_half_way_loses_nothing(tmp_path: Path, moment: str) -> None:
    """The fold that makes a new store's catalog makes it under another name and puts it
    in place only once whole: killed at any moment of it, it leaves no catalog anyone
    must repair, and the next process's fold makes it again from the runs still sealed.
    ("cut": the new file cut short, as a kill while DuckDB wrote its headers leaves it.)"""
    root = tmp_path / "s"
    _killed(_FIRST_FOLD_DIES, root, "after-attach" if moment == "cut" else moment)
    paths = tl.open(root, create=False).paths  # (openable, and reads nothing yet)
    assert not paths.catalog.exists() and paths.catalog_new.exists()
    assert len(paths.sealed_ids()) == 2
    if moment == "cut":
        with paths.catalog_new.open("r+b") as f:
            f.truncate(4096)

    store = tl.open(root)
    assert sorted(store.runs()["name"]) == ["a", "b"]
    for name, builder in (("a", "mlp"), ("b", "cnn")):
        model, inputs = BUILDERS[builder]()
        assert_bitwise(store[name]["output_1"].out, model(*inputs), name)
    assert paths.catalog.exists() and not paths.catalog_new.exists()
    assert paths.sealed_ids() == [] and store.verify().ok
    model, inputs = BUILDERS["mlp"]()
    store.record(model, *inputs, name="c")
    store.close()
    assert sorted(tl.open(root, create=False).runs()["name"]) == ["a", "b", "c"]


_WRITER = """
import sys
import torch
import tracelake as tl
from model_zoo import BUILDERS

root, who = sys.argv[1], sys.argv[2]
store = tl.open(root)
for j in range(3):
    model, inputs = BUILDERS["cnn" if j % 2 else "mlp"]()
    inputs = tuple(x + int(who) for x in inputs)
    run = store.record(model, *inputs, name=f"w{who}-{j}", meta={"writer": int(who)})
    assert torch.equal(run["output_1"].out, model(*inputs))
print("ok")
"""

_READER = """
import sys, time
import torch
import tracelake as tl

root, want = sys.argv[1], int(sys.argv[2])
store = tl.open(root)
deadline = time.monotonic() + 240
queries = reads = 0
while time.monotonic() < deadline:
    names = store.runs()["name"].tolist()
    queries += 1
    for name in names:
        run = store[name]
        assert run["output_1"].out is not None
        reads += 1
    if len(names) >= want:
        break
    time.sleep(0.05)
assert len(names) >= want, names
print(queries, reads)
"""


def test_four_writers_and_a_reader_at_once(tmp_path: Path) -> None:
    root = tmp_path / "s"
    notebook = tl.open(root)  # a long-lived reader in this process: it must block nobody
    assert len(notebook.runs()) == 0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=TESTS,
        )
        for i in range(4)
    ]
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(root), "12"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
    )
    seen_during = set()
    while any(p.poll() is None for p in procs):
        seen_during.update(notebook.runs()["name"])  # queries while recording goes on
        time.sleep(0.1)
    for proc in [*procs, reader]:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
    queries, reads = map(int, out.split())
    assert queries >= 1 and reads >= 12
    names = sorted(notebook.runs()["name"])
    assert names == sorted(f"w{i}-{j}" for i in range(4) for j in range(3))
    assert seen_during <= set(names)
    for i in range(4):
        model, inputs = BUILDERS["mlp"]()
        inputs = tuple(x + i for x in inputs)
        assert_bitwise(notebook[f"w{i}-0"]["output_1"].out, model(*inputs), f"w{i}-0")
    assert notebook.verify().ok


# A child that commits a batch of runs "k0".."k2", opens a second batch ("o0".."o2"),
# and SIGKILLs itself at the moment named by argv[2]: while recording the open batch's
# third run, or inside the open batch's catalog transaction (its runs' directories
# renamed to their ids, nothing committed).
_DIE_IN_BATCH = """
import os, signal, sys
import torch
import tracelake as tl
from tracelake.store import catalog
from model_zoo import BUILDERS

root, moment = sys.argv[1], sys.argv[2]

def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

store = tl.open(root)
with store.batch():
    for k in range(3):
        model, inputs = BUILDERS["cnn" if k % 2 else "mlp"]()
        store.record(model, *inputs, name=f"k{k}", meta={"k": k})
if moment == "batch-commit":
    catalog.fsync_dir = die  # after the renames, before COMMIT
with store.batch():
    for k in range(3):
        model, inputs = BUILDERS["mlp"]()
        if moment == "open-batch" and k == 2:
            model.register_forward_hook(die)
        store.record(model, *inputs, name=f"o{k}")
print("survived")
"""


@pytest.mark.parametrize("moment", ["open-batch", "batch-commit"])
def test_sigkill_during_a_batch_loses_only_the_open_batch(tmp_path: Path, moment: str) -> None:
    root = tmp_path / "s"
    expected = _record_earlier_runs(root)
    _killed(_DIE_IN_BATCH, root, moment)

    store = tl.open(root)
    assert sorted(store.runs()["name"]) == ["a", "b", "k0", "k1", "k2"]
    for name, outs in expected.items():  # runs from before the batches, bit for bit
        for label, tensor in outs.items():
            assert_bitwise(store[name][label].out, tensor, f"{name} {label}")
    for k in range(3):  # the committed batch's runs, bit for bit
        model, inputs = BUILDERS["cnn" if k % 2 else "mlp"]()
        log = tl.trace(model, *inputs)
        run = store[f"k{k}"]
        assert run.meta == {"k": k}
        for op in log:
            assert_bitwise(run[op.label].out, op.out, f"k{k} {op.label}")
    listed = store.runs(all=True).set_index("name")["status"].to_dict()
    lost = {name: status for name, status in listed.items() if name.startswith("o")}
    if moment == "open-batch":  # staged, their writer gone: listed as interrupted
        assert lost == dict.fromkeys(["o0", "o1", "o2"], "interrupted"), listed
    else:  # renamed to their ids, their rows never committed: directories only
        assert lost == {}, listed
    assert store.verify().ok
    runs = root / "runs"
    left = [p for p in runs.iterdir() if p.name not in {f"{i:08d}" for i in range(6)}]
    left = [p for p in left if p.name != ".staging"] + list((runs / ".staging").iterdir())
    assert left, "the open batch's files should be on disk until gc()"
    collected = store.gc()
    assert collected["runs"] == len(lost) and collected["bytes"] > 0, (collected, left)
    # (a killed batch: one directory holding its runs; killed in its commit: the runs
    # renamed to their ids, and the batch's directory with its lock alone)
    assert collected["orphans"] == (0 if moment == "open-batch" else 4), (collected, left)
    assert sorted(p.name for p in runs.iterdir()) == [".sealed", ".staging"] + [
        f"{i:08d}" for i in range(1, 6)
    ]
    # the store takes new runs (and batches) afterwards, under the lost runs' names too
    with store.batch() as batch:
        model, inputs = BUILDERS["mlp"]()
        store.record(model, *inputs, name="o0")
    assert batch.names == ["o0"] and "o0" in store
    assert_bitwise(store["o0"]["output_1"].out, model(*inputs), "o0")
    assert store.verify().ok


# A child that records run "c" (its commit stays in DuckDB's log: the log is under its
# bound) and SIGKILLs itself as soon as record returned.
_DIE_AFTER_RETURN = """
import os, signal, sys
import tracelake as tl
from tracelake.store.duckfile import wal_of
from model_zoo import BUILDERS

root = sys.argv[1]
model, inputs = BUILDERS["cnn"]()
catalog_file = os.path.join(root, "catalog.duckdb")
before = open(catalog_file, "rb").read()
store = tl.open(root)
store.record(model, *inputs, name="c")
store.flush()  # (its rows into the catalog now: a transaction of their own)
assert wal_of(tl.open(root).paths.catalog).exists()  # committed to the log only:
assert open(catalog_file, "rb").read() == before  # the file is as it was
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_commit_in_the_log_survives_sigkill_and_a_restore_from_the_shadow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that returned is durable though only DuckDB's log holds it: it survives
    its writer's SIGKILL right after, and then a catalog file spoilt as a writer killed
    in a checkpoint once left it (readers read the shadow with the log meanwhile; the
    next writer restores the shadow and DuckDB replays the log onto it)."""
    root = tmp_path / "s"
    with monkeypatch.context() as patch:
        patch.setattr(catalog, "LOG_BYTES", 0)  # a and b checkpointed into the file
        expected = _record_earlier_runs(root)
    _killed(_DIE_AFTER_RETURN, root, "after-return")  # (only after its assertions held)
    catalog_file = root / "catalog.duckdb"
    with catalog_file.open("r+b") as f:  # a metadata block spoilt
        f.seek(3 * 4096 + 5000)
        f.write(b"\x00killed\x00" * 8)
    damaged = catalog_file.read_bytes()
    assert sorted(tl.open(root).runs()["name"]) == ["a", "b", "c"]  # shadow + log
    assert catalog_file.read_bytes() == damaged  # (readers change nothing)
    model, inputs = BUILDERS["mlp"]()
    with pytest.warns(tl.TraceLakeWarning, match="restored from catalog.shadow"):
        tl.open(root).record(model, *inputs, name="d")
    store = tl.open(root, create=False)
    assert sorted(store.runs()["name"]) == ["a", "b", "c", "d"]
    for name, outs in expected.items():
        for label, tensor in outs.items():
            assert_bitwise(store[name][label].out, tensor, f"{name} {label}")
    model, inputs = BUILDERS["cnn"]()
    for op in tl.trace(model, *inputs):
        assert_bitwise(store["c"][op.label].out, op.out, f"c {op.label}")
    assert store.verify().ok
