"""The catalog's Arrow columns built from their buffers (``store/arrow.py``), checked
against pyarrow's own conversion (``pa.array``, which imports pandas, and is what they
replace): the same arrays for every type the catalog declares, its refusals (and a few
more); and a process that records, folds and reads runs never imports pandas."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracelake.store import arrow
from tracelake.store.schema import TABLES, arrow_schema

_I32 = st.integers(-(2**31), 2**31 - 1)
_I64 = st.integers(-(2**63), 2**63 - 1)
_F64 = st.floats(allow_nan=False) | st.integers(-(2**53), 2**53)
_TEXT = st.text(max_size=12)  # (any code point, surrogates excluded: str.encode refuses them)
_WHEN = st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1))
MODULE = pa.struct([("path", pa.string()), ("pass", pa.int32())])

#: Every type the catalog's tables declare, with values of it.
CASES: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.bool_(), st.booleans()),
    (pa.int32(), _I32),
    (pa.int64(), _I64),
    (pa.float64(), _F64),
    (pa.string(), _TEXT),
    (pa.timestamp("us"), _WHEN),
    (pa.list_(pa.int32()), st.lists(st.none() | _I32, max_size=4)),
    (pa.list_(pa.int64()), st.lists(st.none() | _I64, max_size=4)),
    (pa.list_(pa.string()), st.lists(st.none() | _TEXT, max_size=4)),
    (
        pa.list_(MODULE),
        st.lists(
            st.none() | st.fixed_dictionaries({"path": st.none() | _TEXT, "pass": _I32}),
            max_size=3,
        ),
    ),
]


def test_the_cases_cover_every_type_the_catalog_declares() -> None:
    declared = {f.type for table in TABLES.values() for f in arrow_schema(table)}
    assert declared <= {t for t, _ in CASES}, declared - {t for t, _ in CASES}
    assert all(arrow.builds(t) for t in declared)
    assert not arrow.builds(pa.decimal128(10, 2)) and not arrow.builds(pa.float32())


@pytest.mark.parametrize("type_, values", CASES, ids=[str(t) for t, _ in CASES])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_arrays_equal_pyarrows_own_conversion(
    type_: pa.DataType, values: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    rows = data.draw(st.lists(st.none() | values, max_size=40))
    built = arrow.array(rows, type_)
    expected = pa.array(rows, type=type_)
    built.validate(full=True)
    assert built.type == type_ and built.equals(expected), (built, expected)
    assert built.to_pylist() == expected.to_pylist()


@settings(max_examples=60, deadline=None)
@given(
    numbers=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=40),
    dtype=st.sampled_from([np.int32, np.int64, np.float64, np.bool_]),
    data=st.data(),
)
def test_numpy_columns_with_a_mask(numbers: list[float], dtype: Any, data: st.DataObject) -> None:
    values = np.array(numbers, dtype=np.float64)
    if dtype is not np.float64:  # (values of the column's own dtype, as the writer has them)
        values = (values % 1000).astype(dtype)
    flags = data.draw(st.lists(st.booleans(), min_size=len(numbers), max_size=len(numbers)))
    mask = np.array(flags, dtype=bool)
    type_ = pa.from_numpy_dtype(dtype)
    built = arrow.array(values[::-1], type_, mask=mask[::-1])  # (a strided view too)
    expected = pa.array(values[::-1], type=type_, mask=mask[::-1])
    built.validate(full=True)
    assert built.equals(expected)
    at = data.draw(st.lists(st.integers(0, max(len(numbers) - 1, 0))))
    positions = np.array(at, dtype=data.draw(st.sampled_from([np.int32, np.int64, np.uint64])))
    if len(numbers):
        assert built.take(arrow.indices(positions)).equals(expected.take(pa.array(positions)))


@pytest.mark.parametrize("type_", [pa.bool_(), pa.int32(), pa.int64(), pa.float64()], ids=str)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_numeric_columns_read_back_as_to_numpy_reads_them(
    type_: pa.DataType, data: st.DataObject
) -> None:
    values = dict(CASES)[type_]
    rows = data.draw(st.lists(st.none() | values, max_size=30))
    column = pa.chunked_array([pa.array(rows, type=type_)] * 2)  # (the reader's case: chunks)
    start = data.draw(st.integers(0, len(rows)))
    sliced = column.slice(start)
    expected = sliced.fill_null(False if type_ == pa.bool_() else -1).to_numpy()
    read = arrow.numbers(sliced, null=False if type_ == pa.bool_() else -1)
    assert read.dtype == expected.dtype and np.array_equal(read, expected)
    if sliced.null_count:
        with pytest.raises(ValueError):
            arrow.numbers(sliced)


@pytest.mark.parametrize(
    "values, type_",
    [
        (["1"], pa.int64()),
        ([2**63], pa.int64()),
        ([2**31], pa.int32()),
        ([1, "a"], pa.float64()),
        ([1], pa.string()),
        (["ab"], pa.list_(pa.int64())),
        ([1], pa.list_(pa.int64())),
        (["2026-01-01"], pa.timestamp("us")),
        ([{"path": 1, "pass": 0}], MODULE),
        (np.array([2**40]), pa.int32()),
        (np.array([0.5]), pa.int64()),
    ],
)
def test_what_pyarrow_refuses_is_refused(values: Any, type_: pa.DataType) -> None:
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError)):
        pa.array(values, type=type_)
    with pytest.raises((TypeError, OverflowError)):
        arrow.array(values, type_)


@pytest.mark.parametrize(
    "values, type_",
    [
        ([1.5], pa.int64()),
        ([[1.5]], pa.list_(pa.int32())),
        ([b"x"], pa.string()),
        ([("a", 0)], MODULE),
    ],
)
def test_what_pyarrow_would_bend_is_refused_too(values: Any, type_: pa.DataType) -> None:
    """``pa.array`` truncates a float into an integer column and takes bytes as a string
    and a tuple as a struct: from a row builder each is a bug, refused rather than kept."""
    pa.array(values, type=type_)
    with pytest.raises(TypeError):
        arrow.array(values, type_)


def test_aware_datetimes_are_their_utc_time_and_arrow_arrays_are_cast() -> None:
    east = datetime(2026, 12, 7, 18, 0, tzinfo=timezone(timedelta(hours=2)))
    built = arrow.array([east, datetime(2026, 12, 7, 16, 0, tzinfo=UTC)], pa.timestamp("us"))
    assert built.equals(pa.array([east, east], type=pa.timestamp("us")))
    assert built.to_pylist() == [datetime(2026, 12, 7, 16, 0)] * 2
    chunked = pa.chunked_array([[1, 2], [3]], type=pa.int32())
    assert arrow.array(chunked, pa.int64()).equals(pa.array([1, 2, 3], pa.int64()))


def test_a_table_of_runs_rows_as_from_pylist_makes_it() -> None:
    schema = arrow_schema(TABLES["runs"])
    rows = [
        {"id": 1, "name": "a", "status": "complete", "created": datetime(2026, 12, 7), "seq": 1},
        {"id": 2, "name": None, "meta": '{"k": 1}', "steps": 3},
    ]
    assert arrow.table(rows, schema).equals(pa.Table.from_pylist(rows, schema=schema))
    by_position = [tuple(row.get(f.name) for f in schema) for row in rows]
    assert arrow.table(by_position, schema).equals(pa.Table.from_pylist(rows, schema=schema))
    assert arrow.table([], schema).equals(schema.empty_table())


def test_recording_folding_and_reading_import_no_pandas(tmp_path: Path) -> None:
    """pyarrow's ``pa.array`` imports pandas (~0.2-0.3 s, ~45 MiB) the first time it is
    called in a process: every table a run writes (ops with statistics, tensors, edges,
    modules, grads, rules, calls), the fold that inserts sealed runs, and a read of them
    are made without it. A first process records and leaves its runs sealed (it exits
    without its fold); a second folds them as a reader, records, closes and queries."""
    store = tmp_path / "s.tl"
    record = textwrap.dedent(
        f"""
        import os, sys, torch
        import tracelake as tl
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from model_zoo import gpt2, mlp
        store = tl.open({str(store)!r})
        model, (x,) = mlp()
        store.record(model, x, name="grads", stats="all", backward=lambda out: out.sum())
        with torch.no_grad():
            store.record(model, x, name="ablated",
                         intervene=tl.when(tl.func("relu"), tl.zero_ablate()))
            with store.batch():
                for k in range(3):
                    store.record(model, x + k, name=f"batch{{k}}")
            model, args = gpt2(n_layer=1)
            store.record(model, *args, name="gpt2", save=tl.none(), stats="all")
        assert store._catalog.sealed_waiting, "the runs were folded"
        print("imported", "pandas" in sys.modules, flush=True)
        os._exit(0)  # (no fold at exit: the runs stay sealed)
        """
    )
    read = textwrap.dedent(
        f"""
        import sys, torch
        import tracelake as tl
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from model_zoo import mlp
        store = tl.open({str(store)!r}, create=False)
        print(len(store.run_rows()), "runs")
        model, (x,) = mlp()
        with torch.no_grad():
            store.record(model, x, name="late", stats="all")
        store.close()
        store = tl.open({str(store)!r}, create=False)
        rows = store.query("select run, label, mean from ops where func = 'relu' and mean >= 0")
        assert {{row["run"] for row in rows}} >= {{"grads", "ablated", "batch2", "late"}}, rows
        grads = store.query("select run, label from grads")
        assert len(grads) and {{row["run"] for row in grads}} == {{"grads"}}
        again = store.query("select run, label, mean from ops where func = 'relu' and mean >= 0")
        assert [r["label"] for r in again] == [r["label"] for r in rows]
        print("imported", "pandas" in sys.modules, flush=True)
        """
    )
    for code, runs in ((record, None), (read, "6 runs")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.strip().splitlines()
        assert lines[-1] == "imported False", done.stdout[-500:]
        assert runs is None or runs in lines
