"""Saved values are exactly the values at the time, whatever happens to the live tensors.

The recorder keeps saved tensors as aliases until something could change them; these
tests change them every way a model or a user can, and check the saved bits never move.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tracelake as tl


def test_inplace_write_through_a_view_does_not_reach_saved_values() -> None:
    class ViewWrites(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x * 2
            row = a[0]
            row.zero_()  # writes into a's storage through a view
            flat = a.view(-1)
            a.add_(1)  # writes into flat's storage
            return flat

    x = torch.ones(2, 3)
    log = tl.trace(ViewWrites(), x)
    assert torch.equal(log["mul_1_1"].out, torch.full((2, 3), 2.0))
    assert torch.equal(log["getitem_1_2"].out, torch.full((3,), 2.0))
    assert torch.equal(log["zero_1_3"].out, torch.zeros(3))
    assert torch.equal(log["view_1_4"].out, torch.tensor([0.0] * 3 + [2.0] * 3))
    assert torch.equal(log["add_1_5"].out, torch.tensor([[1.0] * 3, [3.0] * 3]))
    assert torch.equal(log["output_1"].out, torch.tensor([1.0] * 3 + [3.0] * 3))


def test_setitem_and_out_arguments_are_writes_too() -> None:
    class Writes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x + 0
            a[1] = 7.0
            b = x * 1
            torch.mul(x, 3, out=b)
            return a + b

    x = torch.ones(2)
    log = tl.trace(Writes(), x)
    assert torch.equal(log["add_1_1"].out, torch.ones(2))
    assert torch.equal(log["setitem_1_2"].out, torch.tensor([1.0, 7.0]))
    assert torch.equal(log["mul_1_3"].out, torch.ones(2))
    assert torch.equal(log["mul_2_4"].out, torch.full((2,), 3.0))


def test_user_writes_after_the_trace_do_not_reach_it() -> None:
    class Caches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.cache: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc(x))
            self.cache = h  # kept by the model after the forward
            return h.sum(dim=0)

    model = Caches()
    x = torch.randn(2, 3)
    x_before = x.clone()
    with torch.no_grad():
        expected_h = torch.tanh(model.fc(x))
        log = tl.trace(model, x)
        x.add_(100)
        log.output.mul_(0)
        model.cache.zero_()
        model.fc.weight.zero_()
    assert torch.equal(log["input_1"].out, x_before)
    assert torch.equal(log["tanh_1_2"].out, expected_h)
    assert torch.equal(log["output_1"].out, expected_h.sum(dim=0))
    assert log.output.abs().sum() == 0  # the user's own tensor is theirs to change


def test_views_of_parameters_survive_an_optimizer_step() -> None:
    class UsesTranspose(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.t()

    model = UsesTranspose()
    before = model.w.detach().t().clone()
    log = tl.trace(model, torch.randn(2, 3))
    log.output.sum().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert not torch.equal(model.w.detach().t(), before)
    assert torch.equal(log["t_1_1"].out, before)


def test_a_write_the_recorder_cannot_see_drops_the_value_with_a_warning() -> None:
    class Sneaky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x * 2
            with torch._C.DisableTorchFunction():
                a.add_(1)  # invisible to any torch function mode
            return a * 1

    x = torch.ones(2)
    with pytest.warns(tl.TraceLakeWarning, match="mul_1_1 was written in place"):
        log = tl.trace(Sneaky(), x)
    assert not log["mul_1_1"].saved and log["mul_1_1"].out is None
    assert torch.equal(log["mul_2_2"].out, torch.full((2,), 3.0))


def test_small_views_of_large_tensors_do_not_keep_them_alive() -> None:
    class Corner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 1)[:2, :2]

    log = tl.trace(Corner(), torch.randn(256, 256), save=tl.func("getitem"))
    saved = log["getitem_1_2"].out
    assert saved.untyped_storage().nbytes() == 2 * 2 * 4
    assert log.nbytes_saved == 16


def test_save_all_shares_memory_between_views_and_their_bases() -> None:
    class Views(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            return y.view(-1).reshape(4, 64).t()

    x = torch.randn(16, 16)
    log = tl.trace(Views(), x)
    # x (the user's) is copied; exp's result and its three views share one storage.
    assert log.nbytes_saved == 2 * 16 * 16 * 4
    assert torch.equal(log.output, log["output_1"].out)
