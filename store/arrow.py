"""Arrow arrays from numpy arrays and Python values, built from their buffers.

pyarrow's ``pa.array``, and everything built on it (``Table.from_pylist``, a compute
function such as ``take`` given a numpy array), imports pandas on its first call in a
process, to ask whether its input is a pandas object (apache/arrow#34994): ~0.2-0.3 s
and ~45 MiB resident, paid by the first ``store.record`` of every process with no other
use for pandas. These make the same arrays with ``pa.Array.from_buffers``, for the
types the catalog's tables declare (:data:`TYPES`); the writer's rows, the fold of
sealed runs and a reader's typed rows are made with them, never with ``pa.array``.

Values convert as ``pa.array`` converts them (None is null) and refuse what it refuses
(a value of another type, an integer out of its range), and what it would bend: a float
where an integer belongs (it truncates), bytes where a string does, a tuple where a
struct does: from a row builder, each is a bug.
"""

from __future__ import annotations

import itertools
import operator
from array import array as _packed
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import numpy as np
import pyarrow as pa

#: The numpy dtype of each fixed-width Arrow type these build.
_NUMPY = {
    pa.bool_(): np.bool_,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.float64(): np.float64,
    pa.timestamp("us"): np.int64,
}
#: The leaf types, nested in lists and structs at will (what the catalog declares).
TYPES = (*_NUMPY, pa.string())
#: The numpy dtype of each numeric type :func:`numbers` reads (a dictionary's indices may
#: be narrower than the types built here).
_READ = {**_NUMPY, pa.int8(): np.int8, pa.int16(): np.int16}
_EPOCH = datetime(1970, 1, 1)
_US = timedelta(microseconds=1)
#: The ``array`` module's codes for a Python list's values of each fixed-width type but
#: bool: packed by it (faster than numpy for the few rows of most columns, and as
#: strict: a float where an integer belongs is a TypeError, one out of range an
#: OverflowError).
_CODES = {pa.int32(): "i", pa.int64(): "q", pa.float64(): "d", pa.timestamp("us"): "q"}
assert all(_packed(code).itemsize == np.dtype(_NUMPY[t]).itemsize for t, code in _CODES.items())
#: Up to this many rows a validity bitmap is packed by Python's integers, past it by numpy.
_FEW = 256


def array(values: Any, type_: pa.DataType, mask: np.ndarray | None = None) -> pa.Array:
    """``values`` (a numpy array, a sequence of Python values or None, an Arrow array)
    as an Arrow array of ``type_``; ``mask``: True where a numpy array's row is null.
    ``TypeError`` for a value that is not of the type, ``OverflowError`` for an integer
    out of its range, ``pa.ArrowTypeError`` for an Arrow array that does not cast."""
    given = type(values)
    if given is not list and given is not tuple:  # (most are: they go straight on)
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if isinstance(values, pa.Array):
            return values if values.type == type_ else values.cast(type_)
        if isinstance(values, np.ndarray):
            if type_ in _NUMPY and type_ != pa.timestamp("us"):
                return _fixed(values, type_, None if mask is None else ~np.asarray(mask, bool))
            values = values.tolist()
        values = list(values)
    if mask is not None:
        values = [None if masked else v for v, masked in zip(values, mask.tolist(), strict=True)]
    build = _BUILDERS.get(type_)
    if build is None:
        build = _BUILDERS[type_] = _builder(type_)
    return build(values, type_)


def indices(positions: np.ndarray) -> pa.Array:
    """Positions (a numpy integer array) as the indices of an Arrow ``take``."""
    wide = positions.dtype.itemsize > 4 or positions.dtype.kind == "u"
    return _fixed(positions, pa.int64() if wide else pa.int32(), None)


def numbers(values: pa.Array | pa.ChunkedArray, null: Any = None) -> np.ndarray:
    """A numeric column (bool, integers, floats; an Array or ChunkedArray) as a numpy
    array, its nulls as ``null`` (``ValueError`` if it has nulls and ``null`` is None):
    read from its buffers, as ``to_numpy`` would, which imports pandas too."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    dtype = _READ.get(values.type)
    if dtype is None:
        raise TypeError(f"not a numeric column: {values.type}")
    n, start = len(values), values.offset
    if not n:
        return np.empty(0, dtype)
    validity, data = values.buffers()[:2]
    if dtype is np.bool_:
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        out = bits[start : start + n].astype(np.bool_)
    else:
        out = np.frombuffer(data, dtype, n, start * np.dtype(dtype).itemsize).copy()
    if values.null_count:
        if null is None:
            raise ValueError(f"a column of {values.null_count} nulls, and no value for them")
        bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
        out[~bits[start : start + n].astype(np.bool_)] = null
    return out


def builds(type_: pa.DataType) -> bool:
    """Whether :func:`array` builds arrays of ``type_``."""
    if pa.types.is_list(type_):
        return builds(type_.value_type)
    if pa.types.is_struct(type_):
        return all(builds(field.type) for field in type_)
    return type_ in TYPES


def table(rows: Sequence[dict[str, Any] | Sequence[Any]], schema: pa.Schema) -> pa.Table:
    """Rows as a table of ``schema``: dicts by column name (a missing key is null), as
    ``pa.Table.from_pylist(rows, schema=schema)`` makes it, or tuples by position."""
    columns: list[list[Any]]
    if rows and isinstance(rows[0], dict):
        named = cast("Sequence[dict[str, Any]]", rows)
        columns = [[row.get(f.name) for row in named] for f in schema]
    else:
        placed = cast("Sequence[Sequence[Any]]", rows)
        columns = [[row[k] for row in placed] for k in range(len(schema))]
    return pa.Table.from_arrays(
        [array(values, f.type) for values, f in zip(columns, schema, strict=True)], schema=schema
    )


def _validity(valid: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    """The validity bitmap of ``valid`` (None where every row is) and the null count."""
    if valid is None:
        return None, 0
    nulls = len(valid) - int(np.count_nonzero(valid))
    if not nulls:
        return None, 0
    return pa.py_buffer(np.packbits(valid, bitorder="little")), nulls


def _nulls(values: Sequence[Any]) -> tuple[pa.Buffer | None, int]:
    """The validity bitmap of Python values (None where none is None) and the null
    count. (By identity: ``None in values`` compares by ``==`` too, which a numpy array
    among them answers with an array.)"""
    if not any(map(operator.is_, values, itertools.repeat(None))):
        return None, 0
    n = len(values)
    if n > _FEW:
        return _validity(np.fromiter((v is not None for v in values), np.bool_, n))
    bits = sum(1 << k for k, v in enumerate(values) if v is not None)
    return pa.py_buffer(bits.to_bytes((n + 7) // 8, "little")), n - bits.bit_count()


def _fixed(values: np.ndarray, type_: pa.DataType, valid: np.ndarray | None) -> pa.Array:
    dtype: np.dtype[Any] = np.dtype(_NUMPY[type_])
    if values.dtype != dtype and values.size:
        if dtype.kind in "iu" and values.dtype.kind == "f":
            raise TypeError(f"floats where {type_} belongs")
        if dtype.kind in "iu" and values.dtype.kind in "iu":
            info = np.iinfo(dtype)
            if values.min() < info.min or values.max() > info.max:
                raise OverflowError(f"a value out of the range of {type_}")
    values = np.ascontiguousarray(values, dtype=dtype)
    if dtype == np.bool_:  # (bits in Arrow, bytes in numpy)
        data = pa.py_buffer(np.packbits(values, bitorder="little"))
    else:
        data = pa.py_buffer(values)
    validity, nulls = _validity(valid)
    return pa.Array.from_buffers(type_, len(values), [validity, data], null_count=nulls)


def _numbers(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    validity, nulls = _nulls(values)
    if nulls:
        values = [0 if v is None else v for v in values]
    code = _CODES[type_]
    try:
        data = _packed(code, values)
    except TypeError:
        bad = next(v for v in values if not _packs(code, v))
        raise TypeError(f"{bad!r} ({type(bad).__name__}) is not a value of {type_}") from None
    buffers = [validity, pa.py_buffer(data)]
    return pa.Array.from_buffers(type_, len(values), buffers, null_count=nulls)


def _packs(code: str, value: Any) -> bool:
    try:
        _packed(code, [value])
    except TypeError:
        return False
    except OverflowError:
        pass
    return True


def _bools(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    validity, nulls = _nulls(values)
    if nulls:
        values = [False if v is None else v for v in values]
    flags = np.asarray(values)
    if flags.size and (flags.ndim != 1 or flags.dtype.kind != "b"):
        bad = next((v for v in values if not isinstance(v, (bool, np.bool_))), values)
        raise TypeError(f"{bad!r} is not a value of {type_}")
    data = pa.py_buffer(np.packbits(flags.astype(np.bool_), bitorder="little"))
    return pa.Array.from_buffers(type_, len(values), [validity, data], null_count=nulls)


def _timestamps(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """Datetimes as microseconds since the epoch (an aware one's UTC time; a naive one
    read as UTC, as ``pa.array`` reads it)."""
    micros = []
    for v in values:
        if v is not None:
            if not isinstance(v, datetime):
                raise TypeError(f"{v!r} ({type(v).__name__}) is not a timestamp")
            if v.tzinfo is not None:
                v = v.astimezone(UTC).replace(tzinfo=None)
            v = (v - _EPOCH) // _US
        micros.append(v)
    return _numbers(micros, type_)


def _offsets(rows: Sequence[Any]) -> pa.Buffer:
    """A variable-size column's offsets (int32) from its rows (their lengths).
    ``OverflowError`` past 2 GiB of values (Arrow's int32 offsets)."""
    if len(rows) <= _FEW:
        return pa.py_buffer(_packed("i", itertools.accumulate(map(len, rows), initial=0)))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, rows), np.int64, len(rows)), out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise OverflowError("a column of more than 2 GiB of values (Arrow's int32 offsets)")
    return pa.py_buffer(offsets.astype(np.int32))


def _strings(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    validity, nulls = _nulls(values)
    texts = ["" if v is None else v for v in values] if nulls else values
    try:
        joined = "".join(texts)  # (refuses anything but strings)
    except TypeError:
        bad = next(v for v in texts if not isinstance(v, str))
        raise TypeError(f"{bad!r} ({type(bad).__name__}) is not a string") from None
    data = joined.encode()
    # ASCII (the usual: labels, names, paths): each string's bytes are its characters
    sized = texts if len(data) == len(joined) else [t.encode() for t in texts]
    buffers = [validity, _offsets(sized), pa.py_buffer(data)]
    return pa.Array.from_buffers(type_, len(values), buffers, null_count=nulls)


def _lists(values: Sequence[Any], type_: pa.ListType) -> pa.Array:
    validity, nulls = _nulls(values)
    rows = [() if v is None else v for v in values] if nulls else values
    if not _SEQUENCES.issuperset(map(type, rows)):
        for v in rows:
            if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__len__"):
                raise TypeError(f"{v!r} ({type(v).__name__}) is not a list")
    child = array(list(itertools.chain.from_iterable(rows)), type_.value_type)
    buffers = [validity, _offsets(rows)]
    return pa.Array.from_buffers(type_, len(values), buffers, null_count=nulls, children=[child])


#: The types a list column's rows are taken from without a closer look.
_SEQUENCES = frozenset({list, tuple, np.ndarray})


def _structs(values: Sequence[Any], type_: pa.StructType) -> pa.Array:
    validity, nulls = _nulls(values)
    if not _RECORDS.issuperset(map(type, values)):
        for v in values:
            if v is not None and not isinstance(v, dict):
                raise TypeError(f"{v!r} ({type(v).__name__}) is not a struct (a dict)")
    children = [
        array([None if v is None else v.get(field.name) for v in values], field.type)
        for field in type_
    ]
    return pa.Array.from_buffers(
        type_, len(values), [validity], null_count=nulls, children=children
    )


_RECORDS = frozenset({dict, type(None)})
#: Each type's builder of Python values, found once (:func:`_builder`).
_BUILDERS: dict[pa.DataType, Callable[[Sequence[Any], Any], pa.Array]] = {}


def _builder(type_: pa.DataType) -> Callable[[Sequence[Any], Any], pa.Array]:
    if pa.types.is_string(type_):
        return _strings
    if pa.types.is_list(type_):
        return _lists
    if pa.types.is_struct(type_):
        return _structs
    if type_ == pa.timestamp("us"):
        return _timestamps
    if type_ == pa.bool_():
        return _bools
    if type_ in _CODES:
        return _numbers
    raise TypeError(f"cannot build an Arrow array of {type_} (arrow.py builds {TYPES})")
