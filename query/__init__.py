"""The query language: text → :mod:`~tracelake.query.ast` → parameterised DuckDB SQL.

Stages, one module each, none importing a later one: ``grammar.lark`` (the language),
:mod:`.parser` (Lark → typed AST nodes with source spans; :mod:`.lalr` drives Lark's
tables fast), :mod:`.printer` (AST → canonical text), :mod:`.schema` (the tables,
columns and functions a query may name), :mod:`.compiler` (AST →
:class:`CompiledQuery`; its rules for operands and conditions in :mod:`.operands`, for
tensor-pair functions in :mod:`.pairs`), :mod:`.plan` (what a compiled query is,
and the per-row evaluation of what SQL cannot compute), :mod:`.results` (running it on
a store). See ``docs/query.md``.
"""

from __future__ import annotations

from . import ast
from .compiler import CompiledQuery, TensorItem, compile_query
from .parser import parse

__all__ = ["CompiledQuery", "TensorItem", "ast", "compile_query", "parse"]
