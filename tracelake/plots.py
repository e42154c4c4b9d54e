"""Plots with matplotlib (``pip install 'tracelake[pictures]'``): a numeric column of a query
result across layers or runs (``result.plot``), a tensor's histogram or heatmap
(``result.hist`` / ``result.heatmap``, or :func:`hist` / :func:`heatmap` of any tensor),
and how a comparison's difference grows with depth (``comparison.plot``).

Each function draws on ``ax`` when given (else on a new figure) and returns the Axes.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tracelake.errors import RenderError

if TYPE_CHECKING:
    from tracelake.query.results import Result
    from tracelake.store import Comparison

__all__ = ["heatmap", "hist", "plot_comparison", "plot_result"]

#: Columns ``result.plot`` puts on the x axis when none is named, the first present.
_X_DEFAULTS = ("block", "layer", "label", "key", "idx")


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RenderError(
            "plots need matplotlib: pip install 'tracelake[pictures]' (or pip install matplotlib)"
        ) from exc
    return plt


def _axes(ax: Any) -> Any:
    if ax is not None:
        return ax
    _figure, new = _pyplot().subplots(figsize=(7, 3.5))
    return new


def _pick(name: str, known: Sequence[str], what: str) -> str:
    if name in known:
        return name
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"no {what} {name!r}{hint} (one of {', '.join(known)})")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None if value is None else float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value)
    raise ValueError(
        f"plot a numeric column (a statistic, a reduction such as mean(out[0])); "
        f"this one holds {type(value).__name__} values: for a tensor column use "
        "result.hist(column) or result.heatmap(column)"
    )


def plot_result(
    result: Result, y: str, x: str | None = None, by: str | None = None, ax: Any = None
) -> Any:
    """Column ``y`` (numeric) against ``x`` (default: ``block``, ``layer``, ``label``,
    ``key`` or ``idx``, the first the result has; else the row number), one line per
    value of ``by`` (default ``run`` when the result has several runs)."""
    columns = list(result.columns)
    y = _pick(y, columns, "column")
    if x is None:
        x = next((c for c in _X_DEFAULTS if c in columns), None)
    elif x is not None:
        x = _pick(x, columns, "column")
    rows = list(result)
    if by is None and "run" in columns and len({r["run"] for r in rows}) > 1:
        by = "run"
    elif by is not None:
        by = _pick(by, columns, "column")
    ax = _axes(ax)
    groups: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(None if by is None else row[by], []).append(row)
    categorical = x is not None and any(isinstance(r[x], str) for r in rows)
    ticks: dict[Any, int] = {}
    for key, members in groups.items():
        xs, ys = [], []
        for k, row in enumerate(members):
            value = _number(row[y])
            if value is None:
                continue
            at: Any = k if x is None else row[x]
            if categorical:
                at = ticks.setdefault(at, len(ticks))
            xs.append(at)
            ys.append(value)
        ax.plot(xs, ys, marker="o", markersize=3, label=None if by is None else str(key))
    if categorical:
        ax.set_xticks(list(ticks.values()), [str(t) for t in ticks], rotation=60, ha="right")
    ax.set_xlabel(x or "row")
    ax.set_ylabel(y)
    if by is not None:
        ax.legend(title=by, fontsize="small")
    ax.figure.tight_layout()
    return ax


def _tensor_of(result: Result, column: str | None, row: int) -> tuple[torch.Tensor, str]:
    tensors = result.tensors(column)
    if not 0 <= row < len(tensors):
        raise ValueError(f"row {row} does not exist: the result has {len(tensors)} rows")
    tensor = tensors[row]
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"row {row} has no saved tensor to plot (filter with `saved = true`)")
    return tensor, str(list(result)[row].get("label", f"row {row}"))


def hist(tensor: torch.Tensor, bins: int = 50, ax: Any = None, title: str | None = None) -> Any:
    """A histogram of a tensor's finite values."""
    values = tensor.detach().reshape(-1)
    if values.is_complex():
        values = values.abs()
    values = values.to(torch.float64)
    values = values[torch.isfinite(values)]
    ax = _axes(ax)
    ax.hist(values.numpy(), bins=bins, color="#4c78a8")
    ax.set_xlabel("value")
    ax.set_ylabel("count")
    ax.set_title(title or f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}")
    ax.figure.tight_layout()
    return ax


def heatmap(tensor: torch.Tensor, ax: Any = None, title: str | None = None) -> Any:
    """A heatmap of a tensor as a matrix: its last dimension across, every leading one
    flattened down (slice it first to pick a 2-D part: ``out[0]``)."""
    data = tensor.detach()
    if data.is_complex():
        data = data.abs()
    data = data.to(torch.float64)
    if data.dim() == 0:
        data = data.reshape(1, 1)
    data = data.reshape(-1, data.shape[-1])
    ax = _axes(ax)
    image = ax.imshow(data.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.figure.colorbar(image, ax=ax)
    ax.set_xlabel(f"dim {tensor.dim() - 1}" if tensor.dim() else "")
    ax.set_ylabel("rows" if tensor.dim() > 2 else "dim 0")
    ax.set_title(title or f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}")
    ax.figure.tight_layout()
    return ax


def result_hist(
    result: Result, column: str | None = None, row: int = 0, bins: int = 50, ax: Any = None
) -> Any:
    tensor, name = _tensor_of(result, column, row)
    return hist(tensor, bins=bins, ax=ax, title=name)


def result_heatmap(result: Result, column: str | None = None, row: int = 0, ax: Any = None) -> Any:
    tensor, name = _tensor_of(result, column, row)
    return heatmap(tensor, ax=ax, title=name)


def _tick(value: Any) -> str:
    """A block's tick label: ``3``, not the ``3.0`` a column with nulls holds."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def plot_comparison(
    comparison: Comparison, by: str = "block", metric: str | None = None, ax: Any = None
) -> Any:
    """``metric`` of the compared pairs per block (how a difference grows with depth) or
    per module in execution order; a log scale where the values span decades. The
    default metric: ``max_abs_diff``, or for a statistics-only comparison its first
    summary column (``max_abs_d_mean``)."""
    if by not in ("block", "module"):
        raise ValueError(f"plot a comparison by 'block' or 'module', not {by!r}")
    frame = comparison.by_block() if by == "block" else comparison.by_module()
    known = [c for c in frame.columns if c != "ops"]
    if metric is None:
        metric = "max_abs_diff" if "max_abs_diff" in known else known[0]
    metric = _pick(metric, known, "summary column")
    series = frame[metric]
    if series.index.nlevels > 1:  # a statistics comparison against several runs
        table = series.unstack(0)
    else:
        table = series.to_frame(f"{comparison.a} vs {comparison.b}")
    ax = _axes(ax)
    positions = list(range(len(table.index)))
    for name in table.columns:
        ax.plot(positions, table[name].to_numpy(dtype=float), marker="o", label=str(name))
    names = [_tick(i) for i in table.index]
    ax.set_xticks(positions, names, rotation=0 if by == "block" else 60)
    values = table.to_numpy(dtype=float)
    positive = values[values > 0]
    if positive.size and positive.max() / positive.min() > 1e3:
        ax.set_yscale("log")
    ax.set_xlabel(by)
    ax.set_ylabel(metric)
    ax.set_title(f"{comparison.a} vs {comparison.b}")
    ax.legend(fontsize="small")
    ax.figure.tight_layout()
    return ax
