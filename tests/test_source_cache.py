"""The recorder's process-wide caches follow what is alive: a notebook cell re-run
thousands of times (a model class defined anew each time) leaves memory flat."""

from __future__ import annotations

import ast
import gc
import inspect
import os
import weakref
from pathlib import Path
from typing import Any

import torch

import tracelake as tl
from tracelake.recorder import intercept
from tracelake.recorder.intercept import SourceFinder

CELL = """
def scale(x):
    # a user function that dispatches like a torch function: it reaches the mode
    if torch.overrides.has_torch_function((x,)):
        return torch.overrides.handle_torch_function(scale, (x,), x)
    return x * 2


class Cell(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return scale(torch.relu(self.lin(x)) + 1)
"""


def _rerun_cell(x: torch.Tensor, codes: list[weakref.ref], funcs: list[weakref.ref]) -> None:
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(CELL, "<cell>", "exec"), namespace)
    codes.append(weakref.ref(namespace["Cell"].forward.__code__))
    funcs.append(weakref.ref(namespace["scale"]))
    log = tl.trace(namespace["Cell"](), x)
    assert log["relu_1_2"].source is not None and log["relu_1_2"].source.file == "<cell>"
    log.cleanup()


def test_ten_thousand_cell_reruns_leave_the_caches_flat() -> None:
    x = torch.randn(2, 4)
    codes: list[weakref.ref] = []
    funcs: list[weakref.ref] = []
    peaks = []
    for k in range(10_000):
        _rerun_cell(x, codes, funcs)
        if k % 1000 == 999:
            gc.collect()
            peaks.append((*_sizes(), sum(r() is not None for r in codes + funcs)))
    # Each count stays under a bound that does not grow with the number of re-runs:
    # without the trims, all 10,000 cells' code and functions would still be alive.
    for n_codes, n_funcs, alive in peaks:
        assert n_codes <= _BOUND + 200 and n_funcs <= _BOUND + 200, peaks
        assert alive <= 2 * _BOUND, peaks
    assert len(SourceFinder.codes) == len(SourceFinder._seen)


def test_cell_reruns_stay_flat_while_the_cycle_collector_waits() -> None:
    """Each cell's dead class and functions sit in reference cycles (with the cell's
    globals) until the cycle collector runs: the trims must not wait for it to."""
    x = torch.randn(2, 4)
    peaks = []
    gc.collect()
    gc.disable()
    try:
        for k in range(6_000):
            _rerun_cell(x, [], [])
            if k % 500 == 499:
                peaks.append(_sizes())
    finally:
        gc.enable()
    for n_codes, n_funcs in peaks:
        assert n_codes <= _BOUND + 200 and n_funcs <= _BOUND + 200, peaks


#: The caches' size bound: a trim sweeps at twice what the last sweep left alive.
_BOUND = 2 * intercept._SWEEP_MIN + 8


def _sizes() -> tuple[int, int]:
    return len(SourceFinder.codes), len(intercept._FUNCS)


def _cell_model() -> torch.nn.Module:
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(CELL, "<cell>", "exec"), namespace)
    return namespace["Cell"]()


def test_trim_forgets_dead_code_only() -> None:
    kept, dropped = _cell_model(), _cell_model()
    x = torch.randn(2, 4)
    tl.trace(kept, x).cleanup()
    tl.trace(dropped, x).cleanup()
    kept_code = type(kept).forward.__code__
    dropped_code = weakref.ref(type(dropped).forward.__code__)
    assert {id(kept_code), id(dropped_code())} <= set(SourceFinder.codes)
    del dropped
    gc.collect()
    assert dropped_code() is not None  # only the cache holds it now
    SourceFinder._sweep_at = 0
    SourceFinder.trim()
    assert dropped_code() is None
    assert id(kept_code) in SourceFinder.codes
    assert id(torch.nn.Module._call_impl.__code__) in SourceFinder.codes  # torch's, alive
    assert SourceFinder._sweep_at >= intercept._SWEEP_MIN
    log = tl.trace(kept, x)  # the kept code's sites are still right
    assert log["relu_1_2"].source.file == "<cell>"


def test_internal_roots_do_not_import_the_facade() -> None:
    """The recorder finds the facade's folder from its import spec, not by importing it."""
    source = Path(intercept.__file__).read_text()
    imported = {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "tracelake" not in imported
    roots, files = intercept._internal_roots()
    facade = Path(tl.__file__).parent
    want = {str(p) for p in facade.glob("*.py") if p.name != "demo.py"}
    assert set(files) == want and str(facade / "demo.py") not in files
    here = str(Path(intercept.__file__).parent) + os.sep
    assert here in roots


def test_call_site_lines_are_those_co_lines_gives() -> None:
    # the recorder reads a call site's line from a per-function table by bisection;
    # differential against the plain scan of co_lines, at every offset of many functions
    from tracelake.recorder.entries import _line_at

    def scan(code: Any, offset: int) -> int:
        return next(
            (line for s, e, line in code.co_lines() if s <= offset < e and line is not None),
            code.co_firstlineno,
        )

    functions = (*vars(torch.nn.functional).values(), *vars(torch.nn.Module).values())
    codes = [f.__code__ for f in functions if inspect.isfunction(f)][:300]
    codes.append(test_call_site_lines_are_those_co_lines_gives.__code__)
    assert len(codes) > 100
    for code in codes:
        for offset in range(0, len(code.co_code) + 4, 2):
            assert _line_at(code, offset) == scan(code, offset), (code, offset)
