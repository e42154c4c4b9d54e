"""Backward capture: per-op gradients of a loss, compared bit for bit with what tensor
hooks and full backward hooks on a plain forward+backward see; parameters' ``.grad``
unchanged; several backward calls; selection; stored gradients read back in a new
process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from grad_reference import GradHookMode, module_grad_outputs
from hook_capture import assert_bitwise
from model_zoo import cnn, gpt2, llama, mlp

import tracelake as tl

# The references hook every torch call: the ops connected to neither the input nor the
# output (which TorchLens prunes, and so does a recording by default) are kept here.
KEEP_ORPHANS = tl.options.CaptureOptions(keep_orphans=True)
BACKWARD = tl.options.CaptureOptions(backward_ready=True, keep_orphans=True)
MODELS = {"mlp": mlp, "cnn": cnn, "gpt2": gpt2, "llama": llama}


def logits(output):
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_of(output) -> torch.Tensor:
    """A loss computed outside the model."""
    out = logits(output)
    return (out.float().square().mean() + out.float().sin().sum()) / 3


def plain_param_grads(build) -> dict[str, torch.Tensor]:
    model, inputs = build()
    loss_of(model(*inputs)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_op_grad_equals_tensor_hooks(name):
    build = MODELS[name]
    model, inputs = build()
    trace = tl.trace(model, *inputs, capture=BACKWARD)
    trace.backward(loss_of(trace.output))

    ref_model, ref_inputs = build()
    mode = GradHookMode()
    with mode:
        output = ref_model(*ref_inputs)
    loss_of(output).backward()

    ops = [op for op in trace if op.kind == "op"]
    got = [(op.func, op) for op in ops]
    want = [(func, grads) for func, per_call in mode.calls for grads in per_call]
    assert len(got) == len(want), f"{len(got)} ops recorded, hooks saw {len(want)} tensors"
    compared = 0
    for (_, op), (_, grads) in zip(got, want, strict=True):
        assert len(op.grads) == len(grads), f"{op.label}: {len(op.grads)} vs {len(grads)} grads"
        for mine, theirs in zip(op.grads, grads, strict=True):
            assert_bitwise(mine, theirs, op.label)
            compared += 1
    assert compared > len(ops) // 2  # most ops of these models reach the loss

    # Model gradients: bitwise what a plain backward gives.
    plain = plain_param_grads(build)
    mine = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert mine.keys() == plain.keys() and mine
    for n in plain:
        assert_bitwise(mine[n], plain[n], n)


@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
@pytest.mark.filterwarnings("ignore:For backward hooks:UserWarning")
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_module_outputs_equal_full_backward_hooks(name):
    build = MODELS[name]
    model, inputs = build()
    trace = tl.trace(model, *inputs, capture=BACKWARD)
    trace.backward(loss_of(trace.output))
    ref_model, ref_inputs = build()
    hooked = module_grad_outputs(ref_model, lambda: loss_of(ref_model(*ref_inputs)).backward())
    compared = 0
    for entry in trace.modules:
        if entry.num_passes != 1 or len(entry.output_labels) != 1 or entry.path not in hooked:
            continue
        (grad_output,) = hooked[entry.path]
        if len(grad_output) != 1 or grad_output[0] is None:
            continue
        assert_bitwise(trace[entry.output_labels[0]].grad, grad_output[0], entry.path)
        compared += 1
    assert compared >= 3


def test_fires_in_backward_order_with_node_identity():
    model, (x,) = mlp()
    trace = tl.trace(model, x.requires_grad_(), capture=BACKWARD)
    loss = loss_of(trace.output)
    trace.backward(loss, retain_graph=True)
    trace.backward(loss * 2)
    fires = trace.grad_fires
    assert [f.backward for f in fires] == sorted(f.backward for f in fires)
    assert {f.backward for f in fires} == {1, 2}
    first = [f for f in fires if f.backward == 1]
    second = [f for f in fires if f.backward == 2]
    # Each call fires every node once, output side first, the input's accumulator last.
    assert [f.label for f in first] == [f.label for f in second]
    assert first[-1].label == "input_1" and first[-1].node == "AccumulateGrad"
    order = [f.label for f in first if f.label != "output_1"]
    forward = [op.label for op in trace if op.kind == "op"]
    assert order[:-1] == forward[::-1]  # backward runs this chain in reverse
    assert all(f.fire < g.fire for f, g in zip(first, second, strict=True))
    for op in trace:
        if op.kind == "op":
            one, two = op.grads
            assert_bitwise(two, one * 2, op.label)
            assert op.grad is two


def test_save_grads_selects():
    model, (x,) = cnn()
    trace = tl.trace(model, x, capture=BACKWARD, save=tl.none(), save_grads=tl.func("relu"))
    trace.backward(loss_of(trace.output))
    with_grads = {op.func for op in trace if op.grads}
    assert with_grads == {"relu"}
    assert not any(op.saved for op in trace)
    # save= selects gradients too when save_grads= is not given
    trace2 = tl.trace(model, x, capture=BACKWARD, save=tl.in_module("head"))
    trace2.backward(loss_of(trace2.output))
    assert {op.module for op in trace2 if op.grads} == {"head"}


def test_refusals():
    model, (x,) = mlp()
    plain = tl.trace(model, x)
    with pytest.raises(tl.RecorderError, match="backward_ready=True"):
        plain.backward(plain.output.sum())
    with pytest.raises(ValueError, match="backward_ready"):
        tl.trace(model, x, save_grads=tl.func("relu"))
    with pytest.raises(TypeError, match="CaptureOptions"):
        tl.trace(model, x, capture={"backward_ready": True})
    with torch.no_grad():
        frozen = tl.trace(model, x, capture=BACKWARD)
    with pytest.raises(tl.RecorderError, match="requires grad"):
        frozen.backward(frozen.output.sum())
    trace = tl.trace(model, x, capture=BACKWARD)
    trace.cleanup()
    with pytest.raises(tl.RecorderError, match="cleanup"):
        trace.backward(model(x).sum())


_READ_BACK = r"""
import hashlib, json, sys
import tracelake as tl
store = tl.open(sys.argv[1], create=False)
run = store[sys.argv[2]]
out = []
for op in run:
    digests = []
    for g in op.grads:
        data = g.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        digests.append([str(g.dtype), list(g.shape), hashlib.sha256(data).hexdigest()])
    out.append([op.kind, digests])
print(json.dumps(out))
"""


def _digest(t: torch.Tensor) -> list:
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_stored_grads_read_back_bitwise_in_a_new_process(name, tmp_path):
    build = MODELS[name]
    model, inputs = build()
    store = tl.open(tmp_path / "runs.tl")
    store.record(
        model, *inputs, name="r", backward=loss_of, max_inflight=8 << 20, capture=KEEP_ORPHANS
    )
    plain = plain_param_grads(build)
    for n, p in model.named_parameters():
        if n in plain:
            assert_bitwise(p.grad, plain[n], n)

    ref_model, ref_inputs = build()
    mode = GradHookMode()
    with mode:
        output = ref_model(*ref_inputs)
    loss_of(output).backward()
    want = [[_digest(g) for g in grads] for _, per_call in mode.calls for grads in per_call]

    code = "import torch\n" + _READ_BACK
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "runs.tl"), "r"],
        capture_output=True,
        text=True,
        check=True,
    )
    every = json.loads(done.stdout)
    got = [grads for kind, grads in every if kind == "op"]
    assert got == want
    assert sum(map(len, got)) > len(got) // 2

    # The grads table: one row per op and fire, queryable with out and its reductions.
    res = store.query("select label, out, norm(out), node from grads where run = 'r' order by fire")
    df = res.df()
    assert len(df) == sum(len(grads) for _, grads in every)  # model outputs too
    first = df.iloc[0]
    assert_bitwise(res.tensors("out")[0], store["r"][first["label"]].grad, first["label"])
    assert abs(first["norm(out)"] - float(res.tensors("out")[0].double().norm())) < 1e-6


def test_recording_block_backward_calls_are_separate_fires(tmp_path):
    model, (x,) = mlp()
    store = tl.open(tmp_path / "runs.tl")
    with store.recording("r", model, capture=BACKWARD, save_grads=tl.func("relu")) as rec:
        loss = loss_of(model(x))
        rec.backward(loss, retain_graph=True)
        rec.backward(loss * 2)
    rows = store.sql("select label, backward, fire, node from grads order by fire")
    assert list(rows["backward"]) == [1, 1, 2, 2]
    assert list(rows["node"]) == ["ReluBackward0"] * 4
    assert list(rows["fire"]) == sorted(rows["fire"]) and rows["fire"].is_unique
    run = store["r"]
    for op in run:
        if op.func == "relu":
            one, two = op.grads
            assert_bitwise(two, one * 2, op.label)
    with (
        pytest.raises(tl.RecorderError, match="backward-ready"),
        store.recording("s", model) as rec,
    ):
        rec.backward(model(x).sum())
    with pytest.raises(TypeError, match="backward="):
        store.record(model, x, backward=1.0)
