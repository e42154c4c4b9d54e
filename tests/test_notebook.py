"""A real notebook, executed headless (nbclient, an IPython kernel): the %tlq magics bind
notebook variables and raise on errors, and the reprs, graphs and plots display as a
user sees them (issue 14 items 2 and 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import torch
from model_zoo import mlp
from nbclient import NotebookClient

import tracelake as tl

CELLS = [
    "import tracelake as tl\nstore = tl.open(STORE, create=False)\nstore",
    "%load_ext tracelake",
    "fn = 'relu'\nr = %tlq select run, label, out, absmax from ops where func = :fn\nr",
    "%%tlq store -o picked\nselect run, label, absmax from ops\nwhere label = :lbl",
    "len(picked), type(picked).__name__",
    "store['base']",
    "store['base'].graph(color='absmax')",
    "ax = r.plot('absmax', x='label')",
    "store.compare('base', 'ft')",
    "r.df()",
    "%tlq select nope from ops",
    "%tlq no_such_store.tl select label from ops",
]
RAISES = {10, 11}


def _notebook(store: str) -> Any:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"STORE = {store!r}\nlbl = 'relu_1_2'")]
    for k, source in enumerate(CELLS):
        cell = nbformat.v4.new_code_cell(source)
        if k in RAISES:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    return nb


def _outputs(cell: Any, kind: str) -> list[Any]:
    return [o for o in cell.outputs if o.output_type == kind]


def _data(cell: Any, mime: str) -> str:
    found = [o.data[mime] for o in cell.outputs if mime in o.get("data", {})]
    assert found, f"no {mime} output for {cell.source!r}: {cell.outputs}"
    return str(found[0])


def test_notebook_runs_magics_reprs_graphs_and_plots(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "runs.tl")
    model, inputs = mlp()
    store.record(model, *inputs, name="base", save=tl.all(), meta={"lr": 0.1})
    with torch.no_grad():
        model[2].weight.add_(0.1)
    store.record(model, *inputs, name="ft", save=tl.all())

    nb = _notebook(store.path)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    cells = nb.cells[1:]
    assert "Store" in _data(cells[0], "text/html") and "ft" in _data(cells[0], "text/html")
    relu = _data(cells[2], "text/html")
    assert "Result: 4 rows" in relu and relu.count("<svg") == 4 and "tensor(" not in relu
    assert "<Result: 2 rows" in _data(cells[3], "text/plain")  # the cell displays it...
    assert _data(cells[4], "text/plain") == "(2, 'Result')"  # ...and -o stored it
    run_html = _data(cells[5], "text/html")
    assert "Run base" in run_html and "lr" in run_html and "provenance" in run_html
    svg = _data(cells[6], "image/svg+xml")
    assert "<svg" in svg and "colour: absmax" in svg
    assert _data(cells[7], "image/png")  # the inline backend drew the figure
    assert "first divergence" in _data(cells[8], "text/html")
    assert "tensor(" not in _data(cells[9], "text/plain")
    error = _outputs(cells[10], "error")[0]
    assert error.ename == "QueryCompileError" and "^^^^" in error.evalue
    assert _outputs(cells[11], "error")[0].ename == "StoreNotFoundError"
