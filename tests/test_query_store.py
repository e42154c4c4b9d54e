"""Queries end to end on a real store of several runs, checked against forward hooks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise, run_with_hooks
from model_zoo import mlp

import tracelake as tl

SCALES = {"base": 1.0, "ft": 2.0, "bf": -0.5}


@pytest.fixture(scope="module")
def store_and_hooks(tmp_path_factory: pytest.TempPathFactory):
    """Three runs of the MLP on different inputs, every op saved but the linears of
    'bf'; the forward-hook captures of the same calls."""
    root = tmp_path_factory.mktemp("q") / "store"
    store = tl.open(root)
    hooks = {}
    model, (x,) = mlp()
    for name, scale in SCALES.items():
        inputs = (x * scale,)
        save = tl.all() if name != "bf" else ~tl.func("linear")
        with torch.no_grad():
            store.record(
                model,
                *inputs,
                name=name,
                save=save,
                meta={"prompt": f"The capital of France is Paris ({name})", "lr": scale * 0.01},
            )
            hooks[name] = run_with_hooks(model, inputs)
    return store, hooks


def test_tensors_match_forward_hooks(store_and_hooks) -> None:
    store, hooks = store_and_hooks
    res = store.query(
        "select run, label, module, out from ops where func = 'relu' order by run, label"
    )
    assert len(res) == 6
    for row in res:
        want = hooks[row["run"]].outputs[(row["module"], 1)][0]
        assert_bitwise(row["out"], want, f"{row['run']} {row['label']}")
    # slices, negative indices and steps, and reductions of a slice
    sliced = store.query(
        "select run, out[1:, ::-2] as s, mean(out[0]) as m0, "
        "max(out) as mx from ops where label = 'relu_2_4' order by run"
    )
    for row in sliced:
        want = hooks[row["run"]].outputs[("3", 1)][0]
        flipped = torch.from_numpy(want.numpy()[1:, ::-2].copy())
        assert_bitwise(row["s"], flipped, "slice")
        assert row["m0"] == pytest.approx(want[0].double().mean().item(), rel=1e-6)
        assert row["mx"] == pytest.approx(want.max().item())


def test_unsaved_out_is_none_and_stack(store_and_hooks) -> None:
    store, hooks = store_and_hooks
    res = store.query("select run, out from ops where label = 'linear_1_1' order by run")
    outs = dict(zip((r["run"] for r in res), res.tensors(), strict=True))
    assert outs["bf"] is None and outs["base"] is not None
    with pytest.raises(tl.QueryError, match="no saved tensor"):
        res.stack()
    stacked = store.query("select run, out from ops where label = 'output_1' order by run").stack()
    want = torch.stack([hooks[n].output for n in sorted(SCALES)])
    assert_bitwise(stacked, want, "stacked outputs")
    mixed = store.query("select out from ops where func = 'linear' and run = 'base'")
    with pytest.raises(tl.QueryError, match="different shapes"):
        mixed.stack()
    # a column of numbers stacks into a tensor; one of text is refused, naming it
    numbers = store.query("select absmax, shape from ops where func = 'linear' and run = 'base'")
    assert numbers.stack("absmax").tolist() == [r["absmax"] for r in numbers]
    for column in ("label", "shape"):
        texts = store.query(f"select {column} from ops where run = 'base'")
        with pytest.raises(tl.QueryError, match=f"cannot stack '{column}'"):
            texts.stack(column)


def test_catalog_only_queries_and_meta(store_and_hooks) -> None:
    store, _ = store_and_hooks
    res = store.query("select run from runs where meta.lr > :lr order by run", lr=0.005)
    assert [r["run"] for r in res] == ["base", "ft"]
    paris = store.query(
        "select run, mean(out) from ops where func = 'relu' and meta.prompt like '%(ft)%'"
    )
    assert {r["run"] for r in paris} == {"ft"}
    groups = store.query(
        "select func, count(*) as n from ops where run = 'base' group by func order by func"
    ).df()
    assert dict(zip(groups["func"], groups["n"], strict=True)) == {
        "input": 1,
        "linear": 3,
        "output": 1,
        "relu": 2,
    }
    graph = store.query(
        "select run, label from ops where func = 'linear' and "
        "parent.func = 'relu' and run = 'ft' order by label"
    )
    assert [r["label"] for r in graph] == ["linear_2_3", "linear_3_5"]
    # the run's name became its id, bound like any value
    ft = store.catalog.run_ids["ft"]
    assert "?" in graph.sql and ft in graph.params and "ft" not in graph.sql
    table = store.query("select run, label, out from ops where run = 'base'").arrow()
    assert "out.shape" in table.column_names and table.num_rows == 7
    html = store.query("select run, out from ops where label = 'relu_1_2'")._repr_html_()
    assert "float32" in html and "<table>" in html


# (a run name written in the query that names no run raises RunNotFoundError: the unknown
# names here are bound parameters, which match nothing)
RUN_CONDITIONS = [
    ("run = 'ft'", {}, {"ft"}),
    ("'ft' = run", {}, {"ft"}),
    ("run = :r", {"r": "bf"}, {"bf"}),
    ("run = :nope", {"nope": "nope"}, set()),
    ("run != 'ft'", {}, {"base", "bf"}),
    ("run <> :nope", {"nope": "nope"}, {"base", "bf", "ft"}),
    ("not run = :nope", {"nope": "nope"}, {"base", "bf", "ft"}),
    ("not (run = 'ft' or run = :nope)", {"nope": "nope"}, {"base", "bf"}),
    ("run in ('ft', :nope)", {"nope": "nope"}, {"ft"}),
    ("run in ('ft', null)", {}, {"ft"}),
    ("run not in ('ft', :nope)", {"nope": "nope"}, {"base", "bf"}),
    ("run not in ('ft', null)", {}, set()),  # SQL: null in a 'not in' list matches nothing
    ("run in :rs", {"rs": ["base", "nope"]}, {"base"}),
    ("run not in :rs", {"rs": ["base"]}, {"bf", "ft"}),
    ("run in :rs", {"rs": []}, set()),
    ("run like 'b%'", {}, {"base", "bf"}),
    ("run = label", {}, set()),
    ("run = 'ft' and parent.run = 'ft' and func = 'relu'", {}, {"ft"}),
]


@pytest.mark.parametrize(
    ("condition", "params", "expected"), RUN_CONDITIONS, ids=[c for c, _, _ in RUN_CONDITIONS]
)
def test_conditions_on_run_filter_by_id_as_the_join_did(
    store_and_hooks, condition: str, params: dict, expected: set
) -> None:
    """``run = X`` and ``run [not] in (...)`` compare run ids (no join with ``runs``);
    every condition returns what the join returns."""
    from tracelake.query import compile_query

    store, _ = store_and_hooks
    text = f"select run, label from ops where {condition}"
    res = store.query(text, **params)
    assert {r["run"] for r in res} == expected
    joined = compile_query(text, params)  # compiled without the run ids: the join
    rows = store.catalog.arrow(joined.sql, joined.params).to_pylist()
    assert sorted((r["run"], r["label"]) for r in rows) == sorted(
        (r["run"], r["label"]) for r in res
    )
    if not any(word in condition for word in ("like", "label", "parent")):  # joins still
        by_id = store.query(f"select label from ops where {condition}", **params)
        assert "JOIN" not in by_id.sql and len(by_id) == len(res)


def test_runs_named_with_quotes_deleted_and_overwritten(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s")
    names = ["it's", 'say "hi"', "x' or '1'='1", "plain"]
    with torch.no_grad():
        for i, name in enumerate(names):
            store.record(model, x * (i + 1), name=name)
    for name in names:
        res = store.query("select run, out from ops where run = :r and label = 'output_1'", r=name)
        assert [r["run"] for r in res] == [name] and "JOIN" in res.sql  # run is selected
        lone = store.query("select out from ops where run = :r and label = 'output_1'", r=name)
        assert len(lone) == 1 and "JOIN" not in lone.sql and name not in lone.sql
        assert torch.equal(lone.tensors()[0], res.tensors()[0])
    literal = store.query("select label from ops where run = 'it''s' and label = 'output_1'")
    assert len(literal) == 1
    first = store.query("select out from ops where run = 'plain' and label = 'output_1'")
    with torch.no_grad():
        store.record(model, x * -3, name="plain", overwrite=True)
    again = store.query("select out from ops where run = 'plain' and label = 'output_1'")
    assert len(again) == 1 and not torch.equal(again.tensors()[0], first.tensors()[0])
    assert again.params != first.params  # the new run's id
    store.delete("plain")
    with pytest.raises(tl.RunNotFoundError, match="no complete run named 'plain'"):
        store.query("select out from ops where run = 'plain'")  # written out: a typo?
    assert len(store.query("select out from ops where run = :r", r="plain")) == 0
    assert len(store.query("select label from ops where run != :r", r="plain")) == 3 * 7


@pytest.mark.parametrize("limit", [0, 1, 20, 63, 64, 65, 210])
def test_mirror_results_small_and_large_are_duckdbs_own_arrow(store_and_hooks, limit: int) -> None:
    """The mirror answers a SQL text seen before from Python rows typed by the first
    result's schema (below 64 rows), or rows then Arrow: always what DuckDB's own Arrow
    export gives, types included (lists, structs, timestamps, HUGEINT sums)."""
    store, _ = store_and_hooks
    mirror = store.catalog
    texts = [
        (
            "SELECT t.label, t.shape, t.modules, t.run_id, t.mean, t.saved, r.created, "
            "r.meta, k.i FROM ops AS t JOIN runs AS r ON r.id = t.run_id "
            "CROSS JOIN range(10) AS k(i) ORDER BY t.run_id, t.idx, k.i LIMIT ?",
            [limit],
        ),
        (
            "SELECT func, sum(nbytes) AS s, count(*) AS n, avg(mean) AS m FROM ops "
            "WHERE idx < ? GROUP BY func ORDER BY func",
            [limit],
        ),
    ]
    for sql, params in texts:
        want = mirror._cursor().sql(sql, params=params).to_arrow_table()
        for _ in range(2):  # the first time, then from the kept statement and schema
            got = mirror.arrow(sql, params)
            assert got.schema == want.schema and got.equals(want)


def test_raw_sql_is_read_only_and_isolated(store_and_hooks) -> None:
    store, _ = store_and_hooks
    df = store.sql("select count(*) as n from ops")
    assert int(df["n"][0]) == 21
    for bad in (
        "delete from ops",
        "select 1; delete from ops",
        "attach 'x.db'",
        "select * from read_csv('/etc/passwd')",
        "copy ops to '/tmp/ops.csv'",
        "install httpfs",
    ):
        with pytest.raises(tl.QueryError):
            store.sql(bad)
    assert int(store.sql("select count(*) as n from ops")["n"][0]) == 21


def test_injection_attempts_match_nothing_and_leave_the_store_intact(store_and_hooks) -> None:
    store, _ = store_and_hooks
    attempts = [
        "select run from ops where label = 'x''; drop table ops; --'",
        "select run from ops where label = 'a' union select name from runs",
        "select run from ops; delete from runs",
        "select read_csv('/etc/passwd') from ops",
        "select getenv('HOME') from ops",
        "select run from ops where label = ''' or 1=1 --'",  # the quote stays in the string
        "select run from ops /* comment */ where label = 'x'",
    ]
    for text in attempts:
        try:
            res = store.query(text)
        except tl.QueryError:
            continue
        assert len(res) == 0, text
    assert len(store) == 3 and store.verify().ok


def test_query_errors_point_at_the_culprit(store_and_hooks) -> None:
    store, _ = store_and_hooks
    with pytest.raises(tl.QuerySyntaxError) as info:
        store.query("select run from ops where")
    assert "^" in str(info.value)
    for _ in range(2):  # the second time from the kept parse: the same excerpt
        with pytest.raises(tl.QueryCompileError, match="did you mean 'func'") as info:
            store.query("select fucn from ops where func = :f", f="relu")
        assert str(info.value).splitlines()[1:] == [
            "  select fucn from ops where func = :f",
            "         ^^^^",
        ]


def test_cli_query(store_and_hooks, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tracelake.cli import main

    store, _ = store_and_hooks
    root = store.path
    assert (
        main(
            [
                "query",
                root,
                "select run, label, out from ops where func = 'relu' and run = :r",
                "--param",
                "r=base",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "relu_1_2" in out and "4x16 float32" in out
    assert (
        main(
            [
                "query",
                root,
                "select run, absmax from ops where label = 'relu_1_2' order by run",
                "--format",
                "json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in rows] == ["base", "bf", "ft"]
    target = tmp_path / "res.parquet"
    assert (
        main(
            [
                "query",
                root,
                "select run, out from ops where label = 'output_1'",
                "--format",
                "parquet",
                "-o",
                str(target),
            ]
        )
        == 0
    )
    import pyarrow.parquet as pq

    assert pq.read_table(target).num_rows == 3
    assert main(["query", root, "select run, label from ops", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("run,label")
    done = subprocess.run(
        [sys.executable, "-m", "tracelake.cli", "query", root, "select run frm ops"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "^" in done.stderr


def test_ipython_magics(store_and_hooks) -> None:
    pytest.importorskip("IPython")
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    store, _ = store_and_hooks
    shell = start_ipython() or get_ipython()  # None once started in this process
    shell.run_line_magic("load_ext", "tracelake")
    tl.open(store.path)  # the last opened store
    res = shell.run_line_magic("tlq", "select run, label from ops where func = 'relu'")
    assert len(res) == 6
    res = shell.run_cell_magic(
        "tlq", store.path, "select run, out\nfrom ops\nwhere label = 'relu_1_2'"
    )
    assert len(res) == 3 and isinstance(res.tensors()[0], torch.Tensor)
    with pytest.raises(tl.QueryCompileError, match="unknown column 'nope'"):
        shell.run_line_magic("tlq", "select nope from ops")
