"""Sealed runs (issue 16, items 3 and 4): ``record`` returns once its run is durable and
sealed (its rows in ``runs/.sealed/<id>``); the rows reach ``catalog.duckdb`` with the
next catalog transaction of any writer or reader. Until then the run is complete
everywhere: listed, queried and read by every process, its name taken."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
import torch
from hook_capture import assert_bitwise
from hypothesis import given, settings
from hypothesis import strategies as st
from test_catalog_log import _outputs, reads_back
from test_store import run_python

import tracelake as tl
from tracelake.store import catalog
from tracelake.store.sealed import read_sealed, write_sealed


def _in_file(root: Path) -> list[str]:
    """The complete runs' names in the catalog file itself (read directly; none where
    there is no file yet)."""
    if not (root / "catalog.duckdb").exists():
        return []
    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT name FROM runs WHERE status = 'complete' ORDER BY id")
        return [name for (name,) in rows.fetchall()]
    finally:
        con.close()


_READ_ALL = """
import sys
import tracelake as tl
store = tl.open(sys.argv[1], create=False)
print(",".join(store.runs()["name"]))
for name in store.runs()["name"]:
    print(name, store[name]["output_1"].out.numpy().tobytes().hex())
"""


def test_a_sealed_run_is_complete_everywhere_before_its_rows_reach_the_catalog(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    for i in range(3):
        model, inputs = _outputs(i)
        store.record(model, *inputs, name=f"r{i}")
    # every run is sealed, a new store's first too: there is no catalog file yet
    assert not (root / "catalog.duckdb").exists()
    assert len(store.paths.sealed_ids()) == 3
    done = run_python(_READ_ALL, str(root))  # another process sees all three, bit for bit
    listed, *lines = done.stdout.splitlines()
    assert listed == "r0,r1,r2"
    for i, line in enumerate(lines):
        model, inputs = _outputs(i)
        assert line == f"r{i} {model(*inputs).detach().numpy().tobytes().hex()}"
    # ... and, reading, inserted their rows (its refresh folded them, making the
    # catalog): once each
    assert _in_file(root) == ["r0", "r1", "r2"]
    assert store.paths.sealed_ids() == []
    assert list(store.runs()["name"]) == ["r0", "r1", "r2"]
    reads_back(store, 3)


def test_a_writer_folds_every_so_many_runs_and_when_it_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catalog, "FOLD_AFTER", 4)
    monkeypatch.setattr("tracelake.store.store.FOLD_AFTER", 4)
    root = tmp_path / "s"
    store = tl.open(root)
    model, inputs = _outputs(0)
    waiting = []
    for i in range(10):
        store.record(model, *inputs, name=f"r{i}")
        waiting.append(len(store.paths.sealed_ids()))
    # every fourth run folds the four (the first fold makes the catalog)
    assert waiting == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert _in_file(root) == [f"r{i}" for i in range(8)]
    store.close()
    assert _in_file(root) == [f"r{i}" for i in range(10)]
    run = tl.open(root, create=False)["r9"]
    assert run.info["seq"] == 10 and run.id == 10  # (ids and commit order follow the seals)


def test_a_new_stores_run_is_read_where_its_seal_could_not_tell_readers(tmp_path: Path) -> None:
    """A new store's first seal whose readers' token could not be made (a full disk:
    the run stands, a warning says so) left neither a token nor a catalog: every read
    of another process still folds and sees the run, listing and queries alike."""
    root = tmp_path / "s"
    model, inputs = _outputs(0)
    run_python(  # recorded, and the process gone before any fold
        """
        import errno, os, sys
        import tracelake as tl
        from tracelake.store import catalog
        from test_catalog_log import _outputs
        def full(_self):
            raise OSError(errno.ENOSPC, "No space left on device (made to fail)")
        catalog.FileChangeToken.bump = full
        model, inputs = _outputs(0)
        tl.open(sys.argv[1]).record(model, *inputs, name="r0")
        os._exit(0)
        """,
        str(root),
    )
    assert not (root / "catalog.gen").exists() and not (root / "catalog.duckdb").exists()
    reader = tl.open(root, create=False)
    assert len(reader) == 1 and "r0" in reader  # (before runs(): these read the mirror)
    assert int(reader.sql("SELECT count(*) AS n FROM runs")["n"][0]) == 1
    assert_bitwise(reader["r0"]["output_1"].out, model(*inputs), "the run sealed untold")
    assert _in_file(root) == ["r0"]


def test_a_new_stores_sealed_runs_wait_where_no_fold_can_make_its_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new store's runs are all sealed until a fold makes its catalog. A reader whose
    fold cannot (a full disk, here made to fail) warns and sees no runs yet, with no
    error, and the store is not taken for one whose catalog was lost; the next fold
    that can inserts them, and nothing was lost."""
    root = tmp_path / "s"
    model, inputs = _outputs(0)
    run_python(  # recorded by another process, which exits before any fold ...
        """
        import os, sys
        import tracelake as tl
        from test_catalog_log import _outputs
        model, inputs = _outputs(0)
        tl.open(sys.argv[1]).record(model, *inputs, name="r0")
        os._exit(0)
        """,
        str(root),
    )
    assert not (root / "catalog.duckdb").exists() and len(tl.open(root).paths.sealed_ids()) == 1

    def full(_self: object) -> None:
        raise tl.StoreError("No space left on device (made to fail)")

    monkeypatch.setattr(catalog.CatalogWriter, "_fold_all", full)
    reader = tl.open(root, create=False)
    with pytest.warns(tl.TraceLakeWarning, match="could not be added to its catalog"):
        assert list(reader.runs()["name"]) == []
    with pytest.warns(tl.TraceLakeWarning, match="could not be added"):
        assert len(reader.sql("SELECT * FROM ops")) == 0
    with pytest.warns(tl.TraceLakeWarning, match="could not be added"):
        assert "r0" not in reader
    assert not (root / "catalog.duckdb").exists()
    monkeypatch.undo()
    assert list(reader.runs()["name"]) == ["r0"]  # ... and this fold makes the catalog
    assert _in_file(root) == ["r0"] and not reader.paths.sealed_ids()
    assert_bitwise(reader["r0"]["output_1"].out, model(*inputs), "the run sealed first")
    reads_back(reader, 1)


def test_a_sealed_name_is_taken_and_replaced_as_a_committed_one(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    first, inputs = _outputs(0)
    store.record(first, *inputs, name="base")
    store.record(first, *inputs, name="x")  # (sealed)
    assert "x" not in _in_file(root)
    with pytest.raises(tl.RunExistsError, match="'x'"):
        store.record(first, *inputs, name="x")
    other = run_python(  # another process, which never saw the run, refuses it too
        """
        import sys
        import tracelake as tl
        from model_zoo import BUILDERS
        model, inputs = BUILDERS["mlp"]()
        try:
            tl.open(sys.argv[1], create=False).record(model, *inputs, name="x")
        except tl.RunExistsError as exc:
            print("refused", exc)
        """,
        str(root),
    )
    assert other.stdout.startswith("refused")
    assert store.paths.sealed_ids()  # (a refusal folds nothing)
    second, inputs2 = _outputs(5)
    store.record(second, *inputs2, name="x", overwrite=True)  # sealed, replacing a sealed one
    listed = store.runs(all=True)
    assert listed[listed["name"] == "x"]["status"].tolist() == ["deleted", "complete"]
    assert_bitwise(store["x"]["output_1"].out, second(*inputs2), "the replacement")
    with store.batch():  # a batch refuses it as well, and commits after the folded runs
        with pytest.raises(tl.RunExistsError):
            store.record(first, *inputs, name="x")
        store.record(first, *inputs, name="y")
    assert list(store.runs()["name"]) == ["base", "x", "y"]


_META = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None)
@given(
    name=st.text(min_size=1, max_size=60).filter(lambda n: "\x00" not in n),
    meta=_META,
    ops=st.integers(0, 40),
)
def test_a_sealed_file_round_trips_its_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, meta: object, ops: int
) -> None:
    import pyarrow as pa

    path = tmp_path_factory.mktemp("sealed") / "00000001"
    header = {
        "name": name,
        "overwrite": ops % 2 == 0,
        "created": 1_700_000_000_000_000 + ops,
        "finished": 1_700_000_000_500_000,
        "info": {"model_class": "M", "torch_version": torch.__version__, "meta": meta},
        "summary": {"steps": 1, "op_count": ops, "bytes": 7 * ops, "device": "cpu"},
        "host": "h",
        "pid": 1,
    }
    tables = {
        "ops": pa.table({"run_id": [0] * ops, "label": [f"{name}_{k}" for k in range(ops)]}),
        "edges": pa.table({"run_id": pa.array([], pa.int64())}),  # (empty: left out)
        "calls": pa.table({"x": [1.5, float("nan")]}),
    }
    write_sealed(path, header, tables)
    about, back = read_sealed(path)
    assert {k: about[k] for k in header} == json.loads(json.dumps(header))
    assert set(back) == ({"ops", "calls"} if ops else {"calls"})
    if ops:
        assert back["ops"].equals(tables["ops"])
    column = back["calls"]["x"].to_numpy()  # (NaN too: bit for bit)
    assert column.tobytes() == tables["calls"]["x"].to_numpy().tobytes()
    assert read_sealed(path, tables=False)[0]["name"] == name


def test_a_large_table_is_compressed_and_reads_back_bit_for_bit(tmp_path: Path) -> None:
    """A table past ``COMPRESS_FROM`` (a long run's ops) is written compressed: the
    file is smaller than its rows, and every value, NaNs and strings too, comes back."""
    import numpy as np
    import pyarrow as pa

    from tracelake.store import sealed

    rng = np.random.default_rng(3)
    count = sealed.COMPRESS_FROM // 8
    values = rng.standard_normal(count)
    values[::97] = np.nan
    ops = pa.table(
        {
            "run_id": np.zeros(count, np.int32),
            "label": [f"relu_{k % 300}_{k}" for k in range(count)],
            "mean": values,
        }
    )
    small = pa.table({"x": [1, 2, 3]})
    header = {key: None for key in sealed.HEADER_KEYS} | {"name": "long"}
    path = tmp_path / "00000001"
    write_sealed(path, header, {"ops": ops, "calls": small})
    assert path.stat().st_size < ops.get_total_buffer_size()  # (as written: larger)
    _, back = read_sealed(path)
    assert back["ops"].schema.equals(ops.schema) and back["calls"].equals(small)
    plain = ["run_id", "label"]  # (and NaN, which equals() would call unequal: by bytes)
    assert back["ops"].select(plain).equals(ops.select(plain))
    assert back["ops"]["mean"].to_numpy().tobytes() == values.tobytes()


def test_a_damaged_sealed_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "00000001"
    path.write_bytes(b"tracelake-sealed-run 1\n{not json\n")
    with pytest.raises(tl.StoreError, match=r"00000001.*unreadable"):
        read_sealed(path)
    path.write_bytes(b"tracelake-sealed-run 9\n{}\n")
    with pytest.raises(tl.StoreError, match="format"):
        read_sealed(path)
