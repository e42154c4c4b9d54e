"""The recorder sees exactly what plain PyTorch forward hooks see, bit for bit.

For each small model (tests/model_zoo.py) a plain forward pass is run with a forward hook and
a forward pre-hook on every named submodule; each hook keeps detached clones of the
tensors the module received / returned, per call. Then ``tl.trace`` records the same
model and every module call of the trace must hold exactly those tensors (dtype, shape
and bits), and the model's own output must be untouched. Recording must also leave no
hooks, no function mode and no changed parameter behind.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hook_capture import (
    HookRun,
    assert_all_bitwise,
    assert_bitwise,
    call_label,
    flatten,
    run_with_hooks,
)
from model_zoo import BUILDERS
from torch.nn.modules import module as nn_module
from torch.overrides import _get_current_function_mode_stack

import tracelake as tl

MODEL_NAMES = list(BUILDERS)


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    inputs: tuple
    hooks: HookRun
    plain_output: Any
    log: tl.Trace


@pytest.fixture(scope="module", params=MODEL_NAMES)
def case(request: pytest.FixtureRequest) -> Case:
    name = request.param
    model, inputs = BUILDERS[name]()
    hooks = run_with_hooks(model, inputs)
    plain_output = model(*inputs)  # no hooks, no recording
    log = tl.trace(model, *inputs)
    return Case(name, model, inputs, hooks, plain_output, log)


def _case(name: str) -> Case:
    model, inputs = BUILDERS[name]()
    return Case(
        name, model, inputs, run_with_hooks(model, inputs), model(*inputs), tl.trace(model, *inputs)
    )


@pytest.fixture(scope="module")
def gpt2_case() -> Case:
    return _case("gpt2")


@pytest.fixture(scope="module")
def lstm_case() -> Case:
    return _case("lstm")


@pytest.fixture(scope="module")
def repeated_case() -> Case:
    return _case("repeated_block")


# -- every module call, bitwise --------------------------------------------------------


def test_same_module_calls_as_hooks(case: Case) -> None:
    """One ModuleEntry per hooked call, in the order the calls began, labelled by pass."""
    calls = Counter(path for path, _ in case.hooks.order)
    got = [(m.path, m.pass_num) for m in case.log.modules]
    assert got == case.hooks.order
    assert case.log.module_labels == [call_label(p, n, calls) for p, n in case.hooks.order]
    named = dict(case.model.named_modules())
    for m in case.log.modules:
        assert m.num_passes == calls[m.path], m.label
        assert m.type == type(named[m.path]).__name__, m.label
        assert m.saved, m.label


def test_module_outputs_match_hooks(case: Case) -> None:
    calls = Counter(path for path, _ in case.hooks.order)
    assert case.hooks.outputs, "the hooks saw no module call"
    for (path, call), want in case.hooks.outputs.items():
        label = call_label(path, call, calls)
        entry = case.log[label]
        assert isinstance(entry, tl.ModuleEntry), label
        assert (entry.path, entry.pass_num, entry.label) == (path, call, label)
        assert_all_bitwise(entry.outputs, want, f"{case.name}: {label}.outputs")


def test_module_out_structure_matches_hooks(case: Case) -> None:
    """``.out`` keeps the returned structure; its tensors are ``.outputs``, in order."""
    calls = Counter(path for path, _ in case.hooks.order)
    for (path, call), structure in case.hooks.structures.items():
        label = call_label(path, call, calls)
        entry = case.log[label]
        out = entry.out
        if isinstance(structure, torch.Tensor):
            assert isinstance(out, torch.Tensor), label
        else:
            assert type(out) is type(structure), f"{label}: {type(out)} vs {type(structure)}"
            if isinstance(structure, dict):
                assert list(out) == list(structure), label
            else:
                assert len(out) == len(structure), label
        leaves = flatten(out)
        assert len(leaves) == len(entry.outputs), label
        for leaf, saved in zip(leaves, entry.outputs, strict=True):
            assert leaf is saved, label
        assert_all_bitwise(leaves, flatten(structure), f"{case.name}: {label}.out")


def test_module_inputs_match_hooks(case: Case) -> None:
    calls = Counter(path for path, _ in case.hooks.order)
    for (path, call), want in case.hooks.inputs.items():
        label = call_label(path, call, calls)
        assert_all_bitwise(case.log[label].inputs, want, f"{case.name}: {label}.inputs")


def test_saved_module_tensors_are_detached_copies(case: Case) -> None:
    for entry in case.log.modules:
        for t in (*entry.outputs, *entry.inputs):
            assert not t.requires_grad, entry.label
            assert t.grad_fn is None, entry.label


def test_model_output_bitwise(case: Case) -> None:
    """``log.output`` is the model's own return value, equal to a plain forward's."""
    out, plain = case.log.output, case.plain_output
    assert type(out) is type(plain)
    if isinstance(plain, dict):
        assert list(out) == list(plain)
    got, want = flatten(out), flatten(plain)
    assert got, "the model returned no tensor"
    assert_all_bitwise(got, want, f"{case.name}: log.output")
    assert_all_bitwise(got, flatten(case.hooks.output), f"{case.name}: log.output vs hooked")
    # The model's outputs are recorded as output entries holding the same values.
    recorded = [op.out for op in case.log.outputs]
    assert_all_bitwise(recorded, want, f"{case.name}: output entries")


# -- specific facts per model -----------------------------------------------------------


def test_gpt2_records_sdpa_inside_attention(gpt2_case: Case) -> None:
    log = gpt2_case.log
    sdpa = [op for op in log if op.func == "scaled_dot_product_attention"]
    assert len(sdpa) == 2, [op.label for op in sdpa]  # one per layer (n_layer=2)
    first = sdpa[0]
    stack = [path for path, _ in first.modules]
    assert "transformer.h.0.attn" in stack, first.modules
    assert first.module == "transformer.h.0.attn"
    assert first.modules[0] == ("transformer", 1)
    assert stack == ["transformer", "transformer.h.0", "transformer.h.0.attn"]
    assert sdpa[1].module == "transformer.h.1.attn"
    assert first.saved and first.out is not None
    assert first.shape == tuple(first.out.shape)


def test_lstm_records_embedding_and_lstm(lstm_case: Case) -> None:
    log = lstm_case.log
    funcs = {op.func for op in log}
    assert "lstm" in funcs, sorted(funcs)
    assert "embedding" in funcs, sorted(funcs)
    embedding = next(op for op in log if op.func == "embedding")
    assert embedding.module == "embed"
    lstm_ops = [op for op in log if op.func == "lstm"]
    assert all(op.module == "lstm" for op in lstm_ops)
    # nn.LSTM returns (output, (h_n, c_n)): the op's tensors are the module's outputs.
    entry = log["lstm"]
    assert len(entry.outputs) == 3
    assert_all_bitwise([op.out for op in lstm_ops], list(entry.outputs), "lstm ops")


def test_repeated_block_op_labels_carry_passes(repeated_case: Case) -> None:
    log = repeated_case.log
    in_block = [op for op in log if any(path == "block" for path, _ in op.modules)]
    assert in_block
    suffixes = set()
    for op in in_block:
        block_pass = dict(op.modules)["block"]
        assert op.label.endswith(f":{block_pass}"), (op.label, op.modules)
        assert op.label == f"{op.layer}:{op.pass_num}"
        assert op.pass_num == block_pass and op.num_passes == 3, op.label
        suffixes.add(op.label.rsplit(":", 1)[1])
    assert suffixes == {"1", "2", "3"}
    # Each pass of the block has the same layers.
    layers_by_pass = {p: [op.layer for op in in_block if op.pass_num == p] for p in (1, 2, 3)}
    assert layers_by_pass[1] == layers_by_pass[2] == layers_by_pass[3]
    # Ops that ran once carry no pass; the residual add in the loop body is, as in
    # TorchLens, one layer with a pass per iteration.
    for op in log:
        if op in in_block:
            continue
        if op.func == "add":
            assert op.num_passes == 3 and op.label == f"{op.layer}:{op.pass_num}", op.label
        else:
            assert ":" not in op.label and op.num_passes == 1, op.label


def test_repeated_block_module_passes(repeated_case: Case) -> None:
    log = repeated_case.log
    assert [m.label for m in log.modules if m.path == "block"] == ["block:1", "block:2", "block:3"]
    for n in (1, 2, 3):
        entry = log[f"block:{n}"]
        assert (entry.path, entry.pass_num, entry.num_passes) == ("block", n, 3)
    assert log["head"].num_passes == 1
    # Pass k's input is pass k-1's output plus its input (the residual): passes differ.
    assert not torch.equal(log["block:1"].out, log["block:2"].out)


def test_bare_label_of_multipass_module_is_ambiguous(repeated_case: Case) -> None:
    log = repeated_case.log
    with pytest.raises(tl.AmbiguousLabelError) as info:
        log["block"]
    exc = info.value
    assert isinstance(exc, KeyError)
    assert isinstance(exc, tl.LabelError)
    message = str(exc)
    for n in (1, 2, 3):
        assert f"block:{n}" in message, message
    assert exc.passes == ("block:1", "block:2", "block:3")
    # Submodules of the block ran three passes too.
    with pytest.raises(tl.AmbiguousLabelError):
        log["block.0"]


def test_bare_label_of_multipass_op_layer_is_ambiguous(repeated_case: Case) -> None:
    log = repeated_case.log
    op = next(op for op in log if op.num_passes > 1)
    with pytest.raises(tl.AmbiguousLabelError) as info:
        log[op.layer]
    message = str(info.value)
    for n in (1, 2, 3):
        assert f"{op.layer}:{n}" in message, message
    assert info.value.passes == tuple(f"{op.layer}:{n}" for n in (1, 2, 3))
    assert log[f"{op.layer}:2"].pass_num == 2
    # A pass that never ran is an unknown label, not an ambiguous one.
    with pytest.raises(tl.LabelError) as missing:
        log[f"{op.layer}:4"]
    assert not isinstance(missing.value, tl.AmbiguousLabelError)


# -- recording leaves the model and torch as they were ----------------------------------


def _global_hook_state() -> dict[str, list]:
    names = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    return {n: list(getattr(nn_module, n).items()) for n in names if hasattr(nn_module, n)}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_trace_leaves_no_hooks_behind(name: str) -> None:
    model, inputs = BUILDERS[name]()
    before = _global_hook_state()
    log = tl.trace(model, *inputs)
    assert log.modules
    assert _global_hook_state() == before
    assert not nn_module._global_forward_hooks
    assert not nn_module._global_forward_pre_hooks
    for path, module in model.named_modules():
        assert not module._forward_hooks, path
        assert not module._forward_pre_hooks, path
        assert not module._backward_hooks, path
    assert not _get_current_function_mode_stack()
    # A second recording works (nothing was left active).
    tl.trace(model, *inputs)
    assert _global_hook_state() == before


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_trace_leaves_parameters_unchanged(name: str) -> None:
    model, inputs = BUILDERS[name]()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    training = {path: m.training for path, m in model.named_modules()}
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    tl.trace(model, *inputs)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert_bitwise(after[key], value, f"{name}: state_dict[{key!r}]")
    assert {path: m.training for path, m in model.named_modules()} == training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == requires_grad
    for n, p in model.named_parameters():
        assert p.grad is None, n
