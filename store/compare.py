"""Comparing two recordings op by op: ``store.compare(a, b)`` returns a :class:`Comparison`.

Either side is a stored run (by name or :class:`~tracelake.store.run.Run`) or an
in-memory :class:`~tracelake.Trace`. Ops are aligned by their stable ``key`` (default),
their ``label``, or, with ``on="module"``, module calls by their label (each output
tensor of the call a pair). What only one side has is a row saying so, never an error;
shape mismatches are rows with a reason. Tensors of different dtypes (fp32 vs bf16) are
compared in float64.

Memory stays bounded: a pair's tensors are read and reduced a slice at a time (stored
tensors read only the chunks of the slice), so neither run is ever held whole, and
only each pair's metrics are kept. The statistics' differences come from the stored
statistics and read no tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import torch

from tracelake.errors import StoreError
from tracelake.recorder.entries import OpEntry
from tracelake.recorder.record import STAT_FIELDS, Stats
from tracelake.recorder.selectors import Selector
from tracelake.recorder.trace import TraceView

from .metrics import PairMetrics, Sums, row_slices

if TYPE_CHECKING:
    import pandas
    import pyarrow as pa

__all__ = ["Comparison", "StatsComparison", "compare"]

Align = Literal["key", "label", "module"]
_ALIGNMENTS = ("key", "label", "module")
#: The statistics whose difference (b - a) each row carries.
_STAT_DIFFS = tuple(name for name in STAT_FIELDS if name not in ("nan_count", "inf_count"))


def _slices(entry: Any, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """The entry's tensor a slice of leading rows at a time (stored tensors read only
    the chunks each slice needs)."""
    lazy = getattr(entry, "array", None) if isinstance(entry, OpEntry) else None
    return row_slices(lazy if lazy is not None else entry_tensor(entry), shape)


def entry_tensor(entry: Any) -> torch.Tensor:
    """An op entry's saved tensor, or a module output (a tensor already)."""
    tensor = entry.out if isinstance(entry, OpEntry) else entry
    if not isinstance(tensor, torch.Tensor):
        raise StoreError(f"{getattr(entry, 'label', entry)!r} has no saved tensor to compare")
    return tensor


@dataclass
class _Item:
    """One side's entry for an aligned key: an op entry, or a module output tensor."""

    key: str
    step: int
    entry: Any  # OpEntry, or a tensor (module outputs)
    label: str
    func: str
    module: str
    block: int | None
    shape: tuple[int, ...]
    dtype: str
    order: int
    stats: Stats | None
    saved: bool
    #: Items of one group pair up in order (by call site first, when the two sides
    #: made different numbers of calls): a key less its ordinal, or the whole key.
    group: str = ""
    site: Any = None
    run: str = ""


_COLUMNS = (
    "run_b",
    "step_a",
    "step_b",
    "key",
    "key_b",
    "label_a",
    "label_b",
    "func",
    "module",
    "block",
    "status",
    "reason",
    "shape_a",
    "shape_b",
    "dtype_a",
    "dtype_b",
    *(f.name for f in fields(PairMetrics)),
    *(f"d_{name}" for name in _STAT_DIFFS),
)


class Comparison:
    """Two recordings aligned op by op, with how each aligned pair differs.

    Rows come in ``a``'s execution order (then what only ``b`` has). ``status`` is
    ``"compared"`` (both saved: tensor metrics), ``"not saved"`` (statistics only),
    ``"only a"`` / ``"only b"``, or ``"shape mismatch"`` (``reason`` says how).
    Tensor metrics are computed when first asked for (``df()``, ``arrow()``,
    ``rows()``, ``by_module()``, ``by_block()``); ``first_divergence`` computes only
    as far as it must."""

    def __init__(
        self,
        name_a: str,
        name_b: str,
        pairs: list[tuple[_Item | None, _Item | None]],
        on: str,
        atol: float,
        rtol: float,
        tensors: bool,
    ):
        self.a = name_a
        self.b = name_b
        self.on = on
        self.atol = atol
        self.rtol = rtol
        self._pairs = pairs
        self._tensors = tensors
        self._rows: list[dict[str, Any] | None] = [None] * len(pairs)
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    def _row(self, k: int) -> dict[str, Any]:
        row = self._rows[k]
        if row is None:
            a, b = self._pairs[k]
            row = self._rows[k] = _compare_pair(
                a, b, self.atol, self.rtol, self._tensors, self._scratch
            )
        return row

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Every row (or the first ``limit``) as a dict (columns as in :meth:`df`)."""
        from tracelake.progress import Progress

        count = len(self._pairs) if limit is None else min(limit, len(self._pairs))
        todo = [k for k in range(count) if self._rows[k] is None]
        with Progress(f"comparing {self.a} and {self.b}", len(todo), "pairs") as bar:
            for k in todo:
                self._row(k)
                bar.advance()
        return [self._row(k) for k in range(count)]

    def row(self, k: int) -> dict[str, Any]:
        """Row ``k`` alone (computing only its pair's metrics): a window of a long
        comparison without reading every tensor."""
        return self._row(k)

    def df(self) -> pandas.DataFrame:
        """One row per aligned pair (or one-sided entry)."""
        import pandas

        return _int_blocks(pandas.DataFrame(self.rows(), columns=list(_COLUMNS)))

    def arrow(self) -> pa.Table:
        """The comparison's rows as an Arrow table (what ``df()`` holds)."""
        import pyarrow as pa

        rows = self.rows()
        columns = {
            name: [None if isinstance(v, float) and math.isnan(v) else v for v in values]
            for name, values in ((c, [r[c] for r in rows]) for c in _COLUMNS)
        }
        for name in ("shape_a", "shape_b"):
            columns[name] = [None if s is None else list(s) for s in columns[name]]
        return pa.table(columns)

    def first_divergence(
        self, atol: float | None = None, rtol: float | None = None
    ) -> dict[str, Any] | None:
        """The first compared pair, in ``a``'s execution order, whose tensors are not
        all close (``atol`` / ``rtol`` default to the comparison's), or whose shapes
        differ; None if there is none. Reads tensors only up to that pair."""
        atol = self.atol if atol is None else atol
        rtol = self.rtol if rtol is None else rtol
        for k, (a, b) in enumerate(self._pairs):
            if a is None or b is None:
                continue
            if a.shape != b.shape:
                return self._row(k)
            if not (a.saved and b.saved and self._tensors):
                continue
            if (atol, rtol) == (self.atol, self.rtol):
                row = self._row(k)
            else:
                row = _compare_pair(a, b, atol, rtol, True)
            if not row["allclose"]:
                return row
        return None

    def _grouped(self, column: str) -> pandas.DataFrame:
        frame = self.df()
        compared = frame[frame["status"] == "compared"]
        return compared.groupby(column, sort=False, dropna=True).agg(
            ops=("key", "size"),
            max_abs_diff=("max_abs_diff", "max"),
            mean_abs_diff=("mean_abs_diff", "mean"),
            max_rel_l2=("rel_l2", "max"),
            min_cosine=("cosine", "min"),
            not_close=("allclose", lambda s: int((~s.astype(bool)).sum())),
        )

    def by_module(self) -> pandas.DataFrame:
        """Compared pairs summarised per innermost module, in execution order."""
        return self._grouped("module")

    def by_block(self) -> pandas.DataFrame:
        """Compared pairs summarised per block index (``h.3`` -> 3), sorted by block:
        how a difference grows with depth."""
        return self._grouped("block").sort_index()

    def summary(self) -> dict[str, int]:
        """How many rows of each status (reads no tensor)."""
        counts: dict[str, int] = {}
        for a, b in self._pairs:
            status = _status(a, b, self._tensors)[0]
            counts[status] = counts.get(status, 0) + 1
        return counts

    def __repr__(self) -> str:
        parts = ", ".join(f"{n} {s}" for s, n in self.summary().items())
        return f"<Comparison {self.a!r} vs {self.b!r} on {self.on}: {len(self)} rows ({parts})>"

    def _repr_html_(self) -> str:
        from tracelake.reprs import comparison_html  # notebook display sits downstream

        return comparison_html(self)

    def plot(self, by: str = "block", metric: str | None = None, ax: Any = None) -> Any:
        """How the difference grows with depth: ``metric`` (default ``max_abs_diff``)
        of the compared pairs per block (``by="block"``) or per module
        (``by="module"``), plotted with matplotlib; returns the Axes. See
        :mod:`tracelake.plots`."""
        from tracelake.plots import plot_comparison

        return plot_comparison(self, by=by, metric=metric, ax=ax)


def _status(a: _Item | None, b: _Item | None, tensors: bool) -> tuple[str, str | None]:
    if a is None:
        return "only b", None
    if b is None:
        return "only a", None
    if a.shape != b.shape:
        return "shape mismatch", f"shape {list(a.shape)} vs {list(b.shape)}"
    if not (a.saved and b.saved) or not tensors:
        missing = [side for side, item in (("a", a), ("b", b)) if not item.saved]
        return "not saved", f"not saved in {' and '.join(missing)}" if missing else None
    return "compared", None


def _compare_pair(
    a: _Item | None,
    b: _Item | None,
    atol: float,
    rtol: float,
    tensors: bool,
    scratch: dict[torch.dtype, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One row (reading both sides' tensors a slice at a time, when compared)."""
    status, reason = _status(a, b, tensors)
    any_side = a if a is not None else b
    assert any_side is not None
    row: dict[str, Any] = {
        "run_b": b.run if b else None,
        "step_a": a.step if a else None,
        "step_b": b.step if b else None,
        "key": any_side.key,
        "key_b": b.key if b else None,
        "label_a": a.label if a else None,
        "label_b": b.label if b else None,
        "func": any_side.func,
        "module": any_side.module,
        "block": any_side.block,
        "status": status,
        "reason": reason,
        "shape_a": a.shape if a else None,
        "shape_b": b.shape if b else None,
        "dtype_a": a.dtype if a else None,
        "dtype_b": b.dtype if b else None,
    }
    metrics: PairMetrics | None = None
    if status == "compared":
        assert a is not None and b is not None
        norms = _norms(a.stats, b.stats)
        sums = Sums(atol, rtol, a.stats.absmax if a.stats is not None else None, scratch)
        for x, y in zip(_slices(a.entry, a.shape), _slices(b.entry, b.shape), strict=True):
            sums.add(x, y, own_norms=norms is None)
        metrics = sums.metrics(norms)
    for f in fields(PairMetrics):
        row[f.name] = getattr(metrics, f.name) if metrics else None
    sa, sb = (a.stats if a else None), (b.stats if b else None)
    for name in _STAT_DIFFS:
        va, vb = getattr(sa, name, None), getattr(sb, name, None)
        row[f"d_{name}"] = vb - va if va is not None and vb is not None else None
    return row


def _norms(a: Stats | None, b: Stats | None) -> tuple[float, float] | None:
    """Both sides' L2 norms from their recorded statistics, when both are finite."""
    if a is None or b is None or a.l2 is None or b.l2 is None:
        return None
    if not (math.isfinite(a.l2) and math.isfinite(b.l2)) or a.nan_count or b.nan_count:
        return None
    return a.l2, b.l2


def _op_items(view: TraceView, step: int, on: str, keep: Selector | None) -> list[_Item]:
    items = []
    for op in view:
        if keep is not None and not keep.matches_op(op):
            continue
        items.append(
            _Item(
                key=op.key if on == "key" else op.label,
                step=step,
                entry=op,
                label=op.label,
                func=op.func,
                module=op.module,
                block=op.block,
                shape=tuple(op.shape),
                dtype=str(op.dtype).removeprefix("torch."),
                order=op.index,
                stats=op.stats,
                saved=op.saved,
                group=_group(op.key) if on == "key" else op.label,
                site=_site(op),
            )
        )
    return items


def _group(key: str) -> str:
    """A key less its ordinal (``h.0.attn:view#2.1`` -> ``h.0.attn:view.1``)."""
    head, sep, tail = key.rpartition("#")
    if not sep:
        return key
    _, dot, out_index = tail.partition(".")
    return f"{head}{dot}{out_index}"


def _site(op: OpEntry) -> Any:
    source = op.source
    return None if source is None else (source.file, source.line)


def _module_items(view: TraceView, step: int, keep: Selector | None) -> list[_Item]:
    from tracelake.recorder.entries import block_of

    items = []
    for m in view.modules:
        if keep is not None and not keep.matches_module(m):
            continue
        outputs = m.outputs
        labels = m.output_labels
        for k, name in enumerate(labels):
            tensor = outputs[k] if outputs is not None and k < len(outputs) else None
            op = view[name] if name in view else None  # noqa: SIM401 (a view has no .get)
            like: Any = op if op is not None else tensor
            items.append(
                _Item(
                    key=m.label if len(labels) == 1 else f"{m.label}#{k}",
                    step=step,
                    entry=tensor,
                    label=name,
                    func=m.type,
                    module=m.path,
                    block=block_of(m.path),
                    shape=tuple(getattr(like, "shape", ())),
                    dtype=str(getattr(like, "dtype", "")).removeprefix("torch."),
                    order=m.index,
                    stats=op.stats if op is not None else None,
                    saved=tensor is not None,
                )
            )
    return items


def _align(items_a: list[_Item], items_b: list[_Item]) -> list[tuple[_Item | None, _Item | None]]:
    """Pairs in ``a``'s order, then what only ``b`` has. Items pair within their group
    (a key less its ordinal: one function's calls inside one module call) in order; where
    the two sides made different numbers of such calls (a mask's extra ``view`` in the
    same forward), calls pair by call site first, so that an extra call does not shift
    every later one."""
    groups_b: dict[str, list[_Item]] = {}
    for item in items_b:
        groups_b.setdefault(item.group or item.key, []).append(item)
    groups_a: dict[str, list[_Item]] = {}
    for item in items_a:
        groups_a.setdefault(item.group or item.key, []).append(item)
    partner: dict[int, _Item] = {}
    for group, mine in groups_a.items():
        theirs = groups_b.get(group, [])
        if len(mine) == len(theirs) or any(it.site is None for it in (*mine, *theirs)):
            partner.update((id(x), y) for x, y in zip(mine, theirs, strict=False))
            continue
        by_site: dict[Any, list[_Item]] = {}
        for item in theirs:
            by_site.setdefault(item.site, []).append(item)
        seen: dict[Any, int] = {}
        for item in mine:
            k = seen[item.site] = seen.get(item.site, -1) + 1
            candidates = by_site.get(item.site, [])
            if k < len(candidates):
                partner[id(item)] = candidates[k]
    paired = {id(y) for y in partner.values()}
    pairs: list[tuple[_Item | None, _Item | None]] = [
        (item, partner.get(id(item))) for item in items_a
    ]
    pairs.extend((None, item) for item in items_b if id(item) not in paired)
    return pairs


def _steps(side: Any, store: Any) -> tuple[str, list[TraceView]]:
    """A side's name and its steps as views."""
    if isinstance(side, str):
        if store is None:
            raise StoreError(f"comparing run {side!r} by name needs a store: store.compare(...)")
        side = store[side]
    if isinstance(side, TraceView):
        return "trace", [side]
    steps = getattr(side, "steps", None)
    name = getattr(side, "name", None)
    if steps is None or name is None:
        raise TypeError(
            f"compare runs (names or Run objects) and traces (tl.trace results), not {side!r}"
        )
    return str(name), list(steps)


def compare(
    a: Any,
    b: Any,
    *,
    store: Any = None,
    on: Align = "key",
    select: Selector | None = None,
    where: str | None = None,
    steps: tuple[int, int] | None = None,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    tensors: bool = True,
) -> Comparison:
    """Align ``a`` and ``b`` op by op and say how each pair differs (see
    :class:`Comparison`). ``select``: a selector (``tl.func("linear")``,
    ``tl.in_module("encoder")``) the ops (or, ``on="module"``, module calls) must match;
    ``where``: a condition of the query language on ``ops`` (stored runs only);
    ``steps=(i, j)`` compares step i of ``a`` with step j of ``b`` (default: step k
    with step k, for every step); ``tensors=False`` compares statistics only."""
    if on not in _ALIGNMENTS:
        raise ValueError(f"on= is one of {', '.join(map(repr, _ALIGNMENTS))}, not {on!r}")
    for tolerance, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{tolerance}= is a number >= 0 (as torch.allclose's), not {value!r}")
    many = isinstance(b, (list, tuple))
    if many or (
        not tensors
        and on != "module"
        and select is None
        and where is None
        and steps is None
        and not isinstance(a, TraceView)
        and not isinstance(b, TraceView)
    ):
        if many and (tensors or on == "module" or select or where or steps):
            raise ValueError(
                "comparing with several runs at once compares their statistics only: pass "
                "tensors=False (and neither on='module', select=, where= nor steps=)"
            )
        return _stats_comparison(store, a, list(b) if many else [b], on)
    if select is not None and not isinstance(select, Selector):
        raise TypeError(f"select= takes a selector such as tl.func('relu'), not {select!r}")
    name_a, views_a = _steps(a, store)
    name_b, views_b = _steps(b, store)
    if steps is not None:
        i, j = steps
        views_a, views_b = [_pick(views_a, i, name_a)], [_pick(views_b, j, name_b)]
    if where is not None and on == "module":
        raise ValueError("where= filters ops; with on='module' restrict with select=")
    allowed = _where(where, store, (name_a, name_b)) if where is not None else None
    pairs: list[tuple[_Item | None, _Item | None]] = []
    for k in range(max(len(views_a), len(views_b))):
        items: list[list[_Item]] = []
        for side, views in ((name_a, views_a), (name_b, views_b)):
            if k >= len(views):
                items.append([])
                continue
            view = views[k]
            step = getattr(view, "step", k)
            found = (
                _module_items(view, step, select)
                if on == "module"
                else _op_items(view, step, on, select)
            )
            for item in found:
                item.run = side
            if allowed is not None:
                found = [it for it in found if (side, it.step, it.order) in allowed]
            items.append(found)
        pairs.extend(_align(items[0], items[1]))
    return Comparison(name_a, name_b, pairs, on, atol, rtol, tensors)


class StatsComparison(Comparison):
    """A statistics-only comparison of one run against one or more others, answered by
    one query of the catalog: no tensor is read, and no run is loaded op by op. Pairs
    are made by equal ``key`` (or ``label``) and step; rows come run by run, each in the
    reference's execution order, with what only one side has."""

    def __init__(self, name_a: str, names_b: list[str], table: pa.Table, on: str):
        super().__init__(name_a, ", ".join(names_b), [], on, 0.0, 0.0, False)
        self._table = table

    def __len__(self) -> int:
        return self._table.num_rows

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        table = self._table if limit is None else self._table.slice(0, limit)
        return table.to_pylist()

    def df(self) -> pandas.DataFrame:
        return _int_blocks(self._table.to_pandas())

    def arrow(self) -> pa.Table:
        """The comparison's rows as an Arrow table."""
        return self._table

    def first_divergence(
        self, atol: float | None = None, rtol: float | None = None
    ) -> dict[str, Any] | None:
        """The first shape mismatch (statistics cannot tell more)."""
        for row in self.rows():
            if row["status"] == "shape mismatch":
                return row
        return None

    def summary(self) -> dict[str, int]:
        counts = self._table.group_by("status").aggregate([("status", "count")]).to_pylist()
        return {r["status"]: r["status_count"] for r in counts}

    def _row(self, k: int) -> dict[str, Any]:
        return self._table.slice(k, 1).to_pylist()[0]

    def _grouped(self, column: str) -> pandas.DataFrame:
        frame = self.df()
        return frame.groupby(["run_b", column], sort=False, dropna=True).agg(
            ops=("key", "size"),
            **{f"max_abs_d_{n}": (f"d_{n}", lambda v: v.abs().max()) for n in ("mean", "l2")},
        )


def _int_blocks(frame: pandas.DataFrame) -> pandas.DataFrame:
    """``frame`` with its block numbers as pandas' nullable integers: ops outside any
    block have none, which would make the column float (block 3.0) otherwise."""
    frame["block"] = frame["block"].astype("Int64")
    return frame


def _stats_sql(on: str) -> str:
    """One query: the reference run's ops against each other run's, by ``on`` and step,
    with what only one side has (the reference's rows repeated per other run)."""
    metric_nulls = ", ".join(f"NULL AS {f.name}" for f in fields(PairMetrics))
    diffs = ", ".join(f'b."{n}" - a."{n}" AS "d_{n}"' for n in _STAT_DIFFS)
    return f"""
    WITH others AS (SELECT unnest(?::INTEGER[]) AS run_id),
    a AS (SELECT o.run_id AS other, x.* FROM ops x, others o WHERE x.run_id = ?),
    b AS (SELECT * FROM ops WHERE run_id IN (SELECT run_id FROM others))
    SELECT rb.name AS run_b, a.step AS step_a, b.step AS step_b,
           coalesce(a.key, b.key) AS key, b.key AS key_b,
           a.label AS label_a, b.label AS label_b,
           coalesce(a.func, b.func) AS func, coalesce(a.module, b.module) AS module,
           coalesce(a.block, b.block) AS block,
           CASE WHEN b.run_id IS NULL THEN 'only a' WHEN a.run_id IS NULL THEN 'only b'
                WHEN a.shape <> b.shape THEN 'shape mismatch' ELSE 'not saved' END AS status,
           CASE WHEN a.run_id IS NOT NULL AND b.run_id IS NOT NULL AND a.shape <> b.shape
                THEN 'shape ' || CAST(a.shape AS VARCHAR) || ' vs ' || CAST(b.shape AS VARCHAR)
           END AS reason,
           a.shape AS shape_a, b.shape AS shape_b, a.dtype AS dtype_a, b.dtype AS dtype_b,
           {metric_nulls}, {diffs}
    FROM a FULL JOIN b ON a."{on}" = b."{on}" AND a.step = b.step AND a.other = b.run_id
    JOIN runs rb ON rb.id = coalesce(a.other, b.run_id)
    ORDER BY rb.name, coalesce(a.step, b.step), a.idx NULLS LAST, b.idx
    """


def _stats_comparison(store: Any, a: Any, bs: list[Any], on: str) -> StatsComparison:
    if store is None:
        raise StoreError("comparing stored runs' statistics needs a store: store.compare(...)")
    if on not in ("key", "label"):
        raise ValueError("statistics-only comparisons align on='key' or on='label'")
    names: list[str] = []
    for side in (a, *bs):
        name = side if isinstance(side, str) else getattr(side, "name", None)
        if not isinstance(name, str) or isinstance(side, TraceView):
            raise TypeError(
                "compare stored runs by name or Run; in-memory traces need tensors=True"
            )
        names.append(name)
    catalog = store.catalog
    catalog.refresh(())  # the runs table only: names to ids
    known = catalog.run_ids
    # a name no complete run has: store[name] raises RunNotFoundError with suggestions
    ids = [known[n] if n in known else store[n].id for n in names]
    catalog.refresh(ids)  # these runs' rows only
    table = catalog.arrow(_stats_sql(on), [ids[1:], ids[0]], refresh=False, runs=ids)
    return StatsComparison(names[0], names[1:], table, on)


def _pick(views: list[TraceView], k: int, name: str) -> TraceView:
    if not 0 <= k < len(views):
        raise StoreError(f"{name!r} has steps 0..{len(views) - 1}; step {k} does not exist")
    return views[k]


def _where(text: str, store: Any, names: tuple[str, str]) -> set[tuple[str, int, int]]:
    """(run, step, idx) of the ops of the named runs the condition selects."""
    if store is None or "trace" in names:
        raise StoreError("where= filters stored runs; for in-memory traces use select=")
    first, second = names
    result = store.query(
        f"select run, step, idx from ops where run in (:a, :b) and ({text})", a=first, b=second
    )
    return {(r[0], r[1], r[2]) for r in result.df().itertuples(index=False)}
