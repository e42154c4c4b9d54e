"""Hardening (issue 17, items 13-15): every failure a tracelake error with a clear
message (hostile run names and meta, bad parameters, slices past a tensor's shape, a
file where a store should be, garbled or truncated catalog files), ``meta`` that one run
got wrong breaks no query of the others, NaN is no number to compare, and queries are
linear in their length and bounded in time and memory."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from hook_capture import assert_bitwise
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import tracelake as tl
from tracelake.store import catalog
from tracelake.store.duckfile import wal_of


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tl.Store:
    """Runs a and b checkpointed into the catalog file, c committed to DuckDB's log only
    (as most recent runs are: the log is checkpointed once past its bound)."""
    root = tmp_path_factory.mktemp("errors") / "s"
    model, x = _model()
    store = tl.open(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(catalog, "LOG_BYTES", 0)  # each commit checkpoints
        store.record(model, x, name="a", meta={"lr": 0.5, "tag": "x"})
        store.record(model, x, name="b", meta={"lr": float("nan")})
        store.flush()  # (sealed runs' rows into the catalog: here a transaction each)
    assert not wal_of(root / "catalog.duckdb").exists()
    store.record(model, x, name="c", meta={"lr": 200.0})
    store.flush()
    assert wal_of(root / "catalog.duckdb").exists()
    return store


# -- run names and meta ---------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.text(min_size=0, max_size=12), meta=_JSON)
def test_any_name_and_meta_records_or_is_refused_clearly(
    tmp_path_factory: pytest.TempPathFactory, name: str, meta: Any
) -> None:
    root = tmp_path_factory.mktemp("names") / "s"
    model, x = _model()
    store = tl.open(root)
    try:
        store.record(model, x, name=name, meta={"v": meta})
    except tl.InvalidRunNameError as exc:
        assert repr(name) in str(exc)
        return
    except tl.InvalidMetaError as exc:
        assert "meta=" in str(exc)
        return
    reader = tl.open(root, create=False)
    assert list(reader.runs()["name"]) == [name]
    assert reader[name].name == name
    reader.query("select run, meta.v from runs").df()
    assert len(reader.query("select label from ops where run = :r", r=name).df()) > 0


@pytest.mark.parametrize(
    "name, error",
    [
        ("x\udc80", tl.InvalidRunNameError),
        ("", tl.InvalidRunNameError),
        (3, tl.InvalidRunNameError),
    ],
)
def test_hostile_run_names_are_refused(tmp_path: Path, name: Any, error: type) -> None:
    model, x = _model()
    with pytest.raises(error, match="run name"):
        tl.open(tmp_path / "s").record(model, x, name=name)


def _deep(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"k": "a\udc80"}, "lone surrogate"),
        ({"k": _deep(5000)}, "nested too deeply"),
        ({"k": object()}, "JSON-serialisable"),
        # meta.<key> reads a mapping's keys: a string or a list would answer no query,
        # and JSON would make the key 1 the text '1' without a word
        ("lr=0.1", "a dict"),
        ([1, 2], "a dict"),
        ({1: "a"}, "keys are strings"),
        ({"k": [{"ok": 1}, {2: "b"}]}, "keys are strings"),
    ],
    ids=["surrogate", "deep", "object", "str", "list", "int key", "nested int key"],
)
def test_unstorable_meta_is_refused(tmp_path: Path, meta: Any, match: str) -> None:
    model, x = _model()
    store = tl.open(tmp_path / "s")
    with pytest.raises(tl.InvalidMetaError, match=match):
        store.record(model, x, name="m", meta=meta)
    assert isinstance(tl.InvalidMetaError("x"), ValueError)  # as before, a ValueError too
    assert list(store.runs(all=True)["name"]) == []  # nothing was registered


def test_one_runs_bad_meta_breaks_no_query_of_the_others(tmp_path: Path) -> None:
    root = tmp_path / "s"
    model, x = _model()
    store = tl.open(root)
    for name, lr in (("a", 1.0), ("b", 200.0), ("c", 300.0), ("d", 400.0)):
        store.record(model, x, name=name, meta={"lr": lr})
    store.flush()  # (their rows into the file, which this test edits directly)
    con = duckdb.connect(str(root / "catalog.duckdb"))  # as a crafted or older store would
    con.execute("UPDATE runs SET meta = ? WHERE name = 'a'", ['{"lr": "a\\udc80"}'])
    con.execute(
        "UPDATE runs SET meta = ? WHERE name = 'c'", ['{"lr": ' + "[" * 5000 + "]" * 5000 + "}"]
    )
    con.execute("UPDATE runs SET meta = '{bad' WHERE name = 'd'")
    con.close()
    reader = tl.open(root)
    runs = reader.runs()
    assert list(runs["name"]) == ["a", "b", "c", "d"]
    assert runs["meta"][1] == {"lr": 200.0}
    found = reader.query("select run, meta.lr from runs where meta.lr > 100").df()
    assert list(found["run"]) == ["b"]


def test_nan_meta_matches_no_comparison(store: tl.Store) -> None:
    for condition, expected in [
        ("meta.lr > 100", ["c"]),
        ("meta.lr < 100", ["a"]),
        ("meta.lr >= 0.5", ["a", "c"]),
        ("not meta.lr < 100", ["c"]),
    ]:
        got = store.query(f"select run from runs where {condition} order by run").df()
        assert list(got["run"]) == expected, condition
    nan_first = store.query("select run, meta.lr from runs order by meta.lr desc").df()
    assert list(nan_first["run"])[:2] == ["c", "a"]


# -- query errors ---------------------------------------------------------------------


@pytest.mark.parametrize("text", ["out[99]", "out[0, 0, 0]", "out[0, 99]", "absmax(out[5])"])
def test_a_slice_past_the_shape_is_a_query_error(store: tl.Store, text: str) -> None:
    with pytest.raises(tl.QueryResultError, match="no such element"):
        store.query(f"select label, {text} from ops where run = 'a'").df()


@pytest.mark.parametrize("value", [object(), b"x", 1j, {"a": 1}, {1}, torch.ones(1)])
def test_bad_parameter_types_are_query_errors(store: tl.Store, value: Any) -> None:
    with pytest.raises(tl.QueryTypeError, match="parameter :v is a"):
        store.query("select label from ops where label = :v", v=value)
    with pytest.raises(TypeError):  # (and TypeErrors, as before)
        store.query("select label from ops where label in :v", v=[value])


def test_sql_of_the_wrong_type_is_a_query_error(store: tl.Store) -> None:
    with pytest.raises(tl.QueryTypeError):
        store.sql(42)  # type: ignore[arg-type]
    with pytest.raises(tl.QueryTypeError):
        store.query(b"select label from ops")  # type: ignore[arg-type]


# -- files that are not what they should be -------------------------------------------


def test_a_file_where_the_store_should_be(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a store")
    with pytest.raises(tl.StoreError, match=r"Not a directory|no tracelake store"):
        tl.open(path)
    with pytest.raises(tl.StoreNotFoundError):
        tl.open(path, create=False)


def _copy(store: tl.Store, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(store.path, root)
    return root


@pytest.mark.parametrize("garble", [b"\xff\xfe\x00garbled", b"", b"123\n" * 10_000])
def test_a_garbled_generation_file(store: tl.Store, tmp_path: Path, garble: bytes) -> None:
    root = _copy(store, tmp_path)
    (root / "catalog.gen").write_bytes(garble)
    reader = tl.open(root)
    assert list(reader.runs()["name"]) == ["a", "b", "c"]
    model, x = _model()
    reader.record(model, x, name="d")  # the next write makes it again
    assert list(tl.open(root).runs()["name"]) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("keep", [0, 100, 3])  # empty, a stub header, a third of it
def test_a_truncated_catalog_without_its_shadow_is_a_catalog_error(
    store: tl.Store, tmp_path: Path, keep: int
) -> None:
    root = _copy(store, tmp_path)
    (root / "catalog.shadow").unlink()  # (a store copied without it)
    catalog = root / "catalog.duckdb"
    size = catalog.stat().st_size
    with catalog.open("r+b") as f:
        f.truncate(size // keep if keep == 3 else keep)
    reader = tl.open(root)
    with pytest.raises(tl.CatalogError, match="catalog"):
        reader.runs()
    model, x = _model()
    with pytest.raises(tl.StoreError):
        reader.record(model, x, name="d")


@pytest.mark.parametrize("damage", ["empty", "stub header", "first block"])
def test_an_unreadable_catalog_is_restored_from_its_shadow(
    store: tl.Store, tmp_path: Path, damage: str
) -> None:
    """What a writer SIGKILLed in DuckDB's checkpoint once left (the crash battery):
    a metadata block whose checksum no longer matches. Only the change that was cut
    short may be lost; here nothing was."""
    root = _copy(store, tmp_path)
    catalog = root / "catalog.duckdb"
    with catalog.open("r+b") as f:
        if damage == "first block":  # bytes inside the first block (DuckDB's metadata)
            f.seek(3 * 4096 + 5000)
            f.write(b"\x00killed\x00" * 8)
        else:
            f.truncate(0 if damage == "empty" else 100)
    damaged = catalog.read_bytes()
    # readers read the shadow until a writer restores the catalog
    assert list(tl.open(root).runs()["name"]) == ["a", "b", "c"]
    model, x = _model()
    with pytest.warns(tl.TraceLakeWarning, match="restored from catalog.shadow"):
        tl.open(root).record(model, x, name="d")
    assert list(tl.open(root).runs()["name"]) == ["a", "b", "c", "d"]
    # nothing is thrown away: the unreadable file is kept aside
    (kept,) = (p for p in root.glob("catalog.duckdb.unreadable-*") if p.suffix != ".wal")
    assert kept.read_bytes() == damaged


def test_a_restore_keeps_the_registration_of_a_run_still_recording(
    store: tl.Store, tmp_path: Path
) -> None:
    """A run's registration stays in DuckDB's log until the next checkpoint; the
    shadow copies the file only. A restore keeps the log (DuckDB replays it onto the
    copy), so a run that was recording while another writer restored the catalog still
    commits, whole."""
    root = _copy(store, tmp_path)
    model, x = _model()
    catalog = root / "catalog.duckdb"
    with tl.open(root).recording("e", model):
        model(x)
        assert wal_of(catalog).exists()  # the registration, logged only
        with catalog.open("r+b") as f:  # a metadata block spoilt, as by a killed writer
            f.seek(3 * 4096 + 5000)
            f.write(b"\x00killed\x00" * 8)
        with pytest.warns(tl.TraceLakeWarning, match="restored from catalog.shadow"):
            tl.open(root).delete("a")  # another writer, which restores
    reader = tl.open(root, create=False)
    assert sorted(reader.runs()["name"]) == ["b", "c", "e"]
    assert_bitwise(reader["e"]["output_1"].out, model(x))


# -- 14. query length, time and memory ------------------------------------------------


@pytest.fixture
def limits() -> Iterator[None]:
    before = tl.set_query_limits()
    yield
    tl.set_query_limits(seconds=before.seconds, memory=before.memory)


def test_an_unbounded_query_stops_at_its_time_limit(store: tl.Store, limits: None) -> None:
    tl.set_query_limits(seconds=0.5)
    with pytest.raises(tl.QueryLimitError, match=r"time limit of 0.5 s.*set_query_limits"):
        store.sql("select count(*) from range(1000000000000)")
    # the reader goes on working, within the limit
    assert int(store.sql("select count(*) from ops").iloc[0, 0]) > 0
    assert len(store.query("select label from ops where run = 'a'").df()) > 0


def test_a_query_past_its_memory_limit(store: tl.Store, limits: None) -> None:
    tl.set_query_limits(seconds=None, memory="64MB")
    with pytest.raises(tl.QueryLimitError, match=r"out of memory.*set_query_limits"):
        store.sql("select list(range) from range(100000000)")
    tl.set_query_limits(memory=None)
    assert int(store.sql("select count(*) from range(1000)").iloc[0, 0]) == 1000


@pytest.mark.parametrize("seconds, memory", [(0, None), (-1, None), ("1", None), (None, "lots")])
def test_query_limits_are_checked(limits: None, seconds: Any, memory: Any) -> None:
    with pytest.raises(ValueError):
        tl.set_query_limits(seconds=seconds, memory=memory)


def test_long_in_lists_and_condition_chains_give_the_right_rows(store: tl.Store) -> None:
    labels = list(store.query("select label from ops where run = 'a'").df()["label"])
    wanted = labels[:2]
    many = [f"nothing_{i}" for i in range(5000)] + wanted
    text = (
        "select label from ops where run = 'a' and label in ("
        + ", ".join(f"'{v}'" for v in many)
        + ")"
    )
    assert sorted(store.query(text).df()["label"]) == sorted(wanted)
    chain = " and ".join(f"label != 'nothing_{i}'" for i in range(3000))
    got = store.query(f"select label from ops where run = 'a' and {chain}").df()
    assert sorted(got["label"]) == sorted(labels)
    either = " or ".join(f"label = 'nothing_{i}'" for i in range(1000))
    text = f"select label from ops where run = 'a' and ({either} or label = :l)"
    got = store.query(text, l=wanted[0]).df()
    assert list(got["label"]) == wanted[:1]
    assert math.isfinite(len(json.dumps(text)))  # (the text itself was 60 KB)
