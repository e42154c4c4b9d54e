"""The recorder never breaks the user's model and leaves nothing behind."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.overrides import _get_current_function_mode_stack

import tracelake as tl


def global_state() -> tuple:
    return (
        len(_get_current_function_mode_stack()),
        dict(nn_module._global_forward_hooks),
        dict(nn_module._global_forward_pre_hooks),
        dict(nn_module._global_forward_hooks_always_called),
        torch._C._is_torch_function_enabled(),
    )


class Boom(Exception):
    pass


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        if x.sum() > -1e9:
            raise Boom("mid-forward")
        return x


def test_forward_that_raises_leaves_no_state_behind() -> None:
    before = global_state()
    model = Exploding()
    with pytest.raises(Boom, match="mid-forward"):
        tl.trace(model, torch.randn(1, 2))
    assert global_state() == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # the next recording starts clean
    log = tl.trace(model.inner, torch.randn(1, 2))
    assert log.labels == ["input_1", "linear_1_1", "relu_1_2", "output_1"]
    assert global_state() == before


def test_exception_caught_inside_the_model_keeps_the_module_stack_right() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 2
            raise Boom

    class Catches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fails = Fails()
            self.after = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:  # noqa: SIM105 - the model's own control flow is what is under test
                self.fails(x)
            except Boom:
                pass
            return self.after(x)

    log = tl.trace(Catches(), torch.randn(1, 2))
    assert log["mul_1_1"].module == "fails"
    assert log["linear_1_2"].modules == (("after", 1),)


def test_recordings_refuse_to_nest() -> None:
    class Nested(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tl.trace(nn.Identity(), x)
            return x

    before = global_state()
    with pytest.raises(tl.NestedTraceError, match="cannot be nested"):
        tl.trace(Nested(), torch.randn(2))
    assert global_state() == before


def test_other_threads_are_not_recorded() -> None:
    import threading

    other = nn.Linear(2, 2)
    done = threading.Event()
    go = threading.Event()

    def run_other() -> None:
        go.wait()
        for _ in range(50):
            other(torch.randn(1, 2))
        done.set()

    class Waits(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            go.set()
            done.wait(timeout=30)
            return x + 1

    thread = threading.Thread(target=run_other)
    thread.start()
    log = tl.trace(Waits(), torch.randn(2))
    thread.join()
    assert [op.func for op in log] == ["input", "add", "output"]
    assert log.modules == []


class Fragile(torch.Tensor):
    """A tensor subclass that refuses to be copied or aliased: the recorder cannot save it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.clone, torch.Tensor.detach):
            raise RuntimeError("this tensor cannot be copied")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_what_cannot_be_recorded_is_warned_about_not_raised() -> None:
    class UsesFragile(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.as_subclass(Fragile) * 2
            return y.as_subclass(torch.Tensor) + 1

    x = torch.randn(3)
    with pytest.warns(tl.TraceLakeWarning, match="could not fully record"):
        log = tl.trace(UsesFragile(), x)
    assert torch.equal(log.output, x * 2 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tl.trace(UsesFragile(), x, save=tl.func("add"))  # nothing fragile is copied


def test_the_model_is_unchanged() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU()).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3)
    torch.manual_seed(0)
    log = tl.trace(model, x)
    # train mode ran as usual: running stats moved exactly as a plain forward moves them
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU()).train()
    plain.load_state_dict(state)
    torch.manual_seed(0)
    expected = plain(x)
    assert torch.equal(log.output, expected)
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert model.training
