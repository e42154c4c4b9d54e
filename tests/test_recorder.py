"""Capture semantics of tl.trace: op resolution, labels, edges, sources, in-place safety."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracelake as tl

torch.manual_seed(0)


class Functional(nn.Module):
    """Ops that no module hook sees: operators, Tensor methods, functional calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        h = h + x
        h = h @ h.T
        h = h.softmax(-1)
        q = h.view(1, 1, 4, 4)
        h = F.scaled_dot_product_attention(q, q, q)
        return F.gelu(h).sum(dim=-1)


def func_of(log: tl.Trace) -> list[str]:
    return [op.func for op in log]


def test_functional_ops_are_recorded_with_plain_names() -> None:
    log = tl.trace(Functional(), torch.randn(4, 8))
    assert func_of(log) == [
        "input",
        "linear",
        "relu",
        "add",
        "T",
        "matmul",
        "softmax",
        "view",
        "scaled_dot_product_attention",
        "gelu",
        "sum",
        "output",
    ]
    assert log.labels == [
        "input_1",
        "linear_1_1",
        "relu_1_2",
        "add_1_3",
        "t_1_4",
        "matmul_1_5",
        "softmax_1_6",
        "view_1_7",
        "scaleddotproductattention_1_8",
        "gelu_1_9",
        "sum_1_10",
        "output_1",
    ]
    assert log["linear_1_1"].module == "fc"
    assert log["relu_1_2"].module == ""
    assert log["linear_1_1"].params == ("fc.weight", "fc.bias")


def test_calls_without_tensor_results_are_not_ops() -> None:
    class Sizes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.size(0) + x.dim() + x.shape[1] + int(x.numel())
            return x * n

    log = tl.trace(Sizes(), torch.ones(2, 3))
    assert func_of(log) == ["input", "mul", "output"]


def test_operators_and_inplace_names() -> None:
    class Ops(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = 2 - x  # __rsub__
            y = y / 3
            y += 1
            y[0] = 0
            return -y

    log = tl.trace(Ops(), torch.ones(3))
    # The func column: torch's names, and an operator's own name where it has one.
    assert func_of(log)[1:-1] == ["rsub", "truediv", "iadd", "setitem", "neg"]
    # Labels in TorchLens's spelling (its names for x / 3 and y += 1).
    assert log.labels[1:-1] == ["rsub_1_1", "truediv_1_2", "iadd_1_3", "setitem_1_4", "neg_1_5"]
    assert [op.inplace for op in log][1:-1] == [False, False, True, True, False]
    # in-place ops consume the tensor they overwrite
    assert log["setitem_1_4"].parents == ("iadd_1_3",)
    assert log["neg_1_5"].parents == ("setitem_1_4",)


def test_multi_output_calls_give_one_entry_per_tensor() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = x.chunk(2)
            values, _ = x.max(dim=0)
            return a * b + values

    log = tl.trace(Split(), torch.randn(4, 3))
    chunks = log.find(func="chunk")
    assert [op.label for op in chunks] == ["chunk_1_1", "chunk_2_2"]
    assert [op.out_index for op in chunks] == [0, 1]
    assert [op.label for op in log.find(func="max")] == ["max_1_3", "max_2_4"]
    assert log["mul_1_5"].parents == ("chunk_1_1", "chunk_2_2")


def test_edges_form_the_dataflow_graph() -> None:
    class Diamond(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x.sin()
            b = x.cos()
            return torch.cat([a, b * b])

    log = tl.trace(Diamond(), torch.randn(3))
    assert log["input_1"].children == ("sin_1_1", "cos_1_2")
    assert log["mul_1_3"].parents == ("cos_1_2", "cos_1_2")  # one per argument
    assert log["mul_1_3"].parent_args == ("0", "1")  # the same tensor at both positions
    assert log["cat_1_4"].parents == ("sin_1_1", "mul_1_3")
    assert log["cat_1_4"].parent_args == ("0.0", "0.1")
    assert log["output_1"].parents == ("cat_1_4",)
    for op in log:
        for parent in op.parents:
            assert op.label in log[parent].children
        for child in op.children:
            assert op.label in log[child].parents


def test_source_points_at_the_user_line() -> None:
    class Here(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)  # the line the source must name

    log = tl.trace(Here(), torch.randn(2))
    source = log["tanh_1_1"].source
    lines, start = inspect.getsourcelines(Here.forward)
    expected_line = start + next(i for i, line in enumerate(lines) if "torch.tanh" in line)
    assert source.file == __file__
    assert source.line == expected_line
    assert source.function == "forward"
    assert str(source) == f"{__file__}:{expected_line}"
    # an op issued inside torch's own modules is attributed to the user's call site
    linear = tl.trace(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2))["linear_1_1"]
    assert linear.source.file == __file__


def test_saved_tensors_survive_later_inplace_ops() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    x = torch.randn(5, 6)
    with torch.no_grad():
        expected = model[0](x).clone()
        log = tl.trace(model, x)
    linear = log["linear_1_1"]
    assert torch.equal(linear.out, expected)  # relu_ ran in place on that very tensor
    assert (expected < 0).any()
    relu = log["relu_1_2"]
    assert relu.func == "relu_" and relu.inplace
    assert torch.equal(relu.out, torch.relu(expected))
    assert torch.equal(log["0"].out, expected)  # the module's output, as it was at the time
    assert torch.equal(log["1"].inputs[0], expected)


def test_saved_copies_are_detached_and_independent() -> None:
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    log = tl.trace(model, x)
    saved = log["linear_1_1"].out
    assert not saved.requires_grad
    assert saved.data_ptr() != log.output.data_ptr()
    log.output.sum().backward()  # the user's graph is intact
    assert x.grad is not None


def test_model_output_and_gradients_are_bitwise_unchanged() -> None:
    torch.manual_seed(1)
    model = Functional()
    x = torch.randn(4, 8, requires_grad=True)
    plain = model(x)
    plain.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    log = tl.trace(model, x)
    assert torch.equal(log.output, plain)
    log.output.sum().backward()
    for expected, param in zip(grads, model.parameters(), strict=True):
        assert torch.equal(param.grad, expected)


def test_module_entries_and_inputs() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    model, x = Net(), torch.randn(2, 4)
    log = tl.trace(model, x, save=tl.in_module("encoder"))
    with torch.no_grad():
        encoded = model.encoder(x)
    assert torch.equal(log["encoder"].out, encoded)
    assert torch.equal(log["encoder"].inputs[0], x)
    assert log["encoder"].input_labels == ("input_1",)
    assert log["encoder"].output_labels == ("relu_2_4",)
    assert log["encoder"].first_op == "linear_1_1"
    assert log["encoder"].last_op == "relu_2_4"
    assert log["encoder.layers.1"].type == "Linear"
    assert log["linear_2_3"].modules == (("encoder", 1), ("encoder.layers.1", 1))
    assert log["linear_3_5"].out is None and not log["linear_3_5"].saved  # the head
    assert log["head"].out is None


def test_repeated_module_calls_share_layers_and_count_passes() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
            self.out = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = self.cell(x) + x
            return self.out(x)

    log = tl.trace(Loop(), torch.randn(2, 3))
    # TorchLens's labels: the add in the loop body is a pass of one layer too.
    assert log.labels == [
        "input_1",
        "linear_1_1:1",
        "tanh_1_2:1",
        "add_1_3:1",
        "linear_1_1:2",
        "tanh_1_2:2",
        "add_1_3:2",
        "linear_1_1:3",
        "tanh_1_2:3",
        "add_1_3:3",
        "linear_2_4",
        "output_1",
    ]
    assert log["linear_1_1:2"].pass_num == 2
    assert log["linear_1_1:2"].num_passes == 3
    assert log["linear_1_1:2"].modules == (("cell", 2), ("cell.0", 2))
    assert log.module_labels[:3] == ["cell:1", "cell.0:1", "cell.1:1"]
    with pytest.raises(tl.AmbiguousLabelError) as err:
        log["linear_1_1"]
    assert "'linear_1_1:1', 'linear_1_1:2', 'linear_1_1:3'" in str(err.value)
    assert isinstance(err.value, KeyError)
    with pytest.raises(tl.AmbiguousLabelError, match="'cell:2'"):
        log["cell"]
    assert torch.equal(log["cell:3"].out, log["tanh_1_2:3"].out)


def test_unknown_labels_suggest_close_ones() -> None:
    log = tl.trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(1, 2))
    with pytest.raises(tl.LabelError, match="did you mean 'relu_1_2'") as err:
        log["relu_1_3"]
    assert isinstance(err.value, KeyError)
    assert isinstance(err.value, tl.TraceLakeError)
    with pytest.raises(tl.LabelError):
        log[99]
    assert log[1].label == "linear_1_1"
    assert "relu_1_2" in log and "0" in log and "nope" not in log
    with pytest.raises(TypeError):
        log[1.5]  # type: ignore[index]


def test_dtypes_and_non_float_tensors() -> None:
    class Mixed(nn.Module):
        def forward(self, x: torch.Tensor):
            idx = x.argmax(dim=-1)
            mask = x > 0
            spectrum = torch.fft.fft(x)
            half = x.to(torch.bfloat16) * 2
            return idx, mask, spectrum.abs(), half, mask.sum()

    x = torch.randn(3, 4)
    log = tl.trace(Mixed(), x, stats="all")
    dtypes = {op.func: op.dtype for op in log}
    assert dtypes["argmax"] == torch.int64
    assert dtypes["gt"] == torch.bool
    assert dtypes["fft_fft"] == torch.complex64
    assert dtypes["mul"] == torch.bfloat16
    assert [op.label for op in log.outputs] == [f"output_{i}" for i in range(1, 6)]
    plain = Mixed()(x)
    for entry, expected in zip(log.outputs, plain, strict=True):
        assert entry.out.dtype == expected.dtype
        assert torch.equal(entry.out, expected)
    mask = log.find(func="gt")[0].stats
    assert mask.mean == pytest.approx((x > 0).float().mean().item())
    spectrum = log.find(func="fft_fft")[0].stats
    assert spectrum.mean is None and spectrum.absmax == pytest.approx(
        torch.fft.fft(x).abs().max().item()
    )


def test_stats_match_torch_and_follow_the_stats_option() -> None:
    x = torch.randn(64, 16)
    x[0, 0] = 0.0
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    log = tl.trace(model, x, save=tl.func("relu"))
    relu = log["relu_1_2"]
    out = relu.out
    stats = relu.stats
    assert stats.mean == pytest.approx(out.mean().item())
    assert stats.std == pytest.approx(out.std(correction=0).item())
    assert stats.min == out.min().item() and stats.max == out.max().item()
    assert stats.absmax == out.abs().max().item()
    assert stats.l2 == pytest.approx(out.norm().item())
    assert stats.frac_zero == (out == 0).float().mean().item()
    assert stats.nan_count == 0 and stats.inf_count == 0
    assert log["linear_1_1"].stats is None  # neither saved nor asked for
    all_stats = tl.trace(model, x, save=tl.none(), stats="all")
    assert all_stats["linear_1_1"].stats is not None
    assert all_stats["relu_1_2"].out is None
    # Unsaved small tensors' statistics are gathered and reduced in float64: the same
    # numbers, rounded better than float32 reductions of the saved tensor.
    unsaved, exact = all_stats["relu_1_2"].stats, out.double()
    for field in ("mean", "std", "min", "max", "absmax", "l2", "frac_zero"):
        assert getattr(unsaved, field) == pytest.approx(getattr(stats, field), rel=1e-6)
    assert unsaved.mean == pytest.approx(exact.mean().item(), rel=1e-12)
    assert unsaved.std == pytest.approx(exact.std(correction=0).item(), rel=1e-12)
    assert unsaved.l2 == pytest.approx(exact.norm().item(), rel=1e-12)
    assert (unsaved.nan_count, unsaved.inf_count) == (0, 0)


def test_nan_and_inf_are_counted() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    log = tl.trace(Bad(), torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    stats = log["log_1_1"].stats
    assert stats.nan_count == 1 and stats.inf_count == 1
    assert stats.absmax != stats.absmax  # NaN propagates


def test_cleanup_frees_tensors_but_keeps_metadata() -> None:
    log = tl.trace(nn.Linear(2, 2), torch.randn(1, 2), save=tl.func("linear"))
    assert log.nbytes_saved == 8
    log.cleanup()
    assert log["linear_1_1"].shape == (1, 2)
    with pytest.raises(tl.RecorderError, match="cleanup"):
        _ = log["linear_1_1"].out
    assert log["input_1"].out is None  # never saved: still just None
    assert log.nbytes_saved == 0
    with tl.trace(nn.Linear(2, 2), torch.randn(1, 2)) as scoped:
        assert scoped["linear_1_1"].out is not None
    with pytest.raises(tl.RecorderError):
        _ = scoped["linear_1_1"].out


def test_tensors_created_inside_forward_and_kwargs_inputs() -> None:
    class Positions(nn.Module):
        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[-1], dtype=x.dtype)
            return (x + pos) * scale

    log = tl.trace(Positions(), torch.zeros(2, 3), scale=torch.tensor(2.0))
    assert [op.label for op in log.inputs] == ["input_1", "scale"]  # keywords by name
    assert log["arange_1_1"].parents == ()
    assert log["mul_1_3"].parents == ("add_1_2", "scale")
    assert torch.equal(log.output, torch.tensor([[0.0, 2.0, 4.0]] * 2))


def test_iterating_a_tensor_records_the_unbind() -> None:
    class Rows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([row * i for i, row in enumerate(x)])

    x = torch.randn(3, 2)
    log = tl.trace(Rows(), x)
    assert [op.label for op in log][1:4] == ["unbind_1_1", "unbind_2_2", "unbind_3_3"]
    assert log["stack_1_7"].parents == ("mul_1_4", "mul_2_5", "mul_3_6")
    assert torch.equal(log.output, Rows()(x))


def test_labels_use_torchlens_spelling_and_func_selects_either_name() -> None:
    class Spelled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm(x).div(2) / 3
            y = y + torch.zeros_like(y) + torch.fft.fft(y).real + y.T + y.data
            y %= 5
            return y.add_(1)

    x = torch.randn(4, 4)
    log = tl.trace(Spelled(), x)
    assert log.labels[1:-1] == [
        "layernorm_1_1",
        "div_1_2",
        "truediv_1_3",
        "zeroslike_1_4",
        "add_1_5",
        "fft_1_6",
        "real_1_7",
        "add_2_8",
        "t_1_9",
        "add_3_10",
        "detach_1_11",
        "add_4_12",
        "imod_1_13",
        "add_5_14",
    ]
    funcs = [op.func for op in log][1:-1]
    assert funcs[:3] == ["layer_norm", "div", "truediv"] and funcs[-2:] == ["imod", "add_"]
    for torch_name, torchlens_name in [
        ("layer_norm", "layernorm"),
        ("zeros_like", "zeroslike"),
        ("div", "truediv"),
        ("fft_fft", "fft"),
        ("remainder", "imod"),
    ]:
        a = tl.trace(Spelled(), x, save=tl.func(torch_name))
        b = tl.trace(Spelled(), x, save=tl.func(torchlens_name))
        saved = [op.label for op in a if op.saved]
        assert saved and saved == [op.label for op in b if op.saved], torch_name
    div = tl.trace(Spelled(), x, save=tl.func("div"))
    assert [op.label for op in div if op.saved] == ["div_1_2", "truediv_1_3"]
