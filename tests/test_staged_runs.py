"""A run recorded on its own takes one catalog transaction, its commit: until then it is
a staged directory (``runs/.staging/*``), which listing shows (recording, failed or
interrupted), which a second recording of its name is refused by, and which ``gc()``
reclaims once its writer is gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hook_capture import assert_bitwise
from model_zoo import BUILDERS

import tracelake as tl

TESTS = Path(__file__).parent

# A child that records run "live" and, inside the block, says so and waits for a line
# on its stdin before the block ends (and the run commits).
_LIVE = """
import sys
import tracelake as tl
from model_zoo import BUILDERS

model, inputs = BUILDERS["mlp"]()
store = tl.open(sys.argv[1])
with store.recording("live", model, meta={"who": "child"}):
    model(*inputs)
    print("recording", flush=True)
    sys.stdin.readline()
print("committed", flush=True)
"""


def _catalog_files(root: Path) -> dict[str, tuple[int, int]]:
    """The catalog's files (and the readers' change token), by size and mtime."""
    return {
        p.name: (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.iterdir()
        if p.name.startswith("catalog.") and p.name != "catalog.lock"
    }


def test_a_recording_touches_the_catalog_only_at_its_commit(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = BUILDERS["cnn"]()
    store.record(model, *inputs, name="first")  # (the store's names are read once)
    before = _catalog_files(root)
    with store.recording("second", model, meta={"k": 2}):
        model(*inputs)
        model(*inputs)
        assert _catalog_files(root) == before  # no transaction: readers see nothing
        listed = tl.open(root, create=False).runs(all=True).set_index("name")
        assert listed.loc["second", "status"] == "recording"
        assert listed.loc["second", "meta"] == {"k": 2}
        assert "second" not in tl.open(root, create=False)
    assert _catalog_files(root) != before
    reader = tl.open(root, create=False)
    assert reader.runs(all=True)["name"].tolist() == ["first", "second"]  # listed once
    run = reader["second"]
    assert len(run.steps) == 2 and run.meta == {"k": 2}
    log = tl.trace(model, *inputs)
    for step in (0, 1):
        for op in log:
            assert_bitwise(run.step(step)[op.label].out, op.out, f"{step} {op.label}")
    assert reader.verify().ok
    assert not list((root / "runs" / ".staging").iterdir())


def test_a_live_recording_in_another_process_holds_its_name(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = BUILDERS["mlp"]()
    store.record(model, *inputs, name="before")
    child = subprocess.Popen(
        [sys.executable, "-c", _LIVE, str(root)],
        cwd=TESTS,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "recording"
        listed = store.runs(all=True).set_index("name")
        assert listed.loc["live", "status"] == "recording"
        assert listed.loc["live", "meta"] == {"who": "child"}
        with pytest.raises(tl.RunExistsError, match=r"'live' \(recording\)"):
            store.record(model, *inputs, name="live")
        store.record(model, *inputs, name="mine")  # other names go on
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "committed"
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        assert child.wait(timeout=120) == 0
    assert sorted(store.runs()["name"]) == ["before", "live", "mine"]
    assert store["live"].meta == {"who": "child"}
    with pytest.raises(tl.RunExistsError, match=r"'live' \(complete\)"):
        store.record(model, *inputs, name="live")
    replaced = store.record(model, *inputs, name="live", overwrite=True)
    assert store["live"].id == replaced.id
    assert store.verify().ok


def test_names_committed_by_another_process_are_refused_before_recording(
    tmp_path: Path,
) -> None:
    """The names a writer keeps between its runs are trusted only while no other writer
    changed the catalog: a name another process committed since is refused at once."""
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = BUILDERS["mlp"]()
    store.record(model, *inputs, name="a")
    other = tl.open(root, create=False)  # (another writer: its own catalog writer)
    other.record(model, *inputs, name="b")
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(tl.RunExistsError, match=r"'b' \(complete\)"):
        store.record(model, *inputs, name="b")
    assert calls == []  # refused before the model ran
    other.delete("b")
    run = store.record(model, *inputs, name="b")  # free again, as the catalog says
    assert run.name == "b" and sorted(store.runs()["name"]) == ["a", "b"]


def test_failed_and_interrupted_runs_are_listed_until_gc(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = BUILDERS["mlp"]()
    store.record(model, *inputs, name="ok")
    with pytest.raises(ValueError, match="bad batch"), store.recording("broken", model):
        model(*inputs)
        raise ValueError("bad batch")
    # a writer killed mid-recording leaves its staged directory, its lock free
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys, tracelake as tl\n"
            "from model_zoo import BUILDERS\n"
            "model, inputs = BUILDERS['mlp']()\n"
            "store = tl.open(sys.argv[1])\n"
            "with store.recording('killed', model):\n"
            "    model(*inputs)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n",
            str(root),
        ],
        cwd=TESTS,
        check=False,
    )
    listed = tl.open(root, create=False).runs(all=True).set_index("name")
    assert listed["status"].to_dict() == {
        "ok": "complete",
        "broken": "failed",
        "killed": "interrupted",
    }
    assert listed.loc["broken", "error"] == "ValueError: bad batch"
    assert sorted(store.runs()["name"]) == ["ok"]
    collected = store.gc()
    assert collected["runs"] == 2 and collected["orphans"] == 0 and collected["bytes"] > 0
    assert store.runs(all=True)["name"].tolist() == ["ok"]
    assert not list((root / "runs" / ".staging").iterdir())
    store.record(model, *inputs, name="broken")  # the names are free
    assert store.verify().ok


def test_gc_removes_a_staged_directory_a_writer_died_making(tmp_path: Path) -> None:
    """A writer killed between making its staged directory and its lock file in it
    (found by the crash battery: one of 110 kills) leaves an empty directory no writer
    will claim: gc() removes it once it is old enough that no live writer is making it,
    and leaves a fresh one (a writer may be about to lock it) alone."""
    import os
    import time

    from tracelake.store.layout import ABANDONED_EMPTY_S

    model, inputs = BUILDERS["mlp"]()
    root = tmp_path / "s"
    store = tl.open(root)
    store.record(model, *inputs, name="kept")
    staging = root / "runs" / ".staging"
    abandoned, fresh = staging / "123-abandoned", staging / "124-fresh"
    abandoned.mkdir(parents=True)
    fresh.mkdir()
    then = time.time() - ABANDONED_EMPTY_S - 5
    os.utime(abandoned, (then, then))
    done = store.gc()
    assert done["orphans"] == 1 and done["runs"] == 0
    assert not abandoned.exists() and fresh.is_dir()
    assert list(store.runs()["name"]) == ["kept"]
    os.utime(fresh, (then, then))
    (fresh / "writing.lock").touch()  # a writer made its lock meanwhile: a staged run's
    assert store.gc()["orphans"] == 1 and not fresh.exists()  # (held by nobody: trashed)
