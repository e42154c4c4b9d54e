"""The language compares runs: joins of stored runs, checked against ``store.compare``.

A transformers GPT-2 (random weights) recorded three ways (fp32, one MLP weight
perturbed, bf16) and a small MLP with its linears unsaved in one run; the join's
tensor-pair functions must give ``store.compare``'s numbers for the same pairs.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from model_zoo import gpt2, mlp

import tracelake as tl
from tracelake.query import results as results_module
from tracelake.store import metrics as metrics_module

PAIRS = (
    "select a.key, max_abs_diff(a.out, b.out) as max_abs_diff, "
    "mean_abs_diff(a.out, b.out) as mean_abs_diff, rel_l2(a.out, b.out) as rel_l2, "
    "cosine(a.out, b.out) as cosine, allclose(a.out, b.out, :atol, :rtol) as allclose "
    "from ops a join ops b using (key) where a.run = :a and b.run = :b"
)
METRICS = ("max_abs_diff", "mean_abs_diff", "rel_l2", "cosine", "allclose")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tl.Store:
    store = tl.open(tmp_path_factory.mktemp("join") / "store")
    model, (ids,) = gpt2()
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        weight = perturbed.transformer.h[1].mlp.c_fc.weight
        weight.add_(torch.randn(weight.shape, generator=generator) * 0.05)
        store.record(model, ids, name="base", save=tl.all())
        store.record(perturbed, ids, name="ft", save=tl.all())
        store.record(copy.deepcopy(model).to(torch.bfloat16), ids, name="bf16", save=tl.all())
        small, (x,) = mlp()
        store.record(small, x, name="m1", save=tl.all())
        store.record(small, x * 2, name="m2", save=~tl.func("linear"))
    return store


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if want is None or (isinstance(want, float) and math.isnan(want)):
        return got is None
    if isinstance(want, float) and isinstance(got, float) and got != want:
        # store.compare takes each side's L2 norm from its recorded statistics (float64
        # at record time), the join from the tensors it reads: the last bits may differ
        return math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300)
    return bool(got == want)


@pytest.mark.parametrize(("a", "b"), [("base", "ft"), ("base", "bf16"), ("m1", "m2")])
@pytest.mark.parametrize(("atol", "rtol"), [(1e-8, 1e-5), (1e-3, 1e-2)])
def test_the_join_gives_the_numbers_of_compare(
    store: tl.Store, a: str, b: str, atol: float, rtol: float
) -> None:
    joined = store.query(PAIRS, a=a, b=b, atol=atol, rtol=rtol).df().set_index("a.key")
    compared = store.compare(a, b, atol=atol, rtol=rtol).df().set_index("key")
    both = compared[compared["status"] != "only a"]
    both = both[both["status"] != "only b"]
    assert sorted(joined.index) == sorted(both.index)
    for key, row in both.iterrows():
        for metric in METRICS:
            got, want = joined.loc[key, metric], row[metric]
            if row["status"] != "compared":  # unsaved on a side, or shapes differ
                assert got is None or (isinstance(got, float) and math.isnan(got)), (key, metric)
                continue
            assert _same(got, want), (key, metric, got, want)
    if b == "ft":  # the perturbed layer's MLP differs, what runs before it does not
        assert joined.loc["transformer.h.0.mlp.c_fc:addmm#1", "max_abs_diff"] == 0.0
        assert joined.loc["transformer.h.1.mlp.c_fc:addmm#1", "max_abs_diff"] > 0.0
    if b == "bf16":  # fp32 vs bf16 compared in float64: every op differs a little
        assert (joined["max_abs_diff"].dropna() > 0).mean() > 0.5


def test_unsaved_sides_are_null(store: tl.Store) -> None:
    res = store.query(
        "select a.label, a.saved, b.saved, max_abs_diff(a.out, b.out) as d, "
        "allclose(a.out, b.out) as ok from ops a join ops b using (label) "
        "where a.run = 'm1' and b.run = 'm2' and a.func = 'linear'"
    )
    assert len(res) == 3
    assert all(r["d"] is None and r["ok"] is None for r in res)
    assert all(r["a.saved"] and not r["b.saved"] for r in res)
    assert res.arrow().column("d").null_count == 3


def test_empty_tensors_compare(store: tl.Store) -> None:
    res = store.query(
        "select a.key, a.shape, max_abs_diff(a.out, b.out) as d, cosine(a.out, b.out) as c, "
        "allclose(a.out, b.out) as ok from ops a join ops b using (key) "
        "where a.run = 'base' and b.run = 'bf16' and a.nbytes = 0 and a.saved"
    )
    assert len(res) > 0  # GPT-2 has (0,)-shaped tensors
    for row in res:
        assert (row["d"], row["c"], row["ok"]) == (0.0, None, True)


def test_order_where_and_limit_apply_after_the_pairs(store: tl.Store) -> None:
    everything = store.query(PAIRS, a="base", b="ft", atol=1e-8, rtol=1e-5).df()
    ranked = everything.dropna(subset=["max_abs_diff"]).sort_values(
        "max_abs_diff", ascending=False, kind="stable"
    )
    top = store.query(
        "select a.key, max_abs_diff(a.out, b.out) as d from ops a join ops b using (key) "
        "where a.run = 'base' and b.run = 'ft' order by d desc limit 5 offset 1"
    )
    assert [r["d"] for r in top] == list(ranked["max_abs_diff"].iloc[1:6])
    over = store.query(
        "select a.key, max_abs_diff(a.out, b.out) as d from ops a join ops b using (key) "
        "where a.run = 'base' and b.run = 'ft' and max_abs_diff(a.out, b.out) > :t "
        "and not allclose(a.out, b.out, 1e-6, 0) order by a.idx limit 3",
        t=1e-4,
    )
    want = everything[everything["max_abs_diff"] > 1e-4]
    assert len(over) == min(3, len(want)) and len(over) > 0
    assert all(r["d"] > 1e-4 for r in over)
    # arithmetic over a pair function and a column of the catalog
    rel = store.query(
        "select a.key, max_abs_diff(a.out, b.out) / a.absmax as r from ops a join ops b "
        "using (key) where a.run = 'base' and b.run = 'ft' and a.absmax > 0 "
        "order by r desc, a.key limit 1"
    )
    assert len(rel) == 1 and rel.tensors is not None and rel.df()["r"][0] > 0


def test_the_limit_is_pushed_down_when_the_order_allows(
    store: tl.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = metrics_module.sliced_metrics  # (the query room imports it when it reads tensors)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics_module, "sliced_metrics", counted)
    join = "from ops a join ops b using (key) where a.run = 'base' and b.run = 'ft' and a.saved"
    res = store.query(
        f"select a.key, max_abs_diff(a.out, b.out), cosine(a.out, b.out) {join} limit 4"
    )
    assert len(res) == 4 and len(calls) == 4  # one read per pair, for the rows kept only
    assert "LIMIT" in res.sql
    calls.clear()
    res = store.query(f"select a.key, max_abs_diff(a.out, b.out) as d {join} order by d limit 4")
    total = len(store.query(f"select a.key {join}"))
    assert len(res) == 4 and len(calls) == total and "LIMIT" not in res.sql


def test_statistics_join_reads_no_tensor(store: tl.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reads(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a statistics-only join read a tensor")

    monkeypatch.setattr(results_module._Fetcher, "lazy", no_reads)
    res = store.query(
        "select a.block, count(*) as n, max(abs(b.l2 - a.l2)) as dl2 "
        "from ops a join ops b using (key) where a.run = 'base' and b.run = 'ft' "
        "and a.block is not null group by a.block having count(*) > 1 order by a.block"
    )
    rows = list(res)
    assert [r["a.block"] for r in rows] == [0, 1]
    assert rows[0]["dl2"] == 0.0 and rows[1]["dl2"] > 0.0
    # by label, with arithmetic on statistics, distinct and count(distinct ...)
    assert store.query(
        "select distinct a.func from ops a join ops b using (label) "
        "where a.run = 'm1' and b.run = 'm2' and b.mean - a.mean <> 0 order by a.func"
    ).df()["a.func"].tolist() == ["input", "output", "relu"]  # unsaved linears: no stats


def test_the_slices_and_tensors_of_each_side(store: tl.Store) -> None:
    res = store.query(
        "select a.out as x, b.out as y, a.out[0] as x0, max_abs_diff(a.out[0], b.out[0]) as d0 "
        "from ops a join ops b on a.label = b.label and a.run <> b.run "
        "where a.run = 'm1' and b.run = 'm2' and a.func = 'relu' order by a.idx"
    )
    assert len(res) == 2
    for row in res:
        assert row["x"].shape == row["y"].shape and not torch.equal(row["x"], row["y"])
        assert torch.equal(row["x0"], row["x"][0])
        assert row["d0"] == float((row["x"][0].double() - row["y"][0].double()).abs().max())


def test_steps_pair_step_by_step(tmp_path) -> None:
    store = tl.open(tmp_path / "steps")
    model, (x,) = mlp()
    with torch.no_grad(), store.recording("two", model, save=tl.all()):
        model(x)
        model(x * 3)
    n = len(store.query("select label from ops where run = 'two' and step = 0"))
    res = store.query(
        "select a.step, b.step, max_abs_diff(a.out, b.out) as d from ops a join ops b "
        "using (key) where a.run = 'two' and b.run = 'two'"
    )
    assert len(res) == 2 * n  # step k with step k only
    assert all(r["a.step"] == r["b.step"] and r["d"] == 0.0 for r in res)
    across = store.query(
        "select max_abs_diff(a.out, b.out) as d from ops a join ops b on a.key = b.key "
        "where a.run = 'two' and b.run = 'two' and a.step = 0 and b.step = 1 and a.func = 'relu'"
    )
    assert len(across) == 2 and all(r["d"] > 0 for r in across)


def test_type_errors_point_at_the_text(store: tl.Store) -> None:
    with pytest.raises(tl.QueryCompileError) as info:
        store.query("select a.label from ops a join ops b using (key) where a.label = 3")
    assert str(info.value).splitlines()[1:] == [
        "  select a.label from ops a join ops b using (key) where a.label = 3",
        "                                                                   ^",
    ]
    with pytest.raises(tl.QueryCompileError, match="ambiguous column 'label'"):
        store.query("select label from ops a join ops b using (key)")


def test_cli_and_magic_run_a_join(store: tl.Store, capsys: pytest.CaptureFixture[str]) -> None:
    from tracelake.cli import main

    text = (
        "select a.label, max_abs_diff(a.out, b.out) as d from ops a join ops b using (key) "
        "where a.run = 'base' and b.run = 'ft' order by d desc limit 3"
    )
    assert main(["query", str(store.path), text, "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert '"d"' in out and "a.label" in out
    assert main(["query", str(store.path), text]) == 0
    pytest.importorskip("IPython")
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or get_ipython()  # None once started in this process
    shell.run_line_magic("load_ext", "tracelake")
    res = shell.run_cell_magic("tlq", str(store.path), text.replace(" from", "\nfrom"))
    assert len(res) == 3 and res.df()["d"].is_monotonic_decreasing
