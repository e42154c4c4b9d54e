"""Typed nodes of a parsed query.

Every node is a frozen dataclass with a :class:`Span` (where it stands in the query
text). Spans take no part in equality, so two spellings of the same expression compare
equal (``group by`` matching relies on that). Names of tables, columns and functions are
lower-cased by the parser (the language is case-insensitive there); meta keys, parameter
names and select aliases keep their case; table aliases are names.

A column, a meta key, a graph reference or ``out`` may name the table it belongs to
(``a.label``, ``a.meta.lr``, ``a.parent.func``, ``a.out``): its ``table`` is the
qualifier as written (an alias, or a table's name), None when unqualified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import EllipsisType
from typing import Literal as Lit
from typing import NamedTuple

__all__ = [
    "And",
    "Between",
    "Binary",
    "BoolTest",
    "Call",
    "Column",
    "Compare",
    "Condition",
    "Expr",
    "GraphRef",
    "In",
    "Index",
    "IsNull",
    "Join",
    "Like",
    "Literal",
    "MetaRef",
    "Neg",
    "Node",
    "Not",
    "Or",
    "OrderItem",
    "Out",
    "OutSlice",
    "Param",
    "Query",
    "SelectItem",
    "SliceSpec",
    "Span",
    "Star",
    "TableRef",
    "Value",
]

Value = str | int | float | bool | None


class Span(NamedTuple):
    """1-based line and column of a node's first character; ``end_*`` just past its last.
    ``start`` / ``end`` are offsets into the query text. A named tuple rather than a
    dataclass: the parser makes one per node, and a frozen dataclass costs four times
    as much to build."""

    line: int
    column: int
    end_line: int
    end_column: int
    start: int
    end: int

    def excerpt(self, text: str) -> str:
        """The query line this span starts on, with carets under the span (clipped to
        that line, and to a window around it on long lines)."""
        lines = text.splitlines() or [""]
        source = lines[min(self.line, len(lines)) - 1].expandtabs(1)
        width = (self.end_column - self.column) if self.end_line == self.line else 1
        width = max(1, min(width, len(source) - self.column + 1))
        col = self.column - 1
        if len(source) > 100 and col > 60:  # keep the culprit in view
            cut = col - 40
            source, col = "…" + source[cut:], col - cut + 1
        if len(source) > 100:
            source = source[:100] + "…"
        return f"  {source}\n  {' ' * col}{'^' * width}"


NOWHERE = Span(1, 1, 1, 1, 0, 0)


@dataclass(frozen=True, slots=True)
class Node:
    span: Span = field(default=NOWHERE, compare=False, repr=False, kw_only=True)


# Operands -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column(Node):
    """A column of the queried table (or ``run``, the run's name)."""

    name: str
    table: str | None = None


@dataclass(frozen=True, slots=True)
class GraphRef(Node):
    """``parent.<column>`` / ``child.<column>``: a column of an op at the other end of an
    edge. Only in conditions, where it means "some such op has this property"."""

    direction: Lit["parent", "child"]
    name: str
    table: str | None = None


@dataclass(frozen=True, slots=True)
class MetaRef(Node):
    """``meta.key`` (``meta.a.b`` for nested objects): a value of the run's metadata."""

    keys: tuple[str, ...]
    table: str | None = None


@dataclass(frozen=True, slots=True)
class Literal(Node):
    value: Value


@dataclass(frozen=True, slots=True)
class Param(Node):
    """``:name``, bound when the query is compiled."""

    name: str


@dataclass(frozen=True, slots=True)
class Star(Node):
    """``*``: every column in a select list, every row in ``count(*)``."""


@dataclass(frozen=True, slots=True)
class Out(Node):
    """``out``: the op's output tensor; ``grad`` (``tensor="grad"``): the gradient of the
    loss with respect to it (its latest backward fire)."""

    table: str | None = None
    tensor: Lit["out", "grad"] = "out"


@dataclass(frozen=True, slots=True)
class SliceSpec(Node):
    """``start:stop:step`` inside ``out[...]``; missing parts are ``None``."""

    start: int | None
    stop: int | None
    step: int | None


Index = int | SliceSpec | EllipsisType


@dataclass(frozen=True, slots=True)
class OutSlice(Node):
    """``out[i, a:b, ...]`` (``grad[...]``): basic indexing of the tensor."""

    index: tuple[Index, ...]
    table: str | None = None
    tensor: Lit["out", "grad"] = "out"


@dataclass(frozen=True, slots=True)
class Call(Node):
    """``name(args)``: a tensor reduction (``mean(out)``), an aggregate (``avg(l2)``,
    ``count(*)``, ``count(distinct func)``), ``abs(x)`` or a tensor-pair function
    (``max_abs_diff(a.out, b.out)``); which one is the compiler's decision."""

    name: str
    args: tuple[Expr, ...]
    distinct: bool = False


@dataclass(frozen=True, slots=True)
class Binary(Node):
    """``left op right``: arithmetic on numbers."""

    op: Lit["+", "-", "*", "/"]
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Neg(Node):
    """``-expr`` (a minus before a number literal is the literal's sign instead)."""

    expr: Expr


Expr = Column | GraphRef | MetaRef | Literal | Param | Star | Out | OutSlice | Call | Binary | Neg


# Conditions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compare(Node):
    op: Lit["=", "<>", "<", "<=", ">", ">="]
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Like(Node):
    expr: Expr
    pattern: Expr
    negated: bool = False
    case_insensitive: bool = False


@dataclass(frozen=True, slots=True)
class In(Node):
    """``x in (a, b)``, or ``x in :name`` with a list bound to ``name``."""

    expr: Expr
    values: tuple[Expr, ...] | Param
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Between(Node):
    expr: Expr
    low: Expr
    high: Expr
    negated: bool = False


@dataclass(frozen=True, slots=True)
class IsNull(Node):
    expr: Expr
    negated: bool = False


@dataclass(frozen=True, slots=True)
class BoolTest(Node):
    """A bare operand used as a condition (``where saved``)."""

    expr: Expr


@dataclass(frozen=True, slots=True)
class Not(Node):
    cond: Condition


@dataclass(frozen=True, slots=True)
class And(Node):
    items: tuple[Condition, ...]


@dataclass(frozen=True, slots=True)
class Or(Node):
    items: tuple[Condition, ...]


Condition = Compare | Like | In | Between | IsNull | BoolTest | Not | And | Or


# Clauses ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SelectItem(Node):
    expr: Expr
    alias: str | None = None


@dataclass(frozen=True, slots=True)
class OrderItem(Node):
    expr: Expr
    descending: bool = False


@dataclass(frozen=True, slots=True)
class TableRef(Node):
    """A table of a join, and the alias it is named by (None: its own name)."""

    name: str
    alias: str | None = None


@dataclass(frozen=True, slots=True)
class Join(Node):
    """``join <table> using (col, ...)`` or ``join <table> on <condition>``."""

    table: TableRef
    using: tuple[Column, ...] = ()
    on: Condition | None = None


@dataclass(frozen=True, slots=True)
class Query(Node):
    """One ``select``. ``table`` / ``alias``: the first table of ``from`` and its alias;
    ``joins``: the tables joined to it, in order."""

    items: tuple[SelectItem, ...]
    table: str
    where: Condition | None = None
    group_by: tuple[Expr, ...] = ()
    order_by: tuple[OrderItem, ...] = ()
    limit: Literal | Param | None = None
    offset: Literal | Param | None = None
    table_span: Span = field(default=NOWHERE, compare=False, repr=False)
    alias: str | None = None
    joins: tuple[Join, ...] = ()
    having: Condition | None = None
    distinct: bool = False
