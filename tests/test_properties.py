"""Property tests: random chains of ops are recorded completely and consistently."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tracelake as tl
from tracelake.recorder.names import spelling

UNARY = {
    "relu": torch.relu,
    "sin": torch.sin,
    "neg": torch.neg,
    "exp": torch.exp,
    "transpose": lambda t: t.transpose(0, 1),
    "mul": lambda t: t * 0.5,
}
BINARY = {"add": torch.add, "sub": torch.sub, "maximum": torch.maximum}


class Program(nn.Module):
    """Runs a list of steps; each step applies an op to earlier values."""

    def __init__(self, steps: list[tuple[str, int, int]]):
        super().__init__()
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for name, a, b in self.steps:
            left, right = values[a % len(values)], values[b % len(values)]
            if name in UNARY:
                values.append(UNARY[name](left))
            else:
                if left.shape != right.shape:
                    right = left
                values.append(BINARY[name](left, right))
        return values[-1]


steps = st.lists(
    st.tuples(
        st.sampled_from(sorted(UNARY) + sorted(BINARY)), st.integers(0, 50), st.integers(0, 50)
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(steps=steps)
def test_random_programs_are_recorded_consistently(steps) -> None:
    model = Program(steps)
    x = torch.randn(3, 3)
    log = tl.trace(model, x)
    assert [op.func for op in log] == ["input", *(name for name, _, _ in steps), "output"]
    assert len(set(log.labels)) == len(log)
    # Layers numbered in the order of their first passes, as TorchLens numbers them; a
    # repeated op sequence (exp of exp of exp...) may be one layer with passes.
    counts: dict[str, int] = {}
    n = 0
    for op in log.ops[1:-1]:
        if op.pass_num == 1:
            func = spelling(op.func)
            counts[func] = counts.get(func, 0) + 1
            n += 1
            assert op.layer == f"{func}_{counts[func]}_{n}"
        assert op.label == (op.layer if op.num_passes == 1 else f"{op.layer}:{op.pass_num}")
    for op in log:
        assert all(op.label in log[p].children for p in op.parents)
        assert all(op.label in log[c].parents for c in op.children)
        assert op.out is not None and tuple(op.out.shape) == op.shape
    assert torch.equal(log.output, model(x))
    assert torch.equal(log["output_1"].out, log.output)
