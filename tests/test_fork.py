"""A process forked while a recording runs: a ``DataLoader``'s worker processes started
inside the recorded forward, or an ``os.fork`` there. The child has a copy of the
recording but none of the threads that write it; before, its torch calls reached the
copy and waited for those threads for ever, and the parent waited for the child.

Each scenario runs in a process of its own with a time limit, so that a hang fails the
test instead of stalling the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import tracelake as tl

MODEL = """
import json, os, sys
import torch
import tracelake as tl
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
torch.manual_seed(0)
ROWS = TensorDataset(torch.arange(16 * (1 << 20), dtype=torch.float32).view(16, 1 << 20))


class Loads(torch.nn.Module):
    # its forward reads a data set through worker processes (fork), 4 MiB rows
    def __init__(self, workers):
        super().__init__()
        self.workers = workers
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        total = torch.zeros(())
        loader = DataLoader(ROWS, batch_size=4, num_workers=self.workers,
                            multiprocessing_context="fork" if self.workers else None)
        for (rows,) in loader:
            total = total + rows.sum()
        return self.lin(x).relu() * total
"""


def _run(script: str, timeout: float = 240) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MODEL + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dataloader_workers_forked_inside_a_recorded_forward(tmp_path: Path) -> None:
    where = tmp_path / "store.tl"
    out = _run(
        f"""
        store = tl.open({str(where)!r}, create=True)
        x = torch.randn(2, 8)
        model = Loads(2)
        plain = model(x)
        store.record(model, x, name="forked")
        traced = tl.trace(model, x)
        print(json.dumps({{"trace": traced.labels, "plain": plain.tolist()}}))
        """
    )
    store = tl.open(where, create=False)  # reopened in this process
    run = store["forked"]

    # the worker processes recorded nothing; the parent recorded what it ran, as
    # tl.trace did (bar the `empty` of shared-memory batches, as many as the timing of
    # the workers makes), and the output is the plain forward's
    def ops(labels: list[str]) -> list[str]:
        return [label.split(":")[0].rsplit("_", 2)[0] for label in labels]

    assert [f for f in ops(run.labels) if f != "empty"] == [
        f for f in ops(out["trace"]) if f != "empty"
    ]
    assert ops(run.labels).count("sum") == 4  # one per batch of the parent's loop
    assert run.labels[-1] == "output_1" and "relu" in ops(run.labels)
    assert torch.equal(run["output_1"].out, torch.tensor(out["plain"]))
    report = store.verify()
    assert report.ok, report.problems
    assert list(store.runs()["name"]) == ["forked"]


def test_a_forward_that_forks_leaves_the_run_to_the_parent(tmp_path: Path) -> None:
    where = tmp_path / "store.tl"
    out = _run(
        f"""
        class Forks(torch.nn.Module):
            def forward(self, x):
                y = x * 2
                self.pid = os.fork()
                return (y + 1).relu()

        store = tl.open({str(where)!r}, create=True)
        model = Forks()
        try:
            store.record(model, torch.randn(1 << 21), name="f")  # 8 MiB tensors
            outcome = "recorded"
        except tl.StoreError as exc:
            outcome = str(exc)
        if model.pid == 0:  # the child tells the parent what it saw
            os.write(sys.stdout.fileno(), (json.dumps({{"child": outcome}}) + "\\n").encode())
            os._exit(0)
        _, status = os.waitpid(model.pid, 0)
        print(json.dumps({{"parent": outcome, "status": status}}))
        """
    )
    assert out == {"parent": "recorded", "status": 0}
    store = tl.open(where, create=False)
    assert list(store.runs()["name"]) == ["f"]
    assert store["f"].labels == ["input_1", "mul_1_1", "add_1_2", "relu_1_3", "output_1"]
    assert store.verify().ok


def test_the_forked_child_is_told_why_its_copy_of_the_run_ends(tmp_path: Path) -> None:
    where = tmp_path / "store.tl"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            MODEL
            + textwrap.dedent(
                f"""
                class Forks(torch.nn.Module):
                    def forward(self, x):
                        self.pid = os.fork()
                        return x + 1

                store = tl.open({str(where)!r}, create=True)
                model = Forks()
                try:
                    store.record(model, torch.randn(4), name="f")
                except tl.StoreError as exc:
                    assert model.pid == 0
                    print("child:", exc, flush=True)
                    os._exit(0)
                os.waitpid(model.pid, 0)
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "was forked into this process" in done.stdout
    assert "record in the child with a recording of its own" in done.stdout


def test_a_fork_while_another_thread_holds_a_recorder_lock(tmp_path: Path) -> None:
    # Another thread is inside the recorder's locked sections (installing the source
    # replacements, classifying a code object) at the instant the forward forks: the
    # child, which closes its copy of the recording and runs new code, must find the
    # locks free rather than held for ever by a thread it does not have.
    where = tmp_path / "store.tl"
    out = _run(
        f"""
        import threading, time
        from tracelake.recorder import intercept, sources, trees

        def hold(entered):
            with sources._lock, intercept.SourceFinder._lock, trees._REGISTER_LOCK:
                entered.set()
                time.sleep(0.5)

        class Forks(torch.nn.Module):
            def forward(self, x):
                entered = threading.Event()
                threading.Thread(target=hold, args=(entered,)).start()
                entered.wait()
                self.pid = os.fork()
                return (x + 1).relu()

        store = tl.open({str(where)!r}, create=True)
        model = Forks()
        try:
            store.record(model, torch.randn(4), name="f")
            outcome = "recorded"
        except tl.StoreError:
            outcome = "refused"
        said = {str(tmp_path / "child.json")!r}
        if model.pid == 0:  # the child records a trace of its own
            labels = tl.trace(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(2)).labels
            with open(said, "w") as file:
                json.dump({{"child": outcome, "labels": labels}}, file)
            os._exit(0)
        for _ in range(600):  # a child that hangs is killed and reported, not waited for
            done, status = os.waitpid(model.pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(model.pid, 9)
            os.waitpid(model.pid, 0)
            status = "hung"
        child = json.load(open(said)) if os.path.exists(said) else {{}}
        print(json.dumps({{"parent": outcome, "status": status, **child}}))
        """,
        timeout=120,
    )
    assert out == {
        "parent": "recorded",
        "status": 0,
        "child": "refused",
        "labels": ["input_1", "relu_1_1", "output_1"],
    }


def test_a_child_forked_after_a_run_records_runs_of_its_own(tmp_path: Path) -> None:
    # A child forked after the parent recorded has a copy of the parent's catalog
    # connection (store/catalog.py's engine), whose freeing in the child crashed it
    # (SIGSEGV: the parent's DuckDB threads and locks), and of the writers' shared
    # worker threads (store/writer.py), none of which it has: it makes its own.
    out = _run(
        f"""
        import signal
        store = tl.open({str(tmp_path / "parent.tl")!r}, create=True)
        model, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
        store.record(model, x, name="p")  # the parent's worker threads, now idle
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a child that hangs ends, with a status that fails the test
            child = tl.open({str(tmp_path / "child.tl")!r}, create=True)
            for k in range(3):
                child.record(model, x, name=f"c{{k}}")
            ok = torch.equal(tl.open(child.path)["c2"]["linear_1_1"].out, model(x))
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({{"status": status}}))
        """,
        timeout=120,
    )
    assert out == {"status": 0}
