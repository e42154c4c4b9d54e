"""Running a compiled query on a store, and its :class:`Result`.

The SQL runs first, on the reader's catalog mirror; tensors are read only for the rows it
returned, only the chunks each needs: grouped by (run, array), each chunk of a pack read
once for all the tensors in it, groups read in parallel. ``out`` of an unsaved op is
``None``, never an error.

Tensor-pair functions (``max_abs_diff(a.out, b.out)``) are computed for the rows the SQL
returned, each pair once (whatever functions of it the query names), a slice of rows at
a time (``store.compare``'s :func:`~tracelake.store.compare.sliced_metrics`); then the
plan's ``where``, ``order`` and ``limit`` apply, in that order. A pair of which either
side is unsaved, or whose shapes differ, is null.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tracelake.errors import QueryError, QueryResultError, QueryTypeError, TraceLakeWarning
from tracelake.store.catalog import COMPLETE

from . import ast
from .compiler import CompiledQuery, PointLookup, compile_query
from .operands import walk
from .parser import parse
from .plan import Pair, Ref, evaluate, order_rows
from .schema import closest, json_path

if TYPE_CHECKING:
    import dask.array
    import pandas
    import torch

    from tracelake.progress import Progress
    from tracelake.store import Store
    from tracelake.store.catalog import CatalogMirror
    from tracelake.store.metrics import PairMetrics
    from tracelake.store.run import LazyTensor

__all__ = ["Result", "describe", "run_query", "run_sql"]


def _readers() -> int:
    """Threads reading a result's own arrays: file reads, checksums and zstd release the
    GIL, so one per core this process may use pays; more would only take turns."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch: a result whose
    query read no tensor (all a catalog-only query returns) never needs it."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def describe(value: Any) -> str:
    """A short text for a result cell: tensors as shape, dtype and mean ± std."""
    if is_tensor(value):
        from tracelake.recorder.stats import compute_stats

        dtype = str(value.dtype).removeprefix("torch.")
        shape = "x".join(map(str, value.shape)) or "scalar"
        if value.numel() == 0:
            return f"[{shape} {dtype}]"
        stats = compute_stats(value)
        if stats.mean is None or stats.std is None:
            return f"[{shape} {dtype}]"
        return f"[{shape} {dtype} {stats.mean:.4g} ± {stats.std:.4g}]"
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


class Result:
    """The rows a query returned. Tensor columns hold torch tensors (``None`` for ops
    whose tensor was not saved); reductions of slices hold floats.

    ``df()`` (pandas), ``arrow()``, ``tensors(column)``, ``stack(column)``,
    ``to_dask(column)`` (unread, for aggregations), iteration (one dict per row),
    ``len()``; ``sql`` and ``params`` are what ran."""

    def __init__(
        self,
        compiled: CompiledQuery,
        table: pa.Table,
        tensor_values: dict[str, list[Any]],
        deferred: dict[str, tuple[_Fetcher, Any]] | None = None,
        sources: dict[str, tuple[_Fetcher, Any]] | None = None,
    ):
        self.sql = compiled.sql
        self.params = list(compiled.params)
        self.columns = list(compiled.columns)
        self._tensor_columns = [t.column for t in compiled.tensors if t.kind != "value"]
        self._computed = [t.column for t in compiled.tensors if t.kind == "value"]
        self._table = table.select(list(compiled.columns))
        self._values = tensor_values
        #: Tensor columns not read yet (``run_query(lazy=True)``): column -> (its rows'
        #: fetcher, the selection to apply); read whole on first use, or a few rows at a
        #: time by :meth:`read_rows` (exports: memory bounded by the rows in hand).
        self._deferred = dict(deferred or {})
        #: Where each stored-tensor column's rows live (its fetcher and selection), read
        #: or not: what :meth:`to_dask` builds on.
        self._sources = dict(sources or {})

    @property
    def tensor_columns(self) -> list[str]:
        """The columns holding tensors (``out``, slices of it)."""
        return list(self._tensor_columns)

    def uniform(self, column: str) -> bool:
        """Whether every saved tensor of ``column`` has one shape and dtype (known from
        the catalog for a column not read yet)."""
        if column in self._deferred:
            fetcher, _key = self._deferred[column]
            layouts = {(tuple(loc[3]), loc[4]) for loc in fetcher.locations if loc[0] is not None}
        else:
            layouts = {(tuple(v.shape), v.dtype) for v in self._values[column] if is_tensor(v)}
        return len(layouts) <= 1

    def scalar_types(self) -> dict[str, pa.DataType]:
        """The Arrow type of each column that holds no tensors (computed values and
        reductions: doubles)."""
        types = {f.name: f.type for f in self._table.schema if f.name not in self._values}
        types = {k: v for k, v in types.items() if k not in self._tensor_columns}
        types |= {name: pa.float64() for name in self._computed}
        for name in self._tensor_columns:  # a reduction's floats, or plain numbers
            values = self._values.get(name)
            if values is not None and all(not is_tensor(v) for v in values):
                types[name] = pa.float64()
        return types

    def row_nbytes(self) -> list[int]:
        """For each row, the stored bytes of the tensors its tensor columns read (an upper
        bound for slices): what reading the row costs."""
        sizes = [0] * len(self)
        for fetcher, _key in self._deferred.values():
            for row, location in enumerate(fetcher.locations):
                sizes[row] += location[2] or 0
        for name in self._tensor_columns:
            if name not in self._deferred:
                for row, value in enumerate(self._values[name]):
                    sizes[row] += int(value.nbytes) if is_tensor(value) else 0
        return sizes

    def arrow_slice(self, column: str, start: int, stop: int) -> pa.Array | None:
        """Rows ``start`` to ``stop`` of ``column`` as the Arrow array the result holds
        them in (a catalog column's, typed as :meth:`scalar_types` says); None for a
        column of tensors or computed values, which are Python objects here."""
        if column in self._values or column in self._deferred or column not in self.columns:
            return None
        if column in self._tensor_columns or column in self._computed:
            return None
        return self._table.column(column).slice(start, stop - start).combine_chunks()

    def read_rows(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        """Rows ``start`` to ``stop`` (one dict each), their tensors read now and not
        kept by the result: iterating a large result in slices holds one slice."""
        columns: dict[str, list[Any]] = {}
        for name in self.columns:
            if name in self._deferred:
                fetcher, key = self._deferred[name]
                got = []
                for row in range(start, stop):
                    lazy = fetcher.lazy(row)
                    got.append(None if lazy is None else lazy.read() if key is None else lazy[key])
                columns[name] = got
            elif name in self._values:
                columns[name] = self._values[name][start:stop]
            else:
                columns[name] = self._table.column(name).slice(start, stop - start).to_pylist()
        for values in zip(*(columns[c] for c in self.columns), strict=True):
            yield dict(zip(self.columns, values, strict=True))

    def __len__(self) -> int:
        return self._table.num_rows

    def _column(self, name: str) -> list[Any]:
        if name in self._deferred:  # read now, all at once, and kept
            fetcher, key = self._deferred.pop(name)
            self._values[name] = fetcher.fetch(key)
        if name in self._values:
            return self._values[name]
        if name not in self.columns:
            raise QueryError(f"the result has no column {name!r}; it has {self.columns}")
        return self._table.column(name).to_pylist()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        columns = [self._column(c) for c in self.columns]
        for row in zip(*columns, strict=True):
            yield dict(zip(self.columns, row, strict=True))

    def _default_column(self, column: str | None) -> str:
        if column is not None:
            return column
        if "out" in self._tensor_columns:
            return "out"
        if len(self._tensor_columns) == 1:
            return self._tensor_columns[0]
        raise QueryError(
            f"name the tensor column: one of {self._tensor_columns}"
            if self._tensor_columns
            else "this result has no tensor column"
        )

    def tensors(self, column: str | None = None) -> list[torch.Tensor | None]:
        """The tensors of one column (default ``out``), one per row."""
        return list(self._column(self._default_column(column)))

    def stack(self, column: str | None = None) -> torch.Tensor:
        """One tensor stacking the column's tensors (rows first)."""
        name = self._default_column(column)
        values = self._column(name)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise QueryError(
                f"cannot stack {name!r}: rows {missing[:10]} have no saved "
                "tensor (filter with `saved = true`)"
            )
        shapes = {tuple(v.shape) for v in values if is_tensor(v)}
        if len(shapes) > 1:
            listed = ", ".join(str(list(s)) for s in sorted(shapes)[:10])
            raise QueryError(
                f"cannot stack {name!r}: the tensors have different shapes "
                f"({listed}); slice them to one shape in the query first"
            )
        if not values:
            raise QueryError(f"cannot stack {name!r}: the result has no rows")
        import torch

        if not isinstance(values[0], torch.Tensor):
            odd = next((v for v in values if not isinstance(v, int | float)), None)
            if odd is not None:  # (bool is an int)
                raise QueryError(
                    f"cannot stack {name!r}: it holds {type(odd).__name__} values, not "
                    "tensors or numbers"
                )
            return torch.tensor(values)
        return torch.stack(values)

    def to_dask(self, column: str | None = None) -> dask.array.Array:
        """The column's tensors (default ``out``) as one Dask array, rows first, nothing
        read yet: ``.compute()`` equals :meth:`stack` bitwise. For aggregations over
        more than memory (``docs/query.md``: a PCA). Needs the ``scale`` extra (Dask)."""
        from .aggregate import dask_array

        name = self._default_column(column)
        if name not in self._sources:
            raise QueryError(
                f"{name!r} holds no stored tensors (a reduction or a computed value): "
                "to_dask() serves `out` and slices of it"
            )
        fetcher, key = self._sources[name]
        return dask_array(name, fetcher, key)

    def df(self) -> pandas.DataFrame:
        """A DataFrame of the rows; tensor cells hold the tensors, shown as summaries
        (shape, dtype, mean ± std)."""
        frame = self._table.to_pandas()
        for name in self._tensor_columns:
            frame[name] = pandas_column(self._column(name))
        for name in self._computed:
            frame[name] = self._values[name]
        return _frame_class()(frame)

    def arrow(self) -> pa.Table:
        """An Arrow table; tensor columns become lists of their (flattened) values with a
        ``<column>.shape`` column beside."""
        table = self._table
        for name in self._computed:
            index = table.column_names.index(name)
            table = table.set_column(index, name, pa.array(self._values[name]))
        for name in self._tensor_columns:
            values = self._column(name)
            index = table.column_names.index(name)
            if values and all(not is_tensor(v) for v in values):
                table = table.set_column(index, name, pa.array(values, type=pa.float64()))
                continue
            flat = [None if v is None else v.detach().reshape(-1).tolist() for v in values]
            shapes = [None if v is None else list(v.shape) for v in values]
            table = table.set_column(index, name, pa.array(flat))
            table = table.add_column(
                index + 1, f"{name}.shape", pa.array(shapes, type=pa.list_(pa.int64()))
            )
        return table

    def plot(self, y: str, x: str | None = None, by: str | None = None, ax: Any = None) -> Any:
        """Plot numeric column ``y`` against ``x`` (default: ``block``, ``layer`` or
        ``label``, whichever the result has), a line per ``by`` (default ``run`` when
        there are several), with matplotlib; returns the Axes (:mod:`tracelake.plots`)."""
        from tracelake.plots import plot_result  # drawing sits downstream

        return plot_result(self, y, x=x, by=by, ax=ax)

    def hist(self, column: str | None = None, row: int = 0, bins: int = 50, ax: Any = None) -> Any:
        """A histogram of row ``row``'s tensor in ``column`` (default ``out``)."""
        from tracelake.plots import result_hist

        return result_hist(self, column, row=row, bins=bins, ax=ax)

    def heatmap(self, column: str | None = None, row: int = 0, ax: Any = None) -> Any:
        """A heatmap of row ``row``'s tensor in ``column`` (default ``out``): its last
        dimension across, the leading ones flattened down."""
        from tracelake.plots import result_heatmap

        return result_heatmap(self, column, row=row, ax=ax)

    def _repr_html_(self) -> str:
        from tracelake.reprs import result_html  # notebook display sits downstream

        return result_html(self)

    def __repr__(self) -> str:
        return f"<Result: {len(self)} rows, columns {self.columns}>"


def pandas_column(values: list[Any]) -> Any:
    import pandas

    return pandas.Series(values, dtype=object)


@functools.cache
def _frame_class() -> type:
    """A DataFrame that keeps tensors in its cells but shows each as a summary (shape,
    dtype, mean ± std) rather than torch's truncated text; made on first use, so that
    importing this module does not import pandas."""
    import pandas

    class ResultFrame(pandas.DataFrame):
        @property
        def _constructor(self) -> type:
            return ResultFrame

        def _shown(self) -> pandas.DataFrame:
            plain = pandas.DataFrame(self)
            for name in plain.columns[plain.dtypes == "object"]:
                column = plain[name]
                if any(is_tensor(v) for v in column):
                    plain[name] = [describe(v) if is_tensor(v) else v for v in column]
            return plain

        def __repr__(self) -> str:
            return repr(self._shown())

        def _repr_html_(self) -> str | None:
            return self._shown()._repr_html_()

    return ResultFrame


def _reduce(tensor: torch.Tensor, how: str) -> float | None:
    from tracelake.recorder.stats import compute_stats

    stats = compute_stats(tensor)
    if how == "sum":
        return None if stats.mean is None else stats.mean * tensor.numel()
    return getattr(stats, {"norm": "l2"}.get(how, how))


class _Fetcher:
    """Reads the tensors of a result's rows: grouped by (run, array), each pack chunk
    decoded once (and cached across queries). Groups of own arrays (large tensors, read
    through zarr-python) are read in parallel; packed tensors in this thread, where a
    read is mostly Python and holds the GIL, so threads would only take turns (slower,
    not faster, chunks cached or not)."""

    def __init__(
        self,
        store: Store,
        table: pa.Table,
        names: Mapping[int, str],
        suffix: str = "",
        progress: bool | None = None,
    ):
        self.store = store
        self.names = names
        self.progress = progress
        self.run_ids = table.column("__run_id" + suffix).to_pylist()
        self.locations = list(
            zip(
                *(
                    table.column(name + suffix).to_pylist()
                    for name in ("__array", "__offset", "__nbytes", "__shape", "__dtype")
                ),
                strict=True,
            )
        )
        self.labels = (
            table.column("label").to_pylist()
            if "label" in table.column_names
            else [f"row {i}" for i in range(table.num_rows)]
        )

    def lazy(self, row: int) -> LazyTensor | None:
        """Row ``row``'s tensor, unread; None where unsaved."""
        from tracelake.store.run import LazyTensor, TensorSlot  # torch: only when read

        name, offset, nbytes, shape, dtype = self.locations[row]
        if name is None:
            return None
        arrays = self.store.arrays(self.run_ids[row], self.names.get(self.run_ids[row]))
        return LazyTensor(arrays, TensorSlot(name, offset, nbytes, shape, dtype), self.labels[row])

    def fetch(self, key: Any) -> list[torch.Tensor | None]:
        """Every row's tensor (``key``: a selection to apply), ``None`` where unsaved."""
        out: list[torch.Tensor | None] = [None] * len(self.run_ids)
        groups: dict[tuple[int, str], list[int]] = {}
        for row, (array, *_rest) in enumerate(self.locations):
            if array is not None:
                groups.setdefault((self.run_ids[row], array), []).append(row)

        from tracelake.progress import Progress

        total = sum(self.locations[r][2] or 0 for rows in groups.values() for r in rows)
        # (shown after a second of reading, where someone watches; progress=False: never)
        bar = Progress("reading tensors", total, "bytes", self.progress)

        def read(batch: list[tuple[tuple[int, str], list[int]]]) -> None:
            for _group, rows in batch:
                for row in rows:
                    lazy = self.lazy(row)
                    assert lazy is not None  # grouped rows have an array
                    out[row] = lazy.read() if key is None else lazy[key]
                    bar.advance(self.locations[row][2] or 0)

        items = list(groups.items())
        with bar:
            if len(items) <= 1 or all(
                self.locations[rows[0]][1] is not None for _, rows in items
            ):  # packed, so small
                read(items)
            else:  # a few batches of groups: file reads, checksums and zstd release the GIL
                readers = _readers()
                batches = [items[i::readers] for i in range(min(readers, len(items)))]
                with ThreadPoolExecutor(max_workers=len(batches)) as pool:
                    list(pool.map(read, batches))
        return out


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> ast.Query:
    """The parse of a query text, kept for its next run: a query with parameters is run
    again and again with other values (nodes are immutable; errors are not kept)."""
    return parse(text)


def _looked_up(
    mirror: CatalogMirror, compiled: CompiledQuery, point: PointLookup
) -> pa.Table | None:
    """The rows the SQL of a point lookup would return, from the mirror's op index; None
    before DuckDB ran that SQL once (the index has the values, DuckDB's result the
    types: so a query asked once never builds the index)."""
    if not mirror.knows(compiled.sql, compiled.params):
        return None
    rows = mirror.points.lookup(point.run_id, point.label)[point.start : point.stop]
    names = mirror.run_names
    return mirror.typed(
        compiled.sql,
        compiled.params,
        [
            tuple(names.get(row["run_id"]) if f == "run" else row[f] for f in point.fields)
            for row in rows
        ],
    )


def run_query(
    store: Store,
    text: str,
    params: Mapping[str, Any] | None = None,
    lazy: bool = False,
    progress: bool | None = None,
) -> Result:
    """Compile ``text``, run its SQL on ``store``'s catalog, read the tensors it needs
    (``lazy``: tensor columns are read when first used, or row by row with
    :meth:`Result.read_rows`; reductions and pair functions are computed at once).
    ``progress``: a bar while tensors are read or compared, once that has taken a second
    (None: where someone watches, a terminal or a notebook; see
    :mod:`tracelake.progress`)."""
    mirror = store.catalog
    mirror.refresh(runs=())  # the run ids to compile in
    parsed = _parsed(text)
    compiled = compile_query(parsed, params, mirror.run_ids, source=text)
    _warn_unknown_meta(mirror, parsed)
    mirror.refresh(runs=compiled.runs)  # the rows the query reads
    table = None if compiled.point is None else _looked_up(mirror, compiled, compiled.point)
    if table is None:
        try:
            table = mirror.arrow(
                compiled.sql, compiled.params, False, runs=compiled.runs, error=QueryError
            )
        except QueryError as exc:  # the message, not the generated SQL it points into
            raise QueryError(str(exc).split("\n\nLINE ")[0]) from exc.__cause__
    if compiled.aliases and compiled.aliases != compiled.columns:
        names = list(compiled.columns) + table.column_names[len(compiled.columns) :]
        table = table.rename_columns(names)
    try:
        return _with_tensors(store, compiled, table, lazy, progress)
    except IndexError as exc:  # a slice the SQL could not check against each row's shape
        raise QueryResultError(
            f"a returned row's tensor has no such element ({exc}): slice within the shape "
            "of every row the query returns (select shape to see them, or filter on it)"
        ) from exc


def _with_tensors(
    store: Store,
    compiled: CompiledQuery,
    table: pa.Table,
    lazy: bool = False,
    progress: bool | None = None,
) -> Result:
    """The result: the plan's part over the SQL's rows, then the tensors they need."""
    mirror = store.catalog
    values: dict[str, list[Any]] = {}
    if any(t.kind == "value" for t in compiled.tensors) or compiled.where or compiled.order:
        from tracelake.progress import Progress

        # (a pair's tensors are read as the plan asks for it: a bar counting pairs)
        with Progress("comparing tensors", table.num_rows, "rows", progress) as bar:
            pairs = _Pairs(store, table, mirror.run_names, compiled.suffixes, bar)
            table = pairs.apply(compiled)
            for item in compiled.tensors:
                if item.kind == "value" and item.expr is not None:
                    values[item.column] = pairs.column(item.expr)
    fetchers: dict[int, _Fetcher] = {}
    deferred: dict[str, tuple[_Fetcher, Any]] = {}
    sources: dict[str, tuple[_Fetcher, Any]] = {}
    for item in compiled.tensors:
        if item.kind == "value":
            continue
        if item.source not in fetchers:
            suffix = compiled.suffixes[item.source]
            fetchers[item.source] = _Fetcher(store, table, mirror.run_names, suffix, progress)
        key = item.index if item.kind in ("slice", "reduce") else None
        if item.kind != "reduce":
            sources[item.column] = (fetchers[item.source], key)
        if lazy and item.kind != "reduce":
            deferred[item.column] = (fetchers[item.source], key)
            continue
        got = fetchers[item.source].fetch(key)
        if item.kind == "reduce":
            values[item.column] = [
                None if t is None else _reduce(t, item.reduction or "mean") for t in got
            ]
        else:
            values[item.column] = got
    return Result(compiled, table, values, deferred, sources)


def _warn_unknown_meta(mirror: CatalogMirror, query: ast.Query) -> None:
    """A :class:`~tracelake.TraceLakeWarning` for each ``meta.<key>`` of ``query`` that
    no complete run has (a typo reads as null everywhere, and the query returns no row),
    naming the keys the runs do have at that level."""
    seen: set[tuple[str, ...]] = set()
    for node in walk(query):
        if not isinstance(node, ast.MetaRef) or node.keys in seen:
            continue
        seen.add(node.keys)
        path = json_path(node.keys)[1:-1]  # (checked identifiers: '$.a.b' without quotes)
        row = mirror.query(
            "SELECT count(*) FROM runs WHERE status = ? AND json_exists(meta, ?)",
            [COMPLETE, path],
            runs=(),
        ).fetchone()
        if row is not None and row[0]:
            continue
        parent = "$" + "".join(f".{k}" for k in node.keys[:-1])
        keys = mirror.query(
            "SELECT DISTINCT unnest(json_keys(meta, ?)) FROM runs WHERE status = ? AND "
            "json_type(meta, ?) = 'OBJECT'",
            [parent, COMPLETE, parent],
            runs=(),
        ).fetchall()
        known = sorted(str(k[0]) for k in keys)
        name = "meta." + ".".join(node.keys)
        hint = closest(node.keys[-1], known)
        listed = ", ".join(known[:20]) if known else "none"
        warnings.warn(
            f"no run has {name}, so it is null in every row{hint} (keys there: {listed})",
            TraceLakeWarning,
            stacklevel=4,
        )


class _Pairs:
    """The executor's part of a plan (:mod:`.plan`) over the SQL's rows: tensor-pair
    metrics (each pair of tensors read once, however many of its functions the query
    names), then ``where``, ``order``, ``limit``."""

    def __init__(
        self,
        store: Store,
        table: pa.Table,
        names: Mapping[int, str],
        suffixes: tuple[str, ...],
        bar: Progress,
    ):
        self.store, self.table, self.names, self.suffixes = store, table, names, suffixes
        self.bar = bar  # advanced once per row whose pair metrics were computed
        self.counted: set[int] = set()
        self.fetchers: dict[int, _Fetcher] = {}
        self.memo: dict[tuple[Any, ...], PairMetrics | None] = {}
        self.columns: dict[str, list[Any]] = {}
        self.rows = list(range(table.num_rows))

    def apply(self, compiled: CompiledQuery) -> pa.Table:
        """The SQL's table, filtered, ordered and limited as the plan says."""
        rows = self.rows
        if compiled.where is not None:
            where = compiled.where
            rows = [r for r in rows if evaluate(where, self._values(r)) is True]
        if compiled.order:
            keys = [
                (lambda r, e=expr: evaluate(e, self._values(r)), desc)
                for expr, desc in compiled.order
            ]
            rows = order_rows(rows, keys)
        if compiled.limit is not None:
            offset, count = compiled.limit
            rows = rows[offset : None if count is None else offset + count]
        if rows == self.rows:
            return self.table
        self.rows = rows
        return self.table.take(pa.array(rows, type=pa.int64()))

    def column(self, expr: Any) -> list[Any]:
        """``expr``'s value for each row kept."""
        return [evaluate(expr, self._values(r)) for r in self.rows]

    def _values(self, row: int) -> Any:
        return lambda node: self._value(node, row)

    def _value(self, node: Pair | Ref, row: int) -> Any:
        if isinstance(node, Ref):
            if node.column not in self.columns:
                self.columns[node.column] = self.table.column(node.column).to_pylist()
            return self.columns[node.column][row]
        metrics = self._metrics(node, row)
        return None if metrics is None else getattr(metrics, node.function)

    def _fetcher(self, source: int) -> _Fetcher:
        if source not in self.fetchers:
            self.fetchers[source] = _Fetcher(
                self.store, self.table, self.names, self.suffixes[source]
            )
        return self.fetchers[source]

    def _metrics(self, pair: Pair, row: int) -> PairMetrics | None:
        key = (repr(pair.left), repr(pair.right), pair.atol, pair.rtol, row)
        if key in self.memo:
            return self.memo[key]
        a = self._fetcher(pair.left.source).lazy(row)
        b = self._fetcher(pair.right.source).lazy(row)
        metrics = None
        if a is not None and b is not None:
            from tracelake.store.metrics import sliced_metrics, tensor_metrics

            if pair.left.index is None and pair.right.index is None:
                metrics = sliced_metrics(a, b, pair.atol, pair.rtol)
            else:
                x = a.read() if pair.left.index is None else a[pair.left.index]
                y = b.read() if pair.right.index is None else b[pair.right.index]
                if x.shape == y.shape:
                    metrics = tensor_metrics(x, y, pair.atol, pair.rtol)
        self.memo[key] = metrics
        if row not in self.counted:
            self.counted.add(row)
            self.bar.advance()
        return metrics


def run_sql(store: Store, text: str) -> pandas.DataFrame:
    """Raw SQL over the catalog: one read-only statement (a SELECT), on the reader's
    mirror, where DuckDB's external access is off."""
    if not isinstance(text, str):
        raise QueryTypeError(f"store.sql takes SQL text, not {type(text).__name__}")
    return store.catalog.read_only_df(text)
