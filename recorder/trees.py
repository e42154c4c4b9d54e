"""Trees: the structures a forward pass hands around (module arguments and outputs),
flattened and rebuilt through ``torch.utils._pytree``.

Every type pytree knows is walked with pytree's own node definitions: tuples, lists,
dicts, namedtuples, ``torch.Size``, torch's return types, transformers' ``ModelOutput``
classes (transformers registers them) and whatever the user registered. Flattening yields
the leaves in pytree's order and a ``TreeSpec`` that rebuilds the same types.

Some containers of tensors are not pytree nodes: dataclasses (a model's own output type)
and transformers' ``Cache`` classes. Their instances are *opened*: walked attribute by
attribute under one private node type, :class:`Opened`, whose context names the class.
No user type is registered with pytree: transformers' exporters register ``Cache`` types
themselves and silently keep a registration someone else made first, so registering them
here would change what ``torch.export`` does with them after a recording. Opened classes
are found only among modules already imported (``sys.modules``); tracelake never imports
them.
"""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from .forks import fork_safe_lock

__all__ = [
    "OPENABLE",
    "Opened",
    "Structure",
    "flatten",
    "is_openable",
    "leaves_of",
    "mapping_keys",
    "namedtuple_type",
    "node_type",
    "opened_spec",
    "opened_type",
    "plain_spec",
    "type_name",
]

_Tensor = torch.Tensor
_LEAF = pytree.treespec_leaf()
_PLAIN = (type(None), bool, int, float, str)

#: (module, class names) whose instances, when pytree does not know their type, are
#: opened attribute by attribute so the tensors they hold are seen.
OPENABLE: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "transformers.cache_utils",
        ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer"),
    ),
)


class Opened:
    """The pytree node type of an opened object; never instantiated. Its context is
    ``(cls, names, static)``: the object's class, the attribute names of its children
    (tensors and containers, in attribute order) and its other attributes as
    ``(name, value)`` pairs."""


def _open_unflatten(children: Iterable[Any], context: Any) -> Any:
    cls, names, static = context
    obj = cls.__new__(cls)
    obj.__dict__.update(static)
    obj.__dict__.update(zip(names, children, strict=True))
    return obj


def _never_flattened(node: Any) -> Any:
    raise TypeError("tracelake's Opened node type has no instances")


_REGISTER_LOCK = fork_safe_lock()


def _register_opened() -> None:
    """Register :class:`Opened` with pytree, once, when an opened object is first met."""
    if Opened in pytree.SUPPORTED_NODES:
        return
    with _REGISTER_LOCK:
        if Opened not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(Opened, _never_flattened, _open_unflatten)


def opened_spec(
    cls: type,
    names: tuple[str, ...],
    static: tuple[tuple[str, Any], ...],
    children: list[pytree.TreeSpec],
) -> pytree.TreeSpec:
    """The spec of an opened object of class ``cls`` (see :class:`Opened`)."""
    _register_opened()
    return pytree.TreeSpec(Opened, (cls, names, static), children)  # type: ignore[arg-type]


class Structure(NamedTuple):
    """A structure with its leaves taken out: ``spec`` rebuilds it from ``leaves``."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]


# -- flattening -----------------------------------------------------------------------


class _Bases:
    """The classes of :data:`OPENABLE` that are loaded, looked up again only when one of
    its modules appears in (or leaves) ``sys.modules``."""

    modules: tuple[Any, ...] = ()
    bases: tuple[type, ...] = ()


def _openable_bases() -> tuple[type, ...]:
    modules = tuple(sys.modules.get(name) for name, _ in OPENABLE)
    if modules != _Bases.modules:
        bases: list[type] = []
        for module, (_, names) in zip(modules, OPENABLE, strict=True):
            if module is not None:
                for name in names:
                    cls = getattr(module, name, None)
                    if isinstance(cls, type):
                        bases.append(cls)
        _Bases.modules, _Bases.bases = modules, tuple(bases)
    return _Bases.bases


def is_openable(cls: type) -> bool:
    """Whether instances of ``cls`` are opened: a dataclass, or a subclass of a class in
    :data:`OPENABLE` (from a module already imported), that pytree does not know. (A
    model that returns a dataclass of its own returns its tensors, as TorchLens finds
    them; ``ModelOutput`` is a dataclass pytree knows.)"""
    if cls in pytree.SUPPORTED_NODES:
        return False
    if hasattr(cls, "__dataclass_fields__"):  # (``dataclasses.is_dataclass``, for a class)
        return True
    bases = _openable_bases()
    return bool(bases) and issubclass(cls, bases)


def _node_key(cls: type) -> Any:
    # pytree files every namedtuple under ``namedtuple`` (its context is the class).
    if cls is tuple or cls is list or cls is dict:
        return cls
    return collections.namedtuple if pytree.is_namedtuple_class(cls) else cls


def _is_node(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return False
    cls = type(value)
    return _node_key(cls) in pytree.SUPPORTED_NODES or is_openable(cls)


def _open(obj: Any) -> tuple[tuple[str, ...], list[Any], tuple[tuple[str, Any], ...]]:
    names: list[str] = []
    children: list[Any] = []
    static: list[tuple[str, Any]] = []
    for name, value in obj.__dict__.items():
        if isinstance(value, _Tensor) or _is_node(value):
            names.append(name)
            children.append(value)
        else:
            static.append((name, value))
    return tuple(names), children, tuple(static)


def _walk(
    node: Any, leaves: list[Any], build: bool, opening: frozenset[int] = frozenset()
) -> pytree.TreeSpec | None:
    """pytree's ``tree_flatten`` walk, plus opened objects; builds the spec on request.
    A node whose registered flatten function fails is kept as a leaf, and so is an
    object met again inside itself (``opening``: the opened objects on the way here; a
    user's dataclass may point back at its parent)."""
    if isinstance(node, _Tensor):
        leaves.append(node)
        return _LEAF
    cls = type(node)
    key = _node_key(cls)
    node_def = pytree.SUPPORTED_NODES.get(key)
    if node_def is not None:
        try:
            children, context = node_def.flatten_fn(node)
        except Exception:  # a flatten function that rejects this instance
            pass
        else:
            specs = [_walk(child, leaves, build, opening) for child in children]
            return pytree.TreeSpec(key, context, specs) if build else None  # type: ignore[arg-type]
    elif (
        not isinstance(node, _PLAIN)
        and is_openable(cls)
        and hasattr(node, "__dict__")
        and id(node) not in opening
    ):
        names, children, static = _open(node)
        inside = opening | {id(node)}
        specs = [_walk(child, leaves, build, inside) for child in children]
        return opened_spec(cls, names, static, specs) if build else None  # type: ignore[arg-type]
    leaves.append(node)
    return _LEAF


def flatten(tree: Any) -> Structure:
    """``tree``'s leaves in pytree order and the spec that rebuilds it, at any depth."""
    leaves: list[Any] = []
    spec = _walk(tree, leaves, True)
    assert spec is not None
    return Structure(spec, tuple(leaves))


def leaves_of(tree: Any) -> list[Any]:
    """``tree``'s leaves in pytree order (what :func:`flatten` returns, without a spec)."""
    leaves: list[Any] = []
    _walk(tree, leaves, False)
    return leaves


# -- names of node types, for a stored structure --------------------------------------


def type_name(cls: type) -> str:
    """The name a stored structure gives a pytree node type: its serialized name when it
    was registered with one, else ``module.qualname``."""
    entry = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    name = getattr(entry, "serialized_type_name", None)
    if name and name != pytree.NO_SERIALIZED_TYPE_NAME_FOUND:
        return str(name)
    return f"{cls.__module__}.{cls.__qualname__}"


def node_type(name: str) -> type | None:
    """The registered pytree node type stored as ``name``, or ``None``: only types this
    process registered with pytree are answered, nothing is imported."""
    found = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
    if isinstance(found, type) and found in pytree.SUPPORTED_NODES:
        return found
    for cls in list(pytree.SUPPORTED_NODES):
        if isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}" == name:
            return cls
    return None


def _loaded_class(module_name: str, qualname: str) -> Any:
    """A class of an already imported module, by qualified name; never imports."""
    obj = sys.modules.get(module_name)
    if obj is None or "<locals>" in qualname:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def namedtuple_type(module_name: str, qualname: str, fields: tuple[str, ...]) -> type | None:
    """The namedtuple class stored under this name when this process has it loaded with
    the same fields, else a stand-in namedtuple of that name and fields; ``None`` when
    no namedtuple can carry them."""
    cls = _loaded_class(module_name, qualname)
    if cls is not None and pytree.is_namedtuple_class(cls) and cls._fields == fields:
        return cls
    return _stand_in(qualname.rsplit(".", 1)[-1], fields)


@functools.lru_cache(maxsize=256)
def _stand_in(typename: str, fields: tuple[str, ...]) -> type | None:
    try:
        return collections.namedtuple(typename, fields)  # type: ignore[misc]
    except (ValueError, TypeError):  # names that are not identifiers
        return None


def opened_type(module_name: str, qualname: str) -> type | None:
    """The class of an opened object stored under this name, if this process has it
    loaded and would open it."""
    cls = _loaded_class(module_name, qualname)
    return cls if cls is not None and is_openable(cls) else None


# -- plain containers -----------------------------------------------------------------


def mapping_keys(spec: pytree.TreeSpec) -> list[Any] | None:
    """The keys of a node that is a mapping (its children in key order), else ``None``."""
    node, context = spec.type, spec.context
    count = len(spec.children())
    if node is Opened:
        return list(context[1])
    if not (isinstance(node, type) and issubclass(node, Mapping)):
        return None
    # dict-like nodes keep their keys as the context (dict, OrderedDict, ModelOutput),
    # or as its last part (defaultdict: [default_factory, keys]).
    for keys in (context, context[-1] if isinstance(context, (list, tuple)) and context else None):
        if isinstance(keys, (list, tuple)) and len(keys) == count:
            return list(keys)
    return None


def plain_spec(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` with every node made a plain ``dict`` (mappings, opened objects),
    ``list`` (lists) or ``tuple`` (the rest): the same leaves, in the same order."""
    if spec.is_leaf():
        return spec
    children = [plain_spec(child) for child in spec.children()]
    node = spec.type
    if node in (list, tuple, dict):
        return pytree.TreeSpec(node, spec.context, children)
    keys = mapping_keys(spec)
    if keys is not None:
        return pytree.TreeSpec(dict, keys, children)
    if isinstance(node, type) and issubclass(node, list):
        return pytree.TreeSpec(list, None, children)
    return pytree.TreeSpec(tuple, None, children)
