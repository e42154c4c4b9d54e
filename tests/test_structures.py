"""Structures through ``torch.utils._pytree``: what the recorder sees inside module
arguments and outputs, how ``ModuleEntry.out`` rebuilds them (in memory and from a store
read back in a new process), and that stores written before still read."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hook_capture import assert_bitwise
from structures_zoo import Pair, Scored
from torch import nn

import tracelake as tl
from tracelake.recorder.entries import SlotRef
from tracelake.recorder.intercept import flatten_tensors
from tracelake.recorder.trees import Structure, flatten
from tracelake.store.structure import decode_structure, encode_structure

HERE = Path(__file__).parent


def _nested(depth: int, leaf: Any) -> Any:
    for k in range(depth):
        leaf = [leaf] if k % 3 == 0 else (leaf,) if k % 3 == 1 else {"k": leaf}
    return leaf


# -- flatten_tensors ------------------------------------------------------------------

_A, _B, _C = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)


@pytest.mark.parametrize(
    ("obj", "want"),
    [
        (_A, [_A]),
        ((_A, _B), [_A, _B]),
        ([_A, None, 3, "s", _B], [_A, _B]),
        ({"b": _B, "a": _A}, [_B, _A]),  # insertion order, as pytree
        (Pair(_A, (_B, {"x": _C})), [_A, _B, _C]),
        (torch.Size([2, 3]), []),
        (collections.OrderedDict(x=_C, y=[_A]), [_C, _A]),
        (_nested(40, _A), [_A]),  # deeper than the old cap of 8
        (object(), []),
        (Scored(_A, [_B, _C]), [_A, _B, _C]),
    ],
    ids=[
        "tensor",
        "tuple",
        "mixed",
        "dict",
        "namedtuple",
        "size",
        "ordereddict",
        "deep",
        "obj",
        "dataclass",
    ],
)
def test_flatten_tensors(obj: Any, want: list[torch.Tensor]) -> None:
    got = flatten_tensors(obj)
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True))


def test_flatten_matches_pytree_for_registered_types() -> None:
    tree = {"a": [(_A, 1), Pair(_B, None)], "b": collections.OrderedDict(c=_C)}
    leaves, spec = pytree.tree_flatten(tree)
    structure = flatten(tree)
    assert list(structure.leaves) == leaves and structure.spec == spec
    assert structure.spec.unflatten(list(structure.leaves)) == tree


def test_a_node_whose_flatten_fails_is_a_leaf() -> None:
    class Picky:
        pass

    def refuse(obj: Picky) -> Any:
        raise RuntimeError("not this one")

    pytree.register_pytree_node(Picky, refuse, lambda children, ctx: Picky())
    try:
        picky = Picky()
        assert flatten_tensors([_A, picky]) == [_A]
        assert flatten([_A, picky]).leaves == (_A, picky)
    finally:
        pytree._deregister_pytree_node(Picky)


# -- ModuleEntry.out in memory ----------------------------------------------------------


class Returns(nn.Module):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(self.lin(x))


class Outer(nn.Module):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.inner = Returns(make)

    def forward(self, x: torch.Tensor) -> Any:
        return self.inner(x)


def _model_output(h: torch.Tensor) -> Any:
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=h, hidden_states=(h * 2, h + 1))


MAKERS = {
    "namedtuple": lambda h: Pair(h, {"n": 3, "f": 0.5, "obj": object()}),
    "deep": lambda h: _nested(30, (h, h.sum())),
    "model_output": _model_output,
    "size_and_none": lambda h: (h, h.shape, None, float("inf")),
}


def _same(got: Any, want: Any, where: str = "out") -> None:
    """Same types all the way down, tensors bitwise, other leaves equal."""
    assert type(got) is type(want), f"{where}: {type(got)} vs {type(want)}"
    if isinstance(want, torch.Tensor):
        assert_bitwise(got, want, where)
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}[{k}]")
    else:
        assert got == want, where


def _expected(obj: Any) -> Any:
    """What ``.out`` keeps of ``obj``: non-plain leaves become None."""
    leaves, spec = pytree.tree_flatten(obj)
    plain = (type(None), bool, int, float, str, torch.Tensor)
    return spec.unflatten([leaf if isinstance(leaf, plain) else None for leaf in leaves])


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_module_out_keeps_types(name: str) -> None:
    torch.manual_seed(0)
    model, x = Outer(MAKERS[name]), torch.randn(2, 3)
    want = _expected(model(x))
    log = tl.trace(model, x, save=tl.all())
    entry = log["inner"]
    _same(entry.out, want)
    assert len(entry.outputs) == len(flatten_tensors(want))


def test_gpt2_cache_tensors_are_outputs_and_out_is_a_model_output() -> None:
    from model_zoo import gpt2
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    model, (ids,) = gpt2()
    with torch.no_grad():
        plain = model(ids, use_cache=True)
    log = tl.trace(model, ids, save=tl.all(), use_cache=True)
    cache = plain.past_key_values
    want = [plain.logits] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(log.outputs) == len(want) == 1 + 2 * len(cache.layers)
    for entry, tensor in zip(log.outputs, want, strict=True):
        assert_bitwise(entry.out, tensor, entry.label)
    out = log["transformer"].out
    assert type(out) is BaseModelOutputWithPastAndCrossAttentions
    got_cache = out.past_key_values
    assert type(got_cache) is DynamicCache and len(got_cache.layers) == len(cache.layers)
    for got, layer in zip(got_cache.layers, cache.layers, strict=True):
        assert_bitwise(got.keys, layer.keys, "keys")
        assert_bitwise(got.values, layer.values, "values")
    assert got_cache.get_seq_length() == cache.get_seq_length()
    # the recorder registers no user type with pytree (transformers' exporters do)
    assert DynamicCache not in pytree.SUPPORTED_NODES


# -- the stored JSON --------------------------------------------------------------------


def _structure(obj: Any) -> Structure:
    spec, leaves = flatten(obj)
    slots = iter(range(len(leaves)))
    return Structure(
        spec, tuple(SlotRef(next(slots)) if isinstance(x, torch.Tensor) else x for x in leaves)
    )


def _roundtrip(obj: Any) -> Any:
    structure = decode_structure(json.loads(json.dumps(encode_structure(_structure(obj)))))
    tensors = [x for x in flatten(obj).leaves if isinstance(x, torch.Tensor)]
    leaves = [tensors[x.slot] if isinstance(x, SlotRef) else x for x in structure.leaves]
    return structure.spec.unflatten(leaves)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_json_roundtrip_keeps_types(name: str) -> None:
    obj = _expected(MAKERS[name](torch.randn(2, 3)))
    _same(_roundtrip(obj), obj)


def test_json_roundtrip_of_tuple_keys_and_nonfinite_floats() -> None:
    obj = {(1, "a"): [_A, float("nan")], 2: (float("-inf"), "s", True, None)}
    got = _roundtrip(obj)
    assert list(got) == [(1, "a"), 2] and got[(1, "a")][0] is _A
    assert str(got[(1, "a")][1]) == "nan" and got[2] == (float("-inf"), "s", True, None)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"$t": 0}', "T0"),
        ("null", None),
        ('{"$tuple": [{"$t": 0}, {"$t": 1}]}', ("T0", "T1")),
        ('[{"$t": 1}, 3, "x", {"$float": "inf"}]', ["T1", 3, "x", float("inf")]),
        (
            '{"$dict": [["a", {"$t": 0}], [{"$tuple": [1, 2]}, {"$tuple": [null, true]}]]}',
            {"a": "T0", (1, 2): (None, True)},
        ),
        # a type this process cannot resolve comes back as its plain form
        ('{"$node": "nowhere.Output", "$ctx": ["a"], "$of": {"$dict": [["a", 1]]}}', {"a": 1}),
        ('{"$object": "os:system", "$static": {"$dict": []}, "$of": {"$dict": []}}', {}),
        ('{"$namedtuple": "subprocess:Popen", "$fields": ["a"], "$of": {"$tuple": [1]}}', (1,)),
    ],
)
def test_decode_table(text: str, want: Any) -> None:
    before = set(sys.modules)
    structure = decode_structure(json.loads(text))
    assert set(sys.modules) == before, "decoding imported a module"
    leaves = [f"T{x.slot}" if isinstance(x, SlotRef) else x for x in structure.leaves]
    got = structure.spec.unflatten(leaves)
    if isinstance(want, tuple) and type(got) is not tuple:  # a namedtuple stand-in
        assert isinstance(got, tuple) and tuple(got) == want
    else:
        assert type(got) is type(want) and got == want


def test_a_namedtuple_that_cannot_be_found_keeps_its_fields() -> None:
    text = '{"$namedtuple": "gone:Out", "$fields": ["a", "b"], "$of": {"$tuple": [1, 2]}}'
    structure = decode_structure(json.loads(text))
    got = structure.spec.unflatten(list(structure.leaves))
    assert (got.a, got.b) == (1, 2) and type(got).__name__ == "Out"


def test_a_context_with_no_json_form_reads_back_plain() -> None:
    obj = collections.defaultdict(list, {"a": _A})
    encoded = encode_structure(_structure(obj))
    assert "$ctx" not in encoded  # the default factory is not JSON
    got = _roundtrip(obj)
    assert type(got) is dict and got["a"] is _A


# -- stores -----------------------------------------------------------------------------


def _facts_from(script: str) -> Any:
    """What ``script``, run in a new process beside this file, prints last (JSON)."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_stored_structures_read_back_in_a_new_process(tmp_path: Path) -> None:
    """Types come back where the reading process has them, plain forms where it has not."""
    from model_zoo import gpt2

    model, (ids,) = gpt2()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, ids, name="gpt2", save=tl.all())
    store.record(Outer(MAKERS["namedtuple"]), torch.randn(2, 3), name="pair", save=tl.all())
    n_out = len(store["gpt2"].outputs)
    del store
    script = textwrap.dedent(
        f"""
        import json, sys
        import tracelake as tl
        store = tl.open({str(tmp_path / "s.tl")!r})
        facts = {{}}
        pair = store["pair"]["inner"].out
        facts["plain_pair"] = [type(pair).__name__, list(pair._fields), type(pair[1]).__name__]
        import structures_zoo
        facts["pair"] = type(store["pair"]["inner"].out) is structures_zoo.Pair
        out = store["gpt2"]["transformer"].out
        facts["plain_gpt2"] = [type(out).__name__, type(out["cache"]).__name__]
        import transformers.modeling_outputs, transformers.cache_utils
        out = store["gpt2"]["transformer"].out
        facts["gpt2"] = [type(out).__name__, type(out.past_key_values).__name__,
                         out.past_key_values.get_seq_length()]
        facts["outputs"] = len(store["gpt2"].outputs)
        print(json.dumps(facts))
        """
    )
    facts = _facts_from(script)
    # before the defining module is imported: a stand-in namedtuple, plain dicts
    assert facts["plain_pair"] == ["Pair", ["first", "second"], "dict"]
    assert facts["pair"] is True
    assert facts["plain_gpt2"] == ["dict", "dict"]
    assert facts["gpt2"] == ["BaseModelOutputWithPastAndCrossAttentions", "DynamicCache", 8]
    assert facts["outputs"] == n_out == 5


def test_a_model_returning_its_own_dataclass_returns_its_tensors(tmp_path: Path) -> None:
    """A plain dataclass (not a pytree node, not a ``ModelOutput``) returned by a model
    or a module: its fields' tensors are the outputs, as TorchLens finds them (before,
    tracelake found none), and ``.out`` rebuilds the dataclass, in a new process too
    once its module is imported there (a plain dict before)."""
    model = Outer(lambda h: Scored(h.relu(), [h * 2, h + 1]))
    x = torch.randn(2, 3)
    with torch.no_grad():
        want = model(x)
    log = tl.trace(model, x, save=tl.all())
    tensors = [want.logits, *want.hidden]
    assert [e.label for e in log.outputs] == ["output_1", "output_2", "output_3"]
    for entry, tensor in zip(log.outputs, tensors, strict=True):
        assert_bitwise(entry.out, tensor, entry.label)
    out = log["inner"].out
    assert type(out) is Scored and out.note == "scored"
    _same(out.hidden, want.hidden)
    store = tl.open(tmp_path / "s.tl")
    store.record(model, x, name="scored", save=tl.all())
    del store
    script = textwrap.dedent(
        f"""
        import json
        import torch
        import tracelake as tl
        store = tl.open({str(tmp_path / "s.tl")!r})
        facts = {{"outputs": [e.label for e in store["scored"].outputs]}}
        facts["plain"] = sorted(store["scored"]["inner"].out)
        import structures_zoo
        out = store["scored"]["inner"].out
        facts["type"] = type(out) is structures_zoo.Scored and out.note == "scored"
        facts["sums"] = [float(out.logits.sum()), *(float(h.sum()) for h in out.hidden)]
        print(json.dumps(facts))
        """
    )
    facts = _facts_from(script)
    assert facts["outputs"] == ["output_1", "output_2", "output_3"]
    assert facts["plain"] == ["hidden", "logits"]
    assert facts["type"] is True
    assert facts["sums"] == [float(t.sum()) for t in tensors]


@dataclasses.dataclass
class _Node:
    value: torch.Tensor
    parent: _Node | None = None
    kids: list[_Node] = dataclasses.field(default_factory=list)


class _Tree(nn.Module):
    def forward(self, x: torch.Tensor) -> _Node:
        root = _Node(x + 1)
        root.kids.append(_Node(x * 2, parent=root))
        return root


def test_a_dataclass_that_points_back_at_itself_is_walked_once(tmp_path: Path) -> None:
    """Opening a user's dataclass must end where it points back at an object being
    opened (a child's ``parent``): that one is a leaf, not opened again for ever (a
    ``RecursionError`` in the forward, before)."""
    x = torch.randn(2, 3)
    log = tl.trace(_Tree(), x, save=tl.all())
    assert [e.label for e in log.outputs] == ["output_1", "output_2"]
    assert_bitwise(log.outputs[1].out, x * 2, "the kid's value")
    store = tl.open(tmp_path / "s.tl")
    store.record(_Tree(), x, name="tree", save=tl.all())
    assert_bitwise(tl.open(tmp_path / "s.tl")["tree"]["output_2"].out, x * 2, "stored")


def test_format1_store_module_outputs_still_read(tmp_path: Path) -> None:
    with tarfile.open(HERE / "data" / "format1" / "store.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    store = tl.open(tmp_path / "store.tl")
    run = store["base"]
    seen = 0
    for entry in run.modules:
        if entry.saved:
            out = entry.out
            assert isinstance(out, torch.Tensor), entry.label
            assert_bitwise(out, run[entry.output_labels[-1]].out, entry.label)
            seen += 1
    assert seen >= 3
