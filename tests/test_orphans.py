"""Ops connected to neither the model's inputs nor its outputs (orphans) are pruned after
the forward pass, as TorchLens 2.36.1 prunes them, and labels are numbered without them;
``CaptureOptions(keep_orphans=True)`` keeps them. A stored run holds no tensor of a
pruned op: its bytes are left out of the run like those of a forward that raised."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from test_store import run_python
from torch import nn

import tracelake as tl

torchlens = pytest.importorskip("torchlens", minversion="2.36.1")
from torchlens.backends.torch.wrappers import unwrap_torch  # noqa: E402

KEEP = tl.options.CaptureOptions(keep_orphans=True)


class Dead(nn.Module):
    """A 4 MiB tensor made and dropped (an array of its own when stored) and a dead chain
    through a module: pruned. Kept: a result computed from the input but never used, and
    an unused op reading a buffer that live ops read too (joined to them by the buffer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.side = nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = _noise() * 2  # reaches neither input nor output
        del big
        self.side(torch.zeros(2, 3)).relu()  # a dead chain through a module
        self.scale.sum()  # reads a buffer that the output's ops read: kept
        x.sum()  # from the input: kept
        h = self.fc(x)
        positions = torch.arange(4).float()  # a source that reaches the output: kept
        return h * self.scale + positions


X = torch.randn(2, 4)


def _noise() -> torch.Tensor:
    """4 MiB that does not compress."""
    return torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))


LIVE = [
    "input_1",
    "buffer_1",
    "sum_1_1",
    "sum_2_2",
    "linear_1_3",
    "arange_1_4",
    "float_1_5",
    "mul_1_6",
    "add_1_7",
    "output_1",
]


def _torchlens_labels(model: nn.Module, x: torch.Tensor) -> list[str]:
    try:
        log = torchlens.trace(model, x)
    finally:
        unwrap_torch()
    return [op.label if op.num_passes > 1 else op.label.split(":")[0] for op in log.ops]


def test_orphans_are_pruned_and_labels_are_torchlens_labels() -> None:
    model = Dead()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _torchlens_labels(model, X)
    trace = tl.trace(model, X)
    assert trace.labels == theirs == LIVE
    assert trace["add_1_7"].parents == ("mul_1_6", "float_1_5")
    assert trace["buffer_1"].children == ("sum_1_1", "mul_1_6")
    assert_bitwise(trace["output_1"].out, model(X), "output")
    assert_bitwise(trace["linear_1_3"].out, model.fc(X), "linear")
    # the module called only on dead tensors keeps its call, without ops
    side = trace.modules[[m.label for m in trace.modules].index("side")]
    assert side.input_labels == () and side.output_labels == ()
    # nothing keeps the pruned tensors: the saved bytes are the live ones only
    assert trace.nbytes_saved < 1 << 20


def test_keep_orphans_keeps_them() -> None:
    model = Dead()
    trace = tl.trace(model, X, capture=KEEP)
    assert trace.labels[:6] == [
        "input_1",
        "randn_1_1",
        "mul_1_2",
        "zeros_1_3",
        "linear_1_4",
        "relu_1_5",
    ]
    assert_bitwise(trace["mul_1_2"].out, _noise() * 2, "the orphan's value")
    assert trace["linear_1_4"].modules == (("side", 1),)
    assert len(trace) == len(LIVE) + 5


def test_a_model_recorded_again_is_pruned_the_same_and_label_selectors_match() -> None:
    model = Dead()
    first = tl.trace(model, X)
    # the second recording of the same graph is labelled from the first: a label
    # selector then matches during the forward, through the renumbering
    again = tl.trace(model, X, save=tl.label("mul_1_6"))
    assert again.labels == first.labels == LIVE
    assert [op.label for op in again if op.saved] == ["mul_1_6"]
    assert_bitwise(again["mul_1_6"].out, model.fc(X) * model.scale, "selected")
    kept = tl.trace(model, X, capture=KEEP)  # the cached graph is not reused for this
    assert len(kept) == len(LIVE) + 5


def test_an_intervened_orphan_stays_on_record() -> None:
    model = Dead()
    rule = tl.when(tl.func("relu"), lambda out, hook: out + 1)
    trace = tl.trace(model, X, intervene=rule)
    relu = trace.find(func="relu")
    assert len(relu) == 1 and relu[0].out.min() >= 1  # (changed by the rule)
    linear = trace[relu[0].parents[0]]
    assert linear.modules == (("side", 1),)  # its whole island stays
    assert trace[linear.parents[0]].func == "zeros"
    assert "randn_1_1" not in trace.labels  # the other orphans are pruned


def test_recorded_calls_name_the_renumbered_parents() -> None:
    model = Dead()
    trace = tl.trace(model, X, capture=tl.options.CaptureOptions(record_args=True))
    assert trace.labels == LIVE
    named = 0
    for index, call in trace.call_args().items():
        ops = [v["$op"] for v in call["args"] if isinstance(v, dict) and "$op" in v]
        assert {trace.labels[i] for i in ops} <= set(trace[index].parents), trace.labels[index]
        named += len(ops)
    assert named >= 6  # (buffers are named as parameters)
    assert tl.validate(trace).ok


def test_a_stored_run_is_pruned_and_holds_no_orphan_tensor(tmp_path: Path) -> None:
    model = Dead()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, X, name="pruned", save=tl.all())
    store.record(model, X, name="kept", save=tl.all(), capture=KEEP)
    with store.recording("steps", model, save=tl.all()) as rec:  # a step of a block
        model(X)
        rec.record(model, X)
    assert store.verify().ok  # no array or tensor row without its op
    code = r"""
import json, sys, torch, tracelake as tl
store = tl.open(sys.argv[1], create=False)
rows = store.query("select run, step, label from ops order by run, step, idx").df()
sizes = store.query("select run, sum(nbytes) as n from ops where saved group by run").df()
print(json.dumps({
    "rows": [[r.run, r.step, r.label] for r in rows.itertuples()],
    "bytes": {r.run: int(r.n) for r in sizes.itertuples()},
    "orphan": store["kept"]["mul_1_2"].out[:4].tolist(),
    "out": store["pruned"]["output_1"].out.tolist(),
    "parents": list(store["steps"].step(1)["add_1_7"].parents),
}))
"""
    got = json.loads(run_python(code, str(tmp_path / "s.tl")).stdout)
    runs: dict[str, list[str]] = {}
    for run, step, label in got["rows"]:
        runs.setdefault(f"{run}:{step}", []).append(label)
    assert runs["pruned:0"] == runs["steps:0"] == runs["steps:1"] == LIVE
    assert runs["kept:0"][:3] == ["input_1", "randn_1_1", "mul_1_2"]
    assert len(runs["kept:0"]) == len(LIVE) + 5
    assert got["bytes"]["pruned"] < 1 << 20 <= got["bytes"]["kept"]
    assert got["orphan"] == (_noise()[:4] * 2).tolist()
    assert torch.equal(torch.tensor(got["out"]), model(X))
    assert got["parents"] == ["mul_1_6", "float_1_5"]
    # the pruned op's 4 MiB array was written during the forward, then left out
    sizes = store.runs().set_index("name")["bytes"]
    assert sizes["pruned"] < 1 << 20 <= sizes["kept"]


class OddDtype(nn.Module):
    """Pruned ops that are the only tensors of their dtype: their pack (int64, bool)
    holds nothing the run keeps, and goes with them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(16)  # no input, no use: pruned
        (steps > 3).sum()
        return x * 2


def test_a_pack_only_pruned_tensors_used_is_removed(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s.tl")
    store.record(OddDtype(), X, name="odd", save=tl.all())
    store.record(OddDtype(), X, name="kept", save=tl.all(), capture=KEEP)
    report = store.verify()
    assert report.ok, report.problems  # before: "array pack_... is not in the catalog"
    assert store["odd"].labels == ["input_1", "mul_1_1", "output_1"]
    assert "arange_1_1" in store["kept"].labels
    assert torch.equal(store["kept"]["arange_1_1"].out, torch.arange(16))
