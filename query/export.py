"""A query's result written to a file, every value exactly, in bounded memory.

- **Parquet / Arrow IPC**: scalar columns with their own Arrow types (floats as doubles,
  bit for bit); a tensor column as Arrow's canonical fixed-shape tensor extension type
  (``arrow.fixed_shape_tensor``, the tensor's own dtype and shape; pyarrow reads it back
  as such, DuckDB as an array of numbers) when every saved tensor of the column has one
  shape and dtype, else as a struct of ``dtype``, ``shape`` and the raw little-endian
  ``data`` bytes. bfloat16, which Arrow lacks, is stored as its uint16 bits with
  ``tracelake.dtype = bfloat16`` in the field's metadata.
- **JSON**: one array of row objects; a tensor as ``{"dtype", "shape", "data"}`` with
  ``data`` flat, row-major; NaN and infinities (which JSON lacks) as ``null``.
- **CSV**: floats as their shortest exact text (``repr``), a tensor as the JSON object
  above (non-finite values as ``NaN`` / ``Infinity``, as Python's ``json`` reads them).

Rows go out in batches of about :data:`BATCH_BYTES` of tensors, read just before they
are written (:meth:`Result.read_rows <tracelake.query.results.Result.read_rows>`), so
memory holds one batch whatever the size of the result.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, TextIO

import pyarrow as pa

from tracelake.errors import QueryError

if TYPE_CHECKING:
    import torch

    from .results import Result

__all__ = ["BATCH_BYTES", "FORMATS", "csv_text", "export"]

#: Bytes of tensors per batch of rows written.
BATCH_BYTES = 32 << 20
#: Elements per piece of a tensor's text (JSON, CSV).
_TEXT_ELEMENTS = 1 << 16
FORMATS = ("csv", "json", "parquet", "arrow")
_DTYPE_KEY = b"tracelake.dtype"


def export(result: Result, fmt: str, target: str | TextIO, progress: bool | None = None) -> None:
    """Write ``result`` as ``fmt`` (one of :data:`FORMATS`) to ``target`` (a path, or a
    text stream for csv and json). ``progress``: a bar for exports over a second (None:
    where someone watches, see :mod:`tracelake.progress`)."""
    from tracelake.progress import Progress

    if fmt not in FORMATS:
        raise QueryError(f"export formats are {', '.join(FORMATS)}, not {fmt!r}")
    sizes = result.row_nbytes()
    with Progress(f"writing {fmt}", sum(sizes), "bytes", progress) as bar:
        batches = _batches(result, sizes, bar)
        if fmt in ("parquet", "arrow"):
            if not isinstance(target, str):
                raise QueryError(f"--format {fmt} writes a file: name it (-o FILE)")
            _write_arrow(result, fmt, target, batches)
            return
        out = open(target, "w", newline="") if isinstance(target, str) else target  # noqa: SIM115
        try:
            (_write_json if fmt == "json" else _write_csv)(result, out, batches)
            out.flush()
        finally:
            if out is not target:
                out.close()


def _batches(result: Result, sizes: list[int], bar: Any) -> Iterator[list[dict[str, Any]]]:
    """The result's rows, read in batches of about :data:`BATCH_BYTES`."""
    start = 0
    while start < len(sizes):
        stop, held = start, 0
        while stop < len(sizes) and (stop == start or held + sizes[stop] <= BATCH_BYTES):
            held += sizes[stop]
            stop += 1
        yield list(result.read_rows(start, stop))
        bar.advance(held)
        start = stop
    if not sizes:
        yield []


# -- Arrow and Parquet -----------------------------------------------------------------------


def _arrow_type(dtype: torch.dtype) -> tuple[pa.DataType, bytes | None]:
    """The Arrow type of a tensor's elements, and the dtype to note where Arrow has none."""
    import torch

    if dtype == torch.bfloat16:
        return pa.uint16(), b"bfloat16"
    if dtype.is_complex:
        raise QueryError(
            f"{dtype} tensors have no Arrow type: export them as json or csv, or select "
            "their real and imaginary parts"
        )
    if dtype == torch.bool:
        return pa.bool_(), None
    from tracelake.store.dtypes import numpy_dtype

    np_dtype = numpy_dtype(dtype)
    if np_dtype is None:
        raise QueryError(f"{dtype} tensors have no Arrow type: export them as json or csv")
    return pa.from_numpy_dtype(np_dtype), None


def _flat(tensor: torch.Tensor) -> Any:
    """The tensor's elements, row-major, as numpy (bfloat16 as its uint16 bits)."""
    import torch

    t = tensor.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
        return t.numpy().view("uint16")
    return t.resolve_conj().resolve_neg().numpy()


class _TensorColumn:
    """How one tensor column is written: fixed-shape tensors when the column is uniform
    (decided from the catalog before any tensor is read), else dtype/shape/data
    structs. Plain numbers (a reduction's) go as doubles."""

    def __init__(self, name: str, uniform: bool, first: torch.Tensor | None):
        self.name = name
        self.metadata: dict[bytes, bytes] | None = None
        if first is None:  # no saved tensor in the column at all
            self.fixed = False
            self.type: pa.DataType = pa.null()
            return
        value_type, noted = _arrow_type(first.dtype)
        if noted is not None:
            self.metadata = {_DTYPE_KEY: noted}
        self.value_type = value_type
        self.fixed = uniform and first.dim() > 0
        self.shape = list(first.shape)
        self.size = math.prod(self.shape)
        if self.fixed:
            self.type = pa.fixed_shape_tensor(value_type, self.shape)
        else:
            self.type = pa.struct(
                [("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.binary())]
            )

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, metadata=self.metadata)

    def _check(self, values: list[Any]) -> None:
        for v in values:
            if v is not None and list(v.shape) != self.shape:  # (the catalog said uniform)
                raise QueryError(
                    f"column {self.name!r}: a tensor of shape {list(v.shape)} among {self.shape}"
                )

    def flats(self, values: list[Any]) -> Iterator[Any]:
        """A fixed-shape column's rows as flat numpy values (None: a null row), each
        made when asked for (no copy of a contiguous tensor)."""
        self._check(values)
        return (None if v is None else _flat(v) for v in values)

    def array(self, values: list[Any]) -> pa.Array:
        if self.type == pa.null():
            return pa.nulls(len(values))
        if not self.fixed:
            return pa.array(
                [
                    None
                    if v is None
                    else {
                        "dtype": str(v.dtype).removeprefix("torch."),
                        "shape": list(v.shape),
                        "data": _flat(v).tobytes(),
                    }
                    for v in values
                ],
                type=self.type,
            )
        import numpy as np

        self._check(values)
        present = np.array([v is not None for v in values], dtype=bool)
        if len(values) == 1 and values[0] is not None:
            flat = _flat(values[0])  # (a large tensor is a batch of its own: no copy)
        else:  # one copy of the batch's values, written in place (no list of parts)
            flat = np.zeros(self.size * len(values), dtype=self.value_type.to_pandas_dtype())
            for i, v in enumerate(values):
                if v is not None:
                    flat[i * self.size : (i + 1) * self.size] = _flat(v)
        # Arrays made from buffers, not pa.array: that imports pandas (~45 MiB resident)
        if self.value_type == pa.bool_():  # (bits in Arrow, bytes in numpy)
            flat = np.packbits(flat, bitorder="little")
        data = pa.Array.from_buffers(
            self.value_type, len(values) * self.size, [None, pa.py_buffer(flat)]
        )
        nulls = len(values) - int(present.sum())
        validity = pa.py_buffer(np.packbits(present, bitorder="little")) if nulls else None
        storage = pa.Array.from_buffers(
            self.type.storage_type, len(values), [validity], null_count=nulls, children=[data]
        )
        return pa.ExtensionArray.from_storage(self.type, storage)


def _scalars(result: Result, field: pa.Field, start: int, rows: list[dict[str, Any]]) -> pa.Array:
    """A scalar column's rows: the result's own Arrow slice where it holds one of the
    field's type (no conversion, and no pandas import), else converted from the rows."""
    held = result.arrow_slice(field.name, start, start + len(rows))
    if held is not None and held.type == field.type:
        return held
    return pa.array([row[field.name] for row in rows], type=field.type)


def _write_arrow(
    result: Result, fmt: str, path: str, batches: Iterator[list[dict[str, Any]]]
) -> None:
    import pyarrow.parquet as pq

    from .parquet import PagedParquetWriter
    from .results import is_tensor

    tensor_names = set(result.tensor_columns)
    columns: dict[str, _TensorColumn] = {}
    writer: Any = None
    schema: pa.Schema | None = None
    scalar_types = result.scalar_types()
    at = 0  # the batch's first row
    try:
        for rows in batches:
            if schema is None:
                fields = []
                for name in result.columns:
                    values = [row[name] for row in rows]
                    if name in tensor_names and any(is_tensor(v) for v in values):
                        first = next(v for v in values if is_tensor(v))
                        columns[name] = _TensorColumn(name, result.uniform(name), first)
                        fields.append(columns[name].field())
                    elif name in tensor_names and name not in scalar_types:
                        columns[name] = _TensorColumn(name, False, None)
                        fields.append(columns[name].field())
                    else:
                        fields.append(pa.field(name, scalar_types.get(name, pa.float64())))
                schema = pa.schema(fields)
                # Dictionary pages pay for nothing on tensor values (almost all
                # distinct) and build a table of them: a 64 MiB float32 tensor took
                # 1.5 GiB with them; compression gains little on them and holds a
                # second copy of the column. Scalar columns keep both.
                plain = [f.name for f in fields if f.name not in columns]
                codecs = {f.name: "snappy" if f.name in plain else "none" for f in fields}
                # Fixed-shape tensors go page by page (pyarrow would build a row's
                # page whole: ~235 MiB for a 64 MiB tensor; see query/parquet.py).
                paged = [n for n, c in columns.items() if c.fixed and c.size]
                if fmt == "arrow":
                    writer = pa.ipc.new_file(path, schema)
                elif paged:
                    options = {"use_dictionary": plain, "data_page_version": "2.0"}
                    writer = PagedParquetWriter(
                        path, schema, paged, compression="snappy", **options
                    )
                else:
                    writer = pq.ParquetWriter(
                        path,
                        schema,
                        use_dictionary=plain,
                        compression=codecs,
                        data_page_version="2.0",
                    )
            if isinstance(writer, PagedParquetWriter):
                others = [
                    columns[f.name].array([row[f.name] for row in rows])
                    if f.name in columns
                    else _scalars(result, f, at, rows)
                    for f in writer.others
                ]
                tensors = {n: columns[n].flats([row[n] for row in rows]) for n in writer.paged}
                batch = pa.record_batch(others, schema=writer.others)
                writer.write_group(len(rows), batch, tensors)
                at += len(rows)
                del rows, others, tensors, batch
                pa.default_memory_pool().release_unused()
                continue
            arrays = [
                columns[f.name].array([row[f.name] for row in rows])
                if f.name in columns
                else _scalars(result, f, at, rows)
                for f in schema
            ]
            writer.write_batch(pa.record_batch(arrays, schema=schema))
            at += len(rows)
            del rows, arrays  # (not held while the next batch is read)
            pa.default_memory_pool().release_unused()
    finally:
        if writer is not None:
            writer.close()


# -- text ------------------------------------------------------------------------------------


def _scalar_json(value: Any, allow_nan: bool) -> str:
    if isinstance(value, float) and not math.isfinite(value) and not allow_nan:
        return "null"
    if isinstance(value, (datetime, date)):
        return json.dumps(value.isoformat())
    if isinstance(value, (list, tuple)) and not allow_nan:
        value = [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]
    return json.dumps(value, allow_nan=allow_nan, default=str)


def _tensor_json(tensor: torch.Tensor, allow_nan: bool) -> Iterator[str]:
    """A tensor as a JSON object, in pieces of at most :data:`_TEXT_ELEMENTS` values."""
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    yield f'{{"dtype": "{dtype}", "shape": {json.dumps(list(tensor.shape))}, "data": ['
    flat = tensor.detach().cpu().reshape(-1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.float()  # exact: every such value is a float32
    floating = flat.is_floating_point()
    for at in range(0, flat.numel(), _TEXT_ELEMENTS):
        piece = flat[at : at + _TEXT_ELEMENTS]
        if flat.is_complex():
            values: list[Any] = [[z.real, z.imag] for z in piece.tolist()]
        else:
            values = piece.tolist()
        if floating and not allow_nan and not bool(torch.isfinite(piece).all()):
            values = [v if math.isfinite(v) else None for v in values]
        text = json.dumps(values, allow_nan=allow_nan)[1:-1]
        yield (", " if at else "") + text
    yield "]}"


def _write_json(result: Result, out: TextIO, batches: Iterator[list[dict[str, Any]]]) -> None:
    from .results import is_tensor

    out.write("[")
    first = True
    for rows in batches:
        for row in rows:
            out.write("\n {" if first else ",\n {")
            first = False
            for i, (name, value) in enumerate(row.items()):
                out.write(("" if not i else ", ") + json.dumps(name) + ": ")
                if is_tensor(value):
                    for piece in _tensor_json(value, allow_nan=False):
                        out.write(piece)
                else:
                    out.write(_scalar_json(value, allow_nan=False))
            out.write("}")
        rows, row, value = [], {}, None  # (not held while the next batch is read)
    out.write("\n]\n")


def csv_text(value: Any) -> str:
    """A value that is not a tensor as CSV text: floats to the last bit, dates in ISO
    form, lists, tuples and dicts as JSON (every CSV tracelake writes: queries, diffs)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def _csv_quote(text: str) -> str:
    if any(c in text for c in ',"\r\n') or text != text.strip():
        return '"' + text.replace('"', '""') + '"'
    return text


def _write_csv(result: Result, out: TextIO, batches: Iterator[list[dict[str, Any]]]) -> None:
    from .results import is_tensor

    out.write(",".join(_csv_quote(c) for c in result.columns) + "\r\n")
    for rows in batches:
        for row in rows:
            for i, value in enumerate(row.values()):
                if i:
                    out.write(",")
                if is_tensor(value):  # always quoted: the JSON text has quotes and commas
                    out.write('"')
                    for piece in _tensor_json(value, allow_nan=True):
                        out.write(piece.replace('"', '""'))
                    out.write('"')
                else:
                    out.write(_csv_quote(csv_text(value)))
            out.write("\r\n")
        rows, row, value = [], {}, None  # (not held while the next batch is read)
