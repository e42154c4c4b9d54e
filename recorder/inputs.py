"""The model's inputs: how the entry points that record take them apart from their own
options, and what each input entry is called.

Naming (:func:`input_entries`): positional inputs are ``input_1``, ``input_2``, ... in
pytree order; a keyword input is labelled by its keyword (``input_ids``); a tensor nested
inside a keyword's value by the keyword and its path, joined by dots: a mapping's key
(dicts, ``ModelOutput``, an opened cache's attribute), a namedtuple's field, a sequence's
position (``past_key_values.0.1``, ``batch.pixel_values``). A name that could be taken
for another entry (a submodule's path, or the shape of a generated label: ``input_2``,
``relu_1_2``) is not used: that input keeps its number (``input_3``).

Options (:func:`model_arguments`): ``tl.trace`` and ``store.record`` take the model's
inputs as positional and keyword arguments next to their own keywords (``name``,
``save``, ``meta``, ``stats``...). ``args=(...)`` and ``kwargs={...}`` pass them
explicitly; a model keyword that clashes with one of tracelake's must go in ``kwargs=``,
and when the model's ``forward`` names a keyword that was passed at top level, the call
is refused rather than guessed.
"""

from __future__ import annotations

import collections
import inspect
import re
import weakref
from collections.abc import Collection, Mapping
from typing import Any

import torch

from tracelake.errors import ArgumentClashError

from .trees import flatten, leaves_of, mapping_keys

__all__ = ["input_entries", "input_tensors", "model_arguments"]

_PLAIN = (bool, int, float, str)
#: The shapes of generated labels, which a keyword input's name must not take.
_GENERATED = re.compile(r"(?:input|output)_\d+|.*_\d+_\d+(?::\d+)?")


def _leaf_paths(tree: Any) -> list[tuple[str, Any]]:
    """``tree``'s leaves, each with its path (``""`` for a leaf at the root)."""
    structure = flatten(tree)
    leaves = iter(structure.leaves)
    found: list[tuple[str, Any]] = []

    def walk(spec: Any, path: str) -> None:
        if spec.is_leaf():
            found.append((path, next(leaves)))
            return
        children = spec.children()
        keys: Any = mapping_keys(spec)
        if keys is None and spec.type is collections.namedtuple:
            keys = spec.context._fields  # pytree files namedtuples under one key
        if keys is None or len(keys) != len(children):
            keys = range(len(children))
        for key, child in zip(keys, children, strict=True):
            walk(child, f"{path}.{key}" if path else str(key))

    walk(structure.spec, "")
    return found


def input_entries(
    args: tuple, kwargs: Mapping[str, Any], taken: Collection[str] = ()
) -> list[tuple[torch.Tensor, str | None]]:
    """The model's input tensors in order (positional, then keyword), each with the name
    its entry is labelled by, or ``None`` for a numbered ``input_N`` label (see the
    module's docstring). ``taken``: names an input must not take (submodule paths). A
    tensor given twice (``model(ids, labels=ids)``) is one input, where it came first,
    as in TorchLens (and :func:`.replay.encode_call` numbers them so)."""
    entries: dict[int, tuple[torch.Tensor, str | None]] = {}
    for leaf in leaves_of(list(args)):
        if isinstance(leaf, torch.Tensor):
            entries.setdefault(id(leaf), (leaf, None))
    for keyword, value in kwargs.items():
        for path, leaf in _leaf_paths(value):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in entries:
                name = f"{keyword}.{path}" if path else keyword
                usable = name not in taken and not _GENERATED.fullmatch(name)
                entries[id(leaf)] = (leaf, name if usable else None)
    return list(entries.values())


def input_tensors(args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The model's input tensors in the order of their entries, each once: what a
    recorded call (:func:`.replay.encode_call`) and a run's input fingerprint number."""
    return [tensor for tensor, _ in input_entries(args, kwargs)]


#: forward function -> the names it takes by keyword (weakly held: a notebook's
#: re-run cell makes new functions, whose globals must not be kept alive from here).
_KEYWORDS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def _named_parameters(model: torch.nn.Module) -> frozenset[str]:
    """The parameter names the model's ``forward`` takes by keyword (not ``**kwargs``)."""
    forward = model.forward
    func = getattr(forward, "__func__", None)
    names = _KEYWORDS.get(func) if func is not None else None
    if names is None:
        try:
            parameters = inspect.signature(forward).parameters.values()
        except (TypeError, ValueError):
            return frozenset()
        names = frozenset(
            p.name
            for p in parameters
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        )
        if func is not None:
            _KEYWORDS[func] = names
    return names


def model_arguments(
    model: torch.nn.Module,
    where: str,
    inputs: tuple,
    args: Any,
    kwargs: Any,
    model_kwargs: dict[str, Any],
    options: Mapping[str, tuple[Any, Any]],
) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments to call ``model`` with, from an entry point
    (``where``: ``"tl.trace"``) that got ``inputs`` positionally, ``args=`` / ``kwargs=``
    and other keywords ``model_kwargs``. ``options``: the entry point's own keywords,
    each ``(value, default)``. Raises :class:`ArgumentClashError` when an option given
    at top level is also a keyword of the model's ``forward`` (unless ``kwargs=`` was
    given: then top-level keywords are tracelake's)."""
    if args is not None:
        if inputs:
            raise TypeError(
                f"{where}: give the model's positional inputs either after the model or as "
                "args=(...), not both"
            )
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{where}: args= takes a tuple of positional inputs, not {args!r}")
        inputs = tuple(args)
    if kwargs is None:
        given = [
            name
            for name, (value, default) in options.items()
            if not (value is default or (type(value) in _PLAIN and value == default))
        ]
        clash = sorted(set(given) & _named_parameters(model)) if given else []
        if clash:
            listed = ", ".join(f"{name}=" for name in clash)
            raise ArgumentClashError(
                f"{where}: {type(model).__name__}.forward takes {listed} too, and so does "
                f"{where} itself, so it is not clear whose it is. Pass the model's "
                f"keyword inputs as kwargs={{{clash[0]!r}: ...}}; top-level keywords are "
                f"then {where}'s own."
            )
        return inputs, model_kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"{where}: kwargs= takes a dict of keyword inputs, not {kwargs!r}")
    both = sorted(set(kwargs) & set(model_kwargs))
    if both:
        raise TypeError(f"{where}: {', '.join(both)} given both in kwargs= and at top level")
    return inputs, {**model_kwargs, **kwargs}
