"""The query language: text → :mod:`~tracelake.query.ast` → parameterised DuckDB SQL.

Stages, one module each, none importing a later one: ``grammar.lark`` (the language),
:mod:`.parser` (Lark → typed AST nodes with source spans; :mod:`.lalr` drives Lark's
tables fast), :mod:`.printer` (AST → canonical text), :mod:`.schema` (the tables,
columns and functions a query may name), :mod:`.compiler` (AST →
:class:`CompiledQuery`; its rules for operands and conditions in :mod:`.operands`, for
tensor-pair functions in :mod:`.pairs`), :mod:`.plan` (what a compiled query is,
and the per-row evaluation of what SQL cannot compute), :mod:`.results` (running it on
a store). See ``docs/query.md``.

No module here imports torch at import time (:mod:`.results` does when a query reads
tensors), and the names below load their module when first read (``tracelake._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import ast  # (plain dataclasses)

if TYPE_CHECKING:
    from .compiler import CompiledQuery, TensorItem, compile_query
    from .parser import parse
else:
    from tracelake._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            **dict.fromkeys(("CompiledQuery", "TensorItem", "compile_query"), ".compiler"),
            "parse": ".parser",
        },
    )

__all__ = ["CompiledQuery", "TensorItem", "ast", "compile_query", "parse"]
