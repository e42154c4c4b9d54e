"""AST → parameterised DuckDB SQL, and the plan for what SQL cannot do.

Every value (literals, ``:name`` parameters, the ``complete`` status) is a bound ``?``
parameter; every identifier is looked up in :mod:`.schema` and quoted by its one quoting
function (the keys of ``meta.a.b`` are checked identifiers, written as a JSON path
constant so that DuckDB sees ``meta.a`` in ``select`` and ``group by`` as one
expression); table aliases never reach the SQL (the tables of a join are ``t0``,
``t1``…); the SQL is one ``SELECT`` over the catalog tables and nothing else. Each AST
node class has a ``visit_<Class>`` rule (operands and conditions in :mod:`.operands`);
a class without one reaches ``visit_default``, which raises.

The SQL runs on the reader's catalog mirror, which holds the rows of complete runs only;
``runs`` keeps every status, so reading it (directly, or joined for ``run`` and ``meta``)
filters ``status = 'complete'``. Given the complete runs' ids by name (``runs``), a
condition ``run = X``, ``run != X`` or ``run [not] in (...)`` on another table compares
``run_id`` with the ids of those names instead, and needs no join: DuckDB then skips
every row group of other runs (an unknown name stands for id 0, which no run has).

Tensor-pair functions (``max_abs_diff(a.out, b.out)``) are computed by the executor on
the rows the SQL returns (:mod:`.plan`): a ``where`` conjunct naming one, or an ``order
by`` naming one, moves to the executor with the ``limit``; otherwise the SQL keeps its
limit and tensors are read for the rows it returns only.

What the SQL returns, in order: ``columns`` (the visible ones; a tensor item's column
holds the op's tensor slot, for the executor to replace), then ``hidden``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

from tracelake.errors import QueryCompileError, QueryError, QueryTypeError
from tracelake.store.catalog import COMPLETE
from tracelake.store.points import FIELDS as POINT_FIELDS

from . import ast
from .operands import (
    Refused,
    Source,
    compile_error,
    is_aggregate,
    is_tensor,
    predicate_operands,
    unknown_function,
    walk,
)
from .pairs import PairRules, reads_pairs
from .parser import INT64, parse
from .plan import (
    Apply,
    CompiledQuery,
    PointLookup,
    Post,
    Ref,
    TensorItem,
)
from .printer import expr_text
from .schema import (
    COLUMNS,
    FUNCTIONS,
    HIDDEN_COLUMNS,
    PAIR_FUNCTIONS,
    QUALIFIERS,
    REDUCTIONS,
    TABLE_NAMES,
    closest,
    ident,
    star,
)

__all__ = ["CompiledQuery", "PointLookup", "TensorItem", "compile_query"]

#: Columns of ops a point lookup can select: the op index's fields (``run``: by its id).
_POINT_COLUMNS = frozenset({"run", *POINT_FIELDS} - {"run_id"})


#: Each op's latest gradient: the ``grads`` row of its last fire (its last backward
#: call), which ``grad`` and its reductions read; every fire is a row of ``grads``.
_LATEST_GRADS = (
    '(SELECT * FROM "grads" QUALIFY row_number() OVER '
    '(PARTITION BY "run_id", "step", "idx" ORDER BY "fire" DESC) = 1)'
)

#: More ``and`` / ``or`` terms than this in one filter and DuckDB's optimizer, which
#: rewrites each conjunction term by term, costs time quadratic (and worse) in their
#: number: 1,000 terms 2.4 s, 20,000 ~50 s. Behind a CASE it evaluates them as written.
_MANY_TERMS = 128


def _filter(sql: str) -> str:
    """A ``where`` / ``having`` condition's SQL; a long one hidden from DuckDB's
    optimizer (as a filter the two are the same: both keep only the rows where the
    condition is true, null counting as false)."""
    if sql.count(" AND ") + sql.count(" OR ") <= _MANY_TERMS:
        return sql
    return f"(CASE WHEN {sql} THEN true ELSE false END)"


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
        raise QueryTypeError(
            f"compile_query takes query text or a Query, not {type(query).__name__}"
        )
    values = dict(params or {})
    try:
        return _Compiler(node, values, text, runs).compile()
    except Refused as exc:
        raise compile_error(exc, text) from None
    except QueryError:
        raise
    except RecursionError as exc:
        raise QueryCompileError("the query is nested too deeply") from exc


def _contains_aggregate(node: Any) -> bool:
    return any(is_aggregate(n) for n in walk(node))


class _Compiler(PairRules):
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
        self.runs = runs
        self.params: list[Any] = []
        self.used: set[str] = set()
        self.ctx = "select"
        self.graph = None
        self.touched: set[tuple[int, bool]] = set()
        self.tensors: list[TensorItem] = []
        self.sources = self._sources()
        nodes = walk(query)  # what the query names at all, once
        calls = [n for n in nodes if n.__class__ is ast.Call]
        self.graphs = any(n.__class__ is ast.GraphRef for n in nodes)
        self.pairs = any(c.name in PAIR_FUNCTIONS for c in calls)
        self.aggregates = any(is_aggregate(c) for c in calls)
        self.joined = len(self.sources) > 1
        self.merged = {c.name for j in query.joins for c in j.using}
        self.located: set[int] = set()  # where the tensors the executor reads lie
        self.grads: set[int] = set()
        self.post_columns: list[tuple[str, list[Any]]] = []  # __e<n>: SQL, params
        self.post_where: Post | None = None
        self.post_order: tuple[tuple[Post, bool], ...] = ()
        self.post_limit: tuple[int, int | None] | None = None
        self.moved: list[tuple[str, list[Any]]] = []  # join conditions moved to where
        self.names: list[str] = []
        self.aliases: dict[str, str] = {}  # result column -> its name in the SQL

    # tables -------------------------------------------------------------------------------

    def _sources(self) -> list[Source]:
        q = self.query
        refs = [
            (q.table, q.alias, q.table_span),
            *((j.table.name, j.table.alias, j.table.span) for j in q.joins),
        ]
        joined = len(refs) > 1
        sources: list[Source] = []
        for k, (table, alias, span) in enumerate(refs):
            if table not in TABLE_NAMES:
                raise Refused(
                    f"unknown table {table!r}{closest(table, TABLE_NAMES)}"
                    f" (tables: {', '.join(TABLE_NAMES)})",
                    span,
                )
            name = alias or table
            if name in QUALIFIERS:
                raise Refused(f"{name!r} cannot name a table: {name}. qualifies names", span)
            if any(s.name == name for s in sources):
                raise Refused(
                    f"two tables are named {name!r}: give each an alias ({table} a join {table} b)",
                    span,
                )
            if joined:
                sql = f"t{k}"
                runs_sql = sql if table == "runs" else f"r{k}"
            else:
                sql = runs_sql = "r" if table == "runs" else "t"
                runs_sql = "r"
            sources.append(Source(k, table, name, sql, runs_sql, COLUMNS[table], span))
        return sources

    # driver ---------------------------------------------------------------------------

    def compile(self) -> CompiledQuery:
        q = self.query
        grouped = bool(q.group_by) or (
            self.aggregates
            and (
                any(_contains_aggregate(i.expr) for i in q.items)
                or any(_contains_aggregate(o.expr) for o in q.order_by)
            )
        )
        self._check_shape(grouped)
        select, select_params, names = self._clause(lambda: self._select(grouped))
        self.names = names
        joins = []
        for k in range(1, len(self.sources)):
            on, on_params, _ = self._clause(functools.partial(self._join, k))
            joins.append((on, on_params))
        where, where_params, _ = self._clause(self._where)
        group, group_params, _ = self._clause(self._group)
        having, having_params, _ = self._clause(lambda: self._having(grouped))
        order, order_params, _ = self._clause(lambda: self._order(grouped))
        limit, limit_params, _ = self._clause(self._limit)
        unused = sorted(set(self.values) - self.used)
        if unused:
            raise QueryCompileError(
                f"parameter {unused[0]!r} is not used in the query{closest(unused[0], self.used)}"
            )
        hidden = self._hidden()
        select += "".join(f", {sql} AS {ident(name)}" for name, sql in hidden)
        source, from_params = self._from(joins)
        distinct = "DISTINCT " if q.distinct else ""
        sql = f"SELECT {distinct}{select} FROM {source}{where}{group}{having}{order}{limit}"
        params = [
            *select_params,
            *(p for _, params in self.post_columns for p in params),
            *from_params,
            *where_params,
            *group_params,
            *having_params,
            *order_params,
            *limit_params,
        ]
        post = self.post_where is not None or bool(self.post_order)
        return CompiledQuery(
            sql,
            params,
            tuple(names),
            tuple(self.tensors),
            tuple(name for name, _ in hidden),
            self.sources[0].table,
            frozenset(self.used),
            None if grouped or post or self.joined or q.distinct or self.grads else self._point(),
            self._scope(),
            self._suffixes(),
            self.post_where,
            self.post_order,
            self.post_limit,
            tuple(self.aliases[n] for n in names),
        )

    def _check_shape(self, grouped: bool) -> None:
        """Refuse what no clause can answer: pairs of tensors grouped or made distinct,
        having without groups."""
        q = self.query
        for node in walk(
            (q.items, q.where, q.group_by, q.having, q.order_by) if self.pairs else ()
        ):
            if (
                isinstance(node, ast.Call)
                and node.name in PAIR_FUNCTIONS
                and (grouped or q.distinct)
            ):
                raise self.refuse(
                    f"{node.name}() compares the tensors of each row, after the SQL: it "
                    "cannot be grouped, aggregated or made distinct (summarise the "
                    "result's .df() instead)",
                    node,
                )
        if q.having is not None and not grouped:
            raise self.refuse(
                "having filters groups: add group by (or aggregates), or filter rows with where",
                q.having,
            )

    def _suffixes(self) -> tuple[str, ...]:
        """The suffix of each location's hidden columns (see ``tensor_location``): a
        table's place in a join; ``_g<k>`` for the gradients of table ``k``."""
        tables = tuple(f"_{s.index}" for s in self.sources) if self.joined else ("",)
        if not self.grads:
            return tables
        return tables + tuple(f"_g{s.index}" for s in self.sources)

    def _location_sql(self, location: int) -> str:
        """The SQL alias of the rows holding ``location``'s tensors."""
        n = len(self.sources)
        if location >= n:
            return self.grad_row(self.sources[location - n])
        return self.sources[location].sql

    def _hidden(self) -> list[tuple[str, str]]:
        """(name, SQL) of the hidden columns: each located tensor's location, then the
        expressions the executor reads."""
        hidden = []
        suffixes = self._suffixes()
        for location in sorted(self.located):
            sql = self._location_sql(location)
            hidden += [
                (name + suffixes[location], f"{sql}.{ident(column)}")
                for name, column in HIDDEN_COLUMNS.items()
            ]
        hidden += [(f"__e{n}", sql) for n, (sql, _) in enumerate(self.post_columns)]
        return hidden

    def _scope(self) -> frozenset[int] | None:
        """The runs the query can read rows of (see ``CompiledQuery.runs``)."""
        tables = [s for s in self.sources if s.table != "runs"]
        if not tables:
            return frozenset()
        where = self.query.where
        if self.runs is None or where is None:
            return None
        scopes: dict[int, frozenset[int]] = {}
        for cond in where.items if isinstance(where, ast.And) else (where,):
            found = None
            if isinstance(cond, ast.Compare) and cond.op == "=":
                found = self.run_ids(cond.left, (cond.right,)) or self.run_ids(
                    cond.right, (cond.left,)
                )
            elif isinstance(cond, ast.In) and not cond.negated:
                values = cond.values
                if isinstance(values, ast.Param):
                    value = self.values.get(values.name)
                    items = value if isinstance(value, list | tuple) else [value]
                    values = tuple(ast.Literal(v) for v in items)
                found = self.run_ids(cond.expr, values, not isinstance(cond.values, ast.Param))
            if found is not None:
                src, ids = found
                known = frozenset(i for i in ids if i is not None)
                scopes[src.index] = scopes.get(src.index, known) & known
        if any(s.index not in scopes for s in tables):
            return None
        return frozenset().union(*scopes.values())

    def _point(self) -> PointLookup | None:
        """The query as a lookup in the op index, if it is one (after the clauses
        compiled, so every value in it has been checked)."""
        q = self.query
        if (
            q.table != "ops"
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
            if is_tensor(item.expr):
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

    # from -----------------------------------------------------------------------------

    def _join(self, k: int) -> str:
        """Join ``k``'s condition. ``using (c, ...)`` pairs rows whose columns ``c``
        are equal and, for tables with steps, whose steps are (as ``store.compare``
        pairs step k with step k); ``on`` is as written. A condition naming a later
        table, or the ``run`` / ``meta`` of its own, cannot stand in its join's ``on``
        and moves to ``where`` (an inner join means the same either way)."""
        self.ctx = "on"
        self.touched = set()
        sql = self.visit_Join(self.query.joins[k - 1])
        if any(i > k or (i == k and runs) for i, runs in self.touched):
            self.moved.append((sql, self.params))
            self.params = []
            return ""
        return sql

    def visit_Join(self, join: ast.Join) -> str:
        k = 1 + self.query.joins.index(join)
        src = self.sources[k]
        if join.on is not None:
            return str(self.visit(join.on))
        columns = list(join.using)
        if "step" in src.columns and all(c.name != "step" for c in columns):
            columns.append(ast.Column("step", span=join.span))
        conds = []
        for column in columns:
            left = next((s for s in self.sources[:k] if column.name in s.columns), None)
            if left is None or column.name not in src.columns:
                missing = src if left is not None else self.sources[0]
                raise self.refuse(
                    f"using ({column.name}): {missing.name} ({missing.table}) has no column "
                    f"{column.name!r}{closest(column.name, missing.columns)}",
                    column,
                )
            name = "run_id" if column.name == "run" and "run_id" in src.columns else column.name
            conds.append(f"{left.sql}.{ident(name)} = {src.sql}.{ident(name)}")
        return " AND ".join(conds)

    def visit_TableRef(self, ref: ast.TableRef) -> str:
        if ref.name not in TABLE_NAMES:
            raise self.refuse(f"unknown table {ref.name!r}", ref)
        return ident(ref.name)

    def _from(self, joins: list[tuple[str, list[Any]]]) -> tuple[str, list[Any]]:
        if not self.joined and self.sources[0].table == "runs":
            return '"runs" AS r', []
        parts: list[str] = []
        params: list[Any] = []
        for src in self.sources:
            table = f"{self.visit_TableRef(ast.TableRef(src.table))} AS {src.sql}"
            if src.index == 0:
                parts.append(table)
            else:
                on, on_params = joins[src.index - 1]
                parts.append(f" JOIN {table} ON {on}" if on else f" CROSS JOIN {table}")
                params += on_params
            if src.needs_runs and src.table != "runs":
                r = src.runs_sql
                parts.append(
                    f' JOIN "runs" AS {r} ON {r}."id" = {src.sql}."run_id" AND {r}."status" = ?'
                )
                params.append(COMPLETE)
            if src.index in self.grads:
                g, t = self.grad_row(src), src.sql
                parts.append(
                    f" LEFT JOIN {_LATEST_GRADS} AS {g} ON "
                    + " AND ".join(f'{g}."{c}" = {t}."{c}"' for c in ("run_id", "step", "idx"))
                )
        return "".join(parts), params

    # clauses --------------------------------------------------------------------------

    def _select(self, grouped: bool) -> tuple[str, list[str]]:
        self.ctx = "select"
        parts: list[str] = []
        names: list[str] = []
        for item in self.query.items:
            # a column named after an expression with a value in it (l2 * 2) is named
            # by its place in the SQL: values reach the SQL as parameters only
            valued = (
                item.alias is None
                and item.expr.__class__ not in (ast.Column, ast.Out, ast.Star)
                and any(isinstance(n, ast.Literal | ast.Param) for n in walk(item.expr))
            )
            for sql, name in self.visit_SelectItem(item, grouped):
                if name in names:
                    raise self.refuse(
                        f"two result columns are named {name!r}; rename one with 'as'", item
                    )
                alias = f"__c{len(names)}" if valued else name
                parts.append(f"{sql} AS {ident(alias)}")
                names.append(name)
                self.aliases[name] = alias
        return ", ".join(parts), names

    def _where(self) -> str:
        self.ctx = "where"
        conds = [
            f'{s.sql}."status" = {self.bind(COMPLETE)}' for s in self.sources if s.table == "runs"
        ]
        for sql, params in self.moved:
            conds.append(sql)
            self.params += params
        where = self.query.where
        if where is not None:
            items = where.items if isinstance(where, ast.And) else (where,)
            posted = [c for c in items if self.pairs and reads_pairs(c)]
            kept = [c for c in items if c not in posted]
            if posted:
                self.post_where = (
                    self._post(posted[0])
                    if len(posted) == 1
                    else Apply("and", tuple(self._post(c) for c in posted))
                )
                if kept:
                    conds.append(
                        _filter(self.visit(kept[0] if len(kept) == 1 else ast.And(tuple(kept))))
                    )
            else:
                conds.append(_filter(self.visit(where)))
        return f" WHERE {' AND '.join(conds)}" if conds else ""

    def _group(self) -> str:
        self.ctx = "group"
        if not self.query.group_by:
            return ""
        return " GROUP BY " + ", ".join(self._scalar(e, "group by") for e in self.query.group_by)

    def _having(self, grouped: bool) -> str:
        having = self.query.having
        if having is None:
            return ""
        self.ctx = "having"
        for node in walk(having):
            if isinstance(
                node, ast.Compare | ast.Like | ast.In | ast.Between | ast.IsNull | ast.BoolTest
            ):
                for expr in predicate_operands(node):
                    self._require_grouped(expr, "having")
        return f" HAVING {_filter(self.visit(having))}"

    def _grouped_ok(self, expr: ast.Expr) -> bool:
        """Whether ``expr`` has one value per group."""
        if expr in self.query.group_by or is_aggregate(expr):
            return True
        if isinstance(expr, ast.Literal | ast.Param) or self.output_alias(expr) is not None:
            return True
        if isinstance(expr, ast.Binary):
            return self._grouped_ok(expr.left) and self._grouped_ok(expr.right)
        if isinstance(expr, ast.Neg):
            return self._grouped_ok(expr.expr)
        if isinstance(expr, ast.Call) and expr.name == "abs" and len(expr.args) == 1:
            return self._grouped_ok(expr.args[0])
        return False

    def _require_grouped(self, expr: ast.Expr, where: str) -> None:
        if not self._grouped_ok(expr):
            # a misspelt aggregate (stddev, median) is a misspelt function, not an
            # ungrouped one: say so first
            for node in walk(expr):
                if isinstance(node, ast.Call) and node.name not in FUNCTIONS:
                    raise self.refuse(unknown_function(node.name), node)
            hint = "order by an aggregate" if where == "order" else "wrap it in an aggregate"
            raise self.refuse(
                f"{expr_text(expr)!r} is neither grouped nor aggregated; add it to "
                f"'group by' or {hint}",
                expr,
            )

    def _order(self, grouped: bool) -> str:
        self.ctx = "order"
        items = self.query.order_by
        values = {t.column: t for t in self.tensors if t.kind == "value"}
        if self.pairs and any(self.names_pairs(o.expr) for o in items):
            self.post_order = tuple((self._post_key(o.expr, values), o.descending) for o in items)
            return ""
        terms: list[str] = []
        for item in items:
            expr = item.expr
            name = self._alias_name(expr)
            if name is not None:
                keys = [ident(self.aliases[name])]
            else:
                if self.query.distinct and all(expr != i.expr for i in self.query.items):
                    raise self.refuse(
                        f"with distinct, order by what is selected; {expr_text(expr)} is not",
                        item,
                    )
                if grouped:
                    self._require_grouped(expr, "order")
                keys = self.visit_OrderItem(item)
            direction = " DESC" if item.descending else ""
            terms += [k + direction for k in keys]
        return " ORDER BY " + ", ".join(terms) if terms else ""

    def _alias_name(self, expr: ast.Expr) -> str | None:
        """The result column an order key names (``order by d`` after ``... as d``)."""
        if self.output_alias(expr) is None:
            return None
        assert isinstance(expr, ast.Column)
        return next(n for n in self.names if n.lower() == expr.name)

    def _post_key(self, expr: ast.Expr, values: dict[str, TensorItem]) -> Post:
        name = self._alias_name(expr)
        if name is None:
            return self._post(expr)
        item = values.get(name)
        if item is not None and item.expr is not None:
            return item.expr
        if any(t.column == name for t in self.tensors):
            raise self.refuse(f"{name} is a tensor; order by a number", expr)
        return Ref(name)  # the executor reads the result by its visible names

    def _limit(self) -> str:
        text = ""
        counts: dict[str, int] = {}
        for word, node in (("LIMIT", self.query.limit), ("OFFSET", self.query.offset)):
            if node is None:
                continue
            value = node.value if isinstance(node, ast.Literal) else self.param(node)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64:
                raise self.refuse(
                    f"{word.lower()} takes a non-negative integer, not {value!r}", node
                )
            counts[word] = value
            text += f" {word} {self.bind(value)}"
        if self.post_where is None and not self.post_order:
            return text
        self.params.clear()  # the executor applies them, after the tensor-pair functions
        if counts:
            self.post_limit = (counts.get("OFFSET", 0), counts.get("LIMIT"))
        return ""

    # select items -----------------------------------------------------------------------

    def visit_SelectItem(
        self, item: ast.SelectItem, grouped: bool = False
    ) -> list[tuple[str, str]]:
        expr = item.expr
        if item.alias is not None and item.alias.startswith("__"):
            raise self.refuse(f"names starting with '__' are reserved: {item.alias!r}", item)
        if isinstance(expr, ast.Star):
            if grouped:
                raise self.refuse("'*' cannot be selected with 'group by' or aggregates", item)
            if self.joined:
                raise self.refuse(
                    "'*' in a join: name the columns of each table "
                    f"({', '.join(s.name + '.label' for s in self.sources)})",
                    item,
                )
            table = self.sources[0].table
            return [(self.visit(ast.Column(c, span=expr.span)), c) for c in star(table)]
        name = item.alias or expr_text(expr)
        if self.pairs and reads_pairs(expr):
            self.tensors.append(TensorItem(name, "value", expr=self._post(expr)))
            return [("NULL", name)]
        if is_tensor(expr):
            if grouped or self.query.distinct:
                raise self.refuse(
                    f"{expr_text(expr)!r} cannot be selected with 'group by', aggregates or "
                    "distinct",
                    expr,
                )
            item_ = self._tensor_item(expr, name)
            self.tensors.append(item_)
            return [(f'{self._location_sql(item_.source)}."tensor"', name)]
        if grouped:
            self._require_grouped(expr, "select")
        if isinstance(expr, ast.Literal | ast.Param):
            raise self.refuse(
                f"select a column, out, a reduction or an aggregate, not {expr_text(expr)}", expr
            )
        return [(self.visit(expr), name)]

    def _tensor_item(self, expr: ast.Expr, name: str) -> TensorItem:
        if isinstance(expr, ast.Out):
            return TensorItem(name, "out", source=self.tensor_location(expr))
        if isinstance(expr, ast.OutSlice):
            location = self.tensor_location(expr)
            return TensorItem(name, "slice", self.index_of(expr), source=location)
        assert isinstance(expr, ast.Call) and isinstance(expr.args[0], ast.OutSlice)
        if expr.name not in FUNCTIONS:
            raise self.refuse(unknown_function(expr.name), expr)
        if expr.name not in REDUCTIONS:
            raise self.refuse(
                f"{expr.name}() does not reduce a tensor; reductions: {', '.join(REDUCTIONS)}", expr
            )
        location = self.tensor_location(expr.args[0])
        return TensorItem(name, "reduce", self.index_of(expr.args[0]), expr.name, location)

    def visit_OrderItem(self, item: ast.OrderItem) -> list[str]:
        expr = item.expr
        if isinstance(expr, ast.MetaRef):  # numbers numerically, then text
            return [self.meta(expr, "DOUBLE"), self.meta(expr, None)]
        return [self._scalar(expr, "order by")]

    def _scalar(self, expr: ast.Expr, clause: str) -> str:
        if (
            isinstance(expr, ast.Literal | ast.Param | ast.Star | ast.GraphRef)
            or is_tensor(expr)
            or (clause == "group by" and _contains_aggregate(expr))
        ):
            raise self.refuse(
                f"{clause} takes columns, meta keys, reductions of out"
                f"{'' if clause == 'group by' else ', aggregates, aliases'}; "
                f"not {expr_text(expr)}",
                expr,
            )
        return str(self.visit(expr))

    def visit_Query(self, node: ast.Query) -> CompiledQuery:
        return _Compiler(node, self.values, self.text, self.runs).compile()
