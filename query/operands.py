"""Compile rules for operands and conditions (a part of :mod:`.compiler`'s compiler).

:class:`Operands` holds the ``visit_*`` rules of the expression and condition nodes:
columns (resolved to one table of ``from``), meta keys, graph references, calls,
arithmetic, literals and parameters, and each predicate. Every operand's kind (number,
text, boolean, list) is checked where SQL would otherwise fail at run time, so that a
type error points at the query's text, never at the generated SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import date, datetime
from typing import Any, Literal

from tracelake.errors import QueryCompileError, QueryRunNotFoundError, QueryTypeError
from tracelake.recorder.names import func_spellings

from . import ast
from .parser import INT64
from .printer import expr_text
from .schema import (
    AGGREGATES,
    COLUMNS,
    FUNCTIONS,
    PAIR_FUNCTIONS,
    REDUCTIONS,
    SCALARS,
    STATS,
    TENSOR_TABLES,
    Kind,
    closest,
    ident,
    json_path,
)

__all__ = [
    "Operands",
    "Refused",
    "Source",
    "fields",
    "is_aggregate",
    "is_tensor",
    "predicate_operands",
    "unknown_function",
    "walk",
]

_SCALAR_TYPES = (str, int, float, bool, datetime, date, type(None))


def unknown_function(name: str) -> str:
    """What a query calling a function the language lacks is told."""
    return f"unknown function {name!r}{closest(name, FUNCTIONS)}"


Ctx = Literal["select", "where", "group", "order", "aggregate", "having", "on"]
_CTX_WORDS = {"where": "where", "group": "group by", "on": "a join condition"}
_KIND_WORDS = {"number": "a number", "string": "text", "bool": "true or false", "other": "a list"}


class Refused(Exception):
    """A construct the compiler refuses, and where it stands in the text."""

    def __init__(self, message: str, span: ast.Span):
        super().__init__(message)
        self.message, self.span = message, span


@dataclass
class Source:
    """One table of ``from``: its place, the name the query calls it by (its alias, else
    its table's name), its SQL alias and that of the ``runs`` row joined for its
    ``run`` and ``meta``, and whether the SQL needs that join."""

    index: int
    table: str
    name: str
    sql: str
    runs_sql: str
    columns: dict[str, Kind]
    span: ast.Span
    needs_runs: bool = False


def fields(node: Any) -> tuple[Any, ...]:
    return tuple(getattr(node, name) for name in _field_names(type(node)))


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        fields_ = getattr(cls, "__dataclass_fields__", {})
        names = _FIELD_NAMES[cls] = tuple(n for n in fields_ if n not in ("span", "table_span"))
    return names


def walk(node: Any) -> list[Any]:
    """``node`` and every node under it (tuples of nodes included), in no set order."""
    found: list[Any] = []
    stack = [node]
    while stack:
        item = stack.pop()
        cls = item.__class__
        if cls is tuple:
            stack += item
        elif cls in _LEAVES:
            found.append(item)
        elif isinstance(item, ast.Node):
            found.append(item)
            stack += [getattr(item, name) for name in _field_names(cls)]
    return found


#: Nodes with no node under them.
_LEAVES = frozenset(
    {ast.Column, ast.MetaRef, ast.GraphRef, ast.Literal, ast.Param, ast.Star, ast.Out}
)


def predicate_operands(node: Any) -> list[ast.Expr]:
    """The operands of one predicate."""
    found: list[ast.Expr] = []
    names = ("left", "right", "expr", "pattern", "low", "high")
    for value in (getattr(node, f, None) for f in names):
        if value is not None and not isinstance(value, str | bool):
            found.append(value)
    values = getattr(node, "values", ())
    if isinstance(values, tuple):
        found += values
    return found


def is_aggregate(expr: Any) -> bool:
    return (
        isinstance(expr, ast.Call)
        and expr.name in AGGREGATES
        and not isinstance(expr.args[0] if expr.args else None, ast.Out | ast.OutSlice)
    )


def is_tensor(expr: Any) -> bool:
    """``out``, a slice of it, or a reduction of a slice: read from the store."""
    if isinstance(expr, ast.Out | ast.OutSlice):
        return True
    return (
        isinstance(expr, ast.Call)
        and len(expr.args) == 1
        and expr.name not in PAIR_FUNCTIONS
        and isinstance(expr.args[0], ast.OutSlice)
    )


class Operands:
    """The operand and condition rules; the compiler (:class:`.compiler._Compiler`)
    holds the state they read."""

    sources: list[Source]
    values: dict[str, Any]
    runs: Mapping[str, int] | None
    params: list[Any]
    used: set[str]
    ctx: Ctx
    graph: tuple[str, Source] | None
    merged: set[str]
    touched: set[tuple[int, bool]]
    graphs: bool  # whether the query names parent. or child. anywhere
    query: ast.Query
    grads: set[int]  # tables of from whose ops' latest gradients the SQL joins

    def visit(self, node: Any) -> Any:
        return getattr(self, f"visit_{type(node).__name__}", self.visit_default)(node)

    def visit_default(self, node: Any) -> Any:
        raise TypeError(f"the query compiler has no rule for {type(node).__name__}")

    def bind(self, value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64:
            value = float(value)  # DuckDB binds nothing wider than a 64-bit integer
        self.params.append(value)
        return "?"

    def refuse(self, message: str, node: Any) -> Refused:
        return Refused(message, getattr(node, "span", ast.NOWHERE))

    # tables -------------------------------------------------------------------------------

    def source(self, node: Any) -> Source:
        """The table of ``from`` a column (meta key, graph reference, ``out``) names."""
        table = node.table
        if table is None:
            if len(self.sources) == 1 or (
                isinstance(node, ast.Column) and node.name in self.merged
            ):
                self.touched.add((0, False))
                return self.sources[0]
            spelled = " or ".join(expr_text(replace(node, table=s.name)) for s in self.sources)
            what = f"column {node.name!r}" if isinstance(node, ast.Column) else expr_text(node)
            raise self.refuse(f"ambiguous {what}: write {spelled}", node)
        for src in self.sources:
            if src.name == table:
                self.touched.add((src.index, False))
                return src
        names = [s.name for s in self.sources]
        raise self.refuse(
            f"unknown qualifier {table!r}{closest(table, names)}: qualify names with "
            f"{', '.join(n + '.' for n in names)} (the query's tables), parent., child. "
            "or meta.",
            node,
        )

    def ops_source(self, node: Any, what: str) -> Source:
        src = self.source(node)
        if src.table not in TENSOR_TABLES:
            raise self.refuse(
                f"{what} is a column of {' and '.join(TENSOR_TABLES)}, not of {src.table}", node
            )
        return src

    def grad_source(self, node: Any) -> Source:
        """The ``ops`` table whose ``grad`` (or reduction of it) ``node`` names: the SQL
        then joins each op's latest gradient row of ``grads`` (:meth:`grad_row`)."""
        src = self.source(node)
        if src.table != "ops":
            hint = "; in grads, out is the gradient" if src.table == "grads" else ""
            raise self.refuse(f"grad is a tensor of ops, not of {src.table}{hint}", node)
        self.grads.add(src.index)
        self.touched.add((src.index, True))  # joined after its table, as its runs row
        return src

    def grad_row(self, src: Source) -> str:
        """The SQL alias of the ``grads`` row joined to ``src``'s rows."""
        return f"{src.sql}g"

    def _runs_row(self, src: Source) -> str:
        """The SQL alias of the ``runs`` row of ``src``'s rows (joined on demand)."""
        if src.table == "runs":
            return src.sql
        src.needs_runs = True
        self.touched.add((src.index, True))
        return src.runs_sql

    # operands -----------------------------------------------------------------------------

    def visit_Column(self, node: ast.Column) -> str:
        if self.ctx in ("having", "order"):  # a result column's name: its expression
            aliased = self.output_alias(node)
            if aliased is not None:
                return str(self.visit(aliased))
        src = self.source(node)
        if node.name not in src.columns:
            extra = (
                (", out, grad" if src.table == "ops" else ", out")
                if src.table in TENSOR_TABLES
                else ""
            )
            hint = closest(node.name, [*src.columns, *extra.split(", ")[1:]])
            raise self.refuse(
                f"unknown column {node.name!r}{hint}"
                if hint
                else f"unknown column {node.name!r}; {src.table} has: "
                f"{', '.join(src.columns)}{extra}",
                node,
            )
        if node.name == "run":
            return f'{self._runs_row(src)}."name"'
        return f"{src.sql}.{ident(node.name)}"

    def output_alias(self, node: Any) -> ast.Expr | None:
        """The select item an unqualified name stands for, when it names a result column
        (``as d``) rather than a column of the table."""
        if not isinstance(node, ast.Column) or node.table is not None:
            return None
        if len(self.sources) == 1 and node.name in self.sources[0].columns:
            return None
        for item in self.query.items:
            name = item.alias or expr_text(item.expr)
            if name.lower() == node.name:
                return item.expr
        return None

    def visit_GraphRef(self, node: ast.GraphRef) -> str:
        src = self.source(node)
        if self.graph is None:
            where = "ops conditions" if src.table == "ops" else "queries over ops"
            raise self.refuse(
                f"{node.direction}.<column> can only be used in {where} "
                f"(where {node.direction}.func = 'relu')",
                node,
            )
        if node.name not in COLUMNS["ops"]:
            raise self.refuse(
                f"unknown column {node.name!r}{closest(node.name, COLUMNS['ops'])}", node
            )
        if node.name == "run":  # an edge never leaves its run
            return self.visit(ast.Column("run", node.table, span=node.span))
        return f"g.{ident(node.name)}"

    def visit_MetaRef(self, node: ast.MetaRef) -> str:
        return self.meta(node, None)

    def meta(self, node: ast.MetaRef, cast: str | None) -> str:
        runs = self._runs_row(self.source(node))
        try:
            path = json_path(node.keys)
        except ValueError as exc:  # only a hand-built AST can get here
            raise self.refuse(str(exc), node) from None
        value = f'json_extract_string({runs}."meta", {path})'
        if cast == "DOUBLE":  # a NaN (Python's json writes one) is no number: DuckDB
            # orders it above every number, so `meta.lr > 100` would hold for it
            number = f"TRY_CAST({value} AS DOUBLE)"
            return f"(CASE WHEN isnan({number}) THEN NULL ELSE {number} END)"
        return f"TRY_CAST({value} AS {cast})" if cast else value

    def visit_Literal(self, node: ast.Literal) -> str:
        return self.bind(node.value)

    def visit_Param(self, node: ast.Param) -> str:
        return self.bind(self.scalar_param(node))

    def scalar_param(self, node: ast.Param) -> Any:
        value = self.param(node)
        if isinstance(value, list | tuple):
            raise self.refuse(f"parameter :{node.name} is a list; lists go after 'in'", node)
        return value

    def param(self, node: ast.Param) -> Any:
        if node.name not in self.values:
            raise self.refuse(
                f"no value for parameter :{node.name}{closest(node.name, self.values)}", node
            )
        self.used.add(node.name)
        value = self.values[node.name]
        items = value if isinstance(value, list | tuple) else (value,)
        for item in items:
            if not isinstance(item, _SCALAR_TYPES):
                raise QueryTypeError(
                    f"parameter :{node.name} is a {type(item).__name__}; "
                    "parameters are str, int, float, bool, None, datetime, or "
                    "lists of these after 'in'"
                )
        return value

    def visit_Star(self, node: ast.Star) -> str:
        raise self.refuse("'*' stands only in a select list and in count(*)", node)

    def visit_Out(self, node: ast.Out | ast.OutSlice) -> str:
        raise self.refuse(
            f"{expr_text(node)} is a tensor: select it, compare it with another "
            f"(max_abs_diff({expr_text(node)}, ...)), or use a whole-tensor reduction "
            "such as absmax(out) here",
            node,
        )

    visit_OutSlice = visit_Out

    def number(self, expr: ast.Expr) -> str:
        """``expr`` as a number (arithmetic, ``abs``, ``avg`` / ``sum``)."""
        kind = self.kind(expr)
        if kind not in (None, "number"):
            raise self.refuse(
                f"{expr_text(expr)} is {_KIND_WORDS[kind]}; arithmetic takes numbers", expr
            )
        if isinstance(expr, ast.MetaRef):
            return self.meta(expr, "DOUBLE")
        return str(self.visit(expr))

    def visit_Binary(self, node: ast.Binary) -> str:
        return f"({self.number(node.left)} {node.op} {self.number(node.right)})"

    def visit_Neg(self, node: ast.Neg) -> str:
        return f"(-{self.number(node.expr)})"

    def visit_Call(self, node: ast.Call) -> str:
        name = node.name
        if name not in FUNCTIONS:
            raise self.refuse(unknown_function(name), node)
        if name in PAIR_FUNCTIONS:
            raise self.refuse(
                f"{name}() reads two tensors, so it stands in select, where and order by; "
                f"not in {_CTX_WORDS.get(self.ctx, 'an aggregate or group by')}",
                node,
            )
        if node.distinct and name not in AGGREGATES:
            raise self.refuse(
                f"distinct goes in aggregates (count(distinct func)), not {name}()", node
            )
        if len(node.args) != 1:
            raise self.refuse(f"{name}() takes one argument, not {len(node.args)}", node)
        arg = node.args[0]
        if name in SCALARS:
            return f"{name}({self.number(arg)})"
        if isinstance(arg, ast.Out) and name in REDUCTIONS:
            if arg.tensor == "grad":
                row = self.grad_row(self.grad_source(arg))
            else:
                row = self.ops_source(arg, "out").sql
            if name == "sum":  # mean x element count; a 0-d tensor has one element
                mean = f'{row}."mean"'
                return f'coalesce({mean} * list_product({row}."shape"), {mean})'
            return f"{row}.{ident(STATS[name])}"
        if isinstance(arg, ast.OutSlice):
            raise self.refuse(
                f"{expr_text(node)} reads the tensor, so it can only be "
                "selected; whole-tensor reductions (mean(out)) come from "
                "statistics and can stand anywhere",
                node,
            )
        if name not in AGGREGATES:
            raise self.refuse(
                f"{name}() reduces out or a slice of it ({name}"
                "(out)); over a column use avg, sum, min, max or count",
                node,
            )
        return self._aggregate(node, arg)

    def _aggregate(self, node: ast.Call, arg: ast.Expr) -> str:
        if self.ctx == "aggregate":
            raise self.refuse(f"aggregates cannot nest: {expr_text(node)}", node)
        if self.ctx not in ("select", "order", "having"):
            raise self.refuse(
                f"aggregates such as {expr_text(node)} cannot stand in "
                f"{_CTX_WORDS.get(self.ctx, self.ctx)}; filter groups with having",
                node,
            )
        if isinstance(arg, ast.Star):
            if node.name != "count":
                raise self.refuse(f"{node.name}(*) is not a thing; count(*) is", node)
            return "count(*)"
        if isinstance(arg, ast.Literal | ast.Param):
            raise self.refuse(
                f"{node.name}() aggregates a column or a meta key, not {expr_text(arg)}", node
            )
        saved, self.ctx = self.ctx, "aggregate"
        try:
            numeric = node.name in ("avg", "sum")
            inner = self.number(arg) if numeric else str(self.visit(arg))
        finally:
            self.ctx = saved
        return f"{node.name}({'DISTINCT ' if node.distinct else ''}{inner})"

    # kinds --------------------------------------------------------------------------------

    def kind(self, expr: Any) -> Kind | None:
        """What an operand holds (None: unknown, or null), to check comparisons and to
        cast meta values to match."""
        value: Any
        if isinstance(expr, ast.Literal):
            value = expr.value
        elif isinstance(expr, ast.Param):
            value = self.values.get(expr.name)
            if isinstance(value, list | tuple):
                kinds = {self.kind(ast.Literal(v)) for v in value if v is not None}
                return kinds.pop() if len(kinds) == 1 else None
        elif isinstance(expr, ast.Column):
            if self.output_alias(expr) is not None:
                return self.kind(self.output_alias(expr))
            return self.source(expr).columns.get(expr.name)
        elif isinstance(expr, ast.GraphRef):
            return COLUMNS["ops"].get(expr.name)
        elif isinstance(expr, ast.Binary | ast.Neg):
            return "number"
        elif isinstance(expr, ast.Call):
            if expr.name in ("min", "max") and is_aggregate(expr):
                return self.kind(expr.args[0])
            return "bool" if expr.name == "allclose" else "number"
        else:
            return None
        if isinstance(value, bool):
            return "bool"
        if isinstance(value, int | float):
            return "number"
        return None if value is None else "string"

    def comparable(self, node: Any, left: ast.Expr, *others: ast.Expr) -> None:
        """Refuse comparing values of different kinds (``label = 3``), pointing at the
        value the user wrote when one side is one."""
        if not isinstance(node, ast.In):
            for side in (left, *others):
                if isinstance(side, ast.Param):
                    self.scalar_param(side)  # a list outside 'in' is refused as such
        mine = self.kind(left)
        for other in others:
            theirs = self.kind(other)
            if mine is None or theirs is None or mine == theirs:
                continue
            values = (ast.Literal, ast.Param)
            culprit = (
                other if isinstance(other, values) else left if isinstance(left, values) else node
            )
            raise self.refuse(
                f"{expr_text(left)} is {_KIND_WORDS[mine]} and {expr_text(other)} is "
                f"{_KIND_WORDS[theirs]}: they cannot be compared",
                culprit,
            )

    def operand(self, expr: ast.Expr, *others: Any) -> str:
        if isinstance(expr, ast.MetaRef):
            kinds = {self.kind(o) for o in others} - {None}
            kind = kinds.pop() if len(kinds) == 1 else None
            cast = {"number": "DOUBLE", "bool": "BOOLEAN"}.get(kind or "")
            return self.meta(expr, cast)
        return str(self.visit(expr))

    # conditions ---------------------------------------------------------------------------

    def _predicate(self, node: Any, build: Callable[[], str]) -> str:
        """``build()``'s SQL, inside EXISTS over the edges when it names parent./child."""
        refs = (
            {(g.direction, self.source(g).index) for g in walk(node) if isinstance(g, ast.GraphRef)}
            if self.graphs
            else None
        )
        if not refs:
            return build()
        if len({d for d, _ in refs}) > 1:
            raise self.refuse(
                "one condition cannot name both parent. and child.; "
                "write one for each, joined with 'and'",
                node,
            )
        if len(refs) > 1:
            raise self.refuse("one condition follows the edges of one table", node)
        direction, index = refs.pop()
        src = self.sources[index]
        if src.table != "ops":
            raise self.refuse("parent. and child. name ops, so they work in queries over ops", node)
        self.graph = (direction, src)
        try:
            cond = build()
        finally:
            self.graph = None
        near, far = ("child", "parent") if direction == "parent" else ("parent", "child")
        t = src.sql
        return (
            f'EXISTS (SELECT * FROM "edges" AS e JOIN "ops" AS g ON g."run_id" = e."run_id"'
            f' AND g."step" = e."step" AND g."idx" = e.{ident(far)} WHERE e."run_id" = '
            f'{t}."run_id" AND e."step" = {t}."step" AND e.{ident(near)} = {t}."idx" AND {cond})'
        )

    def visit_Compare(self, node: ast.Compare) -> str:
        for side in (node.left, node.right):
            if isinstance(side, ast.Literal) and side.value is None:
                raise self.refuse("nothing equals null: write 'is null' or 'is not null'", node)
        self.comparable(node, node.left, node.right)
        if node.op in ("=", "<>"):
            for run, other in ((node.left, node.right), (node.right, node.left)):
                found = self.run_ids(run, (other,))
                if found is not None:
                    src, ids = found
                    return f'{src.sql}."run_id" {node.op} {self.bind(ids[0])}'
            for func, name in ((node.left, node.right), (node.right, node.left)):
                if (
                    isinstance(func, ast.Column | ast.GraphRef)
                    and func.name == "func"
                    and isinstance(name, ast.Literal)
                    and isinstance(name.value, str)
                ):
                    # torch's name and TorchLens's spelling select alike (layer_norm,
                    # layernorm; div, truediv), as tl.func() does.
                    return self._func_family(node, func, name)
        return self._predicate(
            node,
            lambda: (
                f"{self.operand(node.left, node.right)} {node.op} "
                f"{self.operand(node.right, node.left)}"
            ),
        )

    def _func_family(self, node: ast.Compare, func: ast.Expr, name: ast.Literal) -> str:
        """``func = '...'``: the name itself, or any name of its family spelled with case
        and underscores taken out (:func:`func_spellings`)."""

        def sql() -> str:
            column = self.operand(func)
            exact = f"{column} = {self.bind(name.value)}"
            spelled = f"replace(lower({column}), {self.bind('_')}, {self.bind('')})"
            spellings = ", ".join(self.bind(s) for s in func_spellings(str(name.value)))
            match = f"({exact} OR {spelled} IN ({spellings}))"
            return match if node.op == "=" else f"NOT {match}"

        return self._predicate(node, sql)

    def visit_Like(self, node: ast.Like) -> str:
        for side in (node.expr, node.pattern):
            if self.kind(side) not in (None, "string"):
                raise self.refuse(f"like compares text; {expr_text(side)} is not text", side)
        op = ("NOT " if node.negated else "") + ("ILIKE" if node.case_insensitive else "LIKE")
        return self._predicate(
            node, lambda: f"{self.operand(node.expr)} {op} {self.operand(node.pattern)}"
        )

    def in_values(self, node: ast.In) -> tuple[ast.Expr, ...]:
        if isinstance(node.values, ast.Param):
            param = node.values
            value = self.param(param)
            items = list(value) if isinstance(value, list | tuple) else [value]
            return tuple(ast.Literal(v, span=param.span) for v in items)
        return node.values

    def visit_In(self, node: ast.In) -> str:
        op = "NOT IN" if node.negated else "IN"
        values = self.in_values(node)
        if not values:  # an empty list: nothing is in it
            return "FALSE" if not node.negated else "TRUE"
        self.comparable(node, node.expr, *values)
        found = self.run_ids(node.expr, values, not isinstance(node.values, ast.Param))
        if found is not None:
            src, ids = found
            return f'{src.sql}."run_id" {op} ({", ".join(self.bind(i) for i in ids)})'

        def build() -> str:
            left = self.operand(node.expr, *values)
            return f"{left} {op} ({', '.join(self.operand(v, node.expr) for v in values)})"

        return self._predicate(node, build)

    def run_ids(
        self, expr: ast.Expr, values: tuple[ast.Expr, ...], written: bool = True
    ) -> tuple[Source, list[int | None]] | None:
        """The table and the ids of the runs named by ``values`` when ``expr`` is a
        table's ``run`` and the compiler knows the runs (null stays null; an unknown
        name bound as a parameter is 0, so that it compares false, never null; one
        written in the query raises :class:`RunNotFoundError`, with the names closest;
        ``written=False``: ``values`` came from a list parameter); None when the
        condition must join ``runs``."""
        if self.runs is None or not (isinstance(expr, ast.Column) and expr.name == "run"):
            return None
        src = self.source(expr)
        if src.table == "runs":
            return None
        names = []
        for value in values:
            if isinstance(value, ast.Param) and value.name in self.values:
                name = self.param(value)
            elif isinstance(value, ast.Literal):
                name = value.value
                if written and isinstance(name, str) and name not in self.runs:  # a typo?
                    raise QueryRunNotFoundError(name, self.runs)
            else:
                return None
            if name is not None and not isinstance(name, str):
                return None  # a list (refused later) or a non-text value: as written
            names.append(name)
        return src, [None if n is None else self.runs.get(n, 0) for n in names]

    def visit_Between(self, node: ast.Between) -> str:
        op = "NOT BETWEEN" if node.negated else "BETWEEN"
        self.comparable(node, node.expr, node.low, node.high)
        return self._predicate(
            node,
            lambda: (
                f"{self.operand(node.expr, node.low, node.high)} {op} "
                f"{self.operand(node.low, node.expr)} AND {self.operand(node.high, node.expr)}"
            ),
        )

    def visit_IsNull(self, node: ast.IsNull) -> str:
        op = "IS NOT NULL" if node.negated else "IS NULL"
        return self._predicate(node, lambda: f"{self.operand(node.expr)} {op}")

    def visit_BoolTest(self, node: ast.BoolTest) -> str:
        expr = node.expr
        if isinstance(expr, ast.MetaRef):
            return self.meta(expr, "BOOLEAN")
        if self.kind(expr) != "bool":
            raise self.refuse(
                f"{expr_text(expr)} is not true or false; compare it ({expr_text(expr)} = ...)",
                node,
            )
        return self._predicate(node, lambda: str(self.visit(expr)))

    def visit_Not(self, node: ast.Not) -> str:
        return f"NOT ({self.visit(node.cond)})"

    def visit_And(self, node: ast.And) -> str:
        return "(" + " AND ".join(self.visit(c) for c in node.items) + ")"

    def visit_Or(self, node: ast.Or) -> str:
        return "(" + " OR ".join(self.visit(c) for c in node.items) + ")"


def compile_error(exc: Refused, text: str) -> QueryCompileError:
    return QueryCompileError(
        exc.message,
        line=exc.span.line,
        column=exc.span.column,
        excerpt=exc.span.excerpt(text) if text else "",
    )
