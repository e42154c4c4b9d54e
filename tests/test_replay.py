"""Replay: a stored run (or an in-memory trace) runs again from its stored inputs, with
its stored interventions, and every stored op comes out bit for bit; what cannot be
replayed is refused before the model runs; tampering is caught."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hook_capture import assert_bitwise
from model_zoo import BUILDERS, gpt2, mlp
from torch import nn

import tracelake as tl
from tracelake.store.tensors import clear_chunk_cache

torch.set_num_threads(1)


def _rules(name: str, store: tl.Store, model: nn.Module) -> list:
    """Interventions for each zoo model, chosen by selectors (no hard-coded labels)."""
    if name in ("mlp", "cnn"):
        return [tl.when(tl.func("relu"), tl.zero_ablate())]
    if name == "lstm":
        return [tl.when(tl.in_module("head"), tl.scale(-2.0))]
    if name == "repeated_block":
        return [
            tl.when(tl.in_module("block") & tl.func("tanh"), tl.add(0.5)),
            tl.when(tl.func("relu"), tl.noise(0.1, seed=3)),
        ]
    # gpt2: patch block 1 from a stored run of another prompt, and clamp the logits
    other = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    donor = store.record(model, other, name="gpt2_donor", save=tl.in_module("transformer.h.1"))
    return [
        tl.when(tl.in_module("transformer.h.1") & tl.func("add"), tl.patch_from(donor)),
        tl.when(tl.in_module("lm_head"), tl.clamp(min=-0.05, max=0.05)),
    ]


def test_ten_stored_runs_replay_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "runs.tl"
    store = tl.open(path)
    models: dict[str, tuple[nn.Module, Callable]] = {}
    recorded = []
    for name, build in BUILDERS.items():
        model, inputs = build()
        models[name] = (model, build)
        store.record(model, *inputs, name=f"{name}_plain")
        store.record(
            model, *inputs, name=f"{name}_intervened", intervene=_rules(name, store, model)
        )
        recorded += [f"{name}_plain", f"{name}_intervened"]
    assert len(recorded) == 10
    intervened = store.query("select run, count(*) from ops where intervened group by run").df()
    assert set(intervened["run"]) == {r for r in recorded if r.endswith("_intervened")}

    reopened = tl.open(path, create=False)
    for run_name in recorded:
        model, _ = models[run_name.rsplit("_", 1)[0]]
        report = reopened.replay(run_name, model)
        saved = reopened.query(f"select count(*) from ops where run = '{run_name}' and saved")
        assert report.ok, (run_name, report.mismatches[:3])
        assert report.compared == int(saved.df().iloc[0, 0]) > 0
        assert {row["status"] for row in report.rows} == {"same"}


def test_a_replay_recorded_as_a_run_holds_the_same_values(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    with store.recording("two", model, intervene=tl.when(tl.func("relu"), tl.scale(0.5))):
        model(x)
        model(x + 1)
    report = store.replay("two", model, name="two_again")
    assert report.ok and report.run.name == "two_again" and report.run.num_steps == 2
    for step in range(2):
        for op in store["two"].step(step):
            assert_bitwise(report.run.step(step)[op.label].out, op.out, op.label)
    again = store.query("select count(*) from ops where run = 'two_again' and intervened").df()
    assert int(again.iloc[0, 0]) == 4  # the interventions ran again, and are audited
    meta = store.runs().set_index("name").loc["two_again", "meta"]
    assert meta == {"replay_of": "two"}


def test_an_in_memory_trace_replays_with_its_interventions() -> None:
    model, inputs = BUILDERS["repeated_block"]()
    log = tl.trace(model, *inputs, intervene=tl.when(tl.func("tanh"), tl.mean_ablate()))
    report = log.replay(model)
    assert report.ok and report.compared == len(log)
    assert_bitwise(report.traces[0].output, log.output)


class _WithLabels(nn.Module):
    """A language-model-like call: the loss's targets are the input tensor itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(x)
        return h if labels is None else ((h - labels) ** 2).mean()


def test_a_tensor_given_twice_is_one_input_and_replays(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, y = _WithLabels(), torch.randn(2, 4), torch.randn(2, 4)
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, labels=x, name="same", save=tl.all())
    store.record(model, x, labels=y, name="apart", save=tl.all())
    same, apart = store["same"], store["apart"]
    # as TorchLens: model(ids, labels=ids) has one input, read by both of its uses
    assert [op.label for op in same.inputs] == ["input_1"]
    assert [op.label for op in apart.inputs] == ["input_1", "labels"]
    assert same["sub_1_2"].parents == ("linear_1_1", "input_1")
    for name, labels in (("same", x), ("apart", y)):
        report = store.replay(name, model)
        assert report.ok, name
        assert_bitwise(report.traces[0].output, model(x, labels=labels).detach(), name)


class _Noisy(nn.Module):
    """Random draws inside the forward: dropout in training mode and torch.randn_like."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        return h + 0.1 * torch.randn_like(h)


def test_a_forward_drawing_random_numbers_replays_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = _Noisy().train(), torch.randn(4, 8)
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="one")
    with store.recording("two", model):
        model(x)
        model(x + 1)
    log = tl.trace(model, x)
    store.record(model.fc, x, name="plain")
    # the replays draw what the recordings drew, and leave the user's generator as it was
    state = torch.get_rng_state()
    reports = [store.replay("one", model), store.replay("two", model), log.replay(model)]
    again = store.replay("two", model, name="two_again")
    assert torch.equal(torch.get_rng_state(), state)
    for report in [*reports, again]:
        assert report.ok, report.mismatches[:2]
        assert {row["status"] for row in report.rows} == {"same"}
    # a forward that draws nothing keeps no generator state in its run
    calls = store.query("select run, call from calls order by run, step").df()
    kept = {run: '"rng"' in call for run, call in zip(calls["run"], calls["call"], strict=True)}
    assert kept == {"one": True, "two": True, "two_again": True, "plain": False}


class _Mixed(nn.Module):
    """A BatchNorm kept in eval mode while the rest trains (a usual fine-tuning set-up),
    and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.fc(x)))


def test_a_replay_runs_the_modules_in_the_modes_they_were_recorded_in(tmp_path: Path) -> None:
    """A run recorded in training mode (dropout drawing) replayed after ``model.eval()``
    differed op by op from the first dropout on; each module's mode as the forward began
    is now kept with the call, set for the replay and given back after it."""
    torch.manual_seed(0)
    model, x = _Mixed().train(), torch.randn(4, 8)
    model.norm.eval()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="mixed")
    log = tl.trace(model, x)
    model.eval()  # as a user does before looking at results
    for report in (store.replay("mixed", model), log.replay(model)):
        assert report.ok, report.mismatches[:2]
    assert not any(m.training for m in model.modules())  # the user's modes are back
    calls = store.query("select call from calls where run = 'mixed'").df()["call"]
    assert json.loads(calls[0])["training"] == ["", "fc", "drop"]
    store.record(model, x, name="eval")
    calls = store.query("select call from calls where run = 'eval'").df()["call"]
    assert json.loads(calls[0])["training"] is False


def test_a_changed_model_is_reported_op_by_op(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="a")
    with torch.no_grad():
        model[2].weight[0, 0] += 1.0
    report = store.replay("a", model)
    assert not report.ok
    first = report.mismatches[0]
    assert first["label"] == "linear_2_3" and first["status"] == "differs"
    assert first["max_abs_diff"] > 0
    assert report.df()["status"].tolist()[:3] == ["same", "same", "same"]


def test_a_tampered_stored_input_is_detected(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    run = store.record(model, x, name="a")
    where = store.sql("select \"array\", byte_offset from ops where label = 'input_1'")
    array, offset = where.iloc[0]
    # rewrite four bytes through zarr itself: the checksums stay valid
    pack = zarr.open_array(store.paths.tensors(run.id) / array, mode="r+")
    pack[int(offset) : int(offset) + 4] = np.frombuffer(np.float32(7.0).tobytes(), np.uint8)
    clear_chunk_cache()
    reopened = tl.open(tmp_path / "s.tl", create=False)
    assert reopened.verify().problems == []  # no checksum can tell
    assert float(reopened["a"]["input_1"].out[0, 0]) == 7.0
    with pytest.raises(tl.ReplayError, match=r"input_1.*do not match the fingerprint"):
        reopened.replay("a", model)


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mode: object = None) -> torch.Tensor:
        return self.lin(x)


def test_what_cannot_be_replayed_is_said_before_the_model_runs(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="relus_only", save=tl.func("relu"))
    store.record(model, x, name="callable", intervene=tl.when(tl.func("relu"), _double))
    flagged = _Flagged().eval()
    store.record(flagged, torch.ones(2, 4), name="odd_arg", mode=object())
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(tl.ReplayError, match="input_1 were not saved"):
            store.replay("relus_only", model)
        with pytest.raises(tl.ReplayError, match=r"rule 0 .*_double"):
            store.replay("callable", model)
    finally:
        hook.remove()
    assert calls == []
    with pytest.raises(tl.ReplayError, match="argument of type object"):
        store.replay("odd_arg", flagged)
    source = tl.trace(model, x)
    log = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.patch_from(source)))
    with pytest.raises(tl.ReplayError, match="in-memory trace"):
        log.replay(model)


def _double(out: torch.Tensor, *, hook: object) -> torch.Tensor:
    return out * 2


def test_gpt2_replay_recorded_with_a_patch_reads_its_source_again(tmp_path: Path) -> None:
    model, (ids,) = gpt2()
    store = tl.open(tmp_path / "s.tl")
    rules = _rules("gpt2", store, model)
    store.record(model, ids, name="patched", intervene=rules, save=tl.none() | tl.label("input_1"))
    report = store.replay("patched", model)
    assert report.ok and report.compared == 1  # only the input was saved
    # the replay patched again: its block-1 output is the donor's
    replayed = report.traces[0]
    donor = store["gpt2_donor"]
    block = replayed["transformer.h.1"].output_labels[0]
    assert replayed[block].intervened
    assert_bitwise(replayed[block].out, donor[block].out)
