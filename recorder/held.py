"""Tensors a model's modules hold without registering them, found and named as
TorchLens 2.36.1 finds and names them (``buffer_writes.iter_module_held_plain_tensors``):
the recording makes their reads ``buffer_N`` entries, as a registered buffer's.

What counts, per module (its own ``__dict__``, public attributes only; never a
``Parameter``):

- a tensor attribute: ``mask``;
- an item of a list or tuple attribute: ``consts.0`` (unbounded, as TorchLens);
- below those, and in dict attributes, a preorder walk of lists, tuples and dicts with
  ``[index]`` / ``[key]`` appended per level (``cache['cpu']``, ``cache['outer']['cpu']``,
  ``pairs.0[1]``), each dict key written by :func:`key_segment`. The walk is bounded:
  :data:`DEPTH` levels, :data:`OBJECTS` tensors and :data:`VISITS` items examined a
  module; a tensor past a bound is not a buffer (its reads come from no entry).

A name met twice in one module gets ``#2``, ``#3``, ... in scan order; a container met
twice is walked once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import compiled
from .eager import named_modules

__all__ = ["held_tensors", "key_segment"]

#: Container levels the walk descends below an attribute (level 1: the attribute's own
#: items); a container at this level is not entered.
DEPTH = 4
#: Tensors the walk takes a module (an attribute's own tensors and list items not counted).
OBJECTS = 4096
#: Items the walk examines a module, of any type: a cap on its cost however large the
#: containers are (a 200,000-entry table of numbers). Reached, the module's walk ends.
VISITS = 1 << 16
#: A key's text is cut to this many characters (the last one then ``~``).
_KEY_CHARS = 40
#: ``.`` separates a module from a buffer's name and ``:`` a label from its pass.
_KEY_ESCAPES = (("%", "%25"), (".", "%2E"), (":", "%3A"))
_PRIVATE = ("_", "tl_")
#: The attribute values a module's scan looks into (what :class:`_Scan` takes or walks).
_HOLDERS = (torch.Tensor, list, tuple, dict)
#: The attributes every module has (``training`` and torch's private ones).
_EVERY_MODULE = frozenset(torch.nn.Module().__dict__)


def held_tensors(
    model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Every module's held tensors, by their full names (``block.cache['cpu']``).
    ``modules``: ``named_modules(model)``, where the caller has it already."""
    held: list[tuple[str, torch.Tensor]] = []
    may_hold = _may_hold_rule()
    for path, module in named_modules(model) if modules is None else modules:
        if not may_hold(module.__dict__):
            continue
        prefix = f"{path}." if path else ""
        held.extend((prefix + name, tensor) for name, tensor in _Scan(module).tensors())
    return held


def _may_hold(attrs: dict[str, Any]) -> bool:
    """Whether a module's ``__dict__`` has a public attribute its scan may take a tensor
    from. Most modules have none (their own attributes are numbers, strings, configs,
    and tuples of numbers such as LayerNorm's ``normalized_shape``, whose items the scan
    would only name), and the attributes every module has are private: a set
    difference leaves the rest. Compiled where the extension is (``_hot.may_hold``,
    the same rule: a recording asks it of every module)."""
    return _may_hold_rule()(attrs)


def _may_hold_rule() -> Callable[[dict[str, Any]], bool]:
    """:func:`_may_hold`, compiled where the extension is (looked up once a walk)."""
    compiled_rule = getattr(compiled.hot(), "may_hold", None)
    if compiled_rule is None:
        return _may_hold_python

    def may_hold(attrs: dict[str, Any]) -> bool:
        found = compiled_rule(attrs, _EVERY_MODULE, _PRIVATE, _HOLDERS)
        return _may_hold_python(attrs) if found is None else found

    return may_hold


def _may_hold_python(attrs: dict[str, Any]) -> bool:
    """:func:`_may_hold` in Python (the reference; a key that is not a str)."""
    for name in attrs.keys() - _EVERY_MODULE:
        value = attrs[name]
        if not isinstance(value, _HOLDERS) or name.startswith(_PRIVATE):
            continue
        if not isinstance(value, (list, tuple)) or any(isinstance(v, _HOLDERS) for v in value):
            return True
    return False


def key_segment(key: Any) -> str:
    """A dict key as one segment of a name: its ``repr`` (``'cpu'``, ``1``), with ``%``,
    ``.`` and ``:`` percent-escaped, cut to 40 characters; a ``repr`` that fails gives
    the type's name."""
    try:
        text = repr(key)
    except Exception:
        text = f"<{type(key).__name__}>"
    for raw, escaped in _KEY_ESCAPES:
        text = text.replace(raw, escaped)
    return text if len(text) <= _KEY_CHARS else text[: _KEY_CHARS - 1] + "~"


def _plain(item: Any) -> bool:
    return isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter)


def _enterable(item: Any) -> bool:
    return isinstance(item, (list, tuple, dict)) and bool(item)


def _items(container: Any) -> Iterator[tuple[str, Any]]:
    """A container's items with their name segments."""
    if isinstance(container, dict):
        for key, item in container.items():
            yield f"[{key_segment(key)}]", item
    else:
        for index, item in enumerate(container):
            yield f"[{index}]", item


class _Scan:
    """One module's scan; the bounds and the names taken are the module's."""

    def __init__(self, module: torch.nn.Module):
        self.attrs = [(k, v) for k, v in module.__dict__.items() if not k.startswith(_PRIVATE)]
        self.taken = {name for name, _ in self.attrs}
        self.entered: set[int] = set()
        self.visits = 0
        self.taken_tensors = 0
        self.ended = False

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for attr, value in self.attrs:
            if isinstance(value, torch.Tensor):
                if _plain(value):
                    yield attr, value
            elif isinstance(value, dict):
                if value:
                    yield from self._walk(value, attr, 1)
            elif isinstance(value, (list, tuple)):
                self.entered.add(id(value))
                for index, item in enumerate(value):
                    name = self._reserve(f"{attr}.{index}")
                    if _plain(item):
                        yield name, item
                    elif _enterable(item) and id(item) not in self.entered:
                        yield from self._walk(item, name, 2)

    def _reserve(self, name: str) -> str:
        unique, n = name, 2
        while unique in self.taken:
            unique, n = f"{name}#{n}", n + 1
        self.taken.add(unique)
        return unique

    def _walk(self, container: Any, path: str, level: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Preorder, iterative (the depth bound, not Python's recursion limit, stops it)."""
        self.entered.add(id(container))
        stack = [(path, level, _items(container))]
        while stack and not self.ended:
            parent, depth, items = stack[-1]
            entry = next(items, None)
            if entry is None:
                stack.pop()
                continue
            if self.visits >= VISITS:
                self.ended = True
                return
            self.visits += 1
            segment, item = entry
            tensor = _plain(item)
            if not tensor and not (_enterable(item) and id(item) not in self.entered):
                continue
            name = self._reserve(parent + segment)
            if tensor:
                if self.taken_tensors >= OBJECTS:
                    self.ended = True
                    return
                self.taken_tensors += 1
                yield name, item
            elif depth < DEPTH:
                self.entered.add(id(item))
                stack.append((name, depth + 1, _items(item)))
