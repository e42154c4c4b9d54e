"""Running a compiled query on a store, and its :class:`Result`.

The SQL runs first, on the reader's catalog mirror; tensors are read only for the rows it
returned, only the chunks each needs: grouped by (run, array), each chunk of a pack read
once for all the tensors in it, groups read in parallel. ``out`` of an unsaved op is
``None``, never an error.
"""

from __future__ import annotations

import functools
import html
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch

from tracelake.errors import QueryError
from tracelake.recorder.stats import compute_stats
from tracelake.store.run import LazyTensor, TensorSlot

from . import ast
from .compiler import CompiledQuery, PointLookup, compile_query
from .parser import parse

if TYPE_CHECKING:
    import pandas

    from tracelake.store import Store
    from tracelake.store.catalog import CatalogMirror

__all__ = ["Result", "describe", "run_query", "run_sql"]


def _readers() -> int:
    """Threads reading a result's own arrays: file reads, checksums and zstd release the
    GIL, so one per core this process may use pays; more would only take turns."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def describe(value: Any) -> str:
    """A short text for a result cell: tensors as shape, dtype and mean ± std."""
    if isinstance(value, torch.Tensor):
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

    ``df()`` (pandas), ``arrow()``, ``tensors(column)``, ``stack(column)``, iteration
    (one dict per row), ``len()``; ``sql`` and ``params`` are what ran."""

    def __init__(
        self, compiled: CompiledQuery, table: pa.Table, tensor_values: dict[str, list[Any]]
    ):
        self.sql = compiled.sql
        self.params = list(compiled.params)
        self.columns = list(compiled.columns)
        self._tensor_columns = [t.column for t in compiled.tensors]
        self._table = table.select(list(compiled.columns))
        self._values = tensor_values

    def __len__(self) -> int:
        return self._table.num_rows

    def _column(self, name: str) -> list[Any]:
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
        shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
        if len(shapes) > 1:
            listed = ", ".join(str(list(s)) for s in sorted(shapes)[:10])
            raise QueryError(
                f"cannot stack {name!r}: the tensors have different shapes "
                f"({listed}); slice them to one shape in the query first"
            )
        if not values:
            raise QueryError(f"cannot stack {name!r}: the result has no rows")
        if not isinstance(values[0], torch.Tensor):
            return torch.tensor(values)
        return torch.stack(values)

    def df(self) -> pandas.DataFrame:
        frame = self._table.to_pandas()
        for name in self._tensor_columns:
            frame[name] = pandas_column(self._values[name])
        return frame

    def arrow(self) -> pa.Table:
        """An Arrow table; tensor columns become lists of their (flattened) values with a
        ``<column>.shape`` column beside."""
        table = self._table
        for name in self._tensor_columns:
            values = self._values[name]
            index = table.column_names.index(name)
            if values and all(not isinstance(v, torch.Tensor) for v in values):
                table = table.set_column(index, name, pa.array(values, type=pa.float64()))
                continue
            flat = [None if v is None else v.detach().reshape(-1).tolist() for v in values]
            shapes = [None if v is None else list(v.shape) for v in values]
            table = table.set_column(index, name, pa.array(flat))
            table = table.add_column(
                index + 1, f"{name}.shape", pa.array(shapes, type=pa.list_(pa.int64()))
            )
        return table

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = []
        for i, row in enumerate(self):
            if i == 50:
                body.append(
                    f"<tr><td colspan={len(self.columns)}>… {len(self) - 50} more rows</td></tr>"
                )
                break
            body.append(
                "<tr>"
                + "".join(f"<td>{html.escape(describe(row[c]))}</td>" for c in self.columns)
                + "</tr>"
            )
        return (
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
            f"</table><p>{len(self)} rows</p>"
        )

    def __repr__(self) -> str:
        return f"<Result: {len(self)} rows, columns {self.columns}>"


def pandas_column(values: list[Any]) -> Any:
    import pandas

    return pandas.Series(values, dtype=object)


def _reduce(tensor: torch.Tensor, how: str) -> float | None:
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

    def __init__(self, store: Store, table: pa.Table, names: Mapping[int, str]):
        self.store = store
        self.names = names
        self.run_ids = table.column("__run_id").to_pylist()
        self.locations = list(
            zip(
                table.column("__array").to_pylist(),
                table.column("__offset").to_pylist(),
                table.column("__nbytes").to_pylist(),
                table.column("__shape").to_pylist(),
                table.column("__dtype").to_pylist(),
                strict=True,
            )
        )
        self.labels = (
            table.column("label").to_pylist()
            if "label" in table.column_names
            else [f"row {i}" for i in range(table.num_rows)]
        )

    def fetch(self, key: Any) -> list[torch.Tensor | None]:
        """Every row's tensor (``key``: a selection to apply), ``None`` where unsaved."""
        out: list[torch.Tensor | None] = [None] * len(self.run_ids)
        groups: dict[tuple[int, str], list[int]] = {}
        for row, (array, *_rest) in enumerate(self.locations):
            if array is not None:
                groups.setdefault((self.run_ids[row], array), []).append(row)

        def read(batch: list[tuple[tuple[int, str], list[int]]]) -> None:
            for (run_id, name), rows in batch:
                arrays = self.store.arrays(run_id, self.names.get(run_id))
                for row in rows:
                    _, offset, nbytes, shape, dtype = self.locations[row]
                    lazy = LazyTensor(
                        arrays, TensorSlot(name, offset, nbytes, shape, dtype), self.labels[row]
                    )
                    out[row] = lazy.read() if key is None else lazy[key]

        items = list(groups.items())
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


def run_query(store: Store, text: str, params: Mapping[str, Any] | None = None) -> Result:
    """Compile ``text``, run its SQL on ``store``'s catalog, read the tensors it needs."""
    mirror = store.catalog
    mirror.refresh(runs=())  # the run ids to compile in
    compiled = compile_query(_parsed(text), params, mirror.run_ids, source=text)
    mirror.refresh(runs=compiled.runs)  # the rows the query reads
    table = None if compiled.point is None else _looked_up(mirror, compiled, compiled.point)
    if table is None:
        table = mirror.arrow(compiled.sql, compiled.params, refresh=False, error=QueryError)
    values: dict[str, list[Any]] = {}
    if compiled.tensors:
        fetcher = _Fetcher(store, table, mirror.run_names)
        for item in compiled.tensors:
            key = item.index if item.kind in ("slice", "reduce") else None
            got = fetcher.fetch(key)
            if item.kind == "reduce":
                values[item.column] = [
                    None if t is None else _reduce(t, item.reduction or "mean") for t in got
                ]
            else:
                values[item.column] = got
    return Result(compiled, table, values)


def run_sql(store: Store, text: str) -> pandas.DataFrame:
    """Raw SQL over the catalog: one read-only statement (a SELECT), on the reader's
    mirror, where DuckDB's external access is off."""
    if not isinstance(text, str):
        raise TypeError(f"store.sql takes SQL text, not {type(text).__name__}")
    mirror = store.catalog
    if not mirror.is_select(text):
        raise QueryError("store.sql runs exactly one read-only SELECT statement")
    return mirror.query(text, error=QueryError).df()
