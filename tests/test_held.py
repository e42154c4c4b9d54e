"""The tensors a model's modules hold without registering them are found and named as
TorchLens's own scan finds and names them (they become ``buffer_N`` entries)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from parity_models import MODELS

import tracelake as tl
from tracelake.recorder import held
from tracelake.recorder.eager import named_modules
from tracelake.recorder.held import held_tensors

buffer_writes = pytest.importorskip("torchlens.backends.torch.buffer_writes")


def _theirs(model: torch.nn.Module) -> list[tuple[str, int]]:
    found = []
    for path, module in named_modules(model):
        prefix = f"{path}." if path else ""
        for name, tensor in buffer_writes.iter_module_held_plain_tensors(module):
            found.append((prefix + name, id(tensor)))
    return found


def _ours(model: torch.nn.Module) -> list[tuple[str, int]]:
    return [(name, id(tensor)) for name, tensor in held_tensors(model)]


def test_bounds_are_torchlens_bounds() -> None:
    assert held.DEPTH == buffer_writes._HELD_SCAN_MAX_DEPTH
    assert held.OBJECTS == buffer_writes._HELD_SCAN_MAX_OBJECTS
    assert held.VISITS == buffer_writes._HELD_SCAN_MAX_VISITS


@pytest.mark.parametrize("name", ["HeldTensors", "HeldNested"])
def test_parity_models_hold_what_torchlens_finds(name: str) -> None:
    model, _ = MODELS[name]()
    assert _ours(model) == _theirs(model) and _ours(model)


#: Keys whose renderings are escaped, cut to 40 characters, or the same once cut (``#2``).
_keys = st.one_of(
    st.sampled_from(["k" * 45 + str(n) for n in range(3)] + ["a.b", "a:b", "50%", "'", ""]),
    st.text(alphabet="ab.:%'", max_size=45),
    st.integers(-2, 2),
    st.tuples(st.integers(0, 1)),
)
_leaves = st.one_of(
    st.just("tensor"), st.just("param"), st.integers(), st.none(), st.text(max_size=3)
)
_kinds = st.sampled_from(["list", "tuple", "dict"])


def _wrap(leaf: Any, kinds: list[str], key: Any) -> Any:
    for kind in kinds:
        leaf = [leaf] if kind == "list" else (leaf,) if kind == "tuple" else {key: leaf}
    return leaf


#: A tensor wrapped in one to seven containers: either side of the depth bound.
_chains = st.builds(_wrap, st.just("tensor"), st.lists(_kinds, min_size=1, max_size=7), _keys)
_holders = st.recursive(
    st.one_of(_leaves, _chains),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
    ),
    max_leaves=24,
)


def _build(spec: Any, shared: list[torch.Tensor]) -> Any:
    if spec == "tensor":
        tensor = torch.zeros(1) if not shared or len(shared) % 3 else shared[0]
        shared.append(tensor)  # every third leaf holds the first tensor again
        return tensor
    if spec == "param":
        return torch.nn.Parameter(torch.zeros(1))
    if isinstance(spec, list):
        return [_build(item, shared) for item in spec]
    if isinstance(spec, tuple):
        return tuple(_build(item, shared) for item in spec)
    if isinstance(spec, dict):
        return {key: _build(item, shared) for key, item in spec.items()}
    return spec


_CUT_ALIKE = {"k" * 45 + str(n): ["tensor"] if n == 2 else "tensor" for n in range(3)}


@settings(max_examples=300, deadline=None)
@example({"a": _CUT_ALIKE, "b": [_CUT_ALIKE, ("tensor", "param")]})
@given(st.dictionaries(st.sampled_from(["a", "b", "_c", "tl_d", "e"]), _holders, max_size=4))
def test_names_match_torchlens_for_any_nesting(attrs: dict[str, Any]) -> None:
    """Names (``#2`` repeats, escaped keys, cut keys), order, depth bound, shared tensors
    and containers: whatever the attributes hold, the scan agrees with TorchLens's."""
    shared: list[torch.Tensor] = []
    outer, inner = torch.nn.Module(), torch.nn.Module()
    outer.inner = inner
    for name, spec in attrs.items():
        setattr(outer, name, _build(spec, shared))
        setattr(inner, name, _build(spec, shared))
    assert _ours(outer) == _theirs(outer)


def test_a_deeply_held_tensor_is_a_validated_buffer() -> None:
    model, inputs = MODELS["HeldNested"]()
    report = tl.validate(model, *inputs)
    trace = tl.trace(model, *inputs)
    ops = [op.label for op in trace if op.kind == "op"]
    assert [op.label for op in trace if op.kind == "buffer"] == [f"buffer_{k}" for k in range(1, 6)]
    assert report.ok and sorted(report.matched) == sorted(ops) and not report.skipped, report


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "_c", "tl_d", "training", "_parameters", "e"]),
        st.one_of(_holders, st.floats(allow_nan=False), st.booleans()),
        max_size=5,
    )
)
def test_which_modules_are_scanned_compiled_as_in_python(attrs: dict[str, Any]) -> None:
    """The extension's answer to "may this module hold a tensor?" (asked of every module
    at every recording's start) is the Python rule's, for any attributes."""
    hot = pytest.importorskip("tracelake.recorder._hot")
    values = {name: _build(spec, []) for name, spec in attrs.items()}
    compiled_answer = hot.may_hold(values, held._EVERY_MODULE, held._PRIVATE, held._HOLDERS)
    assert compiled_answer is held._may_hold_python(values)
    assert held._may_hold(values) is compiled_answer
    odd = {1: torch.zeros(1)}  # a key that is not a str: Python's rule answers
    assert hot.may_hold(odd, held._EVERY_MODULE, held._PRIVATE, held._HOLDERS) is None
