"""A module output's structure (:class:`~tracelake.recorder.trees.Structure`) as JSON.

The JSON is plain containers with the tensors as ``{"$t": slot}``: a list, ``{"$tuple":
[...]}``, ``{"$dict": [[key, value], ...]}``, and ``{"$float": "nan"}`` for non-finite
floats (the first format, still read as is). A node of another type wraps the plain form
of its children (``"$of"``) with what names the type:

- ``{"$node": name, "$ctx": context, "$of": ...}``: a type registered with pytree
  (``ModelOutput``, ``OrderedDict``, ``torch.Size``...), by its pytree serialized name;
  ``$ctx`` is left out when the context is not JSON.
- ``{"$namedtuple": "module:qualname", "$fields": [...], "$of": {"$tuple": ...}}``.
- ``{"$object": "module:qualname", "$static": {...}, "$of": {"$dict": ...}}``: an
  opened object (a transformers cache, a dataclass); ``$static`` holds its other
  attributes, left out when one is not JSON.

Reading resolves a name only against what this process already has: types registered
with pytree, classes of modules already imported that are namedtuples with the same fields
or classes the recorder opens. Nothing is imported and nothing is unpickled; a type that
cannot be rebuilt comes back as its plain form, with the same leaves.
"""

from __future__ import annotations

import collections
import contextlib
import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from tracelake.recorder.entries import SlotRef
from tracelake.recorder.trees import (
    Opened,
    Structure,
    mapping_keys,
    namedtuple_type,
    node_type,
    opened_spec,
    opened_type,
    type_name,
)

__all__ = ["decode_structure", "encode_structure"]

_LEAF = pytree.treespec_leaf()


class _NotJSON(Exception):
    """A value with no JSON form here."""


def _value(obj: Any) -> Any:
    """A context value, dict key or static attribute as JSON; raises :class:`_NotJSON`."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, list):
        return [_value(x) for x in obj]
    if isinstance(obj, tuple):
        return {"$tuple": [_value(x) for x in obj]}
    if isinstance(obj, dict):
        return {"$dict": [[_value(k), _value(v)] for k, v in obj.items()]}
    if isinstance(obj, torch.device):
        return {"$device": str(obj)}
    if isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    raise _NotJSON(type(obj).__name__)


def _key(key: Any) -> Any:
    try:
        return _value(key)
    except _NotJSON:  # a key with no JSON form is kept as its repr
        return repr(key)


def _unvalue(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_unvalue(x) for x in obj]
    if isinstance(obj, dict):
        if "$tuple" in obj:
            return tuple(_unvalue(x) for x in obj["$tuple"])
        if "$dict" in obj:
            return {_unvalue(k): _unvalue(v) for k, v in obj["$dict"]}
        if "$float" in obj:
            return float(obj["$float"])
        if "$device" in obj:
            return torch.device(str(obj["$device"]))
        if "$dtype" in obj:
            dtype = getattr(torch, str(obj["$dtype"]), None)
            return dtype if isinstance(dtype, torch.dtype) else str(obj["$dtype"])
    return obj


def _leaf(leaf: Any) -> Any:
    if isinstance(leaf, SlotRef):
        return {"$t": leaf.slot}
    if isinstance(leaf, float) and not math.isfinite(leaf):
        return {"$float": repr(leaf)}
    return leaf


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _encode(spec: pytree.TreeSpec, leaves: Any) -> Any:
    if spec.is_leaf():
        return _leaf(next(leaves))
    children = [_encode(child, leaves) for child in spec.children()]
    node, context = spec.type, spec.context
    if node is list:
        return children
    if node is tuple:
        return {"$tuple": children}
    if node is dict:
        return {"$dict": [[_key(k), c] for k, c in zip(context, children, strict=True)]}
    keys = mapping_keys(spec)
    if keys is not None:
        plain: Any = {"$dict": [[_key(k), c] for k, c in zip(keys, children, strict=True)]}
    elif isinstance(node, type) and issubclass(node, list):
        plain = children
    else:
        plain = {"$tuple": children}
    out: dict[str, Any]
    if node is collections.namedtuple:
        out = {"$namedtuple": _class_name(context), "$fields": list(context._fields)}
    elif node is Opened:
        out = {"$object": _class_name(context[0])}
        with contextlib.suppress(_NotJSON):  # then it is read back as its plain form
            out["$static"] = _value(dict(context[2]))
    else:
        out = {"$node": type_name(node)}
        with contextlib.suppress(_NotJSON):  # then it is read back as its plain form
            out["$ctx"] = _value(context)
    out["$of"] = plain
    return out


def encode_structure(structure: Structure | None) -> Any:
    """A module output's structure as JSON (see the module's docstring)."""
    if structure is None:
        return None
    return _encode(structure.spec, iter(structure.leaves))


def _typed(obj: dict[str, Any], plain: pytree.TreeSpec) -> pytree.TreeSpec:
    """The node ``obj`` names, over ``plain``'s children, where this process can
    rebuild it; else ``plain``."""
    children = plain.children()
    if "$node" in obj:
        node = node_type(str(obj["$node"]))
        if node is not None and "$ctx" in obj:
            return pytree.TreeSpec(node, _unvalue(obj["$ctx"]), children)
    elif "$namedtuple" in obj:
        module, _, qualname = str(obj["$namedtuple"]).partition(":")
        cls = namedtuple_type(module, qualname, tuple(map(str, obj.get("$fields", ()))))
        if cls is not None and len(cls._fields) == len(children):  # type: ignore[attr-defined]
            return pytree.TreeSpec(collections.namedtuple, cls, children)  # type: ignore[arg-type]
    elif "$object" in obj:
        module, _, qualname = str(obj["$object"]).partition(":")
        cls = opened_type(module, qualname)
        static = _unvalue(obj.get("$static"))
        if cls is not None and isinstance(static, dict) and plain.type is dict:
            return opened_spec(cls, tuple(plain.context), tuple(static.items()), children)
    return plain


def _decode(obj: Any, leaves: list[Any]) -> pytree.TreeSpec:
    if isinstance(obj, list):
        return pytree.TreeSpec(list, None, [_decode(x, leaves) for x in obj])
    if isinstance(obj, dict):
        if "$t" in obj:
            leaves.append(SlotRef(int(obj["$t"])))
            return _LEAF
        if "$tuple" in obj:
            return pytree.TreeSpec(tuple, None, [_decode(x, leaves) for x in obj["$tuple"]])
        if "$dict" in obj:
            keys = [_unvalue(k) for k, _ in obj["$dict"]]
            return pytree.TreeSpec(dict, keys, [_decode(v, leaves) for _, v in obj["$dict"]])
        if "$float" in obj:
            leaves.append(float(obj["$float"]))
            return _LEAF
        if "$of" in obj:
            return _typed(obj, _decode(obj["$of"], leaves))
    leaves.append(obj)
    return _LEAF


def decode_structure(obj: Any) -> Structure:
    """The structure :func:`encode_structure` wrote (or the first format's JSON)."""
    leaves: list[Any] = []
    spec = _decode(obj, leaves)
    return Structure(spec, tuple(leaves))
