"""Running a compiled query on a store, and its :class:`Result`.

The SQL runs first, on the reader's catalog mirror; tensors are read only for the rows it
returned, only the chunks each needs: grouped by (run, array), each chunk of a pack read
once for all the tensors in it, groups read in parallel. ``out`` of an unsaved op is
``None``, never an error.
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import torch

from tracelake.errors import QueryError
from tracelake.recorder.stats import compute_stats
from tracelake.store.run import LazyTensor, _Slot, index_tensor
from tracelake.store.tensors import CHUNK_BYTES, RunArrays, parse_dtype, tensor_from_bytes

from .compiler import CompiledQuery, TensorItem, compile_query

if TYPE_CHECKING:
    import pandas

    from tracelake.store import Store

__all__ = ["Result", "describe", "run_query", "run_sql"]

_READERS = 4


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

    def __init__(self, compiled: CompiledQuery, table: pa.Table,
                 tensor_values: dict[str, list[Any]]):
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
        raise QueryError(f"name the tensor column: one of {self._tensor_columns}"
                         if self._tensor_columns else "this result has no tensor column")

    def tensors(self, column: str | None = None) -> list[torch.Tensor | None]:
        """The tensors of one column (default ``out``), one per row."""
        return list(self._column(self._default_column(column)))

    def stack(self, column: str | None = None) -> torch.Tensor:
        """One tensor stacking the column's tensors (rows first)."""
        name = self._default_column(column)
        values = self._column(name)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise QueryError(f"cannot stack {name!r}: rows {missing[:10]} have no saved "
                             "tensor (filter with `saved = true`)")
        shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
        if len(shapes) > 1:
            listed = ", ".join(str(list(s)) for s in sorted(shapes)[:10])
            raise QueryError(f"cannot stack {name!r}: the tensors have different shapes "
                             f"({listed}); slice them to one shape in the query first")
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
            table = table.add_column(index + 1, f"{name}.shape",
                                     pa.array(shapes, type=pa.list_(pa.int64())))
        return table

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = []
        for i, row in enumerate(self):
            if i == 50:
                body.append(f"<tr><td colspan={len(self.columns)}>… {len(self) - 50} more "
                            "rows</td></tr>")
                break
            body.append("<tr>" + "".join(f"<td>{html.escape(describe(row[c]))}</td>"
                                         for c in self.columns) + "</tr>")
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
                f"</table><p>{len(self)} rows</p>")

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
    """Reads the tensors a result needs: grouped by (run, array), chunks of packs once."""

    def __init__(self, store: Store):
        self.store = store
        self._arrays: dict[int, RunArrays] = {}

    def arrays(self, run_id: int) -> RunArrays:
        arrays = self._arrays.get(run_id)
        if arrays is None:
            name = self.store._query("SELECT name FROM runs WHERE id = ?", [run_id]).fetchone()
            arrays = self._arrays[run_id] = RunArrays(self.store.paths.tensors(run_id),
                                                      name[0] if name else str(run_id))
        return arrays

    def fetch(self, wanted: list[tuple[int, int, str]], index: dict[tuple[int, int], Any]
              ) -> dict[tuple[int, int], torch.Tensor]:
        """``wanted``: (run_id, slot, label); ``index``: selections for own arrays.
        Returns the tensor (or selection) per (run_id, slot)."""
        if not wanted:
            return {}
        keys = sorted({(r, s) for r, s, _ in wanted})
        labels = {(r, s): label for r, s, label in wanted}
        rows = self.store._query(
            "SELECT t.run_id, t.slot, t.\"array\", t.byte_offset, t.nbytes, t.shape, t.dtype "
            "FROM tensors t JOIN (SELECT unnest(?::INTEGER[]) AS r, unnest(?::INTEGER[]) AS s) "
            "w ON t.run_id = w.r AND t.slot = w.s",
            [[k[0] for k in keys], [k[1] for k in keys]]).fetchall()
        groups: dict[tuple[int, str], list[tuple[Any, ...]]] = {}
        for row in rows:
            groups.setdefault((row[0], row[2]), []).append(row)
        out: dict[tuple[int, int], torch.Tensor] = {}

        def read(group: list[tuple[Any, ...]]) -> None:
            run_id, _, name = group[0][:3]
            arrays = self.arrays(run_id)
            if group[0][3] is None:  # large tensors: their own arrays, only what is selected
                for _, slot, _, _, _, shape, dtype in group:
                    lazy = LazyTensor(arrays, _Slot(name, None, 0, shape, dtype),
                                      labels[(run_id, slot)])
                    key = index.get((run_id, slot))
                    out[(run_id, slot)] = lazy.read() if key is None else lazy[key]
                return
            size = arrays.array(name).chunks[0]
            chunks: dict[int, Any] = {}
            for _, slot, _, offset, nbytes, shape, dtype in group:
                dt = parse_dtype(dtype)
                if nbytes == 0:
                    value = torch.empty(tuple(shape), dtype=dt)
                else:
                    first, last = offset // size, (offset + nbytes - 1) // size
                    if first != last or size > CHUNK_BYTES:
                        value = arrays.read_packed(name, offset, nbytes, dt, shape,
                                                   labels[(run_id, slot)])
                    else:
                        if first not in chunks:
                            chunks[first] = arrays.read_packed(
                                name, first * size, min(size, arrays.array(name).shape[0]
                                                        - first * size),
                                torch.uint8, [-1], labels[(run_id, slot)]).numpy()
                        start = offset - first * size
                        value = tensor_from_bytes(chunks[first][start:start + nbytes].copy(),
                                                  dt, shape)
                key = index.get((run_id, slot))
                out[(run_id, slot)] = value if key is None else index_tensor(value, key)

        group_list = list(groups.values())
        if len(group_list) == 1:
            read(group_list[0])
        else:
            with ThreadPoolExecutor(max_workers=_READERS) as pool:
                list(pool.map(read, group_list))
        return out


def run_query(store: Store, text: str, params: Mapping[str, Any] | None = None) -> Result:
    """Compile ``text``, run its SQL on ``store``'s catalog, read the tensors it needs."""
    compiled = compile_query(text, params)
    try:
        table = store._query_arrow(compiled.sql, compiled.params)
    except duckdb.Error as exc:
        raise QueryError(f"the query could not run: {exc}") from exc
    values: dict[str, list[Any]] = {}
    if compiled.tensors:
        run_ids = table.column("__run_id").to_pylist()
        labels = (table.column("label").to_pylist() if "label" in table.column_names
                  else [f"slot {s}" for s in table.column("__tensor").to_pylist()])
        fetcher = _Fetcher(store)
        for item in compiled.tensors:
            values[item.column] = _item_values(fetcher, item, run_ids,
                                               table.column(item.column).to_pylist(), labels)
    return Result(compiled, table, values)


def _item_values(fetcher: _Fetcher, item: TensorItem, run_ids: list[int],
                 slots: list[int | None], labels: list[str]) -> list[Any]:
    key = item.index if item.kind in ("slice", "reduce") else None
    wanted = [(r, s, labels[i]) for i, (r, s) in enumerate(zip(run_ids, slots, strict=True))
              if s is not None]
    selections = {(r, s): key for r, s, _ in wanted} if key is not None else {}
    got = fetcher.fetch(wanted, selections)
    values: list[Any] = []
    for r, s in zip(run_ids, slots, strict=True):
        value = None if s is None else got.get((r, s))
        if value is not None and item.kind == "reduce":
            value = _reduce(value, item.reduction or "mean")
        values.append(value)
    return values


def run_sql(store: Store, text: str) -> pandas.DataFrame:
    """Raw SQL over the catalog: one read-only statement (a SELECT), on the reader's
    mirror, where DuckDB's external access is off."""
    if not isinstance(text, str):
        raise TypeError(f"store.sql takes SQL text, not {type(text).__name__}")
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as exc:
        raise QueryError(f"invalid SQL: {exc}") from exc
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        raise QueryError("store.sql runs exactly one read-only SELECT statement")
    try:
        return store._query(text).df()
    except duckdb.Error as exc:
        raise QueryError(f"the SQL could not run: {exc}") from exc

