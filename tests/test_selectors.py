"""Selectors choose what is saved; wrong arguments fail with a TypeError that says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tracelake as tl


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        h = self.encoder(h)  # two passes
        return self.decoder(h).relu()


def saved(save: tl.Selector) -> tuple[list[str], list[str]]:
    log = tl.trace(Net(), torch.randn(2, 4), save=save)
    return [op.label for op in log if op.saved], [m.label for m in log.modules if m.saved]


CASES = [
    (tl.func("relu"), ["relu_1_2:1", "relu_1_2:2", "relu_2_5", "relu_3_6"], []),
    (tl.func("linear") & tl.in_module("decoder"), ["linear_3_4"], []),
    (tl.in_module("decoder"), ["linear_3_4", "relu_2_5"], ["decoder", "decoder.0", "decoder.1"]),
    (tl.module("encoder.2", "decoder"), [], ["encoder.2:1", "encoder.2:2", "decoder"]),
    (tl.module("encoder:2"), [], ["encoder:2"]),
    (
        tl.label("relu_1_2:2", "linear_1_1", "input_1"),
        ["input_1", "linear_1_1:1", "relu_1_2:2", "linear_1_1:2"],
        [],
    ),
    (tl.label("encoder.0"), [], ["encoder.0:1", "encoder.0:2"]),
    (tl.none(), [], []),
    (tl.func("relu") & ~tl.in_module("encoder"), ["relu_2_5", "relu_3_6"], []),
    (tl.func("input", "output") | tl.module("decoder.1"), ["input_1", "output_1"], ["decoder.1"]),
]


@pytest.mark.parametrize(("selector", "ops", "modules"), CASES, ids=[repr(c[0]) for c in CASES])
def test_selector_saves_exactly(selector: tl.Selector, ops: list[str], modules: list[str]) -> None:
    got_ops, got_modules = saved(selector)
    assert sorted(got_ops) == sorted(ops)
    assert sorted(got_modules) == sorted(modules)


def test_default_saves_everything() -> None:
    log = tl.trace(Net(), torch.randn(2, 4))
    assert all(op.saved for op in log)
    assert all(m.saved for m in log.modules)
    assert saved(tl.all()) == ([op.label for op in log], log.module_labels)


def test_in_module_is_a_path_prefix_on_dot_boundaries() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(2, 2)
            self.encoder = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.encoder(self.enc(x))

    log = tl.trace(Two(), torch.randn(1, 2), save=tl.in_module("enc"))
    assert [op.label for op in log if op.saved] == ["linear_1_1"]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tl.func(), "at least one name"),
        (lambda: tl.func("relu", 3), "takes strings, got int 3"),
        (lambda: tl.in_module(["encoder"]), "got list"),
        (lambda: tl.module(None), "got NoneType"),
        (lambda: tl.label(b"relu_1_1"), "got bytes"),
        (lambda: tl.func("relu") | "linear", "unsupported operand"),
        (lambda: tl.func("relu") & 1, "unsupported operand"),
        (lambda: tl.trace(Net(), torch.randn(2, 4), save="relu"), "save= takes a selector"),
        (lambda: tl.trace(lambda x: x, torch.randn(2)), "torch.nn.Module"),
    ],
)
def test_wrong_types_raise_type_error(build, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        build()


def test_bad_stats_option() -> None:
    with pytest.raises(ValueError, match="stats= takes 'saved' or 'all'"):
        tl.trace(Net(), torch.randn(2, 4), stats="everything")


def test_selectors_have_readable_reprs() -> None:
    selector = tl.func("relu") & ~tl.in_module("encoder") | tl.label("input_1")
    assert repr(selector) == "((tl.func('relu') & ~tl.in_module('encoder')) | tl.label('input_1'))"


class _SinLoop(torch.nn.Module):
    """A parameter-free loop: TorchLens's grouping makes its ops passes of one layer
    only once the forward is over."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.sin(x) * 2
        return x


def test_a_label_read_from_a_trace_selects_that_op_in_the_next_recording() -> None:
    model, x = _SinLoop(), torch.randn(4)
    first = tl.trace(model, x, save=tl.none())
    sins = [op.label for op in first if op.func == "sin"]
    assert sins == ["sin_1_1:1", "sin_1_1:2", "sin_1_1:3"]  # TorchLens's labels
    again = tl.trace(model, x, save=tl.label("sin_1_1:2"))
    assert [op.label for op in again if op.saved] == ["sin_1_1:2"]
    every_pass = tl.trace(model, x, save=tl.label("sin_1_1"))
    assert [op.label for op in every_pass if op.saved] == sins
