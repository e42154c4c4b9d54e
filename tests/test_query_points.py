"""Point lookups (``where run = X and label = Y``) answered from the mirror's op index:
the same rows, types and tensors as DuckDB gives for the same SQL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import mlp

import tracelake as tl
from tracelake.query import compile_query
from tracelake.query.results import _looked_up


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tl.Store:
    """'a' and 'b': one forward each, b without its linears saved; 'steps': three forward
    passes in one run, so that each label has a row per step; 'big': tensors of 4 MiB,
    each in an array of its own (no byte offset)."""
    root = tmp_path_factory.mktemp("points") / "store"
    store = tl.open(root)
    model, (x,) = mlp()
    with torch.no_grad():
        store.record(model, x, name="a")
        store.record(model, x * 2, name="b", save=~tl.func("linear"))
        with store.recording("steps", model) as rec:
            for k in range(3):
                rec.record(model, x + k)
        store.record(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(1024, 1024), name="big")
    return store


LABELS = ["input_1", "linear_1_1", "relu_1_1", "relu_1_2", "output_1", "nosuch_1_1"]
RUNS = ["a", "b", "steps", "big", "nosuch"]
ITEMS = [
    "out",
    "out[0]",
    "out[:, 1:3]",
    "max(out[0])",
    "run",
    "step",
    "idx",
    "label",
    "tensor",
    "array",
    "byte_offset",
    "nbytes",
    "shape",
    "dtype",
]


def _both(store: tl.Store, text: str, **params: object):
    """The DuckDB result and the op index's of one query on the store's mirror."""
    mirror = store.catalog
    mirror.refresh()
    compiled = compile_query(text, params, mirror.run_ids)
    assert compiled.point is not None, text
    duck = mirror.arrow(compiled.sql, compiled.params, refresh=False)
    index = _looked_up(mirror, compiled, compiled.point)
    assert index is not None, "the SQL ran once, so its types are known"
    return duck, index


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    run=st.sampled_from(RUNS),
    label=st.sampled_from(LABELS),
    items=st.lists(st.sampled_from(ITEMS), min_size=1, max_size=4, unique=True),
    limit=st.none() | st.integers(0, 4),
    offset=st.none() | st.integers(0, 3),
    as_params=st.booleans(),
    swapped=st.booleans(),
)
def test_index_gives_duckdbs_rows(
    store: tl.Store,
    run: str,
    label: str,
    items: list[str],
    limit: int | None,
    offset: int | None,
    as_params: bool,
    swapped: bool,
) -> None:
    # (a run name written out that names no run raises RunNotFoundError: bound, it matches none)
    by_param = as_params or run == "nosuch"
    conds = [
        "run = :run" if by_param else f"run = '{run}'",
        "label = :label" if as_params else f"label = '{label}'",
    ]
    if swapped:
        conds = [f"{c.split(' = ')[1]} = {c.split(' = ')[0]}" for c in reversed(conds)]
    text = f"select {', '.join(items)} from ops where {' and '.join(conds)}"
    if limit is not None:
        text += f" limit {limit}" + ("" if offset is None else f" offset {offset}")
    params = {"run": run} if by_param else {}
    params |= {"label": label} if as_params else {}
    duck, index = _both(store, text, **params)
    assert index.equals(duck), (text, index.to_pylist(), duck.to_pylist())
    assert index.schema == duck.schema


def test_store_query_uses_the_index_and_reads_the_same_tensors(
    store: tl.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "select run, step, out, out[1] as row1 from ops where run = :r and label = :l"
    first = store.query(text, r="steps", l="relu_1_2")  # DuckDB: the result's types
    assert [row["step"] for row in first] == [0, 1, 2]
    mirror = store.catalog

    def no_sql(*_: object, **__: object) -> None:
        raise AssertionError("the point lookup ran SQL")

    monkeypatch.setattr(mirror, "arrow", no_sql)
    again = store.query(text, r="steps", l="relu_1_2")
    assert again.sql == first.sql and again.params == first.params
    for x, y in zip(first, again, strict=True):
        assert x.keys() == y.keys()
        assert x["run"] == y["run"] and x["step"] == y["step"]
        assert torch.equal(x["out"], y["out"]) and torch.equal(x["row1"], y["row1"])
    unsaved = store.query(text, r="b", l="linear_1_1")
    assert len(unsaved) == 1 and unsaved.tensors()[0] is None
    assert len(store.query(text, r="nosuch", l="relu_1_2")) == 0
    assert len(store.query(text, r="a", l="nosuch")) == 0


@pytest.mark.parametrize(
    "text",
    [
        "select out from ops where run = 'a'",
        "select out from ops where label = 'relu_1_2'",
        "select out from ops where run = 'a' and label = 'relu_1_2' and step = 0",
        "select out from ops where run = 'a' or label = 'relu_1_2'",
        "select out from ops where run = 'a' and label like 'relu%'",
        "select out from ops where run in ('a') and label = 'relu_1_2'",
        "select out from ops where run = 'a' and label = 'relu_1_2' order by step",
        "select func, out from ops where run = 'a' and label = 'relu_1_2'",
        "select mean(out) from ops where run = 'a' and label = 'relu_1_2'",
        "select * from ops where run = 'a' and label = 'relu_1_2'",
        "select count(*) from ops where run = 'a' and label = 'relu_1_2'",
        "select out from ops where run = 'a' and run = 'b'",
        "select out from ops where run = label and label = 'x'",
        "select label from modules where run = 'a' and label = 'x'",
    ],
)
def test_other_queries_are_not_point_lookups(store: tl.Store, text: str) -> None:
    mirror = store.catalog
    mirror.refresh()
    assert compile_query(text, None, mirror.run_ids).point is None
    assert compile_query("select out from ops where run = 'a' and label = 'x'").point is None, (
        "without the run ids, no lookup"
    )


def test_index_follows_deletes_overwrites_and_new_runs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = tl.open(root)
    model, (x,) = mlp()
    text = "select out from ops where run = :r and label = 'relu_1_2'"
    with torch.no_grad():
        store.record(model, x, name="one")
        assert len(store.query(text, r="one")) == 1
        assert len(store.query(text, r="one")) == 1  # the index, from here on
        other = tl.open(root)  # another writer
        other.record(model, x * 3, name="two")
        assert torch.equal(store.query(text, r="two").tensors()[0], model[:2](x * 3))
        other.record(model, x * 5, name="one", overwrite=True)
        again = store.query(text, r="one")
        assert len(again) == 1 and torch.equal(again.tensors()[0], model[:2](x * 5))
        other.delete("two")
        assert len(store.query(text, r="two")) == 0
