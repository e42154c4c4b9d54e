"""Query text → :class:`~tracelake.query.ast.Query`.

The LALR parser is built once, at import, from ``grammar.lark``, with a builder called
at each reduction that makes nodes with source spans taken from the tokens. The builder
only builds nodes; what they mean is the compiler's business. Text is parsed by
:class:`~.lalr.LeanLALR` over Lark's own tables; text it refuses goes through Lark
itself, so that Lark's exceptions describe it. They never leave :func:`parse`: they
become :class:`~tracelake.errors.QuerySyntaxError` with the line, the column, the tokens
that could have stood there and a caret excerpt.
"""

from __future__ import annotations

import difflib
import re
from typing import Any
from typing import Literal as Lit

from lark import Lark, Token
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from tracelake.errors import QueryError, QuerySyntaxError, QueryTypeError

from . import ast
from .lalr import LeanLALR

__all__ = ["parse"]

INT64 = 2**63 - 1
KEYWORDS = frozenset(
    {
        "select",
        "distinct",
        "from",
        "join",
        "using",
        "on",
        "having",
        "where",
        "group",
        "order",
        "by",
        "asc",
        "desc",
        "limit",
        "offset",
        "as",
        "and",
        "or",
        "not",
        "like",
        "ilike",
        "in",
        "between",
        "is",
        "null",
        "true",
        "false",
        "out",
        "grad",
    }
)


class _Misplaced(Exception):
    """Raised inside the transformer for text that the grammar accepts but the language
    does not (``foo.bar``, ``out[1.5]``); :func:`parse` turns it into a syntax error."""

    def __init__(self, message: str, span: ast.Span, expected: tuple[str, ...] = ()):
        super().__init__(message)
        self.message, self.span, self.expected = message, span, expected


def _first(part: Any) -> tuple[int, int, int] | None:
    if part.__class__ is Token or isinstance(part, Token):
        return part.line or 1, part.column or 1, part.start_pos or 0
    if isinstance(part, ast.Node):
        return part.span.line, part.span.column, part.span.start
    if isinstance(part, tuple) and part:
        return _first(part[0])
    return None


def _last(part: Any) -> tuple[int, int, int] | None:
    if part.__class__ is Token or isinstance(part, Token):
        return part.end_line or 1, part.end_column or 1, part.end_pos or 0
    if isinstance(part, ast.Node):
        return part.span.end_line, part.span.end_column, part.span.end
    if isinstance(part, tuple) and part:
        return _last(part[-1])
    return None


def _cover(*parts: Any) -> ast.Span:
    """The span from the first to the last part that has a place in the text (tokens,
    nodes, tuples of them). Spans come from tokens rather than from Lark's
    ``propagate_positions``, which costs a third of the parse."""
    start = end = None
    for part in parts:  # plain loops: this runs for most nodes of every query
        start = _first(part)
        if start is not None:
            break
    for part in reversed(parts):
        end = _last(part)
        if end is not None:
            break
    if start is None or end is None:
        return ast.NOWHERE
    return ast.Span(start[0], start[1], end[0], end[1], start[2], end[2])


def _span(part: Token | ast.Node) -> ast.Span:
    """The span of one token or node (the common case of :func:`_cover`, made cheap)."""
    if part.__class__ is Token:
        tok: Any = part
        return ast.Span(
            tok.line, tok.column, tok.end_line, tok.end_column, tok.start_pos, tok.end_pos
        )
    return part.span  # type: ignore[union-attr]


def _chain(kind: type[ast.And] | type[ast.Or], conditions: tuple[Any, ...]) -> tuple[Any, ...]:
    """The items of ``a and b and c`` (``kind``: ``And`` or ``Or``); a parenthesised
    chain of the same kind that comes first is flattened into it, as
    ``(a and b) and c`` has always read."""
    items: list[Any] = [_condition(c) for c in conditions]
    if type(items[0]) is kind:
        items[:1] = items[0].items
    return tuple(items)


def _join(first: Token | ast.Node, last: Token | ast.Node) -> ast.Span:
    """The span from the start of ``first`` to the end of ``last``."""
    a, b = _span(first), _span(last)
    return ast.Span(a.line, a.column, b.end_line, b.end_column, a.start, b.end)


def _integer(node: ast.Literal, what: str) -> int:
    value = node.value
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Misplaced(f"{what} must be an integer, not {value!r}", node.span, ("an integer",))
    if abs(value) > INT64:
        raise _Misplaced(f"{what} {value} is out of range", node.span, ("an integer",))
    return value


def _name(tok: Token) -> str:
    """A table, column, function or alias name: keywords are reserved there (Lark's
    contextual lexer reads a keyword as a name wherever the keyword could not stand;
    only meta keys may be spelled like keywords)."""
    if str(tok).lower() in KEYWORDS:
        raise _Misplaced(
            f"Unexpected keyword {str(tok)!r} at line {tok.line}, column {tok.column}",
            _cover(tok),
            ("a name",),
        )
    return str(tok)


#: A table alias that is a keyword taking a number, glued to it.
_GLUED = re.compile(r"(limit|offset)\d+", re.IGNORECASE)

_CONDITIONS = (
    ast.Compare,
    ast.Like,
    ast.In,
    ast.Between,
    ast.IsNull,
    ast.BoolTest,
    ast.Not,
    ast.And,
    ast.Or,
)


def _expr(node: Any) -> ast.Expr:
    """``node`` where a value must stand: a parenthesised condition cannot."""
    if isinstance(node, _CONDITIONS):
        raise _Misplaced(
            "a condition cannot stand where a value is expected; conditions go in "
            "where, on and having",
            node.span,
        )
    return node  # type: ignore[no-any-return]


def _condition(node: Any) -> ast.Condition:
    """``node`` where a condition must stand: a bare value is a boolean test."""
    if isinstance(node, _CONDITIONS):
        return node  # type: ignore[no-any-return]
    return ast.BoolTest(node, span=node.span)


def _graph(
    qualifier: str, names: tuple[Token, ...], table: str | None, span: ast.Span
) -> ast.GraphRef:
    if len(names) != 1:
        raise _Misplaced(f"{qualifier}.<column> takes one column name", _cover(names[1]))
    direction: Lit["parent", "child"] = "parent" if qualifier == "parent" else "child"
    return ast.GraphRef(direction, _name(names[0]).lower(), table, span=span)


class _Build:
    """Reduction callbacks that build AST nodes, nothing else: one method per rule (or
    alias), called with the rule's children as arguments."""

    def start(
        self,
        distinct: Token | None,
        items: tuple[ast.SelectItem, ...],
        table: ast.TableRef,
        *clauses: Any,
    ) -> ast.Query:
        joins = tuple(c for c in clauses if isinstance(c, ast.Join))
        parts: dict[str, Any] = {c[0]: c[1:] for c in clauses if not isinstance(c, ast.Join)}
        limit, offset = parts.get("limit", (None, None))
        return ast.Query(
            items,
            table.name,
            where=parts.get("where", (None,))[0],
            group_by=parts.get("group_by", ((),))[0],
            order_by=parts.get("order_by", ((),))[0],
            limit=limit,
            offset=offset,
            span=_cover(distinct, items, table, *clauses),
            table_span=table.span,
            alias=table.alias,
            joins=joins,
            having=parts.get("having", (None,))[0],
            distinct=distinct is not None,
        )

    def table_ref(self, name: Token, alias: Token | None) -> ast.TableRef:
        if alias is None:
            return ast.TableRef(_name(name).lower(), span=_span(name))
        glued = _GLUED.fullmatch(str(alias))
        if glued:  # `from ops limit10` reads as an alias; meant is `limit 10`
            raise _Misplaced(
                f"Unexpected {str(alias)!r}: if {glued.group(1)!r} is meant as the keyword, "
                "put a space after it",
                _cover(alias),
                (glued.group(1).upper(),),
            )
        return ast.TableRef(_name(name).lower(), _name(alias).lower(), span=_join(name, alias))

    def alias(self, name: Token) -> Token:
        return name

    def join_using(self, table: ast.TableRef, *names: Token) -> ast.Join:
        columns = tuple(ast.Column(_name(n).lower(), span=_span(n)) for n in names[:-1])
        return ast.Join(table, columns, span=_join(table, names[-1]))

    def join_on(self, table: ast.TableRef, cond: ast.Condition) -> ast.Join:
        return ast.Join(table, on=_condition(cond), span=_join(table, cond))

    def having(self, cond: ast.Condition) -> tuple[str, ast.Condition]:
        return ("having", _condition(cond))

    def select_list(self, *items: ast.SelectItem) -> tuple[ast.SelectItem, ...]:
        return items

    def select_star(self, star: Token) -> ast.SelectItem:
        span = _span(star)
        return ast.SelectItem(ast.Star(span=span), span=span)

    def select_expr(self, expr: ast.Expr, alias: Token | None) -> ast.SelectItem:
        expr = _expr(expr)
        if alias is None:
            return ast.SelectItem(expr, None, span=expr.span)
        return ast.SelectItem(expr, _name(alias), span=_join(expr, alias))

    def where(self, cond: ast.Condition) -> tuple[str, ast.Condition]:
        return ("where", _condition(cond))

    def group_by(self, *exprs: ast.Expr) -> tuple[str, tuple[ast.Expr, ...]]:
        return ("group_by", tuple(_expr(e) for e in exprs))

    def order_by(self, *items: ast.OrderItem) -> tuple[str, tuple[Any, ...]]:
        return ("order_by", items)

    def order_item(self, expr: ast.Expr, direction: Token | None) -> ast.OrderItem:
        expr = _expr(expr)
        descending = direction is not None and direction.type == "DESC"
        span = expr.span if direction is None else _join(expr, direction)
        return ast.OrderItem(expr, descending, span=span)

    def direction(self, tok: Token) -> Token:
        return tok

    def limit(self, limit: Any, offset: Any) -> tuple[str, Any, Any]:
        return ("limit", limit, offset)

    def count(self, tok: Token) -> ast.Literal | ast.Param:
        if tok.type == "PARAM":
            return self.param(tok)
        node = self.number(tok)
        _integer(node, "a limit or offset")
        return node

    # conditions

    def or_(self, *conditions: Any) -> ast.Or:
        return ast.Or(_chain(ast.Or, conditions), span=_join(conditions[0], conditions[-1]))

    def and_(self, *conditions: Any) -> ast.And:
        return ast.And(_chain(ast.And, conditions), span=_join(conditions[0], conditions[-1]))

    def not_(self, neg: Token, cond: ast.Condition) -> ast.Not:
        return ast.Not(_condition(cond), span=_join(neg, cond))

    def paren(self, inner: Any, _rpar: Token) -> Any:
        # ``(x)`` stands for x: an expression (parsed as a condition testing it) or a
        # condition; whoever takes it checks which it must be.
        return inner.expr if type(inner) is ast.BoolTest else inner

    def compare(self, left: ast.Expr, op: Token, right: ast.Expr) -> ast.Compare:
        symbol = "<>" if op == "!=" else str(op)
        return ast.Compare(symbol, _expr(left), _expr(right), span=_join(left, right))  # type: ignore[arg-type]

    def like(self, expr: ast.Expr, neg: Token | None, kind: Token, pattern: ast.Expr) -> ast.Like:
        return ast.Like(
            _expr(expr),
            _expr(pattern),
            neg is not None,
            kind.type == "ILIKE",
            span=_join(expr, pattern),
        )

    def in_list(self, expr: ast.Expr, neg: Token | None, *values: Any) -> ast.In:
        items = tuple(_expr(v) for v in values[:-1])
        return ast.In(_expr(expr), items, neg is not None, span=_join(expr, values[-1]))

    def in_param(self, expr: ast.Expr, neg: Token | None, name: Token) -> ast.In:
        return ast.In(_expr(expr), self.param(name), neg is not None, span=_join(expr, name))

    def between(
        self, expr: ast.Expr, neg: Token | None, low: ast.Expr, high: ast.Expr
    ) -> ast.Between:
        return ast.Between(
            _expr(expr), _expr(low), _expr(high), neg is not None, span=_join(expr, high)
        )

    def is_null(self, expr: ast.Expr, neg: Token | None, null: Token) -> ast.IsNull:
        return ast.IsNull(_expr(expr), neg is not None, span=_join(expr, null))

    def bool_test(self, expr: Any) -> Any:
        if isinstance(expr, _CONDITIONS):  # a parenthesised condition
            return expr
        return ast.BoolTest(expr, span=expr.span)

    # arithmetic

    def binary(self, left: ast.Expr, op: Token, right: ast.Expr) -> ast.Binary:
        return ast.Binary(str(op), _expr(left), _expr(right), span=_join(left, right))  # type: ignore[arg-type]

    def neg(self, minus: Token, expr: ast.Expr) -> ast.Expr:
        expr = _expr(expr)
        value = expr.value if type(expr) is ast.Literal else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return ast.Literal(-value, span=_join(minus, expr))  # a signed number
        return ast.Neg(expr, span=_join(minus, expr))

    # operands

    def column(self, name: Token) -> ast.Column:
        return ast.Column(_name(name).lower(), span=_span(name))

    def qualified(self, head: Token, *names: Token) -> ast.Expr:
        """``meta.k…``, ``parent.c`` / ``child.c``, or a table's ``t.c``, ``t.out``,
        ``t.meta.k…``, ``t.parent.c``."""
        qualifier = str(head).lower()
        span = _join(head, names[-1])
        if qualifier == "meta":
            return ast.MetaRef(tuple(str(n) for n in names), span=span)
        if qualifier in ("parent", "child"):
            return _graph(qualifier, names, None, span)
        table = _name(head).lower()
        first = str(names[0]).lower()
        if first == "meta" and len(names) > 1:
            return ast.MetaRef(tuple(str(n) for n in names[1:]), table, span=span)
        if first in ("parent", "child") and len(names) > 1:
            return _graph(first, names[1:], table, span)
        if len(names) > 1:
            raise _Misplaced(
                f"{head!s}.{names[0]!s}.{names[1]!s}: only meta keys nest "
                f"({head!s}.meta.key); a table's column is {head!s}.<column>",
                _cover(names[1]),
            )
        if first in ("out", "grad"):
            return ast.Out(table, "out" if first == "out" else "grad", span=span)
        return ast.Column(_name(names[0]).lower(), table, span=span)

    def qualified_slice(self, head: Token, *parts: Any) -> ast.OutSlice:
        names = [p for p in parts if isinstance(p, Token) and p.type == "NAME"]
        index = parts[len(names) : -1]
        tensor = str(names[0]).lower() if len(names) == 1 else ""
        if tensor not in ("out", "grad") or str(head).lower() == "meta":
            raise _Misplaced(
                "only a tensor can be indexed: out[...], grad[...] or <table>.out[...]",
                _cover(head, *names),
            )
        return ast.OutSlice(
            index,
            _name(head).lower(),
            "out" if tensor == "out" else "grad",
            span=_join(head, parts[-1]),
        )

    def call(self, name: Token, args: tuple[Any, ...], rpar: Token) -> ast.Call:
        distinct = bool(args) and isinstance(args[0], str)
        return ast.Call(
            _name(name).lower(), args[1:] if distinct else args, distinct, span=_join(name, rpar)
        )

    def call_args(self, *args: Any) -> tuple[Any, ...]:
        if len(args) == 1 and isinstance(args[0], Token):  # count(*)
            return (ast.Star(span=_span(args[0])),)
        distinct, *exprs = args
        items = tuple(_expr(e) for e in exprs)
        return ("distinct", *items) if distinct is not None else items

    def out(self, tok: Token) -> ast.Out:
        return ast.Out(span=_span(tok))

    def out_slice(self, tok: Token, *index: Any) -> ast.OutSlice:
        return ast.OutSlice(index[:-1], span=_join(tok, index[-1]))

    def grad(self, tok: Token) -> ast.Out:
        return ast.Out(tensor="grad", span=_span(tok))

    def grad_slice(self, tok: Token, *index: Any) -> ast.OutSlice:
        return ast.OutSlice(index[:-1], tensor="grad", span=_join(tok, index[-1]))

    def signed(self, minus: Token | None, tok: Token) -> ast.Literal:
        literal = self.number(tok)
        if minus is None:
            return literal
        return ast.Literal(-literal.value, span=_join(minus, tok))  # type: ignore[operator]

    def index_at(self, number: ast.Literal) -> int:
        return _integer(number, "an index")

    def index_ellipsis(self, _tok: Token) -> ast.Index:
        return ...

    def index_slice(self, *parts: ast.Literal | None) -> ast.SliceSpec:
        start, stop, step = (None if p is None else _integer(p, "a slice bound") for p in parts)
        span = _cover(*parts)
        if step == 0:
            raise _Misplaced("a slice step cannot be zero", span)
        return ast.SliceSpec(start, stop, step, span=span)

    # literals

    def string(self, tok: Token) -> ast.Literal:
        return ast.Literal(str(tok)[1:-1].replace("''", "'"), span=_span(tok))

    def number(self, tok: Token) -> ast.Literal:
        text = str(tok)
        value: int | float = float(text) if any(c in text for c in ".eE") else int(text)
        return ast.Literal(value, span=_span(tok))

    def true(self, tok: Token) -> ast.Literal:
        return ast.Literal(True, span=_span(tok))

    def false(self, tok: Token) -> ast.Literal:
        return ast.Literal(False, span=_span(tok))

    def null(self, tok: Token) -> ast.Literal:
        return ast.Literal(None, span=_span(tok))

    def param(self, tok: Token) -> ast.Param:
        return ast.Param(str(tok)[1:], span=_span(tok))


class _Inline:
    """The builder as a Lark transformer: Lark calls a rule's callback with the list of
    its children; the builder takes them as arguments."""

    def __init__(self, build: _Build):
        self._build = build

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._build, name)  # AttributeError: Lark's default applies
        return lambda children: method(*children)


# The builder runs inline, at each reduction: no parse tree is built (a tree and a second
# pass cost about a third more).
_LARK = Lark.open(
    "grammar.lark",
    rel_to=__file__,
    parser="lalr",
    maybe_placeholders=True,
    transformer=_Inline(_Build()),
)
_LEAN = LeanLALR(_LARK, _Build())

_DESCRIBE = {
    "NAME": "a name",
    "PARAM": "a :parameter",
    "STRING": "a 'string'",
    "NUMBER": "a number",
    "COMPARE": "a comparison (= != <> < <= > >=)",
    "$END": "the end of the query",
}
_TERMINALS = {
    t.name: (
        repr(t.pattern.value)
        if isinstance(t.pattern, PatternStr)
        else _DESCRIBE.get(t.name, t.name)
    )
    for t in _LARK.terminals
}


def _expected(names: Any) -> tuple[str, ...]:
    described = {_TERMINALS.get(n, _DESCRIBE.get(n, n)) for n in names or ()}
    # quoted keywords and punctuation first, then descriptions
    return tuple(sorted(described, key=lambda s: (not s.startswith("'"), s)))


def _misspelt_keyword(text: str, token: Token, expected: tuple[str, ...]) -> str:
    """``"; did you mean 'where' (not 'wher')?"`` where the unexpected token, or the
    word before it, is a near miss of a keyword the parser expected there (``from ops
    wher func = ...`` reads ``wher`` as the table's alias and stumbles on ``func``)."""
    keywords = [e.strip("'") for e in expected if e.startswith("'") and e[1:-1].isalpha()]
    before = text[: token.start_pos].split() if token.start_pos is not None else []
    for word in (str(token), before[-1] if before else ""):
        if not word.isalpha() or word.lower() in keywords:
            continue
        match = difflib.get_close_matches(word.lower(), keywords, n=1, cutoff=0.7)
        if match:
            return f"; did you mean {match[0]!r} (not {word!r})?"
    return ""


def _syntax_error(text: str, exc: UnexpectedInput) -> QuerySyntaxError:
    if isinstance(exc, UnexpectedToken) and exc.token.type == "$END":
        stripped = text.rstrip()
        line = stripped.count("\n") + 1
        column = len(stripped) - (stripped.rfind("\n") + 1) + 1
        what, width = "end of query", 1
    elif isinstance(exc, UnexpectedToken):
        line, column = exc.token.line or 1, exc.token.column or 1
        what, width = repr(str(exc.token)), max(1, len(str(exc.token)))
    elif isinstance(exc, UnexpectedCharacters):
        line, column = exc.line, exc.column
        what, width = f"character {exc.char!r}", 1
    else:
        line, column, what, width = max(1, exc.line), max(1, exc.column), "input", 1
    allowed = getattr(exc, "allowed", None)
    if isinstance(exc, UnexpectedToken):
        try:  # exact: LALR states' lookahead sets over-approximate
            allowed = exc.interactive_parser.accepts()
        except Exception:  # pragma: no cover - fall back to the state's set
            allowed = exc.expected
    expected = _expected(allowed)
    message = f"Unexpected {what} at line {line}, column {column}"
    if expected:
        message += "; expected one of: " + ", ".join(expected)
    if isinstance(exc, UnexpectedToken) and exc.token.type != "$END":
        message += _misspelt_keyword(text, exc.token, expected)
    span = ast.Span(line, column, line, column + width, 0, 0)
    return QuerySyntaxError(message, line, column, expected, span.excerpt(text))


def parse(text: str) -> ast.Query:
    """Parse query text into an :class:`~tracelake.query.ast.Query`.

    Raises :class:`~tracelake.errors.QuerySyntaxError` for text outside the language."""
    if not isinstance(text, str):
        raise QueryTypeError(f"a query is a str, not {type(text).__name__}")
    try:
        query = _LEAN.parse(text)
        if query is None:  # refused: Lark's own run says why
            _refuse_glued_keyword(text)
            return _LARK.parse(text)  # type: ignore[return-value]
        return query  # type: ignore[no-any-return]
    except _Misplaced as exc:
        raise _misplaced(text, exc) from None
    except UnexpectedInput as exc:
        raise _syntax_error(text, exc) from exc
    except LarkError as exc:  # a callback's exception, wrapped by Lark
        inner = getattr(exc, "orig_exc", None)
        if isinstance(inner, _Misplaced):
            raise _misplaced(text, inner) from None
        if isinstance(inner, QueryError):
            raise inner from None
        raise QuerySyntaxError(f"cannot parse the query: {exc}", 1, 1) from exc
    except RecursionError as exc:
        raise QuerySyntaxError("the query is nested too deeply", 1, 1) from exc


#: Terminals spelled as words: the keywords.
_KEYWORD_TERMINALS = frozenset(
    t.name
    for t in _LARK.terminals
    if isinstance(t.pattern, PatternStr) and t.pattern.value.isalpha()
)


def _refuse_glued_keyword(text: str) -> None:
    """Lark's contextual lexer reads a keyword off the front of a longer word where only
    the keyword can stand (``select label fromops`` would read ``from ops``); words are
    whole in this language, as the fast path reads them. Raise where that happens."""
    try:
        for tok in _LARK.parse_interactive(text).iter_parse():
            end = tok.end_pos
            if (
                tok.type in _KEYWORD_TERMINALS
                and end is not None
                and end < len(text)
                and (text[end].isalnum() or text[end] == "_")
            ):
                stop = end
                while stop < len(text) and (text[stop].isalnum() or text[stop] == "_"):
                    stop += 1
                word = text[tok.start_pos : stop]
                line, column = tok.line or 1, tok.column or 1
                span = ast.Span(line, column, line, column + len(word), 0, 0)
                raise QuerySyntaxError(
                    f"Unexpected {word!r} at line {line}, column {column}: a name cannot "
                    f"stand here; if {str(tok)!r} is meant as the keyword, put a space after "
                    "it",
                    line,
                    column,
                    (_describe_keyword(tok.type),),
                    span.excerpt(text),
                )
    except UnexpectedInput:
        return  # Lark's parse below says why


def _describe_keyword(terminal: str) -> str:
    return terminal.lstrip("_").upper()


def _misplaced(text: str, exc: _Misplaced) -> QuerySyntaxError:
    span = exc.span
    return QuerySyntaxError(
        f"{exc.message} (line {span.line}, column {span.column})",
        span.line,
        span.column,
        exc.expected,
        span.excerpt(text),
    )
