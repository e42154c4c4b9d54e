"""A run's files reach the disk before the catalog names it: every file and directory
of its tree is fsync'd (all at once, from a pool of threads) before the commit that
makes the run visible; a forked child makes its own pool."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import tracelake as tl
from tracelake.store import layout
from tracelake.store.catalog import CatalogWriter, StagedRun


def test_every_file_and_directory_of_a_run_is_fsyncd_before_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a run is sealed, every file of its directory is durable, its rows' file
    among them; before ``record`` returns, the names the seal gave them (``runs/<id>``,
    ``runs/.sealed/<id>``) are too. Another process reads it back bit for bit."""
    store = tl.open(tmp_path / "s.tl", create=True)
    model, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    store.record(model, x, name="warm")
    synced: list[str] = []
    threads: set[str] = set()
    at_seal: list[int] = []
    real_fsync, real_seal = os.fsync, CatalogWriter.seal
    tree: list[str] = []  # the run's directory and everything in it, at its seal

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        threads.add(threading.current_thread().name)

    def seal(self: CatalogWriter, run: StagedRun) -> object:
        at_seal.append(len(synced))
        tree.extend([str(run.staged), *(str(p) for p in run.staged.rglob("*"))])
        return real_seal(self, run)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(CatalogWriter, "seal", seal)
    monkeypatch.setattr(layout, "_FSYNC_FILES", 1 << 20)  # (never a syncfs instead)
    run = store.record(model, x, name="a", save=tl.all())
    assert len(tree) > 5 and at_seal
    before = set(synced[: at_seal[0]])
    assert set(tree) <= before, sorted(set(tree) - before)
    assert any(path.endswith(layout.SEALED_ROWS) for path in tree)
    after = set(synced[at_seal[0] :])
    assert {str(store.paths.runs), str(store.paths.sealed)} <= after
    assert any(name.startswith("tracelake-fsync") for name in threads)
    assert (store.paths.sealed_rows(run.id)).exists()  # (its rows wait there)
    done = subprocess.run(
        [sys.executable, "-c", _READ, store.path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert bytes.fromhex(done.stdout) == model(x).detach().numpy().tobytes()


_READ = """
import sys
import tracelake as tl
print(tl.open(sys.argv[1], create=False)["a"]["linear_1_1"].out.numpy().tobytes().hex())
"""


def test_fsync_all_raises_the_error_of_a_file_that_cannot_be_synced(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        layout.fsync_all([str(good), str(tmp_path / "missing")], [str(tmp_path)])


def test_fsync_all_syncs_every_other_file_after_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (its files in a few sequences at once: a failure ends no sequence early)
    paths = [tmp_path / f"f{k}" for k in range(12)]
    for path in paths[1:]:
        path.write_bytes(b"x")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(FileNotFoundError):
        layout.fsync_all([str(p) for p in paths], [str(tmp_path)])
    assert sorted(synced) == sorted(str(p) for p in [*paths[1:], tmp_path])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_fsync_pool(tmp_path: Path) -> None:
    script = f"""
        import os, signal, sys, time
        from pathlib import Path
        from tracelake.store import layout
        files = []
        for k in range(4):
            path = Path({str(tmp_path)!r}) / f"f{{k}}"
            path.write_bytes(b"x")
            files.append(str(path))
        layout.fsync_all(files)  # the parent's pool: its threads started, then idle
        time.sleep(0.2)
        pid = os.fork()
        if pid == 0:  # (the parent's pool would take these for its idle threads: a hang)
            signal.alarm(10)  # a hung child ends, with a status that fails the test
            layout.fsync_all(files)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0"


def test_a_killed_process_scratch_directory_is_removed_by_the_next_one_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DuckLake store's local scratch (``layout.Scratch``) outlives a process killed
    before its clean-up; the next scratch directory made on the machine removes it, and
    leaves alone one whose process lives (however old), one just made (its lock may not
    be taken yet), and directories that are not scratch of this kind."""
    import tempfile

    prefix = "tl-test-scratch-"
    code = textwrap.dedent(
        f"""
        import os, signal, sys, tempfile
        tempfile.tempdir = {str(tmp_path)!r}
        from tracelake.store.layout import Scratch
        scratch = Scratch({prefix!r})
        open(os.path.join(scratch.name, "mirror.duckdb"), "w").write("x")
        print(scratch.name, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.read()  # alive until the test closes its stdin
        """
    )
    killed = subprocess.run(
        [sys.executable, "-c", code, "kill"], capture_output=True, text=True, check=False
    )
    assert killed.returncode == -9, killed.stderr
    dead = Path(killed.stdout.strip())
    live_process = subprocess.Popen(
        [sys.executable, "-c", code, "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live_process.stdout is not None
        live = Path(live_process.stdout.readline().strip())
        young = tmp_path / f"{prefix}young.held"
        other = tmp_path / f"{prefix}other"  # (not a Scratch's name)
        young.mkdir()
        other.mkdir()
        old = layout.SCRATCH_GRACE_S + 5
        for path in (dead, live, other):
            stat = path.stat()
            os.utime(path, (stat.st_atime - old, stat.st_mtime - old))
        assert dead.exists() and live.exists()

        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        scratch = layout.Scratch(prefix)
        assert not dead.exists()
        assert live.exists() and (live / "mirror.duckdb").exists()
        assert young.exists() and other.exists()
        assert Path(scratch.name).parent == tmp_path and Path(scratch.name).is_dir()
        scratch.cleanup()
        scratch.cleanup()  # (once)
        assert not Path(scratch.name).exists()
    finally:
        assert live_process.stdin is not None
        live_process.stdin.close()
        live_process.wait(timeout=60)
    assert not live.exists()  # its process cleaned it at exit
