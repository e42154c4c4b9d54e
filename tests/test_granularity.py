"""What a recording makes of composite torch functions, pass-through modules, in-place
writes through views and repeated arguments (TorchLens's graph: docs/architecture.md,
"Labels and passes"), seen by a user: labels, parents, saved values, a stored run."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tracelake as tl


class _Function(nn.Module):
    """A plain function as a model."""

    def __init__(self, function: Any) -> None:
        super().__init__()
        self.function = function

    def forward(self, *args: Any) -> Any:
        return self.function(*args)


class _Composite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.normalize(x, dim=-1) * 2
        first, rest = y.split([3, 5], dim=-1)
        z = self.attn(y, y, y, need_weights=False)[0]
        return z + F.mse_loss(first, rest[..., :3])


def test_composite_functions_record_the_calls_inside() -> None:
    torch.manual_seed(0)
    model, x = _Composite().train(), torch.randn(2, 4, 8)
    torch.manual_seed(1)
    expected = model(x)
    torch.manual_seed(1)
    trace = tl.trace(model, x)
    assert torch.equal(trace["output_1"].out, expected)
    labels = trace.labels
    assert labels[1:5] == ["vectornorm_1_1", "clampmin_1_2", "expandas_1_3", "truediv_1_4"]
    assert "normalize" not in {op.func for op in trace}
    assert "splitwithsizes_1_6" in labels and "scaleddotproductattention_1_20" not in labels
    assert any(label.startswith("scaleddotproductattention_") for label in labels)
    assert any(label.startswith("mseloss_") for label in labels)
    norm, _, expand, div = (trace[label] for label in labels[1:5])
    assert div.parents == ("input_1", expand.label)
    assert torch.equal(div.out, x / norm.out.clamp_min(1e-12).expand_as(x))
    # the functions inside are selectable by either name
    picked = tl.trace(model, x, save=tl.func("vector_norm", "truediv"))
    assert [op.label for op in picked if op.out is not None] == [norm.label, div.label]


def test_a_function_dispatching_again_is_one_op() -> None:
    # Tensor.unflatten's body calls its base class, which dispatches to the mode again
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (2, 3)).sum(-1)

    x = torch.randn(4, 6)
    for _ in range(2):
        trace = tl.trace(_Function(forward), x)
        assert trace.labels == ["input_1", "unflatten_1_1", "sum_1_2", "output_1"]
        assert torch.equal(trace["output_1"].out, forward(x))


class _PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Identity()
        self.keep = _Keep()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.keep(self.skip(x)))


class _Keep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _view_writes(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.unsqueeze(0).fill_(0)
    z = y + 1
    y[1:].mul_(3)
    return z * y * y


def _check_graph(run: Any) -> None:
    assert run.labels == [
        "input_1",
        "clone_1_1",
        "unsqueeze_1_2",
        "fill_1_3",
        "add_1_4",
        "getitem_1_5",
        "mul_1_6",
        "mul_2_7",
        "mul_3_8",
        "output_1",
    ]
    assert run["add_1_4"].parents == ("fill_1_3",)
    assert run["mul_2_7"].parents == ("add_1_4", "mul_1_6")
    assert run["mul_3_8"].parents == ("mul_2_7", "mul_1_6")  # y read after y[1:] *= 3
    assert torch.equal(run["fill_1_3"].out, torch.zeros(1, 3, 4))
    assert torch.equal(run["add_1_4"].out, torch.ones(3, 4))


def test_pass_through_modules_views_and_repeated_arguments(tmp_path: Any) -> None:
    model, x = _PassThrough(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    assert trace.labels == ["input_1", "identity_1_1", "identity_2_2", "linear_1_3", "output_1"]
    assert trace["identity_1_1"].module == "skip"
    assert trace["identity_2_2"].parents == ("identity_1_1",)
    assert trace["identity_2_2"].module == "keep"
    assert trace["keep"].output_labels == ("identity_2_2",)
    assert torch.equal(trace["output_1"].out, model(x))

    x = torch.randn(3, 4)
    trace = tl.trace(_Function(_view_writes), x)
    _check_graph(trace)
    assert torch.equal(trace["output_1"].out, _view_writes(x))

    def square(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x * x, x])

    assert tl.trace(_Function(square), x)["mul_1_1"].parents == ("input_1", "input_1")
    assert tl.trace(_Function(square), x)["cat_1_2"].parents == ("mul_1_1", "input_1")

    store = tl.open(tmp_path / "runs.tl")
    store.record(_Function(_view_writes), x, name="views")
    _check_graph(tl.open(tmp_path / "runs.tl")["views"])
