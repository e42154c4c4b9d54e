"""How tracelake's objects show in a notebook: the ``_repr_html_`` of ``Store`` (its runs),
``Run`` (meta, steps, op count, size, provenance), a trace, a query's ``Result`` (tensor
cells summarised, with a small histogram each) and a ``Comparison``.

Everything shown is escaped: run names, meta, labels and module paths come from whoever
recorded the store. Each view reads its object through its public interface and shows a
bounded number of rows (:data:`MAX_ROWS`), saying how many more there are.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tracelake.query.results import describe

if TYPE_CHECKING:
    from tracelake.query.results import Result
    from tracelake.recorder.trace import TraceView
    from tracelake.store import Comparison, Run, Store

__all__ = [
    "MAX_ROWS",
    "comparison_html",
    "human_bytes",
    "result_html",
    "run_html",
    "sparkline",
    "store_html",
    "trace_html",
]

#: Rows a table shows before saying how many more there are.
MAX_ROWS = 50
_BINS = 16

_STYLE = (
    "<style>"
    ".tracelake table{border-collapse:collapse;font-size:12px;margin:4px 0}"
    ".tracelake th{text-align:left;background:#f2f2f2;padding:2px 8px;"
    "border-bottom:1px solid #ccc}"
    ".tracelake td{padding:2px 8px;border-bottom:1px solid #eee;vertical-align:middle;"
    "font-family:monospace}"
    ".tracelake .tl-title{font-weight:bold;margin:2px 0}"
    ".tracelake .tl-muted{color:#777}"
    ".tracelake .tl-bad{color:#b10026;font-weight:bold}"
    ".tracelake .tl-ok{color:#1a7f37}"
    "</style>"
)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def human_bytes(n: Any) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _cell(value: Any) -> str:
    """A table cell's HTML: tensors summarised with a histogram, the rest as text."""
    if isinstance(value, torch.Tensor):
        return f"{_e(describe(value))} {sparkline(value)}"
    if isinstance(value, float):
        return "" if math.isnan(value) else _e(f"{value:.6g}")
    if isinstance(value, (dict, list)):
        return _e(json.dumps(value, default=str))
    return "" if value is None else _e(value)


def sparkline(tensor: torch.Tensor, bins: int = _BINS, width: int = 64, height: int = 16) -> str:
    """A small inline SVG histogram of a tensor's finite values ("" when it has none)."""
    if tensor.is_complex() or tensor.numel() == 0:
        return ""
    values = tensor.detach().reshape(-1).to(torch.float64)
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return ""
    lo, hi = float(values.min()), float(values.max())
    counts = torch.histc(values, bins=bins, min=lo, max=hi if hi > lo else lo + 1).tolist()
    top = max(counts) or 1.0
    w = width / bins
    bars = "".join(
        f'<rect x="{i * w:.1f}" y="{height - h:.1f}" width="{w - 0.5:.1f}" height="{h:.1f}"/>'
        for i, c in enumerate(counts)
        if (h := height * c / top) > 0
    )
    title = _e(f"histogram of {values.numel()} finite values, {lo:.4g} to {hi:.4g}")
    return (
        f'<svg width="{width}" height="{height}" style="vertical-align:middle" '
        f'fill="#4c78a8"><title>{title}</title>{bars}</svg>'
    )


def _table(columns: Sequence[str], rows: Iterable[Sequence[Any]], total: int) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = []
    for i, row in enumerate(rows):
        if i == MAX_ROWS:
            break
        body.append("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
    more = f'<p class="tl-muted">… {total - MAX_ROWS} more rows</p>' if total > MAX_ROWS else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"


def _box(title: str, *parts: str) -> str:
    return f'<div class="tracelake">{_STYLE}<p class="tl-title">{title}</p>{"".join(parts)}</div>'


def _pairs(items: Iterable[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_cell(v)}</td></tr>" for k, v in items)
    return f"<table><tbody>{rows}</tbody></table>"


def store_html(store: Store) -> str:
    """The store's path and its complete runs, one row each."""
    frame = store.runs()
    columns = ["name", "created", "steps", "ops", "size", "model_class", "torch_version", "meta"]
    rows = (
        [
            r["name"],
            r["created"],
            r["steps"],
            r["ops"],
            human_bytes(r["bytes"]),
            r["model_class"],
            r["torch_version"],
            r["meta"],
        ]
        for r in frame.head(MAX_ROWS).to_dict("records")
    )
    title = f"Store {_e(store.path)}: {len(frame)} run{'s' if len(frame) != 1 else ''}"
    return _box(title, _table(columns, rows, len(frame)))


#: Provenance fields of a run's catalog row, in the order a run's view lists them.
_PROVENANCE = (
    "created",
    "finished",
    "host",
    "pid",
    "device",
    "torch_version",
    "param_fingerprint",
    "input_fingerprint",
)


def run_html(run: Run) -> str:
    """A run's meta, steps, op count, size and provenance."""
    info = run.info
    summary = [
        ("model", run.model_class),
        ("steps", run.num_steps),
        ("ops", info.get("op_count")),
        ("size", human_bytes(info.get("bytes"))),
    ]
    meta = run.meta
    meta_rows = list(meta.items()) if isinstance(meta, dict) else [("meta", meta)]
    parts = [_pairs(summary)]
    if meta is not None:
        parts += ['<p class="tl-title">meta</p>', _pairs(meta_rows)]
    provenance = [(k, info[k]) for k in _PROVENANCE if info.get(k) is not None]
    parts += ['<p class="tl-title">provenance</p>', _pairs(provenance)]
    return _box(f"Run {_e(run.name)}", *parts)


_OP_COLUMNS = ("label", "func", "module", "shape", "dtype", "saved", "mean", "std", "absmax")


def trace_html(view: TraceView) -> str:
    """A trace's (or a run step's) counts, then its first ops with their statistics."""
    ops = list(view)
    saved = sum(op.saved for op in ops)
    run = getattr(view, "run", None)  # a step of a stored run
    model = getattr(view, "model_class", None) or getattr(run, "model_class", None)
    where = f"run {run.name}, step {getattr(view, 'step', 0)}: " if run is not None else ""
    title = _e(f"{where}{model or 'Trace'}: {len(ops)} ops")
    summary: list[tuple[str, Any]] = [("saved", saved), ("module calls", len(view.modules))]
    if hasattr(view, "nbytes_saved"):
        summary.append(("saved bytes", human_bytes(view.nbytes_saved)))
    rows = []
    for op in ops[:MAX_ROWS]:
        stats = op.stats
        numbers = [None if stats is None else getattr(stats, s) for s in ("mean", "std", "absmax")]
        dtype = str(op.dtype).removeprefix("torch.")
        rows.append([op.label, op.func, op.module, list(op.shape), dtype, op.saved, *numbers])
    return _box(title, _pairs(summary), _table(_OP_COLUMNS, rows, len(ops)))


def result_html(result: Result) -> str:
    """A query result's rows; tensor cells as shape, dtype, mean ± std and a histogram."""
    columns = result.columns
    rows = ([row[c] for c in columns] for row in result)
    title = f"Result: {len(result)} row{'s' if len(result) != 1 else ''}"
    return _box(title, _table(columns, rows, len(result)))


_COMPARED = ("key", "func", "module", "status", "max_abs_diff", "rel_l2", "cosine", "allclose")


def comparison_html(comparison: Comparison) -> str:
    """A comparison's counts by status, its first divergence, and its first rows."""
    summary = comparison.summary()
    title = f"Comparison {_e(comparison.a)} vs {_e(comparison.b)} on {_e(comparison.on)}"
    counts = _pairs(summary.items())
    first = comparison.first_divergence()
    if first is None:
        verdict = '<p class="tl-ok">no divergence within the tolerances</p>'
    else:
        verdict = (
            f'<p class="tl-bad">first divergence: {_e(first["key"])} '
            f"({_e(first['func'])} in {_e(first['module'] or 'the top level')}): "
            f"{_e(first['reason'] or _max_diff(first))}</p>"
        )
    rows = ([row[c] for c in _COMPARED] for row in comparison.rows(limit=MAX_ROWS))
    return _box(title, counts, verdict, _table(_COMPARED, rows, len(comparison)))


def _max_diff(row: dict[str, Any]) -> str:
    value = row.get("max_abs_diff")
    return f"max |a - b| = {value:.4g}" if isinstance(value, float) else "differs"
