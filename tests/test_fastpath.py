"""Torch's fused fast paths survive recording: nn.MultiheadAttention,
nn.TransformerEncoderLayer and nn.TransformerEncoder (nested tensors under a padding
mask) return, while recorded, bitwise what a plain forward returns, in eval mode under
no_grad (the fast path), in eval mode with autograd on and in training (the Python path);
the fused call is one op; saved tensors read back bitwise, from memory and from a store
reopened in another process."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_store import run_python
from torch import nn

import tracelake as tl
from tracelake.recorder import fastpath

D, HEADS = 16, 4
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


class AttentionModel(nn.Module):
    """Self-attention as torchvision's and most encoders call it."""

    def __init__(self, need_weights: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.head = nn.Linear(D, D)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        y, weights = self.attn(x, x, x, key_padding_mask=mask, need_weights=self.need_weights)
        return (self.head(y), weights) if self.need_weights else self.head(y)


class LayerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.layer(x, src_key_padding_mask=mask).relu()


class EncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.1, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(layer, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=mask) * 2


class ViTBlock(nn.Module):
    """torchvision.models.vision_transformer.EncoderBlock, as written there."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(D, HEADS, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(D, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class ViT(nn.Module):
    """torchvision's VisionTransformer in small: patchify, class token, encoder, head."""

    def __init__(self, image: int = 16, patch: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, D, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.randn(1, 1, D))
        seq = (image // patch) ** 2 + 1
        self.pos_embedding = nn.Parameter(torch.randn(1, seq, D) * 0.02)
        self.layers = nn.Sequential(*[ViTBlock() for _ in range(layers)])
        self.ln = nn.LayerNorm(D, eps=1e-6)
        self.heads = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, D, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        x = self.ln(self.layers(x + self.pos_embedding))
        return self.heads(x[:, 0])


X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
#: Padding at the end of the second sequence (left-aligned: the nested-tensor path).
MASK = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
IMAGES = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))

CASES: dict[str, tuple[Callable[[], nn.Module], tuple, str | None]] = {
    "mha": (AttentionModel, (X,), fastpath.MHA_FUNC),
    "mha-mask": (AttentionModel, (X, MASK), fastpath.MHA_FUNC),
    "mha-weights": (lambda: AttentionModel(need_weights=True), (X,), fastpath.MHA_FUNC),
    "layer": (LayerModel, (X,), fastpath.LAYER_FUNC),
    "layer-mask": (LayerModel, (X, MASK), fastpath.LAYER_FUNC),
    "encoder": (EncoderModel, (X,), fastpath.LAYER_FUNC),
    "encoder-mask": (EncoderModel, (X, MASK), fastpath.ENCODER_FUNC),
    "vit": (ViT, (IMAGES,), fastpath.MHA_FUNC),
}
MODES = ("eval-no_grad", "eval", "train")


def _build(case: str, mode: str) -> tuple[nn.Module, tuple, str | None]:
    make, args, fused = CASES[case]
    torch.manual_seed(0)
    model = make().train(mode == "train")
    return model, args, fused if mode == "eval-no_grad" else None


def _forward(mode: str, call: Callable[[], Any]) -> Any:
    torch.manual_seed(7)  # dropout in training draws the same numbers each time
    if mode == "eval-no_grad":
        with torch.no_grad():
            return call()
    return call()


def _tensors(output: Any) -> list[torch.Tensor]:
    return [output] if isinstance(output, torch.Tensor) else [t for t in output if t is not None]


def _assert_bitwise(a: Any, b: Any) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.detach(), y.detach()), (x - y).abs().max()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_trace_output_is_a_plain_forwards_bitwise(case: str, mode: str) -> None:
    model, args, fused = _build(case, mode)
    plain = _forward(mode, lambda: model(*args))
    trace = _forward(mode, lambda: tl.trace(model, *args))
    _assert_bitwise(plain, trace.output)
    # What was saved is what was returned.
    saved = [op.out for op in trace.outputs]
    _assert_bitwise(plain, saved if len(saved) > 1 else saved[0])
    funcs = [op.func for op in trace]
    if fused is None:
        assert not set(funcs) & set(fastpath.FUSED_FUNCS)
        assert "linear" in funcs or "conv2d" in funcs  # the Python path, op by op
    else:
        assert fused in funcs
        op = trace.find(func=fused)[0]
        assert op.parents and op.parents[0].startswith(("input_", "layernorm", "add"))
        assert op.params  # the module's parameters are what it used
        assert op.saved and op.module  # inside its module's call


def test_one_op_per_fused_call() -> None:
    model, args, _ = _build("vit", "eval-no_grad")
    with torch.no_grad():
        trace = tl.trace(model, *args)
    fused = trace.find(func=fastpath.MHA_FUNC)
    assert [op.module for op in fused] == ["layers.0.self_attention", "layers.1.self_attention"]
    # Nothing is recorded inside the fused call: no op, no inner module call.
    assert not any(op.module.endswith("out_proj") for op in trace)
    assert "layers.0.self_attention.out_proj" not in trace
    attn = trace["layers.0.self_attention"]
    assert attn.first_op == attn.last_op == fused[0].label
    assert fused[0].children and fused[0].children[0].startswith("dropout")

    model, args, _ = _build("encoder-mask", "eval-no_grad")
    with torch.no_grad():
        trace = tl.trace(model, *args)
    (op,) = trace.find(func=fastpath.ENCODER_FUNC)
    assert op.module == "encoder" and op.parents == ("input_1", "input_2")
    assert "encoder.layers.0" not in trace  # inside the one fused op
    assert trace.output[1, 3:].eq(0).all()  # padded positions stay zero, as unrecorded


def test_fast_path_off_is_recorded_op_by_op() -> None:
    model, args, _ = _build("mha", "eval-no_grad")
    with torch.no_grad(), _fastpath_off():
        plain = model(*args)
        trace = tl.trace(model, *args)
    _assert_bitwise(plain, trace.output)
    assert not trace.find(func=fastpath.MHA_FUNC)


class _fastpath_off:
    def __enter__(self) -> None:
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch.backends.mha.set_fastpath_enabled(True)


_READ_BACK = r"""
import json, sys, torch, tracelake as tl
store = tl.open(sys.argv[1], create=False)
result = {}
for name in store:
    run = store[name]
    result[name] = {
        "funcs": [op.func for op in run],
        "outputs": [op.out.tolist() for op in run.outputs],
    }
print(json.dumps(result))
"""


def test_store_record_matches_plain_forwards_and_reads_back_elsewhere(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s.tl")
    expected = {}
    for case in ("mha", "layer-mask", "encoder-mask", "vit"):
        for mode in MODES:
            model, args, fused = _build(case, mode)
            plain = _forward(mode, lambda model=model, args=args: model(*args))
            name = f"{case}.{mode}"
            run = _forward(
                mode,
                lambda model=model, args=args, name=name: store.record(model, *args, name=name),
            )
            trace = _forward(mode, lambda model=model, args=args: tl.trace(model, *args))
            assert [op.func for op in run] == [op.func for op in trace]
            assert (fused in [op.func for op in run]) == (fused is not None)
            _assert_bitwise(plain, run.outputs[0].out)
            expected[name] = (_tensors(plain)[0], fused)
    done = run_python(_READ_BACK, str(tmp_path / "s.tl"))
    stored = json.loads(done.stdout)
    assert sorted(stored) == sorted(expected)
    for name, (plain, fused) in expected.items():
        out = torch.tensor(stored[name]["outputs"][0], dtype=plain.dtype)
        assert torch.equal(out, plain.detach()), name  # floats round-trip exactly in JSON
        assert (fused in stored[name]["funcs"]) == (fused is not None)
