"""Hardening (issue 17, item 15): fuzzed queries, run end to end on a real store, fail
only with ``QueryError`` (never ``IndexError``, ``TypeError``, a raw DuckDB error...).

Queries are generated as syntax trees (``test_query_text``'s strategy, printed back to
text) or as valid texts mangled character by character, with parameters of every type.
The suite runs a few hundred; ``TRACELAKE_FUZZ=20000 pytest tests/test_query_fuzz.py``
runs as many as asked (the issue's 20,000)."""

from __future__ import annotations

import math
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_query_text import _QUERIES
from torch import nn

import tracelake as tl
from tracelake.query.printer import to_text

EXAMPLES = int(os.environ.get("TRACELAKE_FUZZ", "300"))

SEEDS = [
    "select label, out from ops where run = 'a'",
    "select label, out[0, 1:3], absmax(out[..., ::2]) from ops where func = 'linear'",
    "select a.label, max_abs_diff(a.out, b.out) as d from ops a join ops b using (key) "
    "where a.run = 'a' and b.run = 'b' order by d desc limit 3",
    "select func, count(*), avg(l2) from ops group by func having count(*) > 1",
    "select run, meta.lr, meta.tag from runs where meta.lr > 0.001 or meta.tag in ('x', 'y')",
    "select label from ops where idx between 1 and :p and parent.func = 'relu'",
    "select distinct module from modules where run = :Run",
    "select label, out[-1] from ops where shape = '[2, 8]' limit :t_1 offset 1",
]

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["a", "b", "linear", "relu", "[2, 8]", "\udc80", "x'y"]),
    st.datetimes(min_value=datetime(1, 1, 1)),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=3),
    st.sampled_from([object(), b"x", 1j, {"a": 1}, {1}, torch.ones(1), math.inf]),
)
_PARAMS = st.dictionaries(st.sampled_from(["p", "Run", "t_1", "zz"]), _VALUES, max_size=4)


@st.composite
def _mangled(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        what = draw(st.sampled_from(["insert", "delete", "swap", "token"]))
        if what == "insert":
            text = text[:at] + draw(st.text(max_size=3)) + text[at:]
        elif what == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 5)) :]
        elif what == "swap" and at + 1 < len(text):
            text = text[:at] + text[at + 1] + text[at] + text[at + 2 :]
        else:
            token = draw(
                st.sampled_from(
                    [
                        "(",
                        ")",
                        "[",
                        "]",
                        ",",
                        "'",
                        ":",
                        "::",
                        "...",
                        "-",
                        "1e999",
                        "9" * 30,
                        " and ",
                        " or ",
                        " not ",
                        "out",
                        "grad",
                        "norm(grad)",
                        "[0]",
                        "[99]",
                        "[0,0,0,0]",
                        "meta.",
                        "parent.",
                        " join ops c using (key) ",
                        " group by ",
                        " limit ",
                        "*",
                    ]
                )
            )
            text = text[:at] + token + text[at:]
    return text


_TEXTS = st.one_of(_QUERIES.map(to_text), _mangled(), st.sampled_from(SEEDS))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tl.Store:
    root = tmp_path_factory.mktemp("fuzz") / "s"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    store = tl.open(root)
    store.record(model, torch.randn(2, 8), name="a", meta={"lr": 0.01, "tag": "x"})
    store.record(model, torch.randn(2, 8), name="b", meta={"lr": float("nan"), "n": [1]})
    return tl.open(root, create=False)


_outcomes: dict[str, int] = {}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
@given(text=_TEXTS, params=_PARAMS)
def test_fuzzed_queries_raise_only_query_errors(
    store: tl.Store, text: str, params: dict[str, Any]
) -> None:
    try:
        result = store.query(text, **params)
        result.df()
        list(result)
        outcome = "ok"
    except tl.QueryError as exc:
        outcome = type(exc).__name__
    _outcomes[outcome] = _outcomes.get(outcome, 0) + 1


def test_fuzz_report() -> None:
    """(Prints how the fuzzed queries ended, for the record: ``pytest -s``.)"""
    print(f"\nfuzzed queries: {sum(_outcomes.values())}, by outcome: {_outcomes}")
    assert _outcomes, "the fuzz test ran first"


def test_store_fixture_is_real(store: tl.Store) -> None:
    assert sorted(store.runs()["name"]) == ["a", "b"]
    assert Path(store.path).is_dir()
