"""Hardening (issue 17, items 10-11): a recorded model called from two threads at once,
and Ctrl-C at any point of the recorder, leave no thread broken, no mode or global hook
installed and no run stuck ``recording``."""

from __future__ import annotations

import ast
import dis
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from hook_capture import assert_bitwise
from torch import nn
from torch.nn.modules import module as nn_module
from torch.overrides import _get_current_function_mode_stack

import tracelake as tl

PACKAGE = Path(tl.__file__).resolve().parent.parent  # the worktree: recorder/, store/, ...
FROM_NUMPY = torch.from_numpy


def _clean(where: object = None) -> None:
    """No mode on this thread's stack, torch functions enabled (a ``DisableTorchFunction``
    block left without its exit disables them for the thread: every later recording would
    see no op) and no global module hook left behind. ``where``: what was interrupted."""
    assert _get_current_function_mode_stack() == [], where
    assert torch._C._is_torch_function_enabled(), where
    # nor grad mode off (a torch.no_grad() whose __enter__ or __exit__ was cut short)
    assert torch.is_grad_enabled(), where
    assert not nn_module._global_forward_pre_hooks
    assert not nn_module._global_forward_hooks
    assert not nn_module._global_forward_hooks_always_called
    # the source wrappers (recorder/sources.py) are gone: torch is as it was
    assert torch.from_numpy is FROM_NUMPY, where
    assert "__new__" not in torch.Tensor.__dict__, where


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


@functools.cache
def _no_signal_points(code: CodeType) -> frozenset[int]:
    """Where a trace reports a line that no signal can interrupt, in ``code``: the first
    instruction of a line in a ``with`` or ``try``/``finally`` body that no exception
    handler covers (Python 3.11 leaves a ``try:``'s NOP, a loop's closing NOP out; see
    :func:`_unguarded`), and a ``with``'s normal exit (the call of ``__exit__`` after
    the body, reported as the ``with``'s line again). A trace function raising there
    would skip the exit, but CPython delivers a signal only at calls and backward jumps,
    never at these: so they are no Ctrl-C point."""
    ops = {ins.offset: ins.opname for ins in dis.get_instructions(code)}
    entries = dis.Bytecode(code).exception_entries
    points = {
        entry.end
        for entry in entries
        if ops.get(entry.target) == "PUSH_EXC_INFO"
        and ops.get(entry.target + 2) == "WITH_EXCEPT_START"
    }
    # A loop ending a with's body leaves through a NOP (the loop's line) before the
    # with's exit; a NOP (that one, a try:'s line) checks for no signal.
    for point in list(points):
        while ops.get(point) == "NOP":
            point += 2
            points.add(point)
    points.update(offset for offset, name in ops.items() if name == "NOP")
    scope = _scopes(code.co_filename).get((code.co_name, code.co_firstlineno))
    if scope is not None:
        guarded = _protected_lines(scope)
        points.update(
            offset
            for offset, line in dis.findlinestarts(code)
            if line in guarded and not any(e.start <= offset < e.end for e in entries)
        )
    return frozenset(points)


@functools.cache
def _scopes(filename: str) -> dict[tuple[str, int], ast.AST]:
    """The functions and classes of a source file by (name, first line), as code objects
    name them."""
    try:
        return _scopes_of(ast.parse(Path(filename).read_text()))
    except (OSError, SyntaxError, ValueError):
        return {}


def _scopes_of(tree: ast.Module) -> dict[tuple[str, int], ast.AST]:
    scopes: dict[tuple[str, int], ast.AST] = {("<module>", 1): tree}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            scopes[(node.name, first)] = node
    return scopes


@contextmanager
def _interrupt_at(
    point: int,
    where: list[str] | None = None,
    after: Callable[[CodeType], bool] | None = None,
) -> Iterator[list[int]]:
    """Raise KeyboardInterrupt at the ``point``-th line tracelake's own code runs (lines
    of the package only, in this thread; not where no signal can come,
    :func:`_no_signal_points`);
    yields a one-item list: how many lines ran. ``where`` gets the line interrupted
    (``file:line function``). ``after``: count only once a function whose code it
    accepts has returned."""
    count = [0 if after is None else -1]  # -1: not counting yet
    prefix = str(PACKAGE) + os.sep

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event == "return" and count[0] < 0 and after is not None and after(code):
            count[0] = 0
        elif event == "line" and count[0] >= 0 and frame.f_lasti not in _no_signal_points(code):
            count[0] += 1
            if count[0] == point:
                if where is not None:
                    name = os.path.relpath(code.co_filename, PACKAGE)
                    where.append(f"{name}:{frame.f_lineno} {code.co_name}")
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
        where: list[str] = []
        try:
            with _interrupt_at(point, where):
                how(store, model, x)
        except KeyboardInterrupt:
            interrupted += 1
        _clean(where)
        # nor the block's own hooks on the model (its next call would run a stale block's)
        assert not (model._forward_pre_hooks or model._forward_hooks), where
        # no run left recording with a live writer, no lock file left open
        assert "recording" not in set(store.runs(all=True)["status"]), where
        assert not [
            fd
            for fd in os.listdir("/proc/self/fd")
            if _is_lock(f"/proc/self/fd/{fd}", str(tmp_path))
        ], where
        # the next recording works at once, and records the same values
        try:
            how(store, model, x)
        except Exception as exc:
            raise AssertionError(f"the recording after an interrupt at {where}") from exc
        _clean(where)
    assert interrupted >= len(points) * 0.9
    store.gc()
    fresh = tl.open(tmp_path / "s", create=False)
    assert set(fresh.runs(all=True)["status"]) == {"complete"}
    name = "block" if how is _record_block else "call"
    plain, _ = _net()
    assert_bitwise(fresh[name]["output_1"].out, plain(x))
    assert not [p for p in (tmp_path / "s" / "runs").iterdir() if p.name.startswith(".trash")]


def test_ctrl_c_anywhere_in_a_batch_commits_whole_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch builds its small runs' rows together, some while it records (the bound
    set low here) and the rest when it commits: a Ctrl-C anywhere commits each run with
    all its rows, once, or not at all, and leaves nothing installed."""
    import tracelake.store.store as store_module

    monkeypatch.setattr(store_module, "DEFERRED_OPS", 8)  # a build every second run or so
    model, x = _net()
    store = tl.open(tmp_path / "s")

    def batch() -> None:
        with store.batch():
            for k in range(3):
                store.record(model, x, name=f"b{k}", overwrite=True)

    batch()
    total = _lines(batch)
    points = sorted({*range(1, total, max(1, total // 60)), 1, 2, total - 1, total})
    for point in points:
        where: list[str] = []
        try:
            with _interrupt_at(point, where):
                batch()
        except KeyboardInterrupt:
            pass
        _clean(where)
        rows = store.sql(
            "SELECT r.name, r.op_count, count(o.run_id) AS n, count(DISTINCT o.idx) AS d "
            "FROM runs r LEFT JOIN ops o ON o.run_id = r.id "
            "WHERE r.status = 'complete' GROUP BY r.name, r.op_count"
        )
        assert sorted(rows["name"]) == ["b0", "b1", "b2"], where
        assert (rows["n"] == rows["op_count"]).all() and (rows["d"] == rows["n"]).all(), where
        assert not [
            fd
            for fd in os.listdir("/proc/self/fd")
            if _is_lock(f"/proc/self/fd/{fd}", str(tmp_path))
        ], where
    store.gc()
    assert store.verify().ok
    for k in range(3):
        assert_bitwise(store[f"b{k}"]["output_1"].out, model(x), f"b{k}")


def _catalog_commit(code: CodeType) -> bool:
    return code.co_name == "seal" and "catalog" in code.co_filename


@pytest.mark.parametrize("how", [_record_block, _record_call], ids=["recording", "record"])
def test_a_ctrl_c_after_the_catalog_commit_keeps_the_run(tmp_path: Path, how: Any) -> None:
    # Every line the recording runs once the catalog holds the run (releasing its lock,
    # the progress bar, the gradient edges): a Ctrl-C there must not mark it failed.
    model, x = _net()
    store = tl.open(tmp_path / "s")
    how(store, model, x)
    point = 0
    while True:
        point += 1
        where: list[str] = []
        try:
            with _interrupt_at(point, where, after=_catalog_commit):
                how(store, model, x)
        except KeyboardInterrupt:
            pass
        _clean(where)
        assert store.runs(all=True)["status"].iloc[-2:].tolist() == ["deleted", "complete"], where
        assert not [
            fd
            for fd in os.listdir("/proc/self/fd")
            if _is_lock(f"/proc/self/fd/{fd}", str(tmp_path))
        ], where
        if not where:  # past the last line
            break
    assert point > 5
    name = "block" if how is _record_block else "call"
    assert_bitwise(tl.open(tmp_path / "s", create=False)[name]["output_1"].out, model(x))


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


# -- where no Ctrl-C may land unhandled ----------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_INNER = (*_SCOPES, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _protected_lines(scope: ast.AST) -> set[int]:
    """Lines of ``scope``'s own code (not of functions or comprehensions inside it) that
    lie in a ``with`` body or in a ``try`` body with a ``finally``."""
    lines: set[int] = set()

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _INNER):
                continue
            guarded = inside
            if isinstance(child, ast.stmt) and guarded:
                lines.add(child.lineno)
            if isinstance(child, (ast.With, ast.AsyncWith)) or (
                isinstance(child, ast.Try) and child.finalbody
            ):
                for stmt in child.body:
                    lines.add(stmt.lineno)
                    visit(stmt, True)
                for rest in (getattr(child, "handlers", []), getattr(child, "orelse", [])):
                    for stmt in rest:
                        visit(stmt, inside)
                for stmt in getattr(child, "finalbody", []):
                    visit(stmt, inside)
                if isinstance(child, (ast.With, ast.AsyncWith)):
                    for item in child.items:
                        visit(item, inside)
            else:
                visit(child, guarded)

    visit(scope, False)
    return lines


def _unguarded(source: str, name: str) -> list[str]:
    """Lines of ``source`` inside a ``with`` or ``try``/``finally`` whose first
    instruction no exception handler covers: an exception raised as that line starts (a
    trace function's, a debugger's) skips the exit or the ``finally``."""
    scopes = _scopes_of(ast.parse(source))

    def codes(code: CodeType) -> Iterator[CodeType]:
        yield code
        for const in code.co_consts:
            if isinstance(const, CodeType):
                yield from codes(const)

    found = []
    for code in codes(compile(source, name, "exec")):
        scope = scopes.get((code.co_name, code.co_firstlineno))
        if scope is None:
            continue  # a lambda or a comprehension: its exceptions leave through a call
        guarded = _protected_lines(scope)
        entries = dis.Bytecode(code).exception_entries
        for offset, line in dis.findlinestarts(code):
            if line in guarded and not any(e.start <= offset < e.end for e in entries):
                found.append(f"{name}:{line} ({code.co_name})")
    return found


_ESCAPES = """
def f(x):
    with x:
        try:
            return x
        finally:
            pass
"""


def test_no_recorder_line_inside_a_with_or_finally_escapes_its_handler() -> None:
    """The recorder runs inside the user's forward, where a Ctrl-C can come at any line:
    a ``with torch._C.DisableTorchFunction()`` left without its exit disables torch
    functions for the thread (every later recording sees no op). Python 3.11 leaves the
    first instruction of some lines (a ``try:``, a loop's head) in such a body out of
    the enclosing handler; the recorder has none of them."""
    found = [
        line
        for path in sorted((PACKAGE / "recorder").glob("*.py"))
        for line in _unguarded(path.read_text(), path.name)
    ]
    assert found == []
    if sys.version_info[:2] == (3, 11):  # the check finds what it looks for
        assert _unguarded(_ESCAPES, "escapes") == ["escapes:4 (f)"]
        interrupted = []

        def at_try(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == 4 and frame.f_code.co_name == "f":
                raise KeyboardInterrupt
            return at_try

        scope: dict[str, Any] = {}
        exec(compile(_ESCAPES, "escapes", "exec"), scope)
        block = torch._C.DisableTorchFunction()
        sys.settrace(lambda frame, event, arg: at_try if frame.f_code.co_name == "f" else None)
        try:
            scope["f"](block)
        except KeyboardInterrupt:
            interrupted.append(torch._C._is_torch_function_enabled())
        finally:
            sys.settrace(None)
            if not torch._C._is_torch_function_enabled():
                block.__exit__(None, None, None)  # what the skipped exit would have done
        assert interrupted == [False]
        assert torch._C._is_torch_function_enabled()


@pytest.mark.parametrize("which", ["register_forward_pre_hook", "register_forward_hook"])
def test_a_ctrl_c_inside_torchs_hook_registration_leaves_no_hook(
    tmp_path: Path, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hook is in the model's dicts but torch never returned its handle.
    model, x = _net()
    store = tl.open(tmp_path / "s")
    register = getattr(model, which)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        register(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(model, which, interrupted)
    with pytest.raises(KeyboardInterrupt):
        _record_block(store, model, x)
    monkeypatch.undo()
    _clean()
    assert not (model._forward_pre_hooks or model._forward_hooks)
    assert not (model._forward_hooks_with_kwargs or model._forward_hooks_always_called)
    _record_block(store, model, x)
    assert list(store.runs()["name"]) == ["block"]
