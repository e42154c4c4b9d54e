"""Comparing runs: stable keys and ``store.compare``, on transformers GPT-2 and LLaMA
configs with random weights and on small models (issue 11's acceptance)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from model_zoo import gpt2, llama, mlp
from torch import nn

import tracelake as tl
from tracelake.store.metrics import SLICE_ELEMENTS, Sums, tensor_metrics


def _perturbed(model: nn.Module, weight: str) -> nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        param = other.get_parameter(weight)
        param.add_(torch.randn_like(param) * 1e-2)
    return other


@pytest.mark.parametrize(
    ("build", "weight"),
    [(gpt2, "transformer.h.1.mlp.c_fc.weight"), (llama, "model.layers.2.mlp.up_proj.weight")],
    ids=["gpt2", "llama"],
)
def test_first_divergence_is_the_first_op_that_reads_the_perturbed_weight(
    tmp_path: Path, build, weight: str
) -> None:
    model, inputs = build()
    store = tl.open(tmp_path / "s.tl")
    with torch.no_grad():
        store.record(model, *inputs, name="base")
        store.record(_perturbed(model, weight), *inputs, name="ft")
    base = store["base"]
    readers = [op for op in base if weight in op.params]
    assert readers, f"no op reads {weight}"
    found = store.compare("base", "ft").first_divergence()
    assert found is not None
    assert found["label_a"] == readers[0].label
    assert found["key"] == readers[0].key
    # everything before it is bitwise equal
    df = store.compare("base", "ft").df()
    before = df.iloc[: df.index[df["key"] == found["key"]][0]]
    assert (before["max_abs_diff"] == 0).all()


def test_fp32_against_bf16_grows_with_depth_by_block(tmp_path: Path) -> None:
    model, (ids,) = llama()
    store = tl.open(tmp_path / "s.tl")
    with torch.no_grad():
        store.record(model, ids, name="fp32")
        store.record(copy.deepcopy(model).to(torch.bfloat16), ids, name="bf16")
    comparison = store.compare("fp32", "bf16")
    rows = comparison.df()
    compared = rows[rows["status"] == "compared"]
    assert len(compared) == len(rows)  # same graph: every op pairs up
    assert set(compared["dtype_a"]) >= {"float32"} and "bfloat16" in set(compared["dtype_b"])
    blocks = comparison.by_block()
    assert list(blocks.index) == [0, 1, 2, 3]
    # block numbers are integers, shown as 3 rather than 3.0, with or without ops that
    # belong to no block (the embedding, the final norm)
    assert rows["block"].isna().any() and rows["block"].dtype.name == "Int64"
    assert blocks.index.dtype.kind == "i"
    stats = store.compare("fp32", ["bf16"], tensors=False)
    assert stats.df()["block"].dtype.name == "Int64"
    assert stats.by_block().index.get_level_values("block").dtype.kind == "i"
    assert (blocks["max_abs_diff"] > 0).all()
    # the error accumulates through the residual stream: the last block's residual
    # differs more than the first's
    residual = compared[compared["key"].str.fullmatch(r"model\.layers\.\d:add#2")]
    assert residual["rel_l2"].iloc[-1] > residual["rel_l2"].iloc[0]
    assert blocks["max_rel_l2"].iloc[-1] > blocks["max_rel_l2"].iloc[0]


def test_with_and_without_attention_mask_align_by_key() -> None:
    model, (ids,) = gpt2()
    with torch.no_grad():
        plain = tl.trace(model, ids)
        masked = tl.trace(model, ids, attention_mask=torch.ones_like(ids))
    assert len(plain) != len(masked)  # the mask adds ops, so labels shift
    rows = tl.compare(plain, masked).df()
    compared = rows[rows["status"] == "compared"]
    only_a = set(rows.loc[rows["status"] == "only a", "key"])
    only_b = set(rows.loc[rows["status"] == "only b", "key"])
    # every op of either run pairs up but for what the mask path adds or skips: the
    # mask's own ops, and the check the model makes instead when it has no mask (a
    # getitem, and `eq` / `any` inside Tensor.__contains__, recorded as TorchLens
    # records them; that `eq` takes the mask path's own `eq`'s key, another shape)
    mismatched = rows[rows["status"] == "shape mismatch"]
    assert set(rows["status"]) == {"compared", "only a", "only b", "shape mismatch"}
    assert set(mismatched["key"]) == {"transformer:eq#1"}
    assert only_b == {
        "attention_mask",  # a keyword input, labelled by its name
        "transformer:to#2",
        "transformer:sum#1",
        "transformer:eq#1",
        "transformer:view#3",
    } or all(k.startswith(("attention_mask", "transformer:")) for k in only_b)
    assert all(k.startswith("transformer:") for k in only_a) and len(only_a) <= 2
    assert len(compared) == len(plain) - len(only_a) - len(mismatched)
    assert (compared["max_abs_diff"] == 0).all()  # an all-ones mask changes no value
    # inside every submodule the keys themselves are equal; at the model's top level,
    # where the mask's extra view shifts the ordinal of the last one, the pair is made
    # by call site
    moved = compared[compared["key"] != compared["key_b"]]
    assert set(moved["module"]) <= {"transformer"}
    # labels would not have aligned them: they moved where keys did not
    label_in_b = {op.key: op.label for op in masked}
    assert [op for op in plain if op.key in label_in_b and label_in_b[op.key] != op.label]


def test_generate_prefill_and_decode_steps_align(tmp_path: Path) -> None:
    model, (ids,) = gpt2()
    store = tl.open(tmp_path / "s.tl")
    with torch.no_grad(), store.recording("gen", model):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    run = store["gen"]
    assert run.num_steps == 2
    prefill, decode = run.step(0), run.step(1)
    comparison = store.compare("gen", "gen", steps=(0, 1))
    rows = comparison.df()
    paired = rows[rows["status"].isin(["compared", "shape mismatch"])]
    blocks = [op for op in prefill if op.block is not None]
    paired_keys = set(paired["key"])
    # every op inside the transformer blocks of the prefill has its decode counterpart,
    # bar the cache's first-step bookkeeping
    unpaired = [op.key for op in blocks if op.key not in paired_keys]
    assert len(unpaired) <= 4, unpaired
    assert len(paired) >= 0.9 * min(len(prefill), len(decode))
    mismatch = paired[paired["status"] == "shape mismatch"]
    assert mismatch["reason"].str.contains("shape").all()


def test_a_stored_run_against_an_in_memory_trace_differs_by_nothing(tmp_path: Path) -> None:
    model, (ids,) = gpt2()
    store = tl.open(tmp_path / "s.tl")
    with torch.no_grad():
        store.record(model, ids, name="base")
        log = tl.trace(model, ids)
    rows = store.compare("base", log).df()
    assert set(rows["status"]) == {"compared"}
    assert (rows["max_abs_diff"] == 0).all() and rows["allclose"].all()
    assert (rows["rel_l2"] == 0).all()
    # tolerances that are not numbers >= 0 were taken, and allclose meant nothing
    for wrong in ({"atol": "x"}, {"rtol": -1e-5}, {"atol": None}, {"atol": True}):
        with pytest.raises(ValueError, match="is a number >= 0"):
            store.compare("base", log, **wrong)
    assert store.compare("base", log, atol=0, rtol=0).df()["allclose"].all()


def test_only_one_side_shape_mismatch_and_empty_tensors(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self, width: int, extra: bool):
            super().__init__()
            self.lin = nn.Linear(4, width)
            self.extra = extra

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            empty = y[:, :0] * 2  # a zero-size tensor
            if self.extra:
                y = torch.relu(y)
            return y.sum(-1, keepdim=True) + empty.sum()

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    store = tl.open(tmp_path / "s.tl")
    store.record(Net(4, False), x, name="a")
    store.record(Net(5, True), x, name="b")
    rows = store.compare("a", "b").df().set_index("key")
    assert rows.loc["lin:linear#1", "status"] == "shape mismatch"
    assert "[3, 4] vs [3, 5]" in rows.loc["lin:linear#1", "reason"]
    assert rows.loc["relu#1", "status"] == "only b"
    empty = rows.loc["mul#1"]  # (3, 0) on both sides
    assert empty["status"] == "compared" and empty["max_abs_diff"] == 0 and empty["allclose"]


def test_selectors_where_clauses_modules_and_statistics(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="a")
    store.record(_perturbed(model, "2.weight"), x, name="b", save=tl.func("relu"), stats="all")
    by_func = store.compare("a", "b", select=tl.func("linear"))
    assert set(by_func.df()["func"]) == {"linear"}
    by_where = store.compare("a", "b", where="func = 'linear' and idx > 1")
    assert list(by_where.df()["label_a"]) == ["linear_2_3", "linear_3_5"]
    rows = store.compare("a", "b").df().set_index("label_a")
    # b saved only the ReLUs: the rest are compared by their statistics alone
    assert rows.loc["linear_2_3", "status"] == "not saved"
    assert rows.loc["linear_2_3", "max_abs_diff"] is None or math.isnan(
        rows.loc["linear_2_3", "max_abs_diff"]
    )
    assert abs(rows.loc["linear_2_3", "d_mean"]) > 0  # statistics of every op (stats="all")
    assert rows.loc["linear_1_1", "d_mean"] == 0
    modules = store.compare("a", "a", on="module").df()
    assert set(modules["status"]) == {"compared"} and (modules["max_abs_diff"] == 0).all()
    assert "Comparison 'a' vs 'b'" in repr(store.compare("a", "b"))
    assert "<table>" in store.compare("a", "b")._repr_html_()
    stats_only = store.compare("a", "b", tensors=False).df()
    assert set(stats_only["status"]) == {"not saved"}


def test_tensor_metrics_in_float64_and_by_slices() -> None:
    torch.manual_seed(0)
    a = torch.randn(3 * SLICE_ELEMENTS // 1024 + 7, 1024)  # several slices
    b = a + torch.randn_like(a) * 1e-3
    whole = tensor_metrics(a.double(), b.double())
    store_like = Sums(1e-8, 1e-5)
    for start in range(0, a.shape[0], 100):
        store_like.add(a[start : start + 100], b[start : start + 100])
    sliced = store_like.metrics()
    # float32 pairs are subtracted in float32 (exactly rounded), then reduced
    assert sliced.max_abs_diff == pytest.approx(whole.max_abs_diff, rel=1e-6)
    assert sliced.rel_l2 == pytest.approx(whole.rel_l2, rel=1e-6)
    assert sliced.cosine == pytest.approx(whole.cosine, rel=1e-9)
    assert tensor_metrics(a, a.clone()).max_abs_diff == 0
    bf = tensor_metrics(a, a.to(torch.bfloat16))
    assert 0 < bf.max_abs_diff < 0.05 and not bf.allclose
    empty = tensor_metrics(torch.zeros(0, 3), torch.zeros(0, 3))
    assert empty.max_abs_diff == 0 and empty.allclose and empty.cosine is None
    nan = torch.tensor([1.0, float("nan")])
    assert tensor_metrics(nan, nan).allclose
    with pytest.raises(ValueError, match="shapes differ"):
        tensor_metrics(torch.zeros(2), torch.zeros(3))


def test_tracelake_diff_command(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    import pyarrow.parquet as pq

    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="a")
    store.record(_perturbed(model, "2.weight"), x, name="b")
    store.record(model, x, name="same")

    def diff(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tracelake.cli", "diff", str(tmp_path / "s.tl"), *args],
            capture_output=True,
            text=True,
            check=False,
        )

    table = diff("a", "b")
    assert table.returncode == 0 and "linear_2_3" in table.stdout and "False" in table.stdout
    first = diff("a", "b", "--first", "--exit-code", "--format", "json")
    assert first.returncode == 1
    (row,) = json.loads(first.stdout)
    assert row["label_a"] == "linear_2_3" and row["allclose"] is False
    assert diff("a", "same", "--exit-code").returncode == 0
    rows = json.loads(diff("a", "b", "--format", "json", "--where", "func = 'relu'").stdout)
    assert [r["func"] for r in rows] == ["relu", "relu"]
    # CSV cells as `tracelake query --format csv` writes them: lists as JSON text
    import csv
    import io

    csv_rows = list(csv.DictReader(io.StringIO(diff("a", "b", "--format", "csv").stdout)))
    by_key = {r["key"]: r for r in rows}
    assert len(csv_rows) == len(store["a"])
    for got in csv_rows:
        if got["key"] in by_key:
            assert json.loads(got["shape_a"]) == by_key[got["key"]]["shape_a"]
            assert float(got["max_abs_diff"]) == by_key[got["key"]]["max_abs_diff"]
    out = tmp_path / "d.parquet"
    assert diff("a", "b", "--format", "parquet", "-o", str(out)).returncode == 0
    assert pq.read_table(out).num_rows == len(store["a"])
    assert diff("a", "nope").returncode == 1  # a run that does not exist: a clear error


def test_statistics_of_many_runs_against_one_in_one_query(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="base")
    store.record(_perturbed(model, "2.weight"), x, name="ft")
    store.record(model, x[:2], name="half")
    one = store.compare("base", "ft", tensors=False)
    python = store.compare("base", "ft", select=tl.all(), tensors=False).df()
    sql = one.df()
    assert list(sql["key"]) == list(python["key"])
    for name in ("d_mean", "d_std", "d_l2", "d_absmax"):
        assert sql[name].tolist() == pytest.approx(python[name].tolist(), abs=1e-12)
    many = store.compare("base", ["ft", "half"], tensors=False)
    assert many.summary() == {"not saved": len(store["base"]), "shape mismatch": len(store["base"])}
    assert many.first_divergence()["run_b"] == "half"
    with pytest.raises(ValueError, match="statistics only"):
        store.compare("base", ["ft", "half"])
    with pytest.raises(tl.RunNotFoundError):
        store.compare("base", ["ft", "nope"], tensors=False)
