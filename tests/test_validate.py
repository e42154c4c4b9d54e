"""``tl.validate``: every saved op recomputed from its saved parents and recorded
arguments; mismatches named by label with the largest difference; ops that cannot be
recomputed listed with the reason; in memory and from a stored run."""

from __future__ import annotations

import json

import pytest
import torch
from model_zoo import BUILDERS, llama
from torch import nn

import tracelake as tl

ARGS = tl.options.CaptureOptions(record_args=True)
MODELS = {**BUILDERS, "llama": llama}


@pytest.mark.parametrize("name", list(MODELS))
def test_validate_passes_on_the_model_set(name):
    model, inputs = MODELS[name]()
    report = tl.validate(model, *inputs)
    assert report.ok and bool(report), str(report)
    assert report.skipped == {}
    saved_ops = [op for op in tl.trace(model, *inputs) if op.kind == "op"]
    assert len(report.matched) == len(saved_ops)


def test_a_corrupted_saved_tensor_is_named():
    model, (x,) = MODELS["cnn"]()
    trace = tl.trace(model, x, capture=ARGS)
    assert tl.validate(trace).ok
    target = trace.find(func="relu")[0]
    target.out.view(-1)[3] += 0.5  # the trace's own saved value
    report = tl.validate(trace)
    assert not report.ok
    first = report.mismatches[0]
    assert first.label == target.label and first.func == "relu"
    assert first.max_diff == pytest.approx(0.5)
    assert target.label in str(report)
    # its children were recomputed from the corrupted value: they differ too
    assert {m.label for m in report.mismatches[1:]} <= set(
        op.label for op in trace if op.index > target.index
    )


OUTSIDE = torch.ones(4)


class _Odd(nn.Module):
    """In-place writes (through an index too), a random op in training mode, a tensor
    the model holds without registering it (recomputed as a buffer), a tensor from
    outside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.held = torch.full((4,), 3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.relu_()
        h[:, 0] = 2.0
        d = nn.functional.dropout(h, 0.5, training=True)
        return d + h * self.held + h * OUTSIDE


def test_what_cannot_be_recomputed_is_skipped_with_the_reason():
    torch.manual_seed(0)
    model = _Odd()
    report = tl.validate(model, torch.randn(3, 4))
    assert report.ok, str(report)
    trace = tl.trace(model, torch.randn(3, 4), capture=ARGS)
    labels = {op.func: op.label for op in trace}
    assert "RNG" in report.skipped[labels["dropout"]]
    held, outside = [op.label for op in trace if op.func == "mul"]
    assert "neither a recorded op nor a parameter" in report.skipped[outside]
    for label in (labels["linear"], labels["relu_"], labels["setitem"], held):
        assert label in report.matched


def test_refusals():
    model, (x,) = MODELS["mlp"]()
    with pytest.raises(tl.RecorderError, match="record_args=True"):
        tl.validate(tl.trace(model, x))
    with pytest.raises(TypeError, match="a model, a trace or a stored run"):
        tl.validate("run")
    with pytest.raises(TypeError, match="model inputs go with a model"):
        tl.validate(tl.trace(model, x, capture=ARGS), x)


def test_a_stored_run_validates_with_its_model(tmp_path):
    model, inputs = MODELS["gpt2"]()
    store = tl.open(tmp_path / "runs.tl")
    store.record(model, *inputs, name="r", capture=ARGS)
    report = tl.validate(store["r"], model=model)
    assert report.ok and report.matched and not report.skipped, str(report)
    without = tl.validate(store["r"])
    assert any("pass the recorded model" in why for why in without.skipped.values())
    assert without.ok
    # The arguments are catalog data: JSON, queryable.
    rows = store.sql("select label, args from ops where func = 'layer_norm' order by idx limit 1")
    call = json.loads(rows["args"][0])
    # the call inside F.layer_norm is recorded (TorchLens's granularity)
    assert call["fn"] == ["torch", "layer_norm"]
    assert pytest.approx(1e-5) in call["args"]
    plain = store.record(model, *inputs, name="plain")
    assert (
        store.sql("select count(*) as n from ops where args is not null and run_id = 2")["n"][0]
        == 0
    )
    with pytest.raises(tl.RecorderError, match="record_args"):
        tl.validate(plain, model=model)


def test_a_run_of_several_steps_names_the_step(tmp_path):
    model, (x,) = MODELS["mlp"]()
    store = tl.open(tmp_path / "runs.tl")
    with store.recording("r", model, capture=ARGS):
        model(x)
        model(x * 2)
    report = tl.validate(store["r"], model=model)
    assert report.ok and not report.skipped
    assert {label.split(":")[0] for label in report.matched} == {"step 0", "step 1"}
