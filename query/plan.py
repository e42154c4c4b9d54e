"""What a compiled query is: the SQL, and what the executor does with its rows.

The compiler (:mod:`.compiler`) makes a :class:`CompiledQuery`; the executor
(:mod:`.results`) runs its SQL, then reads tensors. Most of a query is SQL. What SQL
cannot compute, the tensor-pair functions (``max_abs_diff(a.out, b.out)``) and what
depends on them, is a small expression tree evaluated per row on the SQL's result:

* :class:`Pair` — a tensor-pair function of two :class:`TensorRef` (a table's ``out``
  or a slice of it), read from the store;
* :class:`Ref` — a column of the SQL's result (any part of the expression SQL can
  compute is computed there, as a hidden ``__e<n>`` column);
* :class:`Const` — a value of the query (a literal or a parameter's value; never SQL);
* :class:`Apply` — arithmetic, comparisons and logic over those, with SQL's semantics
  (null in, null out; three-valued ``and`` / ``or``; nulls sort last).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Literal

__all__ = [
    "PAIR_DEFAULTS",
    "Apply",
    "CompiledQuery",
    "Const",
    "Pair",
    "PointLookup",
    "Post",
    "Ref",
    "TensorItem",
    "TensorRef",
    "evaluate",
    "order_rows",
]

Key = tuple[int | slice | EllipsisType, ...]

#: ``atol`` and ``rtol`` of ``allclose`` when the query gives none (torch's, and
#: ``store.compare``'s).
PAIR_DEFAULTS = (1e-8, 1e-5)


@dataclass(frozen=True)
class TensorRef:
    """One table's tensor in a row: ``source`` is the table's place in ``from`` (its
    location columns are the hidden ones ending in ``CompiledQuery.suffixes[source]``);
    ``index``, the key of a slice (None: the whole tensor)."""

    source: int
    index: Key | None = None


@dataclass(frozen=True)
class Pair:
    """``function(left, right[, atol, rtol])``: one of ``max_abs_diff``,
    ``mean_abs_diff``, ``rel_l2``, ``cosine``, ``allclose``."""

    function: str
    left: TensorRef
    right: TensorRef
    atol: float = PAIR_DEFAULTS[0]
    rtol: float = PAIR_DEFAULTS[1]


@dataclass(frozen=True)
class Ref:
    """A column of the SQL's result."""

    column: str


@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True)
class Apply:
    """``op`` over ``args``: ``+ - * /``, ``neg``, ``abs``, ``= <> < <= > >=``,
    ``and``, ``or``, ``not``, ``is null``, ``is not null``, ``between``, ``in``."""

    op: str
    args: tuple[Post, ...]


Post = Pair | Ref | Const | Apply


@dataclass(frozen=True)
class TensorItem:
    """A select item the executor answers after the SQL.

    ``kind``: ``"out"`` (the whole tensor), ``"slice"`` (``out[...]``, ``index`` is the
    key to index it with: ints, ``slice`` objects and ``...``), ``"reduce"``
    (``reduction`` of that slice, one of ``mean std min max absmax norm sum``), all of
    the tensor of table ``source``; or ``"value"``: ``expr``, an expression over
    tensor-pair functions. Whole-tensor reductions are not tensor items: the SQL
    answers them from statistics."""

    column: str
    kind: Literal["out", "slice", "reduce", "value"]
    index: Key | None = None
    reduction: str | None = None
    source: int = 0
    expr: Post | None = None


@dataclass(frozen=True)
class PointLookup:
    """A query the store's op index can answer without the SQL: the ops of one run and
    one label (``where run = X and label = Y``, nothing else), selecting only what the
    index holds. ``fields``: the index field of each result column of the SQL, in order
    (``"run"``: the run's name); ``start`` / ``stop``: the slice of the rows that
    ``limit`` and ``offset`` keep."""

    run_id: int
    label: str
    fields: tuple[str, ...]
    start: int = 0
    stop: int | None = None


@dataclass(frozen=True)
class CompiledQuery:
    """A query compiled for the catalog: run ``sql`` with ``params``.

    The result's columns are ``columns`` then ``hidden``: for each table whose tensors
    the executor reads, where they lie (``__run_id``, ``__step``, ``__tensor``,
    ``__array``, ``__offset``, ``__nbytes``, ``__shape``, ``__dtype``, each with the
    table's suffix from ``suffixes``: none for a query over one table, ``_0``, ``_1``…
    in a join); then the ``__e<n>`` columns the expressions in ``where`` / ``order``
    read (``aliases``: what the SQL calls the visible ones). ``where``, ``order`` and
    ``limit`` (offset, count or None) are applied by the
    executor when they involve tensor-pair functions (the SQL then has no limit; nor an
    order, when ``order`` is set)."""

    sql: str
    params: list[Any]
    columns: tuple[str, ...]
    tensors: tuple[TensorItem, ...] = ()
    hidden: tuple[str, ...] = ()
    table: str = "ops"
    param_names: frozenset[str] = field(default_factory=frozenset)
    point: PointLookup | None = None
    #: The runs whose rows the SQL can read (ids; empty: the ``runs`` table alone), when
    #: the query says (``run = X`` or ``run in (...)`` standing on its own or joined
    #: with ``and``, for each table of a join); None: any run's.
    runs: frozenset[int] | None = None
    suffixes: tuple[str, ...] = ("",)
    where: Post | None = None
    order: tuple[tuple[Post, bool], ...] = ()
    limit: tuple[int, int | None] | None = None
    #: Each visible column's name in the SQL: its name, or ``__c<n>`` for one named
    #: after an expression with a value in it (values reach the SQL as parameters only).
    aliases: tuple[str, ...] = ()


# Evaluation ------------------------------------------------------------------------------


def _divide(a: Any, b: Any) -> float:
    if b == 0:  # as DuckDB: IEEE division
        return (
            math.nan
            if a == 0 or math.isnan(a)
            else math.copysign(math.inf, a) * (math.copysign(1.0, b))
        )
    return float(a) / b


_ARITHMETIC: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": _divide,
}
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "=": operator.eq,
    "<>": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def evaluate(expr: Post, value: Callable[[Pair | Ref], Any]) -> Any:
    """``expr``'s value for one row; ``value`` gives the row's pair metrics and result
    columns. Nulls (``None``) propagate as in SQL."""
    if isinstance(expr, Const):
        return expr.value
    if not isinstance(expr, Apply):
        return value(expr)
    op = expr.op
    if op in ("and", "or"):
        return _logic(op, [evaluate(a, value) for a in expr.args])
    args = [evaluate(a, value) for a in expr.args]
    if op == "is null":
        return args[0] is None
    if op == "is not null":
        return args[0] is not None
    if op == "in":
        return _in(args[0], args[1:])
    if any(a is None for a in args):
        return None
    if op in _ARITHMETIC:
        return _ARITHMETIC[op](args[0], args[1])
    if op in _COMPARE:
        return _COMPARE[op](args[0], args[1])
    if op == "between":
        return args[1] <= args[0] <= args[2]
    if op == "not":
        return not args[0]
    if op == "neg":
        return -args[0]
    if op == "abs":
        return abs(args[0])
    if op == "bool":
        return bool(args[0])
    raise ValueError(f"no such operation {op!r}")


def _logic(op: str, values: list[Any]) -> bool | None:
    decisive = op == "or"  # True decides an or, False an and
    if any(v is not None and bool(v) is decisive for v in values):
        return decisive
    return None if any(v is None for v in values) else not decisive


def _in(value: Any, options: list[Any]) -> bool | None:
    if value is None:
        return None
    if any(o is not None and o == value for o in options):
        return True
    return None if any(o is None for o in options) else False


def _sort_key(value: Any) -> tuple[int, Any]:
    if isinstance(value, float) and math.isnan(value):
        return (1, 0.0)  # NaN after every number, as DuckDB sorts it
    return (0, value)


def order_rows(rows: list[int], keys: Sequence[tuple[Callable[[int], Any], bool]]) -> list[int]:
    """``rows`` sorted by ``keys`` (each a row's value and whether descending), first key
    first, nulls last either way, ties in the order given."""
    for key, descending in reversed(keys):
        values = {row: key(row) for row in rows}
        present = [row for row in rows if values[row] is not None]
        present.sort(key=lambda row: _sort_key(values[row]), reverse=descending)
        rows = present + [row for row in rows if values[row] is None]
    return rows
