"""Hardening (issue 17, items 10-11): a recorded model called from two threads at once,
and Ctrl-C at any point of the recorder, leave no thread broken, no mode or global hook
installed and no run stuck ``recording``."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from hook_capture import assert_bitwise
from torch import nn
from torch.nn.modules import module as nn_module
from torch.overrides import _get_current_function_mode_stack

import tracelake as tl

PACKAGE = Path(tl.__file__).resolve().parent.parent  # the worktree: recorder/, store/, ...


def _clean() -> None:
    """No mode on this thread's stack and no global module hook left behind."""
    assert _get_current_function_mode_stack() == []
    assert not nn_module._global_forward_pre_hooks
    assert not nn_module._global_forward_hooks
    assert not nn_module._global_forward_hooks_always_called


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        #: Called between the two layers (tests park a thread there).
        self.between: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        self.between()
        return self.b(x).softmax(-1)


def _net() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(), torch.randn(4, 6)


# -- 10. two threads ------------------------------------------------------------------


@pytest.mark.parametrize("first_returns", ["first", "second"])
def test_a_second_thread_is_refused_and_neither_thread_breaks(
    tmp_path: Path, first_returns: str
) -> None:
    model, x = _net()
    inside, second_done = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def park() -> None:  # the first thread waits inside its forward for the second
        if threading.current_thread().name == "first":
            inside.set()
            assert second_done.wait(20)

    def first() -> None:
        seen["first"] = model(x)
        seen["first torch"] = torch.relu(x) + 1

    def second() -> None:
        assert inside.wait(20)
        try:
            model(x)
        except BaseException as exc:
            seen["second error"] = exc
        seen["second torch"] = torch.relu(x) + 1  # this thread's torch still works
        seen["second clean"] = _get_current_function_mode_stack()
        second_done.set()

    model.between = park
    store = tl.open(tmp_path / "s")
    with store.recording("two", model):
        threads = [threading.Thread(target=f, name=f.__name__) for f in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        model.between = lambda: None
        if first_returns == "second":
            model(x)  # the block's own thread records a step afterwards
    assert isinstance(seen["second error"], tl.ConcurrentRecordingError)
    assert "one thread at a time" in str(seen["second error"])
    assert seen["second clean"] == []
    assert torch.equal(seen["second torch"], torch.relu(x) + 1)
    _clean()
    run = tl.open(tmp_path / "s", create=False)["two"]
    steps = 2 if first_returns == "second" else 1
    assert len(run.steps) == steps
    plain, _ = _net()
    for k in range(steps):
        assert_bitwise(run.step(k)["output_1"].out, plain(x))
    # the store and the recorder go on working
    store.record(model, x, name="after")
    assert tl.trace(model, x).output is not None
    _clean()


def test_rec_record_from_a_second_thread_is_refused(tmp_path: Path) -> None:
    model, x = _net()
    inside, second_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def park() -> None:
        if threading.current_thread().name == "first":
            inside.set()
            assert second_done.wait(20)

    model.between = park
    store = tl.open(tmp_path / "s")
    with store.recording("r") as rec:

        def second() -> None:
            assert inside.wait(20)
            try:
                rec.record(model, x)
            except BaseException as exc:
                errors.append(exc)
            second_done.set()

        threads = [
            threading.Thread(target=rec.record, args=(model, x), name="first"),
            threading.Thread(target=second, name="second"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [type(e) for e in errors] == [tl.ConcurrentRecordingError]
    assert len(tl.open(tmp_path / "s")["r"].steps) == 1
    _clean()


def test_tl_trace_in_two_threads_at_once_records_each_thread(tmp_path: Path) -> None:
    model, x = _net()
    both = threading.Barrier(2)
    traces: dict[str, tl.Trace] = {}
    model.between = lambda: both.wait(20)

    def go() -> None:
        traces[threading.current_thread().name] = tl.trace(model, x)

    threads = [threading.Thread(target=go, name=n) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    model.between = lambda: None
    alone = tl.trace(model, x)
    for trace in traces.values():
        assert trace.labels == alone.labels
        for op in alone:
            assert_bitwise(trace[op.label].out, op.out)
    _clean()


# -- 11. Ctrl-C -----------------------------------------------------------------------


@contextmanager
def _interrupt_at(point: int) -> Iterator[list[int]]:
    """Raise KeyboardInterrupt at the ``point``-th line tracelake's own code runs (lines
    of the package only, in this thread); yields a one-item list: how many lines ran."""
    count = [0]
    prefix = str(PACKAGE) + os.sep

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
            if count[0] == point:
                raise KeyboardInterrupt
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if name.startswith(prefix) and "/tests/" not in name:
            return local(frame, event, arg)
        return None

    sys.settrace(tracer)
    try:
        yield count
    finally:
        sys.settrace(None)


def _record_block(store: tl.Store, model: nn.Module, x: torch.Tensor) -> None:
    with store.recording("block", model, overwrite=True):
        model(x)


def _record_call(store: tl.Store, model: nn.Module, x: torch.Tensor) -> None:
    store.record(model, x, name="call", overwrite=True)


def _is_lock(fd: str, under: str) -> bool:
    try:
        target = os.readlink(fd)
        return target.startswith(under) and target.endswith(".lock")
    except OSError:
        return False


def _lines(action: Callable[[], None]) -> int:
    with _interrupt_at(-1) as count:
        action()
    return count[0]


@pytest.mark.parametrize("how", [_record_block, _record_call], ids=["recording", "record"])
def test_ctrl_c_anywhere_leaves_nothing_installed(tmp_path: Path, how: Any) -> None:
    model, x = _net()
    store = tl.open(tmp_path / "s")
    how(store, model, x)  # (the first recording into a store runs more code)
    total = _lines(lambda: how(store, model, x))
    assert total > 200
    # every point would take too long in CI: an even spread, the first and last ones too
    points = sorted({*range(1, total, max(1, total // 60)), 1, 2, 3, total - 1, total})
    interrupted = 0
    for point in points:
        try:
            with _interrupt_at(point):
                how(store, model, x)
        except KeyboardInterrupt:
            interrupted += 1
        _clean()
        # no run left recording with a live writer, no lock file left open
        assert "recording" not in set(store.runs(all=True)["status"])
        assert not [
            fd
            for fd in os.listdir("/proc/self/fd")
            if _is_lock(f"/proc/self/fd/{fd}", str(tmp_path))
        ]
        # the next recording works at once, and records the same values
        how(store, model, x)
        _clean()
    assert interrupted >= len(points) * 0.9
    store.gc()
    fresh = tl.open(tmp_path / "s", create=False)
    assert set(fresh.runs(all=True)["status"]) == {"complete"}
    name = "block" if how is _record_block else "call"
    plain, _ = _net()
    assert_bitwise(fresh[name]["output_1"].out, plain(x))
    assert not [p for p in (tmp_path / "s" / "runs").iterdir() if p.name.startswith(".trash")]


def test_a_caught_ctrl_c_inside_the_block_drops_that_forward_only(tmp_path: Path) -> None:
    model, x = _net()
    calls = [0]

    def interrupt_first() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt

    model.between = interrupt_first
    store = tl.open(tmp_path / "s")
    with store.recording("r", model):
        with pytest.raises(KeyboardInterrupt):
            model(x)  # torch runs no always-called hook for it
        out = model(x)
        assert torch.equal(torch.relu(x) + 1, torch.relu(x) + 1)
    _clean()
    run = tl.open(tmp_path / "s", create=False)["r"]
    assert len(run.steps) == 1
    assert run.labels == tl.trace(model, x).labels
    assert_bitwise(run["output_1"].out, out)


def test_real_sigint_at_random_moments_surfaces_as_keyboard_interrupt(tmp_path: Path) -> None:
    """SIGINT as Ctrl-C sends it, at random moments of ``store.record`` and of a
    recording block, DuckDB's statements included (it reports an interrupt its own way:
    ``RuntimeError: Query interrupted``, ``InterruptException``)."""
    import random
    import signal
    import time

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    x = torch.randn(128, 128)
    store = tl.open(tmp_path / "s")
    store.record(model, x, name="warm")
    start = time.perf_counter()
    store.record(model, x, name="timed")
    took = time.perf_counter() - start
    armed = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        if armed[0]:  # only inside the trial: never in the test's own bookkeeping
            armed[0] = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    try:
        for trial in range(10):
            timer = threading.Timer(
                rng.uniform(0, took * 1.2), lambda: os.kill(os.getpid(), signal.SIGINT)
            )
            armed[0] = True
            timer.start()
            try:
                if trial % 2:
                    store.record(model, x, name=f"r{trial}")
                else:
                    with store.recording(f"r{trial}", model):
                        model(x)
                outcome = "completed"
            except KeyboardInterrupt:
                outcome = "KeyboardInterrupt"
            except BaseException as exc:  # what the issue saw: RuntimeError, CatalogError
                outcome = f"{type(exc).__name__}: {exc}"
            finally:
                armed[0] = False
                timer.cancel()
                timer.join()
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            _clean()
            assert "recording" not in set(store.runs(all=True)["status"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert set(outcomes) <= {"completed", "KeyboardInterrupt"}, outcomes
    store.record(model, x, name="after")
    assert set(tl.open(tmp_path / "s").runs(all=True)["status"]) <= {
        "complete",
        "failed",
        "interrupted",
    }
