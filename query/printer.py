"""AST → query text: the canonical spelling of a parsed query.

``parse(to_text(parse(text))) == parse(text)`` for every query the parser accepts (a
property test checks it): keywords in lower case, one space between tokens, every
nested arithmetic or logical operand in parentheses, strings in single quotes. The
compiler names result columns and quotes expressions in its messages with
:func:`expr_text`.
"""

from __future__ import annotations

import math
from typing import Any

from . import ast

__all__ = ["condition_text", "expr_text", "to_text"]


def _value(value: ast.Value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, float) and math.isinf(value):
        return "1e999" if value > 0 else "-1e999"  # what parses to it
    return repr(value)


def _index(index: ast.Index) -> str:
    if isinstance(index, ast.SliceSpec):
        text = "" if index.start is None else str(index.start)
        text += ":" + ("" if index.stop is None else str(index.stop))
        return text + ("" if index.step is None else f":{index.step}")
    return "..." if index is ... else str(index)


def _qualified(table: str | None, text: str) -> str:
    return text if table is None else f"{table}.{text}"


def _operand(expr: ast.Expr) -> str:
    """``expr`` as an operand of arithmetic: in parentheses unless it is an atom."""
    text = expr_text(expr)
    return f"({text})" if isinstance(expr, ast.Binary | ast.Neg) else text


def expr_text(expr: ast.Expr) -> str:
    """An expression's canonical text (also the default name of a result column)."""
    if isinstance(expr, ast.Column):
        return _qualified(expr.table, expr.name)
    if isinstance(expr, ast.MetaRef):
        return _qualified(expr.table, "meta." + ".".join(expr.keys))
    if isinstance(expr, ast.GraphRef):
        return _qualified(expr.table, f"{expr.direction}.{expr.name}")
    if isinstance(expr, ast.Out):
        return _qualified(expr.table, expr.tensor)
    if isinstance(expr, ast.OutSlice):
        return _qualified(
            expr.table, expr.tensor + "[" + ", ".join(_index(i) for i in expr.index) + "]"
        )
    if isinstance(expr, ast.Call):
        args = ", ".join(expr_text(a) for a in expr.args)
        return f"{expr.name}({'distinct ' if expr.distinct else ''}{args})"
    if isinstance(expr, ast.Star):
        return "*"
    if isinstance(expr, ast.Binary):
        return f"{_operand(expr.left)} {expr.op} {_operand(expr.right)}"
    if isinstance(expr, ast.Neg):
        return f"-{_operand(expr.expr)}"
    if isinstance(expr, ast.Param):
        return f":{expr.name}"
    if isinstance(expr, ast.Literal):
        return _value(expr.value)
    raise TypeError(f"not an expression: {type(expr).__name__}")


def _negated(negated: bool, word: str) -> str:
    return f"not {word}" if negated else word


def _item(cond: ast.Condition) -> str:
    """A condition inside ``and`` / ``or`` / ``not``: in parentheses when compound."""
    text = condition_text(cond)
    return f"({text})" if isinstance(cond, ast.And | ast.Or | ast.Not) else text


def condition_text(cond: ast.Condition) -> str:
    """A condition's canonical text."""
    if isinstance(cond, ast.Compare):
        return f"{expr_text(cond.left)} {cond.op} {expr_text(cond.right)}"
    if isinstance(cond, ast.Like):
        word = _negated(cond.negated, "ilike" if cond.case_insensitive else "like")
        return f"{expr_text(cond.expr)} {word} {expr_text(cond.pattern)}"
    if isinstance(cond, ast.In):
        values = cond.values
        listed = (
            expr_text(values)
            if isinstance(values, ast.Param)
            else "(" + ", ".join(expr_text(v) for v in values) + ")"
        )
        return f"{expr_text(cond.expr)} {_negated(cond.negated, 'in')} {listed}"
    if isinstance(cond, ast.Between):
        word = _negated(cond.negated, "between")
        return f"{expr_text(cond.expr)} {word} {expr_text(cond.low)} and {expr_text(cond.high)}"
    if isinstance(cond, ast.IsNull):
        return f"{expr_text(cond.expr)} is {'not ' if cond.negated else ''}null"
    if isinstance(cond, ast.BoolTest):
        return expr_text(cond.expr)
    if isinstance(cond, ast.Not):
        return f"not ({condition_text(cond.cond)})"
    if isinstance(cond, ast.And | ast.Or):
        word = " and " if isinstance(cond, ast.And) else " or "
        return word.join(_item(c) for c in cond.items)
    raise TypeError(f"not a condition: {type(cond).__name__}")


def _table(ref: ast.TableRef | ast.Query) -> str:
    name = ref.name if isinstance(ref, ast.TableRef) else ref.table
    return name if ref.alias is None else f"{name} {ref.alias}"


def _join(join: ast.Join) -> str:
    if join.on is not None:
        return f" join {_table(join.table)} on {condition_text(join.on)}"
    return f" join {_table(join.table)} using ({', '.join(c.name for c in join.using)})"


def to_text(query: ast.Query) -> str:
    """The query's canonical text."""
    items = ", ".join(
        expr_text(i.expr) + ("" if i.alias is None else f" as {i.alias}") for i in query.items
    )
    parts: list[Any] = [f"select {'distinct ' if query.distinct else ''}{items}"]
    parts.append(f" from {_table(query)}")
    parts += [_join(j) for j in query.joins]
    if query.where is not None:
        parts.append(f" where {condition_text(query.where)}")
    if query.group_by:
        parts.append(" group by " + ", ".join(expr_text(e) for e in query.group_by))
    if query.having is not None:
        parts.append(f" having {condition_text(query.having)}")
    if query.order_by:
        parts.append(
            " order by "
            + ", ".join(
                expr_text(o.expr) + (" desc" if o.descending else "") for o in query.order_by
            )
        )
    if query.limit is not None:
        parts.append(f" limit {expr_text(query.limit)}")
    if query.offset is not None:
        parts.append(f" offset {expr_text(query.offset)}")
    return "".join(parts)
