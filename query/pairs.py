"""Compile rules for tensor-pair functions (a part of :mod:`.compiler`'s compiler).

``max_abs_diff(a.out, b.out)`` and what is computed from it cannot be SQL: they become
an expression of :mod:`.plan` the executor evaluates per row. Whatever part of such an
expression SQL can compute (``a.absmax`` in ``max_abs_diff(a.out, b.out) / a.absmax``)
comes back from the SQL as a hidden ``__e<n>`` column; values (``> 0.01``, ``atol``)
stay in the plan and never reach the SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import ast
from .operands import Operands, walk
from .plan import PAIR_DEFAULTS, Apply, Const, Pair, Post, Ref, TensorRef
from .printer import expr_text
from .schema import PAIR_FUNCTIONS

__all__ = ["PairRules", "reads_pairs"]


def reads_pairs(node: Any) -> bool:
    """Whether a tensor-pair function stands in ``node``."""
    return any(n.__class__ is ast.Call and n.name in PAIR_FUNCTIONS for n in walk(node))


class PairRules(Operands):
    """Tensor-pair functions and the expressions over them, as :mod:`.plan` nodes."""

    post_columns: list[tuple[str, list[Any]]]
    located: set[int]

    def tensor_location(self, expr: ast.Out | ast.OutSlice) -> int:
        """Where ``expr``'s tensor lies: a table's place in ``from`` for its ``out``;
        that plus the number of tables for the ``grad`` of an ``ops`` table (its ops'
        latest gradients, joined from ``grads``). The executor finds each location's
        hidden columns by its suffix (``CompiledQuery.suffixes``)."""
        if expr.tensor == "grad":
            location = self.grad_source(expr).index + len(self.sources)
        else:
            location = self.ops_source(expr, "out").index
        self.located.add(location)
        return location

    def index_of(self, expr: ast.OutSlice) -> tuple[Any, ...]:
        if sum(i is ... for i in expr.index) > 1:
            raise self.refuse("an index can have only one '...'", expr)
        return tuple(
            self.visit_SliceSpec(i) if isinstance(i, ast.SliceSpec) else i for i in expr.index
        )

    def visit_SliceSpec(self, node: ast.SliceSpec) -> slice:
        return slice(node.start, node.stop, node.step)

    def names_pairs(self, node: Any) -> bool:
        """Whether ``node`` reads a tensor-pair function, itself or through the alias
        of a select item (``order by abs(d)`` after ``max_abs_diff(...) as d``)."""
        if reads_pairs(node):
            return True
        aliased = (self.output_alias(n) for n in walk(node) if n.__class__ is ast.Column)
        return any(a is not None and reads_pairs(a) for a in aliased)

    def _post(self, node: Any) -> Post:
        """``node`` as an expression the executor evaluates per row (see :mod:`.plan`):
        tensor-pair functions and what is computed from them; whatever SQL can compute
        comes back from it as a hidden column."""
        aliased = self.output_alias(node) if self.ctx == "order" else None
        if aliased is not None and reads_pairs(aliased):
            return self._post(aliased)
        if not self.names_pairs(node):
            if isinstance(node, ast.Literal):
                return Const(node.value)
            if isinstance(node, ast.Param):
                return Const(self.scalar_param(node))
            return Ref(self._post_column(node))
        if isinstance(node, ast.Call) and node.name in PAIR_FUNCTIONS:
            return self._pair(node)
        if isinstance(node, ast.Call) and node.name == "abs" and len(node.args) == 1:
            return Apply("abs", (self._post_number(node.args[0]),))
        if isinstance(node, ast.Binary):
            return Apply(node.op, (self._post_number(node.left), self._post_number(node.right)))
        if isinstance(node, ast.Neg):
            return Apply("neg", (self._post_number(node.expr),))
        return self._post_condition(node)

    def _post_condition(self, node: Any) -> Post:
        negate: Callable[[Post, bool], Post] = lambda p, neg: Apply("not", (p,)) if neg else p  # noqa: E731
        if isinstance(node, ast.Compare):
            self.comparable(node, node.left, node.right)
            return Apply(node.op, (self._post(node.left), self._post(node.right)))
        if isinstance(node, ast.Between):
            self.comparable(node, node.expr, node.low, node.high)
            bounds = (self._post(node.expr), self._post(node.low), self._post(node.high))
            return negate(Apply("between", bounds), node.negated)
        if isinstance(node, ast.In):
            values = self.in_values(node)
            self.comparable(node, node.expr, *values)
            args = (self._post(node.expr), *(self._post(v) for v in values))
            return negate(Apply("in", args), node.negated)
        if isinstance(node, ast.IsNull):
            return Apply("is not null" if node.negated else "is null", (self._post(node.expr),))
        if isinstance(node, ast.Not):
            return Apply("not", (self._post(node.cond),))
        if isinstance(node, ast.And | ast.Or):
            word = "and" if isinstance(node, ast.And) else "or"
            return Apply(word, tuple(self._post(c) for c in node.items))
        if isinstance(node, ast.BoolTest):
            if self.kind(node.expr) != "bool":
                raise self.refuse(f"{expr_text(node.expr)} is not true or false; compare it", node)
            return Apply("bool", (self._post(node.expr),))
        if isinstance(node, ast.Like):
            raise self.refuse("like compares text; tensor-pair functions give numbers", node)
        name = node.name if isinstance(node, ast.Call) else expr_text(node)
        raise self.refuse(f"{name} cannot take a tensor-pair function", node)

    def _post_number(self, node: ast.Expr) -> Post:
        kind = self.kind(node)
        if kind not in (None, "number"):
            self.number(node)  # refuses, with the message arithmetic has
        return self._post(node)

    def _post_column(self, node: Any) -> str:
        """A hidden column computing ``node`` in SQL, for the executor to read."""
        saved, self.params = self.params, []
        try:
            if isinstance(node, ast.MetaRef):
                sql = self.meta(node, "DOUBLE")
            else:
                sql = str(self.visit(node))
        finally:
            params, self.params = self.params, saved
        self.post_columns.append((sql, params))
        return f"__e{len(self.post_columns) - 1}"

    def _pair(self, node: ast.Call) -> Pair:
        name = node.name
        most = 4 if name == "allclose" else 2
        if node.distinct or not 2 <= len(node.args) <= most:
            extra = "[, atol[, rtol]]" if name == "allclose" else ""
            raise self.refuse(
                f"{name}() takes two tensors{extra}: {name}(a.out, b.out{extra})", node
            )
        refs = []
        for arg in node.args[:2]:
            if not isinstance(arg, ast.Out | ast.OutSlice):
                raise self.refuse(
                    f"{name}() compares tensors (a.out, b.out[0]), not {expr_text(arg)}", arg
                )
            index = self.index_of(arg) if isinstance(arg, ast.OutSlice) else None
            refs.append(TensorRef(self.tensor_location(arg), index))
        tolerances = list(PAIR_DEFAULTS)
        for k, arg in enumerate(node.args[2:]):
            value = arg.value if isinstance(arg, ast.Literal) else None
            if isinstance(arg, ast.Param):
                value = self.scalar_param(arg)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                what = ("atol", "rtol")[k]
                raise self.refuse(f"{what} is a non-negative number, not {expr_text(arg)}", arg)
            tolerances[k] = float(value)
        return Pair(name, refs[0], refs[1], tolerances[0], tolerances[1])
