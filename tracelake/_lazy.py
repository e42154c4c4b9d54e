"""Lazy package exports: a package's public names resolved on first use.

The command line's catalog-only commands (``tracelake runs``, ``--help``) must start
without importing torch, so the packages whose modules need it (the facade, the
recorder, the store, the query room) name their exports here and import each one's
module only when the name is first read. Type checkers and IDEs see the real imports
(each package repeats them under ``TYPE_CHECKING``); ``dir()`` lists every export.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public names are ``exports``
    (name -> ``"module"`` or ``"module:attribute"`` when the attribute's name differs,
    ``"module:"`` for the module itself, modules relative to the package when they
    start with a dot). A name read once is
    kept in the package's namespace, so later reads cost nothing."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, colon, attribute = target.partition(":")
        found = importlib.import_module(module, package)
        value = found if colon and not attribute else getattr(found, attribute or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
