"""Golden files for the query compiler, and the compiled SQL run on a real catalog.

``tests/data/query_golden/cases.json`` holds each case's query (and parameters, and for
some the run ids by name that a store's executor passes) and what it compiles to: the
SQL, the bound values, the output columns, the tensor items. After an
intended change to the compiler, regenerate the expectations and read the diff:

    TRACELAKE_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider \\
        tests/test_query_golden.py

Every case's SQL then runs on an in-memory DuckDB built from the store's own schema
(``test_query_catalog.make_catalog``), and a handful have their rows checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import duckdb
import pytest
from test_query_catalog import make_catalog

from tracelake.query import CompiledQuery, compile_query

GOLDEN = Path(__file__).parent / "data" / "query_golden" / "cases.json"
REGENERATE = os.environ.get("TRACELAKE_REGEN_GOLDEN") == "1"
CASES: list[dict[str, Any]] = json.loads(GOLDEN.read_text())


def _expectation(compiled: CompiledQuery) -> dict[str, Any]:
    return {
        "sql": compiled.sql,
        "bound": compiled.params,
        "columns": list(compiled.columns),
        **({"aliases": list(compiled.aliases)} if compiled.aliases != compiled.columns else {}),
        "hidden": list(compiled.hidden),
        "tensors": [
            {
                "column": t.column,
                "kind": t.kind,
                "index": None if t.index is None else [repr(i) for i in t.index],
                "reduction": t.reduction,
                **({"source": t.source} if t.source else {}),
                **({"expr": repr(t.expr)} if t.expr is not None else {}),
            }
            for t in compiled.tensors
        ],
        **{
            name: repr(value)
            for name, value in (
                ("where", compiled.where),
                ("order", compiled.order),
                ("limit", compiled.limit),
            )
            if value
        },
    }


def _compile(case: dict[str, Any]) -> CompiledQuery:
    return compile_query(case["query"], case.get("params"), case.get("runs"))


@pytest.fixture(scope="module")
def catalog() -> duckdb.DuckDBPyConnection:
    return make_catalog()


def test_regenerate_golden_files() -> None:
    if not REGENERATE:
        pytest.skip("set TRACELAKE_REGEN_GOLDEN=1 to rewrite the expectations")
    out = [
        {
            "name": c["name"],
            "query": c["query"],
            "params": c.get("params"),
            **({"runs": c["runs"]} if "runs" in c else {}),
            **_expectation(_compile(c)),
        }
        for c in CASES
    ]
    GOLDEN.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


def test_case_names_are_unique() -> None:
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden(case: dict[str, Any]) -> None:
    if REGENERATE:
        pytest.skip("regenerating")
    expected = {k: v for k, v in case.items() if k not in ("name", "query", "params", "runs")}
    assert _expectation(_compile(case)) == expected


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_sql_runs_on_the_catalog(
    case: dict[str, Any], catalog: duckdb.DuckDBPyConnection
) -> None:
    compiled = _compile(case)
    cursor = catalog.execute(compiled.sql, compiled.params)
    cursor.fetchall()
    assert [d[0] for d in cursor.description] == [*compiled.aliases, *compiled.hidden]


#: The complete runs of ``make_catalog``, as a store's executor passes them.
RUN_IDS = {"base": 1, "ft": 2}


def _rows(
    catalog: duckdb.DuckDBPyConnection,
    text: str,
    params: dict[str, Any],
    runs: dict[str, int] | None = None,
) -> list[tuple[Any, ...]]:
    compiled = compile_query(text, params, runs)
    return catalog.execute(compiled.sql, compiled.params).fetchall()


RESULTS = [
    (
        "select run, label from ops where func = 'relu' order by run",
        {},
        [("base", "relu_1_2"), ("ft", "relu_1_2")],
    ),
    ("select name from runs order by name", {}, [("base",), ("ft",)]),  # complete runs only
    (
        "select func, count(*) as n from ops where kind = 'op' group by func order by func",
        {},
        [("add", 2), ("linear", 2), ("relu", 2), ("softmax", 2)],
    ),
    (
        "select label from ops where run = 'base' and parent.func = 'input' order by label",
        {},
        [("add_1_3",), ("linear_1_1",)],
    ),
    (
        "select label from ops where run = 'ft' and child.func = 'add' order by label",
        {},
        [("input_1",), ("relu_1_2",)],
    ),
    (
        "select label from ops where run = 'ft' and not parent.kind = 'op' and kind = 'op'",
        {},
        [("linear_1_1",)],
    ),
    ("select name from runs where meta.lr > 0.01", {}, [("base",)]),  # 'broken' failed
    (
        "select distinct_runs from runs".replace("distinct_runs", "name")
        + " where meta.nested.k = 5 and meta.flag",
        {},
        [("base",)],
    ),
    (
        "select run, count(*) from ops where meta.prompt like '%Paris%' group by run",
        {},
        [("base", 6)],
    ),
    (
        "select sum(out), mean(out) from ops where run = 'base' and label = 'add_1_3'",
        {},
        [(9.0, 1.5)],
    ),  # mean 1.5 x 6 elements
    ("select sum(out) from ops where run = 'base' and label = 'output_1'", {}, [(2.0,)]),
    (
        "select label, out, __x from ops".replace(", __x", "") + " where run = :r and idx < 3 "
        "order by idx",
        {"r": "ft"},
        # label, the slot standing in for out, then __run_id, __step, __tensor (the
        # location columns after them are checked by the store's end-to-end tests)
        [("input_1", 0, 2, 0, 0), ("linear_1_1", 1, 2, 0, 1), ("relu_1_2", None, 2, 0, None)],
    ),
    (
        "select label from ops where run in :runs and idx in :idx order by run, idx",
        {"runs": ["ft"], "idx": [4, 5]},
        [("softmax_1_4",), ("output_1",)],
    ),
    ("select label from ops where idx in :none", {"none": []}, []),
    (
        "select meta.lr, count(*) from ops group by meta.lr order by meta.lr desc",
        {},
        [("0.02", 6), ("0.001", 6)],
    ),
    (
        "select path from modules where run = 'base' order by path limit 1 offset 1",
        {},
        [("encoder",)],
    ),
    ("select count(*) from edges where run = 'ft' and parent = 0", {}, [(2,)]),
    ("select name from runs where created > '2025-01-01 12:00:00'", {}, [("ft",)]),
]


@pytest.mark.parametrize("runs", [None, RUN_IDS], ids=["join", "run ids"])
@pytest.mark.parametrize(("text", "params", "expected"), RESULTS)
def test_results(
    text: str,
    params: dict[str, Any],
    expected: list[tuple[Any, ...]],
    runs: dict[str, int] | None,
    catalog: duckdb.DuckDBPyConnection,
) -> None:
    rows = _rows(catalog, text, params, runs)
    width = len(expected[0]) if expected else 0
    assert [row[:width] for row in rows] == expected
