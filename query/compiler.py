"""AST → parameterised DuckDB SQL.

Every value (literals, ``:name`` parameters, the ``complete`` status) is a bound ``?``
parameter; every identifier is looked up in :mod:`.schema` and quoted by its one quoting
function (the keys of ``meta.a.b`` are checked identifiers, written as a JSON path
constant so that DuckDB sees ``meta.a`` in ``select`` and ``group by`` as one
expression); the SQL is one ``SELECT`` over the catalog tables and nothing else. Each
AST node class has a ``visit_<Class>`` rule; a class without one reaches
:meth:`_Compiler.visit_default`, which raises.

The SQL runs on the reader's catalog mirror, which holds the rows of complete runs only;
``runs`` keeps every status, so reading it (directly, or joined for ``run`` and ``meta``)
filters ``status = 'complete'``. Given the complete runs' ids by name (``runs``), a
condition ``run = X``, ``run != X`` or ``run [not] in (...)`` on another table compares
``run_id`` with the ids of those names instead, and needs no join: DuckDB then skips
every row group of other runs (an unknown name stands for id 0, which no run has).

What the SQL returns, in order: ``columns`` (the visible ones; a tensor item's column
holds the op's tensor slot, for the executor to replace), then ``hidden``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from types import EllipsisType
from typing import Any, Literal, cast

from tracelake.errors import QueryCompileError, QueryError
from tracelake.store.catalog import COMPLETE
from tracelake.store.points import FIELDS as POINT_FIELDS

from . import ast
from .parser import INT64, parse
from .schema import (
    AGGREGATES,
    COLUMNS,
    FUNCTIONS,
    HIDDEN,
    HIDDEN_COLUMNS,
    REDUCTIONS,
    STATS,
    TABLE_NAMES,
    Kind,
    closest,
    ident,
    json_path,
    star,
)

__all__ = ["CompiledQuery", "PointLookup", "TensorItem", "compile_query"]

_SCALARS = (str, int, float, bool, datetime, date, type(None))
_Ctx = Literal["select", "where", "group", "order", "aggregate"]


@dataclass(frozen=True)
class TensorItem:
    """A select item the executor answers by reading tensors.

    ``kind``: ``"out"`` (the whole tensor), ``"slice"`` (``out[...]``, ``index`` is the
    key to index it with: ints, ``slice`` objects and ``...``) or ``"reduce"``
    (``reduction`` of that slice, one of ``mean std min max absmax norm sum``). Whole-
    tensor reductions are not tensor items: the SQL answers them from statistics."""

    column: str
    kind: Literal["out", "slice", "reduce"]
    index: tuple[int | slice | EllipsisType, ...] | None = None
    reduction: str | None = None


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


#: Columns of ops a point lookup can select: the op index's fields (``run``: by its id).
_POINT_COLUMNS = frozenset({"run", *POINT_FIELDS} - {"run_id"})


@dataclass(frozen=True)
class CompiledQuery:
    """A query compiled for the catalog: run ``sql`` with ``params``.

    The result's columns are ``columns`` then ``hidden`` (``__run_id``, ``__step``,
    ``__tensor`` and where the tensor's bytes are: ``__array``, ``__offset``,
    ``__nbytes``, ``__shape``, ``__dtype``; when any item is in ``tensors``, else none)."""

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
    #: with ``and``); None: any run's.
    runs: frozenset[int] | None = None


def compile_query(
    query: str | ast.Query,
    params: Mapping[str, Any] | None = None,
    runs: Mapping[str, int] | None = None,
    *,
    source: str = "",
) -> CompiledQuery:
    """Compile query text (or a parsed :class:`~tracelake.query.ast.Query`) to SQL.

    ``params`` binds the query's ``:name`` parameters: ``None``, ``bool``, ``int``,
    ``float``, ``str``, ``datetime`` / ``date``, and lists or tuples of those after
    ``in``. ``runs``, the ids of the complete runs of the catalog the SQL will run on by
    name, lets conditions on ``run`` filter by id (without it they join ``runs``).
    ``source``: the text a parsed query came from, for the excerpts of errors.
    Raises :class:`~tracelake.errors.QuerySyntaxError` or
    :class:`~tracelake.errors.QueryCompileError`; nothing else for any text."""
    text = query if isinstance(query, str) else source
    node = parse(query) if isinstance(query, str) else query
    if not isinstance(node, ast.Query):
        raise TypeError(f"compile_query takes query text or a Query, not {type(query).__name__}")
    values = dict(params or {})
    try:
        return _Compiler(node, values, text, runs).compile()
    except _Refused as exc:
        raise QueryCompileError(
            exc.message,
            line=exc.span.line,
            column=exc.span.column,
            excerpt=exc.span.excerpt(text) if text else "",
        ) from None
    except QueryError:
        raise
    except RecursionError as exc:
        raise QueryCompileError("the query is nested too deeply") from exc


class _Refused(Exception):
    def __init__(self, message: str, span: ast.Span):
        super().__init__(message)
        self.message, self.span = message, span


def _display(expr: ast.Expr) -> str:
    """The default output column name of a select item."""
    if isinstance(expr, ast.Column):
        return expr.name
    if isinstance(expr, ast.MetaRef):
        return "meta." + ".".join(expr.keys)
    if isinstance(expr, ast.GraphRef):
        return f"{expr.direction}.{expr.name}"
    if isinstance(expr, ast.Out):
        return "out"
    if isinstance(expr, ast.OutSlice):
        return "out[" + ", ".join(_index_text(i) for i in expr.index) + "]"
    if isinstance(expr, ast.Call):
        return f"{expr.name}({', '.join(_display(a) for a in expr.args)})"
    if isinstance(expr, ast.Star):
        return "*"
    return repr(expr.value) if isinstance(expr, ast.Literal) else f":{expr.name}"


def _index_text(index: ast.Index) -> str:
    if isinstance(index, ast.SliceSpec):
        text = "" if index.start is None else str(index.start)
        text += ":" + ("" if index.stop is None else str(index.stop))
        return text + ("" if index.step is None else f":{index.step}")
    return "..." if index is ... else str(index)


def _is_aggregate(expr: ast.Expr) -> bool:
    return (
        isinstance(expr, ast.Call)
        and expr.name in AGGREGATES
        and not isinstance(expr.args[0] if expr.args else None, ast.Out | ast.OutSlice)
    )


def _is_tensor(expr: ast.Expr) -> bool:
    if isinstance(expr, ast.Out | ast.OutSlice):
        return True
    return (
        isinstance(expr, ast.Call)
        and len(expr.args) == 1
        and isinstance(expr.args[0], ast.OutSlice)
    )


def _graph_directions(node: Any) -> set[str]:
    """``parent`` / ``child`` as they appear in a predicate's operands."""
    found: set[str] = set()
    for value in _fields(node):
        if isinstance(value, ast.GraphRef):
            found.add(value.direction)
        elif isinstance(value, ast.Node):
            found |= _graph_directions(value)
        elif isinstance(value, tuple):
            for item in value:
                found |= _graph_directions(item)
    return found


def _fields(node: Any) -> tuple[Any, ...]:
    fields = getattr(node, "__dataclass_fields__", {})
    return tuple(getattr(node, name) for name in fields if name != "span")


class _Compiler:
    def __init__(
        self,
        query: ast.Query,
        values: dict[str, Any],
        text: str,
        runs: Mapping[str, int] | None = None,
    ):
        self.query = query
        self.values = values
        self.text = text
        self.runs = runs if self.query.table != "runs" else None
        self.table = query.table
        self.alias = "r" if self.table == "runs" else "t"
        self.columns: dict[str, Kind] = {}
        self.params: list[Any] = []
        self.used: set[str] = set()
        self.needs_runs = False
        self.ctx: _Ctx = "select"
        self.graph: str | None = None
        self.tensors: list[TensorItem] = []

    # driver ---------------------------------------------------------------------------

    def compile(self) -> CompiledQuery:
        q = self.query
        if self.table not in TABLE_NAMES:
            raise _Refused(
                f"unknown table {self.table!r}{closest(self.table, TABLE_NAMES)}"
                f" (tables: {', '.join(TABLE_NAMES)})",
                q.table_span,
            )
        self.columns = COLUMNS[self.table]
        grouped = (
            bool(q.group_by)
            or any(_is_aggregate(i.expr) for i in q.items)
            or any(_is_aggregate(o.expr) for o in q.order_by)
        )
        select, select_params, names = self._clause(lambda: self._select(grouped))
        where, where_params, _ = self._clause(lambda: self._where())
        group, group_params, _ = self._clause(lambda: self._group())
        order, order_params, _ = self._clause(lambda: self._order(grouped, names))
        limit, limit_params, _ = self._clause(lambda: self._limit())
        unused = sorted(set(self.values) - self.used)
        if unused:
            raise QueryCompileError(
                f"parameter {unused[0]!r} is not used in the query{closest(unused[0], self.used)}"
            )
        source, from_params = self._from()
        sql = f"SELECT {select} FROM {source}{where}{group}{order}{limit}"
        params = [
            *select_params,
            *from_params,
            *where_params,
            *group_params,
            *order_params,
            *limit_params,
        ]
        return CompiledQuery(
            sql,
            params,
            tuple(names),
            tuple(self.tensors),
            HIDDEN if self.tensors else (),
            self.table,
            frozenset(self.used),
            None if grouped else self._point(),
            self._scope(),
        )

    def _scope(self) -> frozenset[int] | None:
        """The runs the query can read rows of (see ``CompiledQuery.runs``)."""
        if self.table == "runs":
            return frozenset()
        where = self.query.where
        if self.runs is None or where is None:
            return None
        scope: frozenset[int] | None = None
        for cond in where.items if isinstance(where, ast.And) else (where,):
            ids = None
            if isinstance(cond, ast.Compare) and cond.op == "=":
                ids = self._run_ids(cond.left, (cond.right,)) or self._run_ids(
                    cond.right, (cond.left,)
                )
            elif isinstance(cond, ast.In) and not cond.negated:
                values = cond.values
                if isinstance(values, ast.Param):
                    value = self.values.get(values.name)
                    items = value if isinstance(value, list | tuple) else [value]
                    values = tuple(ast.Literal(v) for v in items)
                ids = self._run_ids(cond.expr, values) if values else []
            if ids is not None:
                known = frozenset(i for i in ids if i is not None)
                scope = known if scope is None else scope & known
        return scope

    def _point(self) -> PointLookup | None:
        """The query as a lookup in the op index, if it is one (after the clauses
        compiled, so every value in it has been checked)."""
        q = self.query
        if (
            self.table != "ops"
            or self.runs is None
            or q.order_by
            or q.group_by
            or not (isinstance(q.where, ast.And) and len(q.where.items) == 2)
        ):
            return None
        keys: dict[str, Any] = {}
        for cond in q.where.items:
            if not (isinstance(cond, ast.Compare) and cond.op == "="):
                return None
            for column, value in ((cond.left, cond.right), (cond.right, cond.left)):
                if isinstance(column, ast.Column) and column.name in ("run", "label"):
                    if isinstance(value, ast.Literal):
                        keys[column.name] = value.value
                    elif isinstance(value, ast.Param):
                        keys[column.name] = self.values.get(value.name)
                    break
        run, label = keys.get("run"), keys.get("label")
        if not (isinstance(run, str) and isinstance(label, str)):
            return None
        fields = []
        for item in q.items:
            if _is_tensor(item.expr):
                fields.append("tensor")
            elif isinstance(item.expr, ast.Column) and item.expr.name in _POINT_COLUMNS:
                fields.append(item.expr.name)
            else:
                return None
        if self.tensors:
            fields += HIDDEN_COLUMNS.values()  # the index's fields are ops columns
        start = self._count(q.offset) or 0
        limit = self._count(q.limit)
        return PointLookup(
            self.runs.get(run, 0),
            label,
            tuple(fields),
            start,
            None if limit is None else start + limit,
        )

    def _count(self, node: ast.Literal | ast.Param | None) -> int | None:
        """A limit's or offset's value (checked by ``_limit``)."""
        if node is None:
            return None
        value = node.value if isinstance(node, ast.Literal) else self.values[node.name]
        return cast(int, value)  # _limit let only integers through

    def _clause(self, build: Callable[[], Any]) -> tuple[Any, list[Any], Any]:
        """Run ``build`` collecting the parameters it binds, in text order."""
        self.params = []
        result = build()
        if isinstance(result, tuple):
            return result[0], self.params, result[1]
        return result, self.params, None

    def visit(self, node: Any) -> Any:
        return getattr(self, f"visit_{type(node).__name__}", self.visit_default)(node)

    def visit_default(self, node: Any) -> Any:
        raise TypeError(f"the query compiler has no rule for {type(node).__name__}")

    def bind(self, value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64:
            value = float(value)  # DuckDB binds nothing wider than a 64-bit integer
        self.params.append(value)
        return "?"

    def _refuse(self, message: str, node: Any) -> _Refused:
        return _Refused(message, getattr(node, "span", ast.NOWHERE))

    # clauses --------------------------------------------------------------------------

    def _select(self, grouped: bool) -> tuple[str, list[str]]:
        self.ctx = "select"
        parts: list[str] = []
        names: list[str] = []
        for item in self.query.items:
            for sql, name in self.visit_SelectItem(item, grouped):
                if name in names:
                    raise self._refuse(
                        f"two result columns are named {name!r}; rename one with 'as'", item
                    )
                parts.append(f"{sql} AS {ident(name)}")
                names.append(name)
        if self.tensors:
            parts += [
                f"{self.alias}.{ident(column)} AS {ident(name)}"
                for name, column in HIDDEN_COLUMNS.items()
            ]
        return ", ".join(parts), names

    def _from(self) -> tuple[str, list[Any]]:
        if self.table == "runs":
            return '"runs" AS r', []
        source = f"{ident(self.table)} AS t"
        if not self.needs_runs:
            return source, []
        return (f'{source} JOIN "runs" AS r ON r."id" = t."run_id" AND r."status" = ?', [COMPLETE])

    def _where(self) -> str:
        self.ctx = "where"
        conds = []
        if self.table == "runs":
            conds.append(f'r."status" = {self.bind(COMPLETE)}')
        if self.query.where is not None:
            conds.append(self.visit(self.query.where))
        return f" WHERE {' AND '.join(conds)}" if conds else ""

    def _group(self) -> str:
        self.ctx = "group"
        if not self.query.group_by:
            return ""
        return " GROUP BY " + ", ".join(self._scalar(e, "group by") for e in self.query.group_by)

    def _order(self, grouped: bool, names: list[str]) -> str:
        self.ctx = "order"
        terms: list[str] = []
        for item in self.query.order_by:
            expr = item.expr
            if (
                isinstance(expr, ast.Column)
                and expr.name not in self.columns
                and any(n.lower() == expr.name for n in names)
            ):
                keys = [ident(next(n for n in names if n.lower() == expr.name))]
            else:
                if grouped and not _is_aggregate(expr) and expr not in self.query.group_by:
                    raise self._refuse(
                        f"{_display(expr)!r} is neither grouped nor aggregated;"
                        " add it to 'group by' or order by an aggregate",
                        item,
                    )
                keys = self.visit_OrderItem(item)
            direction = " DESC" if item.descending else ""
            terms += [k + direction for k in keys]
        return " ORDER BY " + ", ".join(terms) if terms else ""

    def _limit(self) -> str:
        text = ""
        for word, node in (("LIMIT", self.query.limit), ("OFFSET", self.query.offset)):
            if node is None:
                continue
            value = node.value if isinstance(node, ast.Literal) else self._param(node)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64:
                raise self._refuse(
                    f"{word.lower()} takes a non-negative integer, not {value!r}", node
                )
            text += f" {word} {self.bind(value)}"
        return text

    # select items -----------------------------------------------------------------------

    def visit_SelectItem(
        self, item: ast.SelectItem, grouped: bool = False
    ) -> list[tuple[str, str]]:
        expr = item.expr
        if item.alias is not None and item.alias.startswith("__"):
            raise self._refuse(f"names starting with '__' are reserved: {item.alias!r}", item)
        if isinstance(expr, ast.Star):
            if grouped:
                raise self._refuse("'*' cannot be selected with 'group by' or aggregates", item)
            return [(self.visit(ast.Column(c, span=expr.span)), c) for c in star(self.table)]
        name = item.alias or _display(expr)
        if _is_tensor(expr):
            if grouped:
                raise self._refuse(
                    f"{_display(expr)!r} cannot be selected with 'group by' or aggregates", expr
                )
            self.tensors.append(self._tensor_item(expr, name))
            return [(f'{self.alias}."tensor"', name)]
        if grouped and not _is_aggregate(expr) and expr not in self.query.group_by:
            raise self._refuse(
                f"{_display(expr)!r} is neither grouped nor aggregated; add it"
                " to 'group by' or wrap it in an aggregate",
                expr,
            )
        if isinstance(expr, ast.Literal | ast.Param):
            raise self._refuse(
                f"select a column, out, a reduction or an aggregate, not {_display(expr)}", expr
            )
        return [(self.visit(expr), name)]

    def _tensor_item(self, expr: ast.Expr, name: str) -> TensorItem:
        self._require_ops(expr, "out")
        if isinstance(expr, ast.Out):
            return TensorItem(name, "out")
        if isinstance(expr, ast.OutSlice):
            return TensorItem(name, "slice", self._index(expr))
        assert isinstance(expr, ast.Call)
        self._call_shape(expr)
        if expr.name not in REDUCTIONS:
            raise self._refuse(
                f"{expr.name}() does not reduce a tensor; reductions: {', '.join(REDUCTIONS)}", expr
            )
        assert isinstance(expr.args[0], ast.OutSlice)
        return TensorItem(name, "reduce", self._index(expr.args[0]), expr.name)

    def _index(self, expr: ast.OutSlice) -> tuple[int | slice | EllipsisType, ...]:
        if sum(i is ... for i in expr.index) > 1:
            raise self._refuse("an index can have only one '...'", expr)
        return tuple(
            self.visit_SliceSpec(i) if isinstance(i, ast.SliceSpec) else i for i in expr.index
        )

    def visit_SliceSpec(self, node: ast.SliceSpec) -> slice:
        return slice(node.start, node.stop, node.step)

    def visit_OrderItem(self, item: ast.OrderItem) -> list[str]:
        expr = item.expr
        if isinstance(expr, ast.MetaRef):  # numbers numerically, then text
            return [self._meta(expr, "DOUBLE"), self._meta(expr, None)]
        return [self._scalar(expr, "order by")]

    def _scalar(self, expr: ast.Expr, clause: str) -> str:
        if (
            isinstance(expr, ast.Literal | ast.Param | ast.Star | ast.GraphRef)
            or (_is_tensor(expr))
            or (clause == "group by" and _is_aggregate(expr))
        ):
            raise self._refuse(
                f"{clause} takes columns, meta keys, reductions of out"
                f"{'' if clause == 'group by' else ', aggregates, aliases'}; "
                f"not {_display(expr)}",
                expr,
            )
        return str(self.visit(expr))

    # operands ---------------------------------------------------------------------------

    def visit_Column(self, node: ast.Column) -> str:
        if node.name not in self.columns:
            extra = ", out" if self.table == "ops" else ""
            hint = closest(node.name, [*self.columns, *(["out"] if extra else [])])
            raise self._refuse(
                f"unknown column {node.name!r}{hint}"
                if hint
                else f"unknown column {node.name!r}; {self.table} has: "
                f"{', '.join(self.columns)}{extra}",
                node,
            )
        if node.name == "run":
            self.needs_runs = self.needs_runs or self.table != "runs"
            return 'r."name"'
        return f"{self.alias}.{ident(node.name)}"

    def visit_GraphRef(self, node: ast.GraphRef) -> str:
        if self.graph is None:
            where = "ops conditions" if self.table == "ops" else "queries over ops"
            raise self._refuse(
                f"{node.direction}.<column> can only be used in {where} "
                f"(where {node.direction}.func = 'relu')",
                node,
            )
        if node.name not in COLUMNS["ops"]:
            raise self._refuse(
                f"unknown column {node.name!r}{closest(node.name, COLUMNS['ops'])}", node
            )
        if node.name == "run":  # an edge never leaves its run
            return self.visit(ast.Column("run", span=node.span))
        return f"g.{ident(node.name)}"

    def visit_MetaRef(self, node: ast.MetaRef) -> str:
        return self._meta(node, None)

    def _meta(self, node: ast.MetaRef, cast: str | None) -> str:
        self.needs_runs = self.needs_runs or self.table != "runs"
        try:
            path = json_path(node.keys)
        except ValueError as exc:  # only a hand-built AST can get here
            raise self._refuse(str(exc), node) from None
        value = f'json_extract_string(r."meta", {path})'
        return f"TRY_CAST({value} AS {cast})" if cast else value

    def visit_Literal(self, node: ast.Literal) -> str:
        if self.ctx == "select":
            raise self._refuse("values cannot be selected", node)
        return self.bind(node.value)

    def visit_Param(self, node: ast.Param) -> str:
        value = self._param(node)
        if isinstance(value, list | tuple):
            raise self._refuse(f"parameter :{node.name} is a list; lists go after 'in'", node)
        return self.bind(value)

    def _param(self, node: ast.Param) -> Any:
        if node.name not in self.values:
            raise self._refuse(
                f"no value for parameter :{node.name}{closest(node.name, self.values)}", node
            )
        self.used.add(node.name)
        value = self.values[node.name]
        items = value if isinstance(value, list | tuple) else (value,)
        for item in items:
            if not isinstance(item, _SCALARS):
                raise TypeError(
                    f"parameter :{node.name} is a {type(item).__name__}; "
                    "parameters are str, int, float, bool, None, datetime, or "
                    "lists of these after 'in'"
                )
        return value

    def visit_Star(self, node: ast.Star) -> str:
        raise self._refuse("'*' stands only in a select list and in count(*)", node)

    def visit_Out(self, node: ast.Out | ast.OutSlice) -> str:
        raise self._refuse(
            f"{_display(node)} is a tensor: select it, or use a whole-tensor "
            "reduction such as absmax(out) here",
            node,
        )

    visit_OutSlice = visit_Out

    def _require_ops(self, node: Any, what: str) -> None:
        if self.table != "ops":
            raise self._refuse(f"{what} is a column of ops, not of {self.table}", node)

    def _call_shape(self, node: ast.Call) -> None:
        if node.name not in FUNCTIONS:
            raise self._refuse(
                f"unknown function {node.name!r}{closest(node.name, FUNCTIONS)}", node
            )
        if len(node.args) != 1:
            raise self._refuse(f"{node.name}() takes one argument, not {len(node.args)}", node)

    def visit_Call(self, node: ast.Call) -> str:
        self._call_shape(node)
        arg = node.args[0]
        if isinstance(arg, ast.Out) and node.name in REDUCTIONS:
            self._require_ops(node, "out")
            if node.name == "sum":  # mean x element count; a 0-d tensor has one element
                return 'coalesce(t."mean" * list_product(t."shape"), t."mean")'
            return f"t.{ident(STATS[node.name])}"
        if isinstance(arg, ast.OutSlice):
            raise self._refuse(
                f"{_display(node)} reads the tensor, so it can only be "
                "selected; whole-tensor reductions (mean(out)) come from "
                "statistics and can stand anywhere",
                node,
            )
        if node.name not in AGGREGATES:
            raise self._refuse(
                f"{node.name}() reduces out or a slice of it ({node.name}"
                "(out)); over a column use avg, sum, min, max or count",
                node,
            )
        return self._aggregate(node, arg)

    def _aggregate(self, node: ast.Call, arg: ast.Expr) -> str:
        if self.ctx not in ("select", "order"):
            raise self._refuse(
                f"aggregates such as {_display(node)} cannot stand in "
                f"{'where' if self.ctx == 'where' else 'group by'}",
                node,
            )
        if isinstance(arg, ast.Star):
            if node.name != "count":
                raise self._refuse(f"{node.name}(*) is not a thing; count(*) is", node)
            return "count(*)"
        if not isinstance(arg, ast.Column | ast.MetaRef):
            raise self._refuse(
                f"{node.name}() aggregates a column or a meta key, not {_display(arg)}", node
            )
        saved, self.ctx = self.ctx, "aggregate"
        try:
            if isinstance(arg, ast.MetaRef) and node.name in ("avg", "sum"):
                inner = self._meta(arg, "DOUBLE")
            else:
                inner = self.visit(arg)
        finally:
            self.ctx = saved
        function = {"count": "count", "avg": "avg", "sum": "sum", "min": "min", "max": "max"}
        return f"{function[node.name]}({inner})"

    # conditions -------------------------------------------------------------------------

    def _kind(self, expr: Any) -> Kind | None:
        """What an operand holds, to cast meta values to match (None: unknown)."""
        value: Any
        if isinstance(expr, ast.Literal):
            value = expr.value
        elif isinstance(expr, ast.Param):
            value = self.values.get(expr.name)
            if isinstance(value, list | tuple):
                kinds = {self._kind(ast.Literal(v)) for v in value if v is not None}
                return kinds.pop() if len(kinds) == 1 else None
        elif isinstance(expr, ast.Column):
            return self.columns.get(expr.name)
        elif isinstance(expr, ast.GraphRef):
            return COLUMNS["ops"].get(expr.name)
        elif isinstance(expr, ast.Call):
            return "number"
        else:
            return None
        if isinstance(value, bool):
            return "bool"
        if isinstance(value, int | float):
            return "number"
        return None if value is None else "string"

    def _operand(self, expr: ast.Expr, *others: Any) -> str:
        if isinstance(expr, ast.MetaRef):
            kinds = {self._kind(o) for o in others} - {None}
            kind = kinds.pop() if len(kinds) == 1 else None
            cast = {"number": "DOUBLE", "bool": "BOOLEAN"}.get(kind or "")
            return self._meta(expr, cast)
        return str(self.visit(expr))

    def _predicate(self, node: Any, build: Callable[[], str]) -> str:
        """``build()``'s SQL, inside EXISTS over the edges when it names parent./child."""
        directions = _graph_directions(node)
        if not directions:
            return build()
        if len(directions) > 1:
            raise self._refuse(
                "one condition cannot name both parent. and child.; "
                "write one for each, joined with 'and'",
                node,
            )
        if self.table != "ops":
            raise self._refuse(
                "parent. and child. name ops, so they work in queries over ops", node
            )
        self.graph = direction = directions.pop()
        try:
            cond = build()
        finally:
            self.graph = None
        near, far = ("child", "parent") if direction == "parent" else ("parent", "child")
        return (
            f'EXISTS (SELECT * FROM "edges" AS e JOIN "ops" AS g ON g."run_id" = e."run_id"'
            f' AND g."step" = e."step" AND g."idx" = e.{ident(far)} WHERE e."run_id" = '
            f't."run_id" AND e."step" = t."step" AND e.{ident(near)} = t."idx" AND {cond})'
        )

    def visit_Compare(self, node: ast.Compare) -> str:
        for side in (node.left, node.right):
            if isinstance(side, ast.Literal) and side.value is None:
                raise self._refuse("nothing equals null: write 'is null' or 'is not null'", node)
        if node.op in ("=", "<>"):
            for run, other in ((node.left, node.right), (node.right, node.left)):
                ids = self._run_ids(run, (other,))
                if ids is not None:
                    return f'{self.alias}."run_id" {node.op} {self.bind(ids[0])}'
        return self._predicate(
            node,
            lambda: (
                f"{self._operand(node.left, node.right)} {node.op} "
                f"{self._operand(node.right, node.left)}"
            ),
        )

    def visit_Like(self, node: ast.Like) -> str:
        for side in (node.expr, node.pattern):
            if self._kind(side) not in (None, "string"):
                raise self._refuse(f"like compares text; {_display(side)} is not text", side)
        op = ("NOT " if node.negated else "") + ("ILIKE" if node.case_insensitive else "LIKE")
        return self._predicate(
            node, lambda: f"{self._operand(node.expr)} {op} {self._operand(node.pattern)}"
        )

    def visit_In(self, node: ast.In) -> str:
        op = "NOT IN" if node.negated else "IN"
        if isinstance(node.values, ast.Param):
            param = node.values
            value = self._param(param)
            items = list(value) if isinstance(value, list | tuple) else [value]
            values: tuple[ast.Expr, ...] = tuple(ast.Literal(v, span=param.span) for v in items)
        else:
            values = node.values
        if not values:  # an empty list: nothing is in it
            return "FALSE" if not node.negated else "TRUE"
        ids = self._run_ids(node.expr, values)
        if ids is not None:
            return f'{self.alias}."run_id" {op} ({", ".join(self.bind(i) for i in ids)})'

        def build() -> str:
            left = self._operand(node.expr, *values)
            return f"{left} {op} ({', '.join(self._operand(v, node.expr) for v in values)})"

        return self._predicate(node, build)

    def _run_ids(self, expr: ast.Expr, values: tuple[ast.Expr, ...]) -> list[int | None] | None:
        """The ids of the runs named by ``values`` when ``expr`` is ``run`` and the
        compiler knows the runs (null stays null; an unknown name is 0, so that it
        compares false, never null); None when the condition must join ``runs``."""
        if self.runs is None or not (isinstance(expr, ast.Column) and expr.name == "run"):
            return None
        names = []
        for value in values:
            if isinstance(value, ast.Param) and value.name in self.values:
                name = self._param(value)
            elif isinstance(value, ast.Literal):
                name = value.value
            else:
                return None
            if name is not None and not isinstance(name, str):
                return None  # a list (refused later) or a non-text value: as written
            names.append(name)
        return [None if n is None else self.runs.get(n, 0) for n in names]

    def visit_Between(self, node: ast.Between) -> str:
        op = "NOT BETWEEN" if node.negated else "BETWEEN"
        return self._predicate(
            node,
            lambda: (
                f"{self._operand(node.expr, node.low, node.high)} {op} "
                f"{self._operand(node.low, node.expr)} AND {self._operand(node.high, node.expr)}"
            ),
        )

    def visit_IsNull(self, node: ast.IsNull) -> str:
        op = "IS NOT NULL" if node.negated else "IS NULL"
        return self._predicate(node, lambda: f"{self._operand(node.expr)} {op}")

    def visit_BoolTest(self, node: ast.BoolTest) -> str:
        expr = node.expr
        if isinstance(expr, ast.MetaRef):
            return self._meta(expr, "BOOLEAN")
        if self._kind(expr) != "bool":
            raise self._refuse(
                f"{_display(expr)} is not true or false; compare it ({_display(expr)} = ...)", node
            )
        return self._predicate(node, lambda: str(self.visit(expr)))

    def visit_Not(self, node: ast.Not) -> str:
        return f"NOT ({self.visit(node.cond)})"

    def visit_And(self, node: ast.And) -> str:
        return "(" + " AND ".join(self.visit(c) for c in node.items) + ")"

    def visit_Or(self, node: ast.Or) -> str:
        return "(" + " OR ".join(self.visit(c) for c in node.items) + ")"

    def visit_Query(self, node: ast.Query) -> CompiledQuery:
        return _Compiler(node, self.values, self.text, self.runs).compile()
