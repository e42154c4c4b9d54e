"""Non-tensor arguments key ops as TorchLens keys them (recorder/argkeys.py).

Differential, against TorchLens 2.36.1's own functions: for two random calls, the tokens
a recording keeps (``capture`` at the call, ``hash_tokens`` / ``signature`` after the
forward) are equal exactly where TorchLens's argument hash
(``_get_hash_from_args``) and structural signature (``_structural_arg_signature``) are.
End to end, the compiled path and Python keep the same ``arg_values`` (every row equal:
tests/test_compiled.py's ``arguments`` model) and the labels match TorchLens's on the
parity models (tests/test_torchlens_parity.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracelake as tl
from tracelake.recorder.argkeys import Opaque, capture, hash_tokens, signature
from tracelake.recorder.record import position

torchlens = pytest.importorskip("torchlens", minversion="2.36.1")
from torchlens.backends.torch.tensor_tracking import _get_hash_from_args  # noqa: E402
from torchlens.postprocess.loop_detection import _structural_arg_signature  # noqa: E402


class Plain:
    """An object whose repr is its address: TorchLens keys it by its type."""


class Shown:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"Shown({self.n})"


_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0.5, -1.0, 1.0, float("inf"), 1e-5]),
    st.text("ab_1", max_size=3),
    st.sampled_from(
        [
            torch.float32,
            torch.int64,
            torch.device("cpu"),
            torch.contiguous_format,
            torch.strided,
            torch.Size([2, 3]),
            slice(None, 2),
            Ellipsis,
            complex(1, 2),
            range(3),
        ]
    ),
    st.builds(Plain),
    st.builds(Shown, st.integers(0, 2)),
    st.builds(np.float64, st.sampled_from([0.5, 2.0])),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text("xy", min_size=1, max_size=2), inner, max_size=2),
        st.frozensets(st.integers(0, 3), max_size=3),
    ),
    max_leaves=6,
)
_CALLS = st.tuples(
    st.lists(_VALUES, max_size=3),
    st.dictionaries(st.sampled_from(["dim", "min", "keepdim"]), _VALUES, max_size=2),
)


def _ours(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[str], str]:
    """What a recording keeps of the call and the tokens it spells from that."""
    values: list[Any] = []
    for pos, value in enumerate(args):
        values += [pos, capture(value)]
    for key, value in kwargs.items():
        values += [key, capture(value)]
    return hash_tokens(tuple(values)), signature(tuple(values) or None)


def _theirs(args: list[Any], kwargs: dict[str, Any]) -> tuple[str, str]:
    op = SimpleNamespace(non_tensor_pos_args=list(args), non_tensor_kwargs=dict(kwargs))
    return _get_hash_from_args(tuple(args), kwargs), _structural_arg_signature(op)


def _mutated(call: tuple[list[Any], dict[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
    args, kwargs = call
    return list(args), dict(kwargs)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_keys_equal_where_torchlens_keys_are(data: st.DataObject) -> None:
    a = data.draw(_CALLS)
    # the same call again (fresh objects where the strategy makes them), or another
    b = data.draw(st.one_of(st.just(_mutated(a)), _CALLS))
    ours_a, ours_b = _ours(*a), _ours(*b)
    theirs_a, theirs_b = _theirs(*a), _theirs(*b)
    assert (ours_a[0] == ours_b[0]) == (theirs_a[0] == theirs_b[0]), (a, b)
    assert (ours_a[1] == ours_b[1]) == (theirs_a[1] == theirs_b[1]), (a, b)


def test_rows_never_hold_tensors_or_user_objects() -> None:
    big = np.arange(100_000.0)

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.cat([x, x * 0.5], dim=0)  # a list of tensors: its tensors are parents
            z = torch.where(y > 0, y, 0.0)
            w = torch.as_tensor(big[:4]).float()  # a numpy array: kept as its tokens
            return (z.sum(dim=[0], keepdim=True) + w).to(torch.float64)

    trace = tl.trace(M(), torch.randn(2, 4))
    kept = [row[position("arg_values")] for row in trace._table.rows]
    leaves = [value for values in kept if values for value in values[1::2]]
    assert any(isinstance(value, Opaque) for value in leaves)
    assert torch.float64 in leaves and 0.5 in leaves
    plain = (int, float, bool, str, type(None), torch.dtype, Opaque)

    def kept(value: Any) -> bool:  # a plain value, or a tuple of them (x.sum(dim=[0]))
        if isinstance(value, tuple):
            return all(item.__class__ in plain for item in value)
        return value.__class__ in plain

    for value in leaves:
        assert not isinstance(value, (torch.Tensor, np.ndarray, list, dict)), value
        assert kept(value), value
    # and the numpy array's tokens are bounded (numpy's own summary, or a digest)
    assert all(len(v.text) <= 4096 for v in leaves if isinstance(v, Opaque))
