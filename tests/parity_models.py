"""Small models, one per kind of graph, that tracelake and TorchLens must label alike
(tests/test_torchlens_parity.py). Each builder returns ``(model, inputs)``; the model
is in eval mode unless its name says train, and seeded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Builder = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
MODELS: dict[str, Builder] = {}


def model(*shapes: tuple[int, ...], train: bool = False) -> Callable[[type], type]:
    """Register a module class built without arguments, with random inputs of these
    shapes."""

    def register(cls: type) -> type:
        def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
            torch.manual_seed(0)
            module = cls()
            module.train(train)
            return module, tuple(torch.randn(*shape) for shape in shapes)

        MODELS[cls.__name__] = build
        return cls

    return register


class _Fn(nn.Module):
    """A model whose forward is a plain function of its inputs."""

    fn: Callable[..., object]

    def forward(self, *xs: torch.Tensor) -> object:
        return type(self).fn(*xs)


def functional(name: str, *shapes: tuple[int, ...]) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        cls = type(name, (_Fn,), {"fn": staticmethod(fn)})
        model(*shapes)(cls)
        return fn

    return register


# -- function-name spelling ---------------------------------------------------------------


@functional("Operators", (4, 4))
def _operators(x: torch.Tensor) -> torch.Tensor:
    a = x / 2 + (1 + x) - x // 3 + x % 2 + (-x) + x @ x.T + x**2
    b = x.div(2) + x.mul(3) + x.sub(1) + x.add(1) + torch.abs(x)
    return a * b


@functional("InplaceOperators", (4, 4))
def _inplace_operators(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y += 1
    y *= 2
    y -= 0.5
    y /= 3
    y.add_(1).mul_(2)
    y //= 0.5  # (through torch.floor_divide_ and pow_, named for the operator)
    y **= 2
    return y


@functional("Comparisons", (4, 4))
def _comparisons(x: torch.Tensor) -> torch.Tensor:
    mask = (x > 0) & (x < 1) | (x == 0.5)
    return torch.where(~mask, x, torch.zeros_like(x)) + mask.float()


@model((2, 3, 8, 8))
class Spelling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.ln = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.bn(self.conv(x)))
        y = self.ln(y.permute(0, 2, 3, 1))
        z = torch.zeros_like(y) + torch.ones_like(y)
        return F.adaptive_avg_pool2d(y + z, 1).flatten(1)


@functional("Namespaces", (4, 8))
def _namespaces(x: torch.Tensor) -> torch.Tensor:
    spectrum = torch.fft.fft(x).abs()
    return torch.special.expit(spectrum) + torch.linalg.vector_norm(x, dim=-1, keepdim=True)


@functional("Properties", (4, 4))
def _properties(x: torch.Tensor) -> torch.Tensor:
    return x.T + x.mT + x.data + x.t() + x.detach()


@functional("ViewsAndShapes", (2, 3, 4))
def _views(x: torch.Tensor) -> torch.Tensor:
    y = x.view(6, 4).reshape(2, 12).unsqueeze(0).squeeze(0)
    z = x.permute(2, 0, 1).contiguous().flatten().expand(2, 24)
    return torch.cat([y, z[:, :12]], dim=0).transpose(0, 1)


@functional("Reductions", (4, 6))
def _reductions(x: torch.Tensor) -> torch.Tensor:
    values, indices = x.max(dim=1)
    return x.sum() + x.mean(0).sum() + values.sum() + indices.float().sum() + x.std()


@functional("Chunks", (4, 6))
def _chunks(x: torch.Tensor) -> torch.Tensor:
    a, b, c = x.chunk(3, dim=1)
    d, e = torch.split(x, [2, 4], dim=1)
    return a * b + c - d + e[:, :2]


# -- loops without parameters ---------------------------------------------------------------


@functional("LoopSinMul", (2, 4))
def _loop_sin_mul(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = torch.sin(x)
        x = x * 2
    return x / 3


@functional("LoopScalarArgs", (2, 4))
def _loop_scalar_args(x: torch.Tensor) -> torch.Tensor:
    for i in range(3):  # the scalar differs per iteration: no loop for TorchLens
        x = torch.sin(x) * (i + 1)
    return x


@functional("LoopKeywordArgs", (2, 4))
def _loop_keyword_args(x: torch.Tensor) -> torch.Tensor:
    for i in range(3):  # a keyword that differs per iteration: no loop for TorchLens
        x = torch.clamp(x.sin(), min=-0.5 * i)
    return x


@functional("LoopSameScalarArgs", (2, 4))
def _loop_same_scalar_args(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):  # the same float and keywords each time: one loop of passes
        x = torch.clamp(x * 0.5, min=-1.0, max=1.0).cos()
    return x


@functional("LoopContainerArgs", (3, 3))
def _loop_container_args(x: torch.Tensor) -> torch.Tensor:
    for dims in ((1, 0), (0, 1), (1, 0)):  # a tuple argument, hashed item by item
        x = x.permute(dims).sin()
    for d in (0, 1):  # torch.cat([x, x], dim=d): a list of tensors and a keyword
        x = torch.cat([x, x], dim=d).tanh()
    return x.sum(dim=[0, 1], keepdim=True)


@model((1, 2, 8, 8))
class LoopParamArgs(nn.Module):
    """One kernel called with padding 1 twice, then padding 2: TorchLens splits the
    layer by the non-tensor arguments of the calls of one parameter set."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for padding in (1, 1, 2):
            x = F.conv2d(x, self.conv.weight, self.conv.bias, padding=padding).relu()
        return x


@functional("LoopSingleOp", (2, 4))
def _loop_single(x: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.tanh(x)
    return x


@functional("LoopThreeOps", (2, 4))
def _loop_three(x: torch.Tensor) -> torch.Tensor:
    for _ in range(5):
        x = (x + 1).relu().sin()
    return x


@functional("NestedLoops", (2, 4))
def _nested(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        for _ in range(3):
            x = x.cos() * 0.5
        x = x + 1
    return x


@functional("LoopWithAccumulator", (2, 4))
def _accumulate(x: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(x)
    for _ in range(3):
        x = x.exp().clamp(max=2.0)
        total = total + x
    return total


@functional("LoopOverList", (3, 4))
def _over_list(x: torch.Tensor) -> torch.Tensor:
    outs = [row.sigmoid() for row in x]
    return torch.stack(outs)


@functional("StraightLineRepeats", (2, 4))
def _straight(x: torch.Tensor) -> torch.Tensor:
    y = torch.tanh(x)
    z = torch.tanh(y)
    return z + y


# -- loops with parameters --------------------------------------------------------------------


@model((2, 4))
class LoopLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.relu(self.fc(x))
        return x


@model((2, 3))
class LoopBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.out = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.cell(x) + x
        return self.out(x)


@model((2, 4))
class NestedParamLoops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for _ in range(2):
                x = self.inner(x).relu()
            x = self.outer(x)
        return x


@model((2, 4))
class FunctionalWeightLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = F.linear(x, self.weight).tanh()
        return x


@model((2, 4))
class TiedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4, bias=False)
        self.dec = nn.Linear(4, 4, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x).relu())


# -- reused modules -------------------------------------------------------------------------


@model((2, 4))
class ReluTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(self.act(x))))


@model((2, 4))
class LinearTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x).sigmoid())


@model((2, 4))
class ReusedSequential(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + self.block(x * 2)


@model((2, 4))
class SiameseBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.tower(x), self.tower(-x)], dim=-1))


# -- buffers, identity, sources ---------------------------------------------------------------


@model((2, 4))
class BufferAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.arange(4.0))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset


@model((2, 4))
class BufferTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.scale


class _HeldMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = torch.tril(torch.ones(4, 4))  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.mask


@model((2, 4))
class HeldTensors(nn.Module):
    # tensors a module holds without registering them (an attribute, list items, a
    # dict's values, a submodule's attribute): TorchLens reads them as buffers
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.arange(4.0)
        self.consts = [torch.ones(4), torch.full((4,), 3.0)]
        self.cache = {"cpu": torch.full((4,), 0.5)}
        self.inner = _HeldMask()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.consts:  # a loop over held tensors
            x = torch.sin(x) * c
        return self.inner(x + self.bias) - self.cache["cpu"] + self.bias


@model((2, 4))
class HeldNested(nn.Module):
    # held tensors below the first container level (TorchLens walks four): a dict of
    # dicts, a dict of lists, a list of tuples, a key with a dot, one tensor held twice
    def __init__(self) -> None:
        super().__init__()
        self.cache = {
            "outer": {"cpu": torch.full((4,), 0.5)},
            "a.b": [torch.ones(4), (torch.zeros(4),)],
        }
        self.pairs = [(torch.ones(4), torch.arange(4.0))]
        self.same = [self.pairs[0][1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.cache["outer"]["cpu"] + self.cache["a.b"][0] - self.cache["a.b"][1][0]
        return x * self.pairs[0][0] + self.pairs[0][1] + self.same[0]


@model((2, 3, 4, 4))
class BatchNormEval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x).relu()


@model((2, 3, 4, 4), train=True)
class BatchNormTrain(nn.Module):
    # in train mode BatchNorm adds 1 to num_batches_tracked and updates its running
    # statistics: each buffer written gets a new entry, and the entries of the buffers
    # read keep what they held before the write; so for a buffer written in place
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.norm = nn.InstanceNorm1d(3, track_running_stats=True)
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("last", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x).relu()
        self.ema.mul_(0.9).add_(y.mean((0, 2, 3)) * 0.1)
        self.last.copy_(y.amax((0, 2, 3)))
        return self.norm(y.flatten(2)).sum() + y * self.ema[:, None, None] + self.last.sum()


@model((2, 4))
class IdentityModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Identity()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.skip(x))


@model((2, 4))
class DropoutEval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


@functional("TensorLiteral", (2, 3))
def _literal(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor([1.0, 2.0, 3.0]) + torch.Tensor([0.5, 0.5, 0.5])


@functional("FromNumpy", (2, 3))
def _from_numpy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.from_numpy(np.arange(3, dtype=np.float32))


@functional("ArangeSource", (2, 5))
def _arange(x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(5)
    return x + positions.float() + torch.ones(5)


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@model((2, 3))
class InputInObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(_Holder(x).tensor)


# -- views and in-place writes ------------------------------------------------------------------


@functional("InplaceThroughView", (3, 4))
def _inplace_view(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.unsqueeze(0).fill_(0)
    return y + 1


@functional("SetItem", (3, 4))
def _setitem(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y[0] = 0
    y[:, 1] = x[:, 2]
    return y.sum(0)


@functional("SliceWrite", (3, 4))
def _slice_write(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[1:].mul_(3)
    return y.relu()


@model((2, 4))
class InplaceRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) + 1


@functional("MaskedFillInplace", (3, 4))
def _masked_fill(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.masked_fill_(y < 0, 0.0)
    return y * 2


@functional("ViewChain", (4, 4))
def _view_chain(x: torch.Tensor) -> torch.Tensor:
    y = x.view(16)
    z = y[2:10].view(2, 4)
    return z.t() @ z


# -- composite functional calls -----------------------------------------------------------------


@functional("Normalize", (3, 4))
def _normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1) * 2


@functional("MseLoss", (3, 4), (3, 4))
def _mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(x, y)


@functional("CrossEntropy", (3, 5))
def _cross_entropy(x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x, torch.tensor([0, 1, 4]))


@functional("SoftmaxFamily", (3, 5))
def _softmax(x: torch.Tensor) -> torch.Tensor:
    return F.softmax(x, -1) + F.log_softmax(x, -1) + x.softmax(0)


@functional("Activations", (3, 5))
def _activations(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) + F.silu(x) + F.elu(x) + F.leaky_relu(x) + torch.sigmoid(x) + F.softplus(x)


@functional("Sdpa", (1, 2, 4, 8))
def _sdpa(x: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(x, x, x, is_causal=True)


@model((2, 5, 8), train=True)
class MultiheadAttentionTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


@model((2, 5, 8), train=True)
class EncoderLayerTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


# -- recurrent cells ------------------------------------------------------------------------------


@model((4, 2, 3))
class LstmCellLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(2, 5)
        c = torch.zeros(2, 5)
        for step in x:
            h, c = self.cell(step, (h, c))
        return h


@model((4, 2, 3))
class GruCellLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cell(x[0])
        for step in x[1:]:
            h = self.cell(step, h)
        return h


@model((2, 4, 3))
class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 5, batch_first=True)
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


@model((2, 4, 3))
class Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 5, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@model((3, 2, 4))
class ElmanLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wx = nn.Linear(4, 6)
        self.wh = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(2, 6)
        for step in x:
            h = torch.tanh(self.wx(step) + self.wh(h))
        return h


# -- multiple inputs and outputs ------------------------------------------------------------------


@model((2, 4), (2, 4))
class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * y


@model((2, 4))
class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h.relu(), h.sigmoid()


@functional("SameOutputTwice", (2, 4))
def _twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * 3
    return y, y


@functional("InputReturned", (2, 4))
def _input_returned(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x + 1


@functional("RepeatedOperands", (4, 4))
def _repeated_operands(x: torch.Tensor) -> torch.Tensor:
    # TorchLens lists a tensor once among the parents of these (its argument crawl), and
    # once per argument for the rest (mm, cat)
    index = torch.zeros(4, 4, dtype=torch.long)
    a = torch.einsum("ij,jk->ik", x, x) + torch.einsum("ij,ij->ij", [x, x])
    b = torch.block_diag(x, x)[:4, :4] + torch.chain_matmul(x, x, x)
    c = x.scatter(0, index, x) + torch.mm(x, x) + torch.cat([x, x])[:4]
    return a + b + c


@functional("ArgumentOrder", (4, 4))
def _argument_order(x: torch.Tensor) -> torch.Tensor:
    # TorchLens lists index_put's values before its indices and _foreach_add's second
    # list before its first (its argument specs); a torch._foreach_* output's parents
    # are its own members; an out= call's are crawled (each once, lists' members last)
    i, j = x[0].argsort()[:2], x[1].argsort()[:2]
    put = x.index_put((i,), x[:2] * 2) + torch.index_put(x, [i, j], x[0, :2], accumulate=True)
    written = x.clone()
    written.index_put_((j,), x[2:] * 3)
    a, b = x * 2, x + 1
    summed = torch._foreach_add([a, b], [b, a])
    scaled = torch._foreach_addcmul([a, b], [x, a], [b, x], torch.tensor([0.5, 2.0]))
    into = torch.zeros(8, 4)
    torch.cat([x, a], out=into)
    product = torch.zeros(4, 4)
    torch.mm(x, x, out=product)
    h, c = torch.lstm_cell(x, (a, b), x.repeat(4, 1), b.repeat(4, 1), x[0].repeat(4), None)
    return put + written + sum(summed) + sum(scaled) + into[4:] + product + h + c


@functional("ArgumentsHandedBack", (4, 4), (1, 4))
def _handed_back(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # broadcast_tensors and atleast_2d return an argument itself inside their tuple where
    # it needs no change: TorchLens records the entry, and later reads of that argument
    # still read its own producer; a lone result (atleast_2d(x)) is the call's
    a, b = torch.broadcast_tensors(x, y)
    c, d = torch.atleast_2d(x * 2, y)
    (e,) = torch.broadcast_tensors(x)
    return a + b + c + d + e + torch.atleast_2d(x)


@model((2, 8))
class InplaceActivations(nn.Module):
    # F.silu(x, inplace=True) writes through torch._C._nn.silu_, a call TorchLens does
    # not see: the F.silu call itself is the op, and the module no pass-through
    def __init__(self) -> None:
        super().__init__()
        self.acts = nn.Sequential(
            nn.SiLU(inplace=True), nn.Mish(inplace=True), nn.Hardswish(inplace=True)
        )
        self.gate = nn.Hardsigmoid(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.acts(x * 2)
        return self.gate(F.silu(y + 1, inplace=True)) + y


@model((1, 2, 8, 8))
class PoolIndices(nn.Module):
    # MaxPool2d(return_indices=True) calls F.max_pool2d_with_indices through torch's
    # boolean_dispatch: TorchLens names the op for F.max_pool2d, the call it sees
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, indices = self.pool(self.conv(x))
        values, where = F.adaptive_max_pool2d(y, 2, return_indices=True)
        direct = F.max_pool2d_with_indices(x, 4)[0]  # (called directly: its own name)
        return self.unpool(y, indices).sum() + values * where + direct.sum()


@model((1, 2, 8, 8))
class DispatchedBranches(nn.Module):
    # torch's boolean_dispatch functions run the branch their flag picks, which TorchLens
    # sees the calls of: torch.unique records torch._unique2 (three outputs),
    # AdaptiveMaxPool2d adaptive_max_pool2d_with_indices (two), lu torch._lu_with_info;
    # unique(dim=) calls an unwrapped function, so it stays one op
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveMaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(x).flatten()
        values, counts = torch.unique(y.round(), return_counts=True)
        rows = torch.unique(x[0, 0].round(), dim=0).sum() + x.round().unique().sum()
        lu = torch.functional.lu(y[:4].reshape(2, 2) + 4 * torch.eye(2))[0]
        pooled = F.max_pool1d(y[None], 2).sum() + F.adaptive_max_pool1d(y[None], 2).sum()
        return values.sum() * counts.sum() + rows + lu.sum() + pooled + y.sum()


class _Biased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.fc(x) + bias, bias


@model((2, 4))
class KeywordPassThrough(nn.Module):
    # T5's layers hand the position bias they were given by keyword back unchanged:
    # TorchLens takes a module's keyword arguments as its inputs too, so each such
    # output gets an identity op inside the module
    def __init__(self) -> None:
        super().__init__()
        self.a = _Biased()
        self.b = _Biased()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.a(x, bias=x * 2)
        h, bias = self.b(h, bias=bias)
        return h + bias


@model((2, 4))
class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "probs": logits.softmax(-1)}


@dataclasses.dataclass
class _Scores:
    """A model's own output type (not a pytree node, not a ``ModelOutput``)."""

    logits: torch.Tensor
    extra: list[torch.Tensor]
    note: str = "scores"


@model((2, 4))
class DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> _Scores:
        h = self.fc(x)
        return _Scores(h.relu(), [h.sigmoid(), h * 2])


@model((2, 4), (2, 4), (2, 4))
class ThreeInputsNested(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        return [a + b, (b * c, c - a)]  # type: ignore[list-item]


# -- ops reaching neither input nor output -------------------------------------------------------


@functional("DeadBranch", (2, 4))
def _dead(x: torch.Tensor) -> torch.Tensor:
    unused = torch.ones(3) * 2  # reaches neither the input nor the output
    del unused
    return x + 1


@functional("UnusedResult", (2, 4))
def _unused(x: torch.Tensor) -> torch.Tensor:
    x.sum()  # computed from the input, never used
    return x * 2


# -- whole small networks --------------------------------------------------------------------------


@model((2, 8))
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


@model((2, 3, 8, 8))
class ResidualCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.block(x)
        return self.fc(x.mean((2, 3)))


@model((2, 6))
class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 3).long().clamp(max=9)
        return self.fc(self.emb(ids).mean(1))


@model((2, 4))
class ModuleList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).relu()
        return x


@model((2, 4))
class ModuleListRepeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for layer in self.layers:
                x = layer(x).tanh()
        return x


@model((2, 4))
class ConditionalBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


@model((2, 4))
class GatedUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.proj(x).chunk(2, dim=-1)
        return a * torch.sigmoid(b)


@model((2, 6, 8))
class TinyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).split(8, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / 8**0.5
        return x + self.out(scores.softmax(-1) @ v)
