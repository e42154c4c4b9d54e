"""Typed selectors: which entries a recording saves.

A selector answers two questions: does it select this op entry (by function, module,
label), and does it select this module call's entry. They compose with ``&``, ``|`` and
``~``. Arguments are checked when a selector is built; wrong types raise ``TypeError``.

    tl.func("relu", "gelu")          ops by function name (torch's or TorchLens's spelling,
                                     in-place variants included)
    tl.in_module("encoder")          ops executed inside encoder or its submodules, and
                                     the module entries of encoder and its submodules
    tl.module("encoder.layers.0")    module entries, by exact named_modules() path
    tl.label("relu_1_2", "input_1")  entries by label; a bare layer label selects all passes
    tl.all(), tl.none()
"""

from __future__ import annotations

import ast
import difflib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tracelake.errors import TraceLakeWarning

from .names import func_family

if TYPE_CHECKING:
    from .entries import ModuleEntry, OpEntry

__all__ = [
    "Selector",
    "all_",
    "as_selector",
    "func",
    "in_module",
    "label",
    "labels_named",
    "module",
    "none",
    "parse_selector",
    "unmatched",
    "warn_unmatched",
]


class Selector(ABC):
    """Decides which entries of a recording are saved."""

    #: True or False when the answer is the same for every entry (tl.all(), tl.none()).
    constant: bool | None = None

    @abstractmethod
    def matches_op(self, op: OpEntry) -> bool:
        """Whether the op entry (input, op or output) is selected."""

    @abstractmethod
    def matches_module(self, entry: ModuleEntry) -> bool:
        """Whether the module call's entry is selected."""

    def __and__(self, other: object) -> Selector:
        if not isinstance(other, Selector):
            return NotImplemented
        return _And(self, other)

    def __or__(self, other: object) -> Selector:
        if not isinstance(other, Selector):
            return NotImplemented
        return _Or(self, other)

    def __invert__(self) -> Selector:
        return _Not(self)


def _names(kind: str, values: tuple[object, ...]) -> tuple[str, ...]:
    if not values:
        raise TypeError(f"tl.{kind}() needs at least one name, e.g. tl.{kind}('relu')")
    for value in values:
        if not isinstance(value, str):
            raise TypeError(f"tl.{kind}() takes strings, got {type(value).__name__} {value!r}")
    return tuple(values)  # type: ignore[arg-type]


def _within(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


class _Func(Selector):
    def __init__(self, names: tuple[str, ...]):
        self.names = names
        # Torch's name and TorchLens's spelling select the same ops (layer_norm and
        # layernorm, div and truediv), and a name selects its in-place variant too:
        # nn.ReLU(inplace=True) runs relu_, x += y is iadd.
        self._match = frozenset(func_family(n) for n in names)

    def matches_op(self, op: OpEntry) -> bool:
        return func_family(op.func) in self._match

    def matches_module(self, entry: ModuleEntry) -> bool:
        return False

    def __repr__(self) -> str:
        return f"tl.func({', '.join(map(repr, self.names))})"


class _InModule(Selector):
    def __init__(self, path: str):
        self.path = path

    def matches_op(self, op: OpEntry) -> bool:
        return any(_within(path, self.path) for path, _ in op.modules)

    def matches_module(self, entry: ModuleEntry) -> bool:
        return _within(entry.path, self.path)

    def __repr__(self) -> str:
        return f"tl.in_module({self.path!r})"


class _Module(Selector):
    def __init__(self, paths: tuple[str, ...]):
        self.paths = frozenset(paths)
        self._order = paths

    def matches_op(self, op: OpEntry) -> bool:
        return False

    def matches_module(self, entry: ModuleEntry) -> bool:
        return entry.path in self.paths or f"{entry.path}:{entry.pass_num}" in self.paths

    def __repr__(self) -> str:
        return f"tl.module({', '.join(map(repr, self._order))})"


class _Label(Selector):
    def __init__(self, labels: tuple[str, ...]):
        self.labels = frozenset(labels)
        self._order = labels

    def matches_op(self, op: OpEntry) -> bool:
        # During a recording an entry's label is not final yet (layers and passes are
        # grouped once the forward is over): the label a graph seen before gave it
        # decides, else the one numbered so far.
        final = op.settled_label()
        if final is not None:
            return final in self.labels or final.partition(":")[0] in self.labels
        return op.layer in self.labels or f"{op.layer}:{op.pass_num}" in self.labels

    def matches_module(self, entry: ModuleEntry) -> bool:
        return entry.path in self.labels or f"{entry.path}:{entry.pass_num}" in self.labels

    def __repr__(self) -> str:
        return f"tl.label({', '.join(map(repr, self._order))})"


class _Const(Selector):
    def __init__(self, value: bool):
        self.value = value
        self.constant = value

    def matches_op(self, op: OpEntry) -> bool:
        return self.value

    def matches_module(self, entry: ModuleEntry) -> bool:
        return self.value

    def __repr__(self) -> str:
        return "tl.all()" if self.value else "tl.none()"


class _And(Selector):
    def __init__(self, left: Selector, right: Selector):
        self.left, self.right = left, right

    def matches_op(self, op: OpEntry) -> bool:
        return self.left.matches_op(op) and self.right.matches_op(op)

    def matches_module(self, entry: ModuleEntry) -> bool:
        return self.left.matches_module(entry) and self.right.matches_module(entry)

    def __repr__(self) -> str:
        return f"({self.left!r} & {self.right!r})"


class _Or(Selector):
    def __init__(self, left: Selector, right: Selector):
        self.left, self.right = left, right

    def matches_op(self, op: OpEntry) -> bool:
        return self.left.matches_op(op) or self.right.matches_op(op)

    def matches_module(self, entry: ModuleEntry) -> bool:
        return self.left.matches_module(entry) or self.right.matches_module(entry)

    def __repr__(self) -> str:
        return f"({self.left!r} | {self.right!r})"


class _Not(Selector):
    def __init__(self, inner: Selector):
        self.inner = inner

    def matches_op(self, op: OpEntry) -> bool:
        return not self.inner.matches_op(op)

    def matches_module(self, entry: ModuleEntry) -> bool:
        return not self.inner.matches_module(entry)

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


def func(*names: str) -> Selector:
    """Ops by function name: ``tl.func("relu", "gelu")``. Torch's name and TorchLens's
    spelling select the same ops (``"layer_norm"``, ``"layernorm"``; ``"div"`` and
    ``"truediv"``), in-place variants included."""
    return _Func(_names("func", names))


def in_module(path: str) -> Selector:
    """Ops run inside the module at ``path`` (or any submodule), and those module entries."""
    (checked,) = _names("in_module", (path,))
    return _InModule(checked)


def module(*paths: str) -> Selector:
    """Module entries by exact ``named_modules()`` path (``"encoder"`` or ``"encoder:2"``)."""
    return _Module(_names("module", paths))


def label(*labels: str) -> Selector:
    """Entries by label; a bare label of a multi-pass layer or module selects every pass."""
    return _Label(_names("label", labels))


def all_() -> Selector:
    """Every entry (the default)."""
    return _Const(True)


def none() -> Selector:
    """No entry: metadata, edges and (with ``stats="all"``) statistics only."""
    return _Const(False)


def as_selector(save: object) -> Selector:
    """The selector for a ``save=`` argument: ``None`` means everything."""
    if save is None:
        return all_()
    if isinstance(save, Selector):
        return save
    raise TypeError(
        f"save= takes a selector such as tl.func('relu') or tl.in_module('encoder'), "
        f"not {type(save).__name__} {save!r}"
    )


def parse_selector(text: str) -> Selector:
    """The selector whose ``repr`` is ``text`` (``(tl.func('add') & ~tl.label('x'))``):
    how a stored intervention rule names its selector. Only the constructors above,
    string arguments and ``& | ~`` are accepted; nothing is evaluated."""
    makers: dict[str, Any] = {
        "func": func,
        "in_module": in_module,
        "module": module,
        "label": label,
        "all": all_,
        "none": none,
    }

    def build(node: ast.AST) -> Selector:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            left, right = build(node.left), build(node.right)
            return left & right if isinstance(node.op, ast.BitAnd) else left | right
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return ~build(node.operand)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "tl"
            and node.func.attr in makers
            and not node.keywords
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
        ):
            return makers[node.func.attr](*(a.value for a in node.args))  # type: ignore[attr-defined]
        raise ValueError(f"not a selector: {text!r}")

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not a selector: {text!r}") from None
    return build(tree.body)


def _leaves(selector: Selector) -> list[Selector]:
    """The selectors ``selector`` is built of (through ``&``, ``|``, ``~``)."""
    if isinstance(selector, (_And, _Or)):
        return _leaves(selector.left) + _leaves(selector.right)
    if isinstance(selector, _Not):
        return _leaves(selector.inner)
    return [selector]


def labels_named(selector: Selector) -> set[str]:
    """The labels the ``tl.label`` selectors in ``selector`` name."""
    return {n for leaf in _leaves(selector) if isinstance(leaf, _Label) for n in leaf.labels}


def unmatched(
    selector: Selector, ops: Iterable[OpEntry], modules: Iterable[ModuleEntry]
) -> list[str]:
    """What in ``selector`` matched no entry of a recording (``ops``, ``modules``: its
    entries, every step's): one message per name, with the closest names that did run
    (a typo such as ``tl.func("reul")`` would otherwise save nothing, silently)."""
    parts = [leaf for leaf in _leaves(selector) if leaf.constant is None]
    if not parts:
        return []
    funcs: set[str] = set()
    paths: set[str] = set()
    labels: set[str] = set()
    for op in ops:
        funcs.add(op.func)
        labels.update((op.layer, f"{op.layer}:{op.pass_num}"))
        paths.update(path for path, _ in op.modules)
    for entry in modules:
        paths.add(entry.path)
        labels.update((entry.path, f"{entry.path}:{entry.pass_num}"))
    messages = []
    for leaf in parts:
        if isinstance(leaf, _Func):
            families = {func_family(f) for f in funcs}
            missing = [n for n in leaf.names if func_family(n) not in families]
            messages += [_unmatched("func", n, funcs, "functions") for n in missing]
        elif isinstance(leaf, _InModule):
            if not any(_within(p, leaf.path) for p in paths):
                messages.append(_unmatched("in_module", leaf.path, paths, "modules"))
        elif isinstance(leaf, _Module):
            missing = [p for p in leaf._order if p not in paths and p not in labels]
            messages += [_unmatched("module", p, paths, "modules") for p in missing]
        elif isinstance(leaf, _Label):
            missing = [n for n in leaf._order if n not in labels]
            messages += [_unmatched("label", n, labels, "labels") for n in missing]
    return messages


def _unmatched(kind: str, name: str, known: set[str], what: str) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f" (no such {what} ran)"
    return f"tl.{kind}({name!r}) matched nothing in this recording{hint}"


def warn_unmatched(
    selector: Selector,
    ops: Iterable[OpEntry],
    modules: Iterable[ModuleEntry],
    stacklevel: int = 2,
) -> None:
    """A :class:`~tracelake.TraceLakeWarning` per :func:`unmatched` message."""
    for message in unmatched(selector, ops, modules):
        warnings.warn(message, TraceLakeWarning, stacklevel=stacklevel + 1)
