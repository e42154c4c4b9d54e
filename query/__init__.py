"""The query language: text → :mod:`~tracelake.query.ast` → parameterised DuckDB SQL.

Stages, one module each, none importing a later one: ``grammar.lark`` (the language),
:mod:`.parser` (Lark → typed AST nodes with source spans), :mod:`.schema` (the tables,
columns and functions a query may name), :mod:`.compiler` (AST → :class:`CompiledQuery`).
Running the SQL and reading tensors is the store's part. See ``docs/query.md``.
"""

from __future__ import annotations

from . import ast
from .compiler import CompiledQuery, TensorItem, compile_query
from .parser import parse

__all__ = ["CompiledQuery", "TensorItem", "ast", "compile_query", "parse"]
