"""A small in-memory catalog for the query tests (imported by the others): the store's own
schema, a few rows.

Two complete runs (``base``, ``ft``) of the same six-op graph, plus a ``failed`` and a
``recording`` run that have a ``runs`` row only, as in a reader's mirror.

    input_1 ──> linear_1 ──> relu_1 ──> add_1 ──> softmax_1 ──> output_1
         └─────────────────────────────────^
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from tracelake.store.schema import TABLES, accept_rows, arrow_schema, create_schema, insert

RUNS = [
    (
        1,
        "base",
        "complete",
        {"lr": 0.02, "prompt": "The capital of France is Paris", "nested": {"k": 5}, "flag": True},
    ),
    (2, "ft", "complete", {"lr": 0.001, "prompt": "Berlin", "flag": False}),
    (3, "broken", "failed", {"lr": 0.5, "prompt": "Paris again"}),
    (4, "busy", "recording", {"lr": 0.3}),
]
# idx, label, func, kind, module, shape, mean, tensor slot (None: unsaved)
OPS = [
    (0, "input_1", "input", "input", "", [2, 4], 0.5, 0),
    (1, "linear_1_1", "linear", "op", "encoder.fc", [2, 3], -0.25, 1),
    (2, "relu_1_2", "relu", "op", "encoder.act", [2, 3], 0.75, None),
    (3, "add_1_3", "add", "op", "decoder", [2, 3], 1.5, 2),
    (4, "softmax_1_4", "softmax", "op", "decoder.head", [2, 3], 0.125, 3),
    (5, "output_1", "output", "output", "", [], 2.0, 3),
]
EDGES = [(0, 1), (1, 2), (2, 3), (0, 3), (3, 4), (4, 5)]  # (parent, child)


def _insert(con: duckdb.DuckDBPyConnection, table: str, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        names = ", ".join(f'"{k}"' for k in row)
        con.execute(
            f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(row))})",
            list(row.values()),
        )


def make_catalog() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    create_schema(con)
    _insert(
        con,
        "runs",
        [
            {
                "id": i,
                "name": n,
                "status": s,
                "created": datetime(2025, 1, i),
                "steps": 1,
                "op_count": len(OPS),
                "meta": json.dumps(m),
            }
            for i, n, s, m in RUNS
        ],
    )
    for run_id, _name, status, _meta in RUNS:
        if status != "complete":
            continue
        scale = run_id  # run 2's statistics are twice run 1's
        _insert(
            con,
            "ops",
            [
                {
                    "run_id": run_id,
                    "step": 0,
                    "idx": idx,
                    "label": label,
                    "layer": label,
                    "pass": 1,
                    "num_passes": 1,
                    "func": func,
                    "kind": kind,
                    "module": module,
                    "shape": shape,
                    "dtype": "float32",
                    "nbytes": 4 * max(1, _numel(shape)),
                    "inplace": False,
                    "saved": slot is not None,
                    "tensor": slot,
                    "mean": mean * scale,
                    "std": 1.0,
                    "min": -2.0 * scale,
                    "max": 3.0 * scale,
                    "absmax": 3.0 * scale,
                    "l2": 4.0 * scale,
                    "frac_zero": 0.0,
                    "nan_count": 0,
                    "inf_count": 0,
                }
                for idx, label, func, kind, module, shape, mean, slot in OPS
            ],
        )
        _insert(
            con,
            "edges",
            [
                {"run_id": run_id, "step": 0, "parent": p, "child": c, "arg": "0", "edge": 0}
                for p, c in EDGES
            ],
        )
        _insert(
            con,
            "modules",
            [
                {
                    "run_id": run_id,
                    "step": 0,
                    "idx": 0,
                    "label": "encoder",
                    "path": "encoder",
                    "type": "Sequential",
                    "pass": 1,
                    "num_passes": 1,
                    "op_start": 1,
                    "op_end": 3,
                },
                {
                    "run_id": run_id,
                    "step": 0,
                    "idx": 1,
                    "label": "decoder",
                    "path": "decoder",
                    "type": "Linear",
                    "pass": 1,
                    "num_passes": 1,
                    "op_start": 3,
                    "op_end": 5,
                },
            ],
        )
    return con


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def snapshot(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Every table's rows, to check that a query changed nothing."""
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables ORDER BY 1"
        ).fetchall()
    ]
    return {t: sorted(map(repr, con.execute(f'SELECT * FROM "{t}"').fetchall())) for t in tables}


def test_the_catalog_has_the_store_schema_and_rows() -> None:
    con = make_catalog()
    counts = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]  # type: ignore[index]
        for t in TABLES
    }
    assert counts == {
        "runs": 4,
        "ops": 12,
        "tensors": 0,
        "edges": 12,
        "modules": 4,
        "rules": 0,
        "calls": 0,
        "grads": 0,
    }


def _as_run(rows: pa.Table, run_id: int) -> pa.Table:
    k = rows.schema.get_field_index("run_id")
    return rows.set_column(k, rows.schema.field(k), pa.array([run_id] * rows.num_rows, pa.int32()))


def test_insert_adds_rows_by_name_and_its_views_outlive_a_rolled_back_transaction() -> None:
    """``insert`` takes a table's rows of its declared schema (all a writer builds:
    through the view ``accept_rows`` made for that table) and rows lacking columns (an
    older catalog's: the rest get their defaults); a column the table lacks is an
    error, and after its transaction is rolled back the connection still inserts."""
    con = make_catalog()
    accept_rows(con)
    rows = con.sql("SELECT * FROM ops WHERE run_id = 1 ORDER BY idx").to_arrow_table()
    rows = rows.cast(arrow_schema(TABLES["ops"]))
    rows = rows.set_column(
        rows.schema.get_field_index("intervened"),
        rows.schema.field("intervened"),
        pa.array([True] * rows.num_rows),
    )
    insert(con, "ops", _as_run(rows, 7))
    insert(con, "ops", _as_run(rows, 8).select(["run_id", "idx", "label"]))
    con.execute("BEGIN TRANSACTION")
    with pytest.raises(duckdb.BinderException, match="nonsense"):
        insert(
            con, "ops", _as_run(rows, 9).append_column("nonsense", pa.array([1] * rows.num_rows))
        )
    con.execute("ROLLBACK")
    con.execute("BEGIN TRANSACTION")
    insert(con, "ops", _as_run(rows, 9))
    con.execute("COMMIT")

    def read(run_id: int, columns: str = "* EXCLUDE (run_id)") -> list[tuple[Any, ...]]:
        return con.execute(
            f"SELECT {columns} FROM ops WHERE run_id = ? ORDER BY idx", [run_id]
        ).fetchall()

    pairs = list(zip(rows["idx"].to_pylist(), rows["label"].to_pylist(), strict=True))
    assert len(read(7)) == rows.num_rows and read(7) == read(9)
    assert read(7, "idx, label, intervened") == [(i, label, True) for i, label in pairs]
    # the columns the rows lacked: their defaults (intervened: false), else NULL
    assert read(8, "idx, label, intervened, rule, func") == [
        (i, label, False, None, None) for i, label in pairs
    ]
