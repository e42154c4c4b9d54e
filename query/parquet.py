"""A Parquet file whose tensor columns are written page by page, in bounded memory.

pyarrow's Parquet writer ends a data page only at the end of a row, and builds a row's
repetition and definition levels, values and page whole: about 235 MiB for one row of a
64 MiB tensor (``README.md``, "Export memory"). Here a fixed-shape tensor column's
column chunk is written by hand instead, in data pages (version 1, ``PLAIN`` values,
``RLE`` levels, uncompressed) of at most :data:`PAGE_VALUES` values each, a row spanning
as many pages as it needs (version 1 pages may: only version 2 pages and page indexes
begin at a row). Everything else comes from pyarrow: the file's schema and its Arrow
schema (``ARROW:schema``, which gives readers back the ``arrow.fixed_shape_tensor``
type, its dtype and shape) from an empty file of the whole schema, and each row group's
other columns from a small file of those columns alone, whose column chunks are copied
in and whose metadata is moved to where they land. The footer is Thrift's compact
protocol, decoded and encoded field by field (:func:`_decode` / :func:`_encode`), so
that fields this module does not know pass through as they were.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from typing import Any, BinaryIO

import pyarrow as pa

__all__ = ["PAGE_VALUES", "PagedParquetWriter"]

#: Values per data page of a tensor column (1 MiB of float32).
PAGE_VALUES = 1 << 18
_MAGIC = b"PAR1"

# Thrift compact protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
# Parquet's enums and field ids (parquet.thrift)
_BOOLEAN, _INT32, _INT64, _FLOAT, _DOUBLE_T, _FLBA = 0, 1, 2, 4, 5, 7
_PLAIN, _RLE, _DATA_PAGE, _OPTIONAL, _REPEATED = 0, 3, 0, 1, 2

Struct = list[list[Any]]  # [[field id, compact type, value], ...] in the order read


# -- Thrift compact protocol -----------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        self.at += 1
        return self.data[self.at - 1]

    def varint(self) -> int:
        shift = n = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        self.at += n
        return self.data[self.at - n : self.at]


def _read_value(r: _Reader, kind: int) -> Any:
    if kind in (_I16, _I32, _I64):
        return r.zigzag()
    if kind == _BINARY:
        return r.take(r.varint())
    if kind == _STRUCT:
        return _read_struct(r)
    if kind in (_LIST, _SET):
        head = r.byte()
        size = head >> 4 if head >> 4 != 15 else r.varint()
        elem = head & 0x0F
        return [elem, [_read_value(r, elem) for _ in range(size)]]
    if kind == _MAP:
        size = r.varint()
        types = r.byte() if size else 0
        k, v = types >> 4, types & 0x0F
        return [types, [(_read_value(r, k), _read_value(r, v)) for _ in range(size)]]
    if kind == _DOUBLE:
        return r.take(8)
    if kind in (_BYTE, _TRUE, _FALSE):  # (a bool in a list or map is a byte)
        return r.byte()
    raise ValueError(f"Thrift compact type {kind} in a Parquet footer")


def _read_struct(r: _Reader) -> Struct:
    fields: Struct = []
    last = 0
    while True:
        head = r.byte()
        if head == 0:
            return fields
        kind, delta = head & 0x0F, head >> 4
        last = last + delta if delta else r.zigzag()
        value = None if kind in (_TRUE, _FALSE) else _read_value(r, kind)
        fields.append([last, kind, value])


def _write_value(out: list[bytes], kind: int, value: Any) -> None:
    if kind in (_I16, _I32, _I64):
        out.append(_zigzag(value))
    elif kind == _BINARY:
        out += [_varint(len(value)), value]
    elif kind == _STRUCT:
        _write_struct(out, value)
    elif kind in (_LIST, _SET):
        elem, items = value
        n = len(items)
        out.append(bytes([(n << 4) | elem]) if n < 15 else bytes([0xF0 | elem]) + _varint(n))
        for item in items:
            _write_value(out, elem, item)
    elif kind == _MAP:
        types, items = value
        out.append(_varint(len(items)))
        if items:
            out.append(bytes([types]))
        for k, v in items:
            _write_value(out, types >> 4, k)
            _write_value(out, types & 0x0F, v)
    elif kind == _DOUBLE:
        out.append(value)
    else:  # a byte, or a bool in a list or map
        out.append(bytes([value]))


def _write_struct(out: list[bytes], fields: Struct) -> None:
    last = 0
    for fid, kind, value in sorted(fields, key=lambda f: f[0]):
        if 0 < fid - last <= 15:
            out.append(bytes([((fid - last) << 4) | kind]))
        else:
            out.append(bytes([kind]) + _zigzag(fid))
        last = fid
        if kind not in (_TRUE, _FALSE):
            _write_value(out, kind, value)
    out.append(b"\x00")


def _decode(data: bytes) -> Struct:
    return _read_struct(_Reader(data))


def _encode(fields: Struct) -> bytes:
    out: list[bytes] = []
    _write_struct(out, fields)
    return b"".join(out)


def _get(fields: Struct, fid: int, default: Any = None) -> Any:
    return next((f[2] for f in fields if f[0] == fid), default)


def _set(fields: Struct, fid: int, kind: int, value: Any) -> None:
    fields[:] = [f for f in fields if f[0] != fid] + [[fid, kind, value]]


def _drop(fields: Struct, *fids: int) -> None:
    fields[:] = [f for f in fields if f[0] not in fids]


def _footer(data: bytes) -> Struct:
    """The FileMetaData of a whole Parquet file held in ``data``."""
    (size,) = struct.unpack("<i", data[-8:-4])
    return _decode(data[-8 - size : -8])


# -- the writer ------------------------------------------------------------------------------


def _levels(runs: list[tuple[int, int]], width: int) -> bytes:
    """Levels as RLE runs of (value, count), with their 4-byte length (data page v1)."""
    body = b"".join(
        _varint(count << 1) + value.to_bytes((width + 7) // 8, "little") for value, count in runs
    )
    return struct.pack("<i", len(body)) + body


def _add_run(runs: list[tuple[int, int]], value: int, count: int) -> None:
    if runs and runs[-1][0] == value:
        runs[-1] = (value, runs[-1][1] + count)
    elif count:
        runs.append((value, count))


class _TensorChunk:
    """One tensor column's column chunk in the row group being written: its pages, as
    rows arrive."""

    def __init__(self, out: BinaryIO, leaf: Struct, max_def: int, max_rep: int, path: list[bytes]):
        self.out, self.max_def, self.max_rep, self.path = out, max_def, max_rep, path
        self.physical = _get(leaf, 1)
        self.start = out.tell()
        self.levels = 0  # in the chunk
        self._reset()

    def _reset(self) -> None:
        self.defs: list[tuple[int, int]] = []
        self.reps: list[tuple[int, int]] = []
        self.pieces: list[Any] = []
        self.held = 0  # values in the page
        self.count = 0  # levels in the page

    def _plain(self) -> bytes:
        import numpy as np

        if not self.pieces:
            return b""
        values = np.concatenate(self.pieces) if len(self.pieces) > 1 else self.pieces[0]
        if self.physical == _BOOLEAN:
            return np.packbits(values.astype(bool), bitorder="little").tobytes()
        if self.physical == _INT32:
            if values.dtype == np.uint32:
                return values.astype("<u4").view("<i4").tobytes()
            return values.astype("<i4").tobytes()
        if self.physical == _INT64:
            return values.astype("<u8" if values.dtype == np.uint64 else "<i8").tobytes()
        if self.physical == _FLOAT:
            return values.astype("<f4").tobytes()
        if self.physical == _DOUBLE_T:
            return values.astype("<f8").tobytes()
        return values.astype(values.dtype.newbyteorder("<")).tobytes()  # (float16's bytes)

    def flush(self) -> None:
        if not self.count:
            return
        body = b"".join(
            [
                _levels(self.reps, self.max_rep.bit_length()) if self.max_rep else b"",
                _levels(self.defs, self.max_def.bit_length()) if self.max_def else b"",
                self._plain(),
            ]
        )
        header: Struct = [
            [1, _I32, _DATA_PAGE],
            [2, _I32, len(body)],
            [3, _I32, len(body)],
            [
                5,
                _STRUCT,
                [[1, _I32, self.count], [2, _I32, _PLAIN], [3, _I32, _RLE], [4, _I32, _RLE]],
            ],
        ]
        self.out.write(_encode(header))
        self.out.write(body)
        self.levels += self.count
        self._reset()

    def add(self, flat: Any) -> None:
        """One row: the tensor's values, row-major (None: a null row)."""
        if flat is None:
            _add_run(self.reps, 0, 1)
            _add_run(self.defs, 0, 1)
            self.count += 1
            return
        at, first = 0, True
        while at < len(flat):
            piece = flat[at : at + PAGE_VALUES - self.held]
            n = len(piece)
            if first:
                _add_run(self.reps, 0, 1)
            _add_run(self.reps, 1, n - 1 if first else n)
            _add_run(self.defs, self.max_def, n)
            self.pieces.append(piece)
            self.held += n
            self.count += n
            at += n
            first = False
            if self.held >= PAGE_VALUES:
                self.flush()

    def metadata(self) -> Struct:
        """The ColumnChunk, once its pages are written."""
        self.flush()
        size = self.out.tell() - self.start
        meta: Struct = [
            [1, _I32, self.physical],
            [2, _LIST, [_I32, [_PLAIN, _RLE]]],
            [3, _LIST, [_BINARY, self.path]],
            [4, _I32, 0],  # uncompressed
            [5, _I64, self.levels],
            [6, _I64, size],
            [7, _I64, size],
            [9, _I64, self.start],
        ]
        return [[2, _I64, self.start], [3, _STRUCT, meta]]


def _leaves(schema: list[Struct]) -> list[tuple[int, Struct, int, int, list[bytes]]]:
    """Each leaf of the Parquet schema: (its top-level column, its element, max
    definition level, max repetition level, path)."""
    out = []
    at = 1  # (element 0 is the root)

    def walk(top: int, depth_def: int, depth_rep: int, path: list[bytes]) -> None:
        nonlocal at
        element = schema[at]
        at += 1
        rep = _get(element, 3, 0)
        d = depth_def + (rep != 0)  # optional and repeated both add a level
        r = depth_rep + (rep == _REPEATED)
        here = [*path, _get(element, 4)]
        children = _get(element, 5, 0)
        if not children:
            out.append((top, element, d, r, here))
        for _ in range(children):
            walk(top, d, r, here)

    for top in range(_get(schema[0], 5, 0)):
        walk(top, 0, 0, [])
    return out


class PagedParquetWriter:
    """A Parquet file of ``schema`` written a row group at a time
    (:meth:`write_group`), the columns named in ``paged`` (fixed-shape tensors of a
    numeric or bool value type) page by page; ``options``: pyarrow's ``ParquetWriter``
    options for the other columns."""

    def __init__(self, path: str, schema: pa.Schema, paged: list[str], **options: Any):
        import pyarrow.parquet as pq

        self.schema, self.paged, self.options = schema, set(paged), options
        empty = io.BytesIO()
        pq.write_table(schema.empty_table(), empty, **options)
        self.meta = _footer(empty.getvalue())
        self.leaves = _leaves(_get(self.meta, 2)[1])
        self.others = pa.schema([f for f in schema if f.name not in self.paged])
        self.groups: list[Struct] = []
        self.rows = 0
        self.out: BinaryIO = open(path, "wb")  # noqa: SIM115  (closed by close())
        self.out.write(_MAGIC)

    def write_group(
        self, rows: int, others: pa.RecordBatch, tensors: dict[str, Iterator[Any]]
    ) -> None:
        """One row group of ``rows`` rows: ``others`` (the other columns' values, of
        ``self.others``) and,
        per paged column, its rows' flat values (numpy, row-major; None for a null row),
        each read only when its turn comes."""
        import pyarrow.parquet as pq

        small = io.BytesIO()
        data, copied = b"", []
        if len(self.others):
            pq.write_table(
                pa.Table.from_batches([others], self.others),
                small,
                row_group_size=rows,
                **self.options,
            )
            data = small.getvalue()
            group = _get(_footer(data), 4)[1][0]  # (the one row group)
            copied = list(_get(group, 1)[1])
        start = self.out.tell()
        columns: list[Struct] = []
        for top, leaf, max_def, max_rep, path in self.leaves:
            name = self.schema.field(top).name
            if name in self.paged:
                chunk = _TensorChunk(self.out, leaf, max_def, max_rep, path)
                for flat in tensors[name]:
                    chunk.add(flat)
                columns.append(chunk.metadata())
                continue
            column = copied.pop(0)
            columns.append(self._copy(data, column))
        size = sum(_get(_get(c, 3), 6) for c in columns)
        self.groups.append(
            [
                [1, _LIST, [_STRUCT, columns]],
                [2, _I64, size],
                [3, _I64, rows],
                [5, _I64, start],
                [6, _I64, self.out.tell() - start],
                [7, _I16, len(self.groups)],
            ]
        )
        self.rows += rows

    def _copy(self, data: bytes, column: Struct) -> Struct:
        """A column chunk of the small file copied to the end of ours, its offsets moved."""
        meta = _get(column, 3)
        first = min(_get(meta, f) for f in (9, 11) if _get(meta, f) is not None)
        size = _get(meta, 7)
        shift = self.out.tell() - first
        self.out.write(data[first : first + size])
        for fid in (9, 10, 11):  # data, index and dictionary pages
            if _get(meta, fid) is not None:
                _set(meta, fid, _I64, _get(meta, fid) + shift)
        _drop(meta, 14, 15)  # (a bloom filter lies outside the chunk: not copied)
        column = [f for f in column if f[0] not in (2, 3, 4, 5, 6, 7)]  # (no page index)
        return [*column, [2, _I64, first + shift], [3, _STRUCT, meta]]

    def close(self) -> None:
        if self.out.closed:
            return
        try:
            meta = [f for f in self.meta if f[0] not in (3, 4)]
            meta += [[3, _I64, self.rows], [4, _LIST, [_STRUCT, self.groups]]]
            footer = _encode(meta)
            self.out.write(footer + struct.pack("<i", len(footer)) + _MAGIC)
        finally:
            self.out.close()
