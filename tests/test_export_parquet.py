"""Parquet exports write fixed-shape tensor columns page by page (``query/parquet.py``):
rows spanning pages, null rows among them, every dtype Arrow has, read back bit for bit
by pyarrow (as ``arrow.fixed_shape_tensor`` with the tensor's dtype and shape) and by
DuckDB; and the footer's Thrift codec gives back what it read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracelake as tl
from tracelake.query import parquet
from tracelake.query.export import export
from tracelake.query.results import run_query

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


class Casts(torch.nn.Module):
    """One (3, 5, 7) tensor per dtype, and a relu whose output is not saved."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = torch.relu(x * 3)
        return [(h - 1.5).to(dtype) for dtype in DTYPES]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pq") / "s.tl"
    torch.manual_seed(5)
    with torch.no_grad():
        tl.open(path).record(Casts(), torch.randn(3, 5, 7), name="d", save=tl.func("to", "mul"))
    return path


@pytest.mark.parametrize("page", [1, 8, 50, 1 << 18])
def test_tensor_rows_spanning_pages_come_back_bit_for_bit(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: int
) -> None:
    import duckdb
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(parquet, "PAGE_VALUES", page)
    store = tl.open(root, create=False)
    stored = {op.label: op.out for op in store["d"]}
    con = duckdb.connect()
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        # the float32 rows: mul (saved), relu (not saved: a null row) and the cast
        text = f"select label, idx, out from ops where run = 'd' and dtype = '{name}' order by idx"
        out = tmp_path / f"{name}.parquet"
        export(run_query(store, text, lazy=True), "parquet", str(out), progress=False)
        table = pq.read_table(out)
        column = table.column("out").combine_chunks()
        assert isinstance(column.type, pa.FixedShapeTensorType), name
        assert list(column.type.shape) == [3, 5, 7]
        labels = table.column("label").to_pylist()
        nulls = [stored[label] is None for label in labels]
        assert any(not n for n in nulls)
        if dtype == torch.float32:
            assert any(nulls)  # the relu
        rows = con.execute(f"select label, out from '{out}' order by idx").fetchall()
        assert [r[0] for r in rows] == labels
        for i, label in enumerate(labels):
            assert column.storage.is_null()[i].as_py() == nulls[i]
            assert (rows[i][1] is None) == nulls[i]
            if nulls[i]:
                continue
            want = stored[label]
            got = column.storage[i].values.to_numpy(zero_copy_only=False)
            if dtype == torch.bfloat16:  # its bits, the dtype in the field's metadata
                assert table.schema.field("out").metadata == {b"tracelake.dtype": b"bfloat16"}
                expected = want.view(torch.int16).reshape(-1).numpy().view("uint16")
            else:
                expected = want.reshape(-1).numpy()
            assert got.dtype == expected.dtype, name
            assert got.tobytes() == expected.tobytes(), name
            from_duckdb = np.array(rows[i][1], dtype=expected.dtype)
            assert from_duckdb.tobytes() == expected.tobytes(), name


def test_a_result_of_tensor_columns_only(root: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    store = tl.open(root, create=False)
    text = "select out, out as again from ops where run = 'd' and dtype = 'int8'"
    out = tmp_path / "only.parquet"
    result = run_query(store, text, lazy=True)
    export(result, "parquet", str(out), progress=False)
    table = pq.read_table(out)
    assert table.column_names == ["out", "again"] and table.num_rows == len(result) > 0
    assert table.column("out").equals(table.column("again"))
    assert table.column("out").null_count < table.num_rows


# -- the footer's Thrift compact protocol ---------------------------------------------------

_SCALARS = [
    (parquet._I32, st.integers(-(2**31), 2**31 - 1)),
    (parquet._I64, st.integers(-(2**63), 2**63 - 1)),
    (parquet._I16, st.integers(-(2**15), 2**15 - 1)),
    (parquet._BINARY, st.binary(max_size=40)),
    (parquet._DOUBLE, st.binary(min_size=8, max_size=8)),
    (parquet._BYTE, st.integers(0, 255)),
]


def _value(depth: int) -> st.SearchStrategy:
    kinds = [st.tuples(st.just(k), s) for k, s in _SCALARS]
    kinds.append(st.tuples(st.sampled_from([parquet._TRUE, parquet._FALSE]), st.none()))
    if depth:
        kinds.append(st.tuples(st.just(parquet._STRUCT), _struct(depth - 1)))
        kinds.append(
            st.sampled_from(_SCALARS).flatmap(
                lambda ks: st.tuples(
                    st.just(parquet._LIST),
                    st.lists(ks[1], max_size=20).map(lambda items, k=ks[0]: [k, items]),
                )
            )
        )
    return st.one_of(kinds)


def _struct(depth: int) -> st.SearchStrategy:
    return st.dictionaries(st.integers(1, 400), _value(depth), max_size=6).map(
        lambda d: [[fid, kind, value] for fid, (kind, value) in sorted(d.items())]
    )


@settings(max_examples=200, deadline=None)
@given(_struct(3))
def test_thrift_structs_round_trip(fields: list) -> None:
    assert parquet._decode(parquet._encode(fields)) == fields


def test_pyarrow_footers_round_trip(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"a": [1, None, 3], "s": ["x", "y", None], "f": [[1.5], [], None]})
    pq.write_table(table, tmp_path / "t.parquet")
    data = (tmp_path / "t.parquet").read_bytes()
    size = int.from_bytes(data[-8:-4], "little")
    raw = data[-8 - size : -8]
    assert parquet._encode(parquet._decode(raw)) == raw
