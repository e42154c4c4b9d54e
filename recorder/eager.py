"""Compiled models (``torch.compile(model)``, ``model.compile()``, compiled submodules)
are recorded running eagerly.

Recording needs the model's Python code to run: dynamo would otherwise trace into the
recorder's mode and hooks (slow, and ops go missing from what it compiles). While a
compiled model is recorded, the compiler's stance is ``force_eager`` (every
``torch.compile`` directive is ignored, nothing is compiled), module paths are those of
the uncompiled modules (no ``_orig_mod.``), and a ``TraceLakeWarning`` says, once per
model, that the recording ran it eagerly: its output is the eager one, which a compiled
backend such as inductor may differ from by rounding.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch

from tracelake.errors import TraceLakeWarning

__all__ = [
    "EagerStance",
    "compiled_wrapper",
    "is_compiled",
    "module_path",
    "module_tree",
    "named_modules",
    "uncompiled",
]

#: The path component ``torch.compile`` puts between a wrapper and the module it wraps.
WRAPPED = "_orig_mod"

_warned: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def compiled_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported from here
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper wraps (``model`` itself if none)."""
    while compiled_wrapper(model):
        model = getattr(model, WRAPPED)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether calling ``model`` would run compiled code: it, or a module inside it, is a
    ``torch.compile`` wrapper or was compiled in place (``module.compile()``)."""
    return module_tree(model)[1]


def module_path(path: str) -> str:
    """A ``named_modules()`` path without the wrappers' ``_orig_mod`` components."""
    if WRAPPED not in path:
        return path
    return ".".join(part for part in path.split(".") if part != WRAPPED)


def named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` as recorded: ``torch.compile`` wrappers left out (the
    module each wraps stands for it) and their ``_orig_mod`` left out of paths."""
    return module_tree(model)[0]


def module_tree(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], bool]:
    """:func:`named_modules` and :func:`is_compiled` of ``model`` from one walk of its
    modules (a recording's start needs both)."""
    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled in this process
        return list(model.named_modules()), False
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (compiled_wrapper's test)
    wrapper = () if eval_frame is None else eval_frame.OptimizedModule
    named, compiled = [], False
    for path, m in model.named_modules():
        if isinstance(m, wrapper):
            compiled = True
            continue
        if not compiled and getattr(m, "_compiled_call_impl", None) is not None:
            compiled = True
        named.append((module_path(path) if WRAPPED in path else path, m))
    return named, compiled


class EagerStance:
    """While entered, ``torch.compile`` directives are ignored if ``model`` is compiled
    (and a warning says so, once per model); a no-op otherwise. ``compiled``: what
    :func:`is_compiled` says of ``model``, where the caller knows it already."""

    def __init__(self, model: torch.nn.Module, compiled: bool | None = None):
        self.active = is_compiled(model) if compiled is None else compiled
        self._model = model
        self._stance: Any = None

    def __enter__(self) -> EagerStance:
        if self.active:
            if self._model not in _warned:
                _warned.add(self._model)
                warnings.warn(
                    f"{type(uncompiled(self._model)).__name__} is compiled (torch.compile); "
                    "tracelake recorded it running eagerly (its Python code, every op "
                    "recorded), so the recorded output is the eager one, which the compiled "
                    "model's may differ from by rounding",
                    TraceLakeWarning,
                    stacklevel=4,
                )
            self._stance = torch.compiler.set_stance("force_eager")  # (set at once)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._stance is not None:
            self._stance.__exit__(None, None, None)  # the stance before
            self._stance = None
