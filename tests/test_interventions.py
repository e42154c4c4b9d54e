"""Interventions (``intervene=tl.when(selector, action)``) against the hook that does the
same thing by hand, bit for bit; the audit in memory and in the catalog; errors."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hook_capture import assert_bitwise
from model_zoo import gpt2, mlp
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import tracelake as tl
from tracelake.recorder.actions import decode_value, encode_value
from tracelake.recorder.selectors import parse_selector

torch.set_num_threads(1)


def _hooked(model: nn.Module, hooks: dict[nn.Module, Callable], *inputs: torch.Tensor) -> Any:
    """The model's output with a forward hook on each module of ``hooks`` returning
    ``fn(output)``."""
    handles = [
        module.register_forward_hook(lambda m, a, out, fn=fn: fn(out))
        for module, fn in hooks.items()
    ]
    try:
        return model(*inputs)
    finally:
        for handle in handles:
            handle.remove()


def test_zero_ablating_a_relu_equals_a_hook_that_zeroes_it() -> None:
    model, (x,) = mlp()
    log = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.zero_ablate()))
    both = _hooked(model, {model[1]: torch.zeros_like, model[3]: torch.zeros_like}, x)
    assert_bitwise(log.output, both)
    relus = [op for op in log if op.func == "relu"]
    assert [op.intervened for op in relus] == [True, True]
    assert [op.rule for op in relus] == [0, 0]
    assert not any(op.intervened for op in log if op.func != "relu")
    for op in relus:
        assert_bitwise(op.out, torch.zeros_like(op.out))
    # the next op consumed the zeroed value, and knows it came from the relu
    after = log[relus[0].children[0]]
    assert relus[0].label in after.parents
    [row] = log.interventions.audit()
    assert row["touched"] == 2 and row["replayable"] and row["action"] == "zero_ablate"
    assert parse_selector(row["selector"]).matches_op(relus[0])


def test_an_in_place_relu_is_ablated_in_place_as_a_hook_would() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    log = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.zero_ablate()))
    expected = _hooked(model, {model[1]: lambda out: out.mul_(0)}, x)
    assert_bitwise(log.output, expected)
    [relu] = [op for op in log if op.intervened]
    assert relu.func == "relu_" and relu.out.count_nonzero() == 0


def _direction() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 16)


def _projected_off(out: torch.Tensor) -> torch.Tensor:
    d = _direction().reshape(1, 16)
    return out - d * (
        torch.sum(out * d, dim=1, keepdim=True) / torch.sum(d * d, dim=1, keepdim=True)
    )


def _noise(out: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return out + torch.randn(out.shape, generator=gen, dtype=out.dtype) * 0.3


#: (action, what a forward hook on the first ReLU returns instead of its output)
HELPER_CASES = [
    (tl.zero_ablate(), torch.zeros_like),
    (tl.scale(0.5), lambda out: out * 0.5),
    (tl.add(1.25), lambda out: out + 1.25),
    (tl.add(torch.arange(16.0)), lambda out: out + torch.arange(16.0)),
    (tl.clamp(min=0.1, max=0.3), lambda out: torch.clamp(out, min=0.1, max=0.3)),
    (tl.clamp(max=0.2), lambda out: torch.clamp(out, max=0.2)),
    (tl.mean_ablate(), lambda out: torch.zeros_like(out) + out.mean()),
    (
        tl.mean_ablate(source=torch.full((4, 16), 2.0)),
        lambda out: torch.zeros_like(out) + torch.full((4, 16), 2.0).mean(),
    ),
    (
        tl.steer(_direction(), 2.0, feature_axis=-1),
        lambda out: out + _direction().reshape(1, 16) * 2.0,
    ),
    (tl.project_off(_direction(), feature_axis=1), _projected_off),
    (tl.replace_with(torch.ones(4, 16)), lambda out: torch.ones(4, 16)),
    (tl.noise(0.3, seed=7), _noise),
]


@pytest.mark.parametrize(("action", "hook"), HELPER_CASES, ids=[repr(a) for a, _ in HELPER_CASES])
def test_each_helper_equals_the_hook_that_does_it_by_hand(
    action: tl.Selector, hook: Callable
) -> None:
    model, (x,) = mlp()
    first = tl.func("relu") & tl.in_module("1")
    log = tl.trace(model, x, intervene=tl.when(first, action))
    assert_bitwise(log.output, _hooked(model, {model[1]: hook}, x))
    assert [op.func for op in log if op.intervened] == ["relu"]
    # the spec rebuilds the very same action: the replay reproduces every op
    assert log.replay(model).ok


def test_rules_apply_in_order_and_the_first_is_the_ops_rule() -> None:
    model, (x,) = mlp()
    rules = [
        tl.when(tl.func("relu"), tl.add(1.0)),
        tl.when(tl.in_module("3"), tl.scale(3.0)),
    ]
    log = tl.trace(model, x, intervene=rules)
    expected = _hooked(model, {model[1]: lambda o: o + 1.0, model[3]: lambda o: (o + 1.0) * 3.0}, x)
    assert_bitwise(log.output, expected)
    assert [(op.func, op.rule) for op in log if op.intervened] == [("relu", 0), ("relu", 0)]
    assert [row["touched"] for row in log.interventions.audit()] == [2, 1]


def test_a_user_callable_is_recorded_by_name_and_is_not_replayable() -> None:
    model, (x,) = mlp()

    def halve(out: torch.Tensor, *, hook: object) -> torch.Tensor:
        return out / 2

    log = tl.trace(model, x, intervene=tl.when(tl.func("relu"), halve))
    expected = _hooked(model, {model[1]: lambda o: o / 2, model[3]: lambda o: o / 2}, x)
    assert_bitwise(log.output, expected)
    [row] = log.interventions.audit()
    assert row["action"] == "callable" and not row["replayable"]
    assert "halve" in json.loads(row["spec"])["params"]["qualname"]
    with pytest.raises(tl.ReplayError, match="halve"):
        log.replay(model)


def test_a_rule_that_selects_nothing_warns(tmp_path: Path) -> None:
    model, (x,) = mlp()
    with pytest.warns(tl.TraceLakeWarning, match="selected no op"):
        log = tl.trace(model, x, intervene=tl.when(tl.func("gelu"), tl.zero_ablate()))
    assert_bitwise(log.output, model(x))
    store = tl.open(tmp_path / "s.tl")
    rules = [tl.when(tl.func("relu"), tl.scale(2.0)), tl.when(tl.module("1"), tl.scale(2.0))]
    with pytest.warns(tl.TraceLakeWarning, match=r"tl.module\('1'\).*selected no op"):
        store.record(model, x, name="one_idle", intervene=rules)
    touched = store.query("select rule, touched from rules order by rule").df()
    assert touched.values.tolist() == [[0, 2], [1, 0]]


class _Loop(nn.Module):
    """A parameter-free sequence run three times: one layer with three passes, known
    only once the forward is over (TorchLens's grouping)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for _ in range(3):
            x = torch.sin(x) * 2
        return x


def test_a_label_rule_on_a_graph_not_seen_before_says_why_it_selected_nothing() -> None:
    from tracelake.recorder import entries

    torch.manual_seed(0)
    model, x = _Loop().eval(), torch.randn(2, 4)
    assert "sin_1_2:2" in tl.trace(model, x).labels
    entries._SETTLED.clear()  # (as in a new process: this graph was never recorded)
    rule = tl.when(tl.label("sin_1_2:2"), tl.scale(0.5))
    with pytest.warns(tl.TraceLakeWarning, match=r"has 'sin_1_2:2'.*after the forward"):
        first = tl.trace(model, x, intervene=rule)
    assert not any(op.intervened for op in first)
    again = tl.trace(model, x, intervene=rule)  # the graph is known now: the label works
    assert [op.label for op in again if op.intervened] == ["sin_1_2:2"]


def test_patch_from_on_label_aligns_final_labels() -> None:
    """Labels of layers with several passes, and those numbered after them, are final
    only after the forward: patching by label matches them (as by key)."""
    torch.manual_seed(0)
    model = _Loop().eval()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    source = tl.trace(model, y)
    rule = tl.when(tl.label("mul_1_3:2"), tl.patch_from(source, on="label"))
    log = tl.trace(model, x, intervene=rule)
    assert [op.label for op in log if op.intervened] == ["mul_1_3:2"]
    assert_bitwise(log["mul_1_3:2"].out, source["mul_1_3:2"].out)
    assert_bitwise(log.output, source.output)


def test_wrong_arguments_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="selector"):
        tl.when("relu", tl.zero_ablate())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="helper"):
        tl.when(tl.func("relu"), 3)
    with pytest.raises(TypeError, match=r"fn\(out, \*, hook\)"):
        tl.when(tl.func("relu"), lambda a, b, c: a)
    with pytest.raises(TypeError, match="intervene="):
        tl.trace(nn.ReLU(), torch.ones(2), intervene="relu")
    with pytest.raises(ValueError, match="min=, max="):
        tl.clamp()
    with pytest.raises(ValueError, match="'self'"):
        tl.mean_ablate(over="batch")
    with pytest.raises(TypeError, match="store="):
        tl.patch_from("baseline")


def test_an_action_that_changes_the_shape_fails_at_that_op() -> None:
    model, (x,) = mlp()
    with pytest.raises(tl.InterventionError, match=r"relu_1_2 \(1:relu#1\)"):
        tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.replace_with(torch.ones(3))))
    assert not _get_current_function_mode_stack()
    assert_bitwise(model(x), tl.trace(model, x).output)  # nothing stayed installed


def test_specs_keep_tensors_bit_for_bit() -> None:
    for tensor in (
        torch.randn(3, 4),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor([float("nan"), -0.0, float("inf")]),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.empty(0, 3),
    ):
        back = decode_value(json.loads(json.dumps(encode_value({"t": tensor}))))["t"]
        assert_bitwise(back, tensor)


@pytest.mark.parametrize(
    "selector",
    [
        tl.func("relu"),
        tl.func("add", "relu"),
        tl.in_module("transformer.h.3") & tl.func("add"),
        ~tl.label("relu_1_2") | tl.module("0:2"),
        tl.all(),
        tl.none(),
    ],
)
def test_selectors_round_trip_through_their_spelling(selector: tl.Selector) -> None:
    assert repr(parse_selector(repr(selector))) == repr(selector)


@pytest.mark.parametrize("text", ["__import__('os')", "tl.func(x)", "tl.eval('1')", "1 + 1"])
def test_only_selector_spellings_are_parsed(text: str) -> None:
    with pytest.raises(ValueError, match="not a selector"):
        parse_selector(text)


# -- patch_from ---------------------------------------------------------------------------


def _block_output_op(trace: tl.Trace, path: str) -> str:
    """The label of the op that produced module ``path``'s first output."""
    return trace[path].output_labels[0]


def test_patching_gpt2s_block_3_residual_from_a_stored_run_equals_a_hook(tmp_path: Path) -> None:
    model, (ids,) = gpt2(n_layer=5)
    other = torch.randint(1, 64, ids.shape, generator=torch.Generator().manual_seed(1))
    store = tl.open(tmp_path / "runs.tl")
    source = store.record(model, other, name="prompt_b", save=tl.in_module("transformer.h.3"))
    residual = _block_output_op(tl.trace(model, ids, save=tl.none()), "transformer.h.3")

    # the hook-based patch: block 3 returns the other prompt's hidden state
    def hidden(out: object) -> torch.Tensor:  # a block returns a tensor or a tuple
        return out if isinstance(out, torch.Tensor) else out[0]  # type: ignore[index]

    def patched_output(out: object) -> object:
        if isinstance(out, torch.Tensor):
            return donor["h"].clone()
        return (donor["h"].clone(), *out[1:])  # type: ignore[index]

    donor: dict[str, torch.Tensor] = {}
    grab = model.transformer.h[3].register_forward_hook(
        lambda m, a, out: donor.setdefault("h", hidden(out).detach().clone())
    )
    model(other)
    grab.remove()
    patch = model.transformer.h[3].register_forward_hook(lambda m, a, out: patched_output(out))
    try:
        expected = model(ids)
    finally:
        patch.remove()

    rule = tl.when(tl.label(residual), tl.patch_from(source))
    patched = store.record(model, ids, name="patched", intervene=rule)
    in_memory = tl.trace(
        model, ids, intervene=tl.when(tl.label(residual), tl.patch_from("prompt_b", store=store))
    )
    assert_bitwise(in_memory.output.logits, expected.logits)
    assert_bitwise(patched["output_1"].out, expected.logits)
    assert_bitwise(patched[residual].out, donor["h"])
    assert_bitwise(patched[residual].out, source[residual].out)

    # the rules and the ops they touched, in the catalog, read by a new process
    code = (
        "import json, tracelake as tl\n"
        f"s = tl.open({str(tmp_path / 'runs.tl')!r}, create=False)\n"
        'ops = s.query("select run, label, key, rule from ops where intervened").df()\n'
        "cols = 'run, rule, selector, action, spec, replayable, touched'\n"
        'rules = s.query(f"select {cols} from rules").df()\n'
        "print(json.dumps({'ops': ops.values.tolist(), 'rules': rules.values.tolist()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["ops"] == [["patched", residual, "transformer.h.3:add#2", 0]]
    [[run, number, selector, action, spec, replayable, touched]] = seen["rules"]
    assert (run, number, action, replayable, touched) == ("patched", 0, "patch_from", True, 1)
    assert selector == f"tl.label({residual!r})"
    assert json.loads(spec)["params"] == {"source": "prompt_b", "on": "key"}


def test_patch_from_a_trace_aligns_by_key_or_label() -> None:
    model, (x,) = mlp()
    y = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    source = tl.trace(model, y)
    for on in ("key", "label"):
        log = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.patch_from(source, on=on)))
        for op in log:
            if op.func == "relu":
                assert op.intervened
                assert_bitwise(op.out, source[op.label].out)
        assert_bitwise(log.output, source.output)  # the last relu decides the rest
        [row] = log.interventions.audit()
        assert not row["replayable"] and "in-memory" in row["reason"]


def test_patch_from_refuses_before_the_forward_what_it_can_know() -> None:
    model, (x,) = mlp()
    unsaved = tl.trace(model, x, save=tl.func("linear"))
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(tl.InterventionError, match="did not save relu_1_2"):
            tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.patch_from(unsaved)))
        with pytest.raises(tl.InterventionError, match="no op that"):
            tl.trace(model, x, intervene=tl.when(tl.func("gelu"), tl.patch_from(unsaved)))
    finally:
        hook.remove()
    assert calls == []  # the model never ran


def test_patch_from_fails_at_the_op_the_source_lacks_or_shapes_differently() -> None:
    model, (x,) = mlp()
    torch.manual_seed(1)
    smaller = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    one_relu = tl.trace(smaller, x)
    with pytest.raises(tl.InterventionError, match=r"relu_2_4 \(3:relu#1\).*no op with key"):
        tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.patch_from(one_relu)))
    short = tl.trace(model, x[:2])
    with pytest.raises(tl.InterventionError, match=r"relu_1_2 \(1:relu#1\).*shape \[2, 16\]"):
        tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.patch_from(short)))
    assert not _get_current_function_mode_stack()


def test_a_store_recording_intervenes_in_every_step(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every rule selects something: no warning
        with store.recording(
            "steps", model, intervene=tl.when(tl.func("relu"), tl.scale(0.0))
        ) as rec:
            model(x)
            model(x * 2)
    run = store["steps"]
    assert run.num_steps == 2
    touched = store.query("select run, touched from rules where run = 'steps'").df()
    assert touched["touched"].tolist() == [4]
    counts = store.query(
        "select step, count(*) from ops where run = 'steps' and intervened "
        "group by step order by step"
    ).df()
    assert counts.values.tolist() == [[0, 2], [1, 2]]
    assert rec.interventions.touched == [4]


def test_a_patch_that_cannot_apply_fails_the_stored_run(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    source = store.record(model, x, name="src", save=tl.func("linear"))
    with pytest.raises(tl.InterventionError, match="did not save"):
        store.record(
            model, x, name="bad", intervene=tl.when(tl.func("relu"), tl.patch_from(source))
        )
    with (
        pytest.raises(tl.InterventionError, match="did not save"),
        store.recording("bad2", model, intervene=tl.when(tl.func("relu"), tl.patch_from(source))),
    ):
        model(x)
    assert "bad" not in store and "bad2" not in store
