"""The query language: the grammar rule by rule, error messages, property tests and
injection attempts. The golden files and results are in ``test_query_golden.py``."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lark import Lark
from lark.exceptions import LarkError
from test_query_catalog import make_catalog, snapshot
from test_query_text import JOIN_INJECTIONS

from tracelake import errors
from tracelake.errors import QueryCompileError, QueryError, QuerySyntaxError
from tracelake.query import ast, compile_query, parse
from tracelake.query import compiler as compiler_module
from tracelake.query import parser as parser_module

GRAMMAR = Path(compiler_module.__file__).with_name("grammar.lark")


def test_grammar_is_lalr_without_conflicts() -> None:
    if importlib.util.find_spec("interegular"):
        Lark.open(str(GRAMMAR), parser="lalr", maybe_placeholders=True, strict=True)
        return
    # strict mode's lexer check needs interegular; the parser check does not
    from lark.parsers.lalr_parser import LALR_Parser

    lark = Lark.open(str(GRAMMAR), parser="lalr", maybe_placeholders=True)
    LALR_Parser(lark.parser.parser_conf, strict=True)


def test_every_node_class_has_a_compile_rule() -> None:
    nodes = [
        c
        for c in vars(ast).values()
        if isinstance(c, type) and issubclass(c, ast.Node) and c is not ast.Node
    ]
    assert len(nodes) >= 20
    missing = [
        c.__name__ for c in nodes if not hasattr(compiler_module._Compiler, f"visit_{c.__name__}")
    ]
    assert missing == []


def test_nodes_are_frozen_and_spans_do_not_count_in_equality() -> None:
    a = parse("select label from ops where func = 'relu'")
    b = parse("SELECT   label\nFROM ops WHERE FUNC='relu'")
    assert a == b
    assert a.items[0].expr.span != b.items[0].expr.span
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.table = "runs"  # type: ignore[misc]


def test_spans_point_into_the_text() -> None:
    text = "select label,\n  mean(out[0, :]) from ops where parent.func = 'add'"
    q = parse(text)
    call = q.items[1].expr
    assert text[call.span.start : call.span.end] == "mean(out[0, :])"
    assert (call.span.line, call.span.column) == (2, 3)
    assert q.where is not None
    assert text[q.where.span.start : q.where.span.end] == "parent.func = 'add'"


# Accepted text: one row per grammar rule and alternative -------------------------------

ACCEPT = [
    # select list, from, star, aliases
    ("select label from ops", "label"),
    ("select * from runs", "*"),
    ("select *, out from ops", "*"),
    ("select label as l, func from ops", "as"),
    ("SELECT label FROM OPS", "keywords in any case"),
    ("select label from ops where func = 'relu';", "one trailing semicolon"),
    ("select label from ops limit 3 ; -- the end\n", "a semicolon, then a comment"),
    ("select selection, out_index from ops".replace("selection", "label"), "out prefix"),
    ("select run from modules", "run everywhere"),
    ("select parent, child from edges", "edge columns named like the qualifiers"),
    # out and slices
    ("select out from ops", "out"),
    ("select out[0] from ops", "index"),
    ("select out[-1, :, 3:5] from ops", "negative index, slices"),
    ("select out[::2, 1:, :-1, ::-1] from ops", "steps"),
    ("select out[..., 0] from ops", "ellipsis"),
    ("select grad, grad[0, ..., -1] from ops", "grad and its slices"),
    ("select a.grad, b.grad[0] from ops a join ops b using (key)", "qualified grad"),
    ("select label from ops where norm(grad) > 0 order by absmax(grad) desc", "grad reductions"),
    # reductions and aggregates
    (
        "select mean(out), std(out), min(out), max(out), absmax(out), norm(out), sum(out) from ops",
        "whole-tensor reductions",
    ),
    ("select mean(out[0]) from ops", "reduction of a slice"),
    (
        "select count(*), count(label), avg(l2), sum(nbytes), min(mean), max(std) from ops",
        "aggregates",
    ),
    ("select func, count(*) from ops group by func", "group by"),
    ("select func, kind, count(*) from ops group by func, kind", "group by two"),
    # order, limit
    ("select label from ops order by label", "order by"),
    ("select label from ops order by label asc, idx desc", "asc desc"),
    ("select label from ops order by absmax(out) desc", "order by reduction"),
    ("select func, count(*) as n from ops group by func order by n", "order by alias"),
    ("select label from ops limit 3", "limit"),
    ("select label from ops limit 3 offset 2", "offset"),
    ("select label from ops limit :n offset :o", "limit parameters"),
    # conditions
    ("select label from ops where idx = 1", "="),
    ("select label from ops where idx != 1 and idx <> 2", "!= <>"),
    ("select label from ops where idx < 1 or idx <= 2 or idx > 3 or idx >= 4", "< <= > >="),
    ("select label from ops where label like 'a%'", "like"),
    ("select label from ops where label not like 'a%'", "not like"),
    ("select label from ops where label ilike 'A%' and label not ilike 'b%'", "ilike"),
    ("select label from ops where func in ('relu', 'add')", "in"),
    ("select label from ops where func not in ('relu')", "not in"),
    ("select label from ops where run in :runs", "in parameter"),
    ("select label from ops where idx between 1 and 3", "between"),
    ("select label from ops where idx not between 1 and 3 and saved", "not between"),
    ("select label from ops where tensor is null", "is null"),
    ("select label from ops where tensor is not null", "is not null"),
    ("select label from ops where not saved", "not"),
    ("select label from ops where not (saved or inplace) and (idx = 1 or idx = 2)", "parens"),
    ("select label from ops where ((saved))", "nested parens"),
    # literals and parameters
    ("select label from ops where label = 'it''s'", "string with quote"),
    ("select label from ops where mean = -1.5e-3 or mean = .5 or idx = 10", "numbers"),
    ("select label from ops where saved = true or inplace = false", "booleans"),
    ("select label from ops where func in ('a', null)", "null"),
    ("select label from ops where func = :func", "parameter"),
    # graph and meta
    ("select label from ops where parent.func = 'add'", "parent"),
    ("select label from ops where child.kind = 'output'", "child"),
    ("select label from ops where parent.module = module", "correlated"),
    ("select name from runs where meta.lr > 0.01", "meta"),
    ("select meta.a.b from runs", "nested meta"),
    ("select meta.limit, meta.out from runs", "meta keys spelled like keywords"),
    ("select label from ops\nwhere\tfunc = 'relu'\n", "whitespace"),
    ("select label from ops -- a comment\nwhere saved -- another", "comments"),
    ("select avg(mean(out)), max(absmax(out)) from ops", "aggregates of statistics"),
    ("select l2 - mean, -l2, abs(mean) * 2 / nbytes, (l2 + 1) * 2 from ops", "arithmetic"),
    ("select label from ops where l2 - mean > -(idx + 1) and -1 < abs(min)", "arithmetic in where"),
    ("select distinct func from ops order by func", "distinct"),
    ("select count(distinct func) from ops", "count distinct"),
    ("select func, count(*) as n from ops group by func having count(*) > 1", "having"),
    (
        "select func from ops group by func having n > 1 and avg(l2) < 3".replace(
            "from", ", count(*) as n from"
        ),
        "having an alias",
    ),
    ("select ops.label from ops", "a column qualified by its table"),
    ("select o.label, o.meta.lr, o.out, o.out[0] from ops o", "an alias"),
    ("select o.label from ops as o where o.parent.func = 'add'", "an alias's graph reference"),
    (
        "select a.label, b.label from ops a join ops b using (key) where a.run = 'x' and "
        "b.run = 'y'",
        "join using",
    ),
    ("select a.label from ops as a join ops as b on a.key = b.key and a.step = b.step", "join on"),
    ("select key, a.label from ops a join ops b using (key, label)", "using columns unqualified"),
    ("select a.path, b.path from modules a join modules b using (label)", "modules join"),
    (
        "select a.label, max_abs_diff(a.out, b.out) as d, mean_abs_diff(a.out, b.out), "
        "rel_l2(a.out, b.out), cosine(a.out[0], b.out[0]), allclose(a.out, b.out, 1e-3, 0) "
        "from ops a join ops b using (key) where max_abs_diff(a.out, b.out) > 0 "
        "order by d desc limit 3",
        "tensor-pair functions",
    ),
]


@pytest.mark.parametrize(("text", "rule"), ACCEPT, ids=[r for _, r in ACCEPT])
def test_accepts(text: str, rule: str) -> None:
    params = {"n": 1, "o": 0, "runs": ["a"], "func": "relu"}
    used = {k: v for k, v in params.items() if f":{k}" in text}
    compiled = compile_query(text, used)
    assert compiled.sql.startswith("SELECT ")


# Rejected text ---------------------------------------------------------------------------

SYNTAX = [
    ("", "empty"),
    ("select label", "no from"),
    ("select from ops", "no items"),
    ("select label from", "no table"),
    ("select label from ops where", "no condition"),
    ("select label from ops where label == 'x'", "=="),
    ('select label from ops where label = "x"', "double quotes"),
    ("select label from ops where label = 'x", "unterminated string"),
    ("select label from ops; drop table ops", "second statement"),
    ("select label from ops;;", "two semicolons"),
    ("select label; from ops", "a semicolon inside"),
    ("select label from ops /* c */", "block comment"),
    ("select label b from ops", "alias without as"),
    ("select label from ops order by", "order by nothing"),
    ("select label from ops limit -1", "negative limit"),
    ("select label from ops limit 1.5", "fractional limit"),
    ("select out[1.5] from ops", "fractional index"),
    ("select out[::0] from ops", "zero step"),
    ("select out[] from ops", "empty index"),
    ("select label[0] from ops", "slice of a column"),
    ("select parent.a.b from ops", "deep graph reference"),
    ("select label from ops where label is 'x'", "is with a value"),
    ("select label from ops where a between 1", "between without and"),
    ("select label from ops group func", "group without by"),
    ("select label from ops where label in ()", "empty in list"),
    ("select label, from ops", "trailing comma"),
    ("select select from ops", "keyword as a column"),
    ("select label as from from ops", "keyword as an alias"),
    ("select label from ops where idx = 1 +", "arithmetic without a right operand"),
    ("select label from ops where (idx = 1) + 2", "a condition in arithmetic"),
    ("select label from ops join", "join without a table"),
    ("select label from ops a join ops b", "join without a condition"),
    ("select label from ops a join ops b using key", "using without parentheses"),
    ("select label from ops a join ops b using ()", "empty using"),
    ("select distinct from ops", "distinct without items"),
    ("select label from ops having", "having without a condition"),
    ("select a.label.x from ops a", "a column is not nested"),
    ("select a.label[0] from ops a", "only out is indexed"),
    ("select count(distinct *) from ops", "distinct star"),
    ("select label from ops union select name from runs", "union"),
    ("select label from read_csv('x')", "table function"),
    ("update ops set label = 'x'", "other statement"),
    ("select label from ops where label = :", "bare colon"),
    ("select label from ops where label = 'a' 'b'", "two strings"),
    ("select label fromops", "keyword glued to a name"),
    ("select label from ops wherefunc = 'relu'", "where glued to a column"),
    ("select label from ops limit10", "limit glued to its count"),
]


def test_glued_keyword_says_where_and_how_to_fix() -> None:
    with pytest.raises(QuerySyntaxError) as info:
        compile_query("select label fromops")
    assert (info.value.line, info.value.column) == (1, 14)
    assert "'fromops'" in str(info.value) and "put a space after it" in str(info.value)
    # names that merely begin like a keyword stay names
    where = parse("select label from ops where order_id = 1 or fromage = 2").where
    assert [c.left.name for c in where.items] == ["order_id", "fromage"]


@pytest.mark.parametrize(("text", "why"), SYNTAX, ids=[w for _, w in SYNTAX])
def test_rejects_syntax(text: str, why: str) -> None:
    with pytest.raises(QuerySyntaxError) as info:
        compile_query(text)
    err = info.value
    assert err.line >= 1 and err.column >= 1
    assert isinstance(err.expected, tuple)
    assert "^" in str(err) or text == ""
    assert err.__cause__ is None or not isinstance(err.__cause__, QueryError)


COMPILE = [
    ("select fucn from ops", "unknown column 'fucn'; did you mean 'func'?"),
    ("select label from opz", "unknown table 'opz'; did you mean 'ops'?"),
    ("select label from tensors", "unknown table 'tensors'"),
    ("select meen(out) from ops", "unknown function 'meen'; did you mean 'mean'?"),
    # a mistyped function among aggregates is a mistyped function, not an ungrouped one
    ("select avg(l2), stddev(l2) from ops", "unknown function 'stddev'; did you mean 'std'?"),
    ("select func, median(l2) from ops group by func", "unknown function 'median'"),
    ("select func from ops group by func order by mx(l2)", "unknown function 'mx'"),
    ("select func from ops group by func having cnt(*) > 1", "unknown function 'cnt'"),
    ("select label from ops where parent.fucn = 'x'", "did you mean 'func'?"),
    ("select out from runs", "out is a column of ops"),
    ("select mean(out) from modules", "out is a column of ops"),
    ("select label from ops where mean(out[0]) > 1", "can only be selected"),
    ("select label from ops order by out", "order by takes columns"),
    ("select label from ops where out = 1", "is a tensor"),
    ("select label from ops where mean(l2) > 1", "over a column use avg"),
    ("select label from ops where count(*) > 1", "cannot stand in where"),
    ("select count(*) from ops group by count(*)", "group by takes"),
    ("select func, label from ops group by func", "neither grouped nor aggregated"),
    ("select func, count(*) from ops order by label", "neither grouped nor aggregated"),
    ("select *, count(*) from ops", "'*' cannot be selected"),
    ("select out, count(*) from ops", "cannot be selected with 'group by'"),
    ("select avg(*) from ops", "count(*) is"),
    ("select avg(out[0]) from ops", "does not reduce a tensor"),
    ("select count(label, func) from ops", "takes one argument"),
    ("select avg(count(*)) from ops", "aggregates cannot nest"),
    ("select avg(label) from ops", "label is text; arithmetic takes numbers"),
    ("select foo.bar from ops", "unknown qualifier 'foo'"),
    ("select label from ops where label = 3", "label is text and 3 is a number"),
    ("select label from ops where idx in (1, 'x')", "idx is a number and 'x' is text"),
    ("select label from ops where shape = 3", "shape is a list and 3 is a number"),
    ("select label - 1 from ops", "label is text; arithmetic takes numbers"),
    (
        "select label from ops a join ops b using (key)",
        "ambiguous column 'label': write a.label or b.label",
    ),
    ("select out from ops a join ops b using (key)", "ambiguous out: write a.out or b.out"),
    ("select meta.lr from ops a join ops b using (key)", "write a.meta.lr or b.meta.lr"),
    ("select c.label from ops a join ops b using (key)", "unknown qualifier 'c'"),
    ("select a.label from ops join ops using (key)", "two tables are named 'ops'"),
    ("select m.label from ops meta", "'meta' cannot name a table"),
    ("select * from ops a join ops b using (key)", "'*' in a join"),
    ("select a.label from ops a join runs b using (key)", "has no column 'key'"),
    (
        "select a.label from ops a join ops b using (key) group by max_abs_diff(a.out, b.out)",
        "cannot be grouped",
    ),
    ("select max_abs_diff(a.out, b.label) from ops a join ops b using (key)", "compares tensors"),
    ("select max_abs_diff(a.out) from ops a join ops b using (key)", "takes two tensors"),
    (
        "select allclose(a.out, b.out, -1) from ops a join ops b using (key)",
        "atol is a non-negative number",
    ),
    (
        "select a.label from ops a join ops b on max_abs_diff(a.out, b.out) > 1",
        "not in a join condition",
    ),
    (
        "select a.label from ops a join ops b using (key) "
        "where max_abs_diff(a.out, b.out) like 'x'",
        "like compares text",
    ),
    (
        "select count(*), max_abs_diff(a.out, b.out) from ops a join ops b using (key)",
        "cannot be grouped",
    ),
    ("select label from ops having idx > 1", "having filters groups"),
    (
        "select func, count(*) from ops group by func having label = 'x'",
        "neither grouped nor aggregated",
    ),
    ("select distinct func from ops order by label", "with distinct, order by what is selected"),
    ("select distinct out from ops", "cannot be selected with"),
    ("select abs(label) from ops", "arithmetic takes numbers"),
    ("select mean(distinct l2) from ops", "distinct goes in aggregates"),
    ("select label from ops where count(distinct func) > 1", "cannot stand in where"),
    ("select 'x' from ops", "not 'x'"),
    ("select :p from ops", "not :p"),
    ("select parent.func from ops", "can only be used in"),
    ("select label from modules where parent.func = 'x'", "queries over ops"),
    ("select label from ops where parent.func = child.func", "both parent. and child."),
    ("select label, label from ops", "two result columns are named 'label'"),
    ("select label as __x from ops", "reserved"),
    ("select label from ops where label = null", "is null"),
    ("select label from ops where func", "is not true or false"),
    ("select label from ops where idx like '1%'", "like compares text"),
    ("select label from ops where label = :missing", "no value for parameter :missing"),
    ("select label from ops order by 1", "order by takes"),
    ("select label from ops where label = :p", "is a list"),
    ("select label from ops limit :p", "limit takes a non-negative integer"),
]


@pytest.mark.parametrize(("text", "message"), COMPILE, ids=[m for _, m in COMPILE])
def test_rejects_at_compile_time(text: str, message: str) -> None:
    params = {"p": [1, 2]} if ":p" in text else None
    with pytest.raises(QueryCompileError) as info:
        compile_query(text, params)
    assert message in str(info.value)
    assert not isinstance(info.value, QuerySyntaxError)


def test_unused_and_ill_typed_parameters() -> None:
    with pytest.raises(QueryCompileError, match=r"'fnuc' is not used.*did you mean 'func'"):
        compile_query("select label from ops where func = :func", {"func": "a", "fnuc": "b"})
    with pytest.raises(TypeError, match="parameter :f is a object"):
        compile_query("select label from ops where func = :f", {"f": object()})
    with pytest.raises(TypeError, match="query text or a Query"):
        compile_query(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a query is a str"):
        parse(b"select label from ops")  # type: ignore[arg-type]


def test_syntax_error_message_has_position_expected_tokens_and_caret() -> None:
    text = "select label\nfrom ops where label == 'x'"
    with pytest.raises(QuerySyntaxError) as info:
        compile_query(text)
    err = info.value
    assert (err.line, err.column) == (2, 23)
    assert "a 'string'" in err.expected and "a name" in err.expected
    lines = str(err).splitlines()
    assert lines[0].startswith("Unexpected '=' at line 2, column 23; expected one of: ")
    assert lines[1] == "  from ops where label == 'x'"
    assert lines[2] == "  " + " " * 22 + "^"
    assert err.excerpt == "\n".join(lines[1:])


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("select label from ops wher func = 'relu'", "did you mean 'where' (not 'wher')?"),
        ("select label form ops", "did you mean 'from' (not 'form')?"),
        (
            "select label from ops where step = 0 oder by label",
            "did you mean 'order' (not 'oder')?",
        ),
        ("select label from ops limt 3", "did you mean 'limit' (not 'limt')?"),
        ("selct label from ops", "did you mean 'select' (not 'selct')?"),
    ],
)
def test_a_misspelt_keyword_is_named(text: str, hint: str) -> None:
    """``... from ops wher func = 'relu'`` read ``wher`` as the table's alias and said
    only that ``func`` was unexpected; the near miss of an expected keyword is named."""
    with pytest.raises(QuerySyntaxError) as info:
        compile_query(text)
    assert str(info.value).splitlines()[0].endswith(hint)


def test_compile_error_points_at_the_culprit() -> None:
    with pytest.raises(QueryCompileError) as info:
        compile_query("select label, fucn from ops")
    err = info.value
    assert str(err).splitlines() == [
        "unknown column 'fucn'; did you mean 'func'?",
        "  select label, fucn from ops",
        "                ^^^^",
    ]
    assert (err.line, err.column) == (1, 15)
    assert err.message == "unknown column 'fucn'; did you mean 'func'?"


def test_query_errors_are_in_the_tree() -> None:
    assert issubclass(QuerySyntaxError, errors.QueryError)
    assert issubclass(QueryCompileError, errors.QueryError)
    assert issubclass(errors.QueryError, errors.TraceLakeError)
    for name in ("QueryError", "QuerySyntaxError", "QueryCompileError"):
        assert name in errors.__all__
        assert name in (errors.__doc__ or "")


def test_a_parsed_query_compiles_like_its_text() -> None:
    text = "select run, out[0] from ops where meta.lr > :lr order by run"
    assert compile_query(parse(text), {"lr": 0.1}) == compile_query(text, {"lr": 0.1})


# Properties ---------------------------------------------------------------------------------

_ALPHABET = st.sampled_from(
    [
        "select ",
        "from ",
        "where ",
        "ops ",
        "runs ",
        "label",
        "func",
        "out",
        "grad",
        "[",
        "]",
        "(",
        ")",
        ",",
        ":",
        "::",
        "'",
        "''",
        "=",
        "<",
        ">",
        "!",
        " and ",
        " or ",
        " not ",
        "in",
        "like",
        "between",
        "is",
        "null",
        "*",
        "-",
        ".",
        "meta.",
        "parent.",
        "1",
        "2.5",
        "e",
        "group by",
        "order by",
        "limit",
        " ",
        "\n",
        ";",
        '"',
        "count",
        "mean",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(max_size=80),
        st.lists(_ALPHABET, max_size=25).map("".join),
        st.lists(_ALPHABET, max_size=25).map(lambda t: "select " + "".join(t)),
    )
)
def test_any_text_raises_only_query_errors(text: str) -> None:
    try:
        compiled = compile_query(text)
    except QueryError:
        return
    assert compiled.sql.startswith("SELECT ")


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


TEMPLATES = [
    "select label from ops where func = {}",
    "select label from ops where label like {} or func in ({}, 'x')",
    "select run from ops where meta.key = {} order by run",
    "select label from ops where parent.label != {}",
    "select name from runs where meta.a.b between {} and 'zz'",
    "select label from ops where module not ilike {}",
]
NUMBER_TEMPLATES = [
    "select label from ops where mean > {}",
    "select label from ops where meta.lr >= {} and idx in ({}, 7)",
    "select label from ops where child.absmax between {} and 1e9",
]


@settings(max_examples=60, deadline=None)
@given(value=st.text(min_size=1, max_size=30), template=st.sampled_from(TEMPLATES))
def test_a_string_literal_never_reaches_the_sql(value: str, template: str) -> None:
    compiled = compile_query(template.format(*[_quote(value)] * template.count("{}")))
    reference = compile_query(template.format(*["'reference'"] * template.count("{}")))
    assert compiled.sql == reference.sql  # the SQL does not depend on the value
    assert value in compiled.params
    assert _quote(value) not in compiled.sql


@settings(max_examples=60, deadline=None)
@given(
    value=st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
    ),
    template=st.sampled_from(NUMBER_TEMPLATES),
)
def test_a_number_literal_never_reaches_the_sql(value: float, template: str) -> None:
    text = repr(value)
    compiled = compile_query(template.format(*[text] * template.count("{}")))
    reference = compile_query(template.format(*["12345"] * template.count("{}")))
    assert compiled.sql == reference.sql
    assert float(value) in [float(p) for p in compiled.params if isinstance(p, int | float)]


# Injection ---------------------------------------------------------------------------------

INJECTIONS = [
    "select label from ops where label = 'x'' or 1=1 --'",
    "select label from ops where label = 'x'; drop table ops; --'",
    "select label from ops where label = ''; drop table runs",
    "select label from ops where label = '' union select name from runs",
    "select label from ops where label = 'x' union select name from runs",
    "select label from ops where label = '/* */ union select getenv(''HOME'')'",
    "select label from read_csv('/etc/passwd')",
    "select label from ops where label in (select name from runs)",
    "select getenv('HOME') from ops",
    "select read_csv('/etc/passwd') from ops",
    "select label from ops where func = read_text('/etc/passwd')",
    "select label from ops where meta.x = 'a''); select 1; --'",
    'select label from "ops"',
    'select "label" from ops',
    "select label from ops where label = 'x' -- ' and func = 'y'",
    "select label from ops where label = 'x\\' or 1=1'",
    "select label from ops; pragma enable_external_access",
    "select label from ops where label = 'install httpfs; load httpfs'",
    "select label from ops where label = '' or '1'='1'",
    "select label from ops where meta.lr > 0 or meta.x = 'set threads=1'",
    "select label from ops where label = :p",
]


@pytest.fixture(scope="module")
def catalog() -> duckdb.DuckDBPyConnection:
    return make_catalog()


@pytest.mark.parametrize("text", INJECTIONS + JOIN_INJECTIONS)
def test_injection_fails_or_only_binds_values(
    text: str, catalog: duckdb.DuckDBPyConnection
) -> None:
    params: dict[str, Any] = {"p": "x'; drop table ops; --"} if ":p" in text else {}
    before = snapshot(catalog)
    try:
        compiled = compile_query(text, params)
    except QueryError:
        return
    for forbidden in (
        ";",
        "--",
        "/*",
        "union",
        "read_csv",
        "getenv",
        "read_text",
        "pragma",
        "install",
        "drop",
        "set ",
    ):
        assert forbidden not in compiled.sql.lower(), forbidden
    assert compiled.sql.count("'") == 2 * compiled.sql.count("'$.")  # only meta paths
    rows = catalog.execute(compiled.sql, compiled.params).fetchall()
    assert snapshot(catalog) == before
    labels = {r[0] for r in rows}
    assert labels <= {"input_1", "linear_1_1", "relu_1_2", "add_1_3", "softmax_1_4", "output_1"}


def _doc_queries() -> list[str]:
    doc = Path(__file__).parents[1] / "docs" / "query.md"
    blocks = doc.read_text().split("```sql\n")[1:]
    lines = [line.split("--")[0].strip() for b in blocks for line in b.split("```")[0].splitlines()]
    return [line for line in lines if line]


@pytest.mark.parametrize("text", _doc_queries())
def test_the_documented_queries_compile(text: str) -> None:
    compile_query(text)


# The lean parser ---------------------------------------------------------------------------


def _outcome(parse_with: Any, text: str) -> Any:
    """What a parser made of ``text``: the AST with every span, or the refusal."""

    def spanned(node: Any) -> Any:
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return (
                type(node).__name__,
                *(spanned(getattr(node, f.name)) for f in dataclasses.fields(node)),
            )
        return tuple(spanned(n) for n in node) if isinstance(node, tuple) else node

    try:
        return spanned(parse_with(text))
    except parser_module._Misplaced as exc:
        return ("misplaced", exc.message, spanned(exc.span))
    except LarkError as exc:
        inner = getattr(exc, "orig_exc", None)
        if isinstance(inner, parser_module._Misplaced):
            return ("misplaced", inner.message, spanned(inner.span))
        return ("syntax", type(exc).__name__)


_LEAN_EXTRA = st.sampled_from(
    [
        "...",
        " as ",
        "x",
        ":p",
        "'a\nb'",
        "true",
        " asc",
        " desc",
        "offset ",
        "1e3",
        ".5",
        " ilike ",
        "fromage",
        "OUT",
        "Meta.",
        " join ops b ",
        " using (key) ",
        " on ",
        "distinct ",
        " having ",
        "+",
        "/",
        "-- c\n",
        "a.",
        "b.out",
        "abs(",
        "max_abs_diff(",
        "limit10",
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(_ALPHABET, _LEAN_EXTRA), max_size=25).map(lambda t: "select " + "".join(t))
)
def test_the_lean_parser_agrees_with_lark(text: str) -> None:
    """Text the lean driver parses (or refuses in the builder) comes out exactly as
    through Lark, spans included; what it leaves to Lark is Lark's to judge."""
    lean = _outcome(parser_module._LEAN.parse, text)
    if lean is not None:
        assert lean == _outcome(parser_module._LARK.parse, text)


@pytest.mark.parametrize("text", [t for t, _ in ACCEPT] + _doc_queries())
def test_valid_queries_take_the_lean_path(text: str) -> None:
    assert parser_module._LEAN.parse(text) == parser_module._LARK.parse(text)
    assert _outcome(parser_module._LEAN.parse, text) == _outcome(parser_module._LARK.parse, text)


def test_the_lean_parser_refuses_what_it_does_not_follow() -> None:
    from tracelake.query.lalr import LeanLALR

    with pytest.raises(ValueError, match="LALR"):
        LeanLALR(Lark("start: NAME\nNAME: /[a-z]+/", parser="earley"), object())
    with pytest.raises(ValueError, match="no method for rule"):
        LeanLALR(Lark('start: NAME NAME\nNAME: /[a-z]+/\n%ignore " "', parser="lalr"), object())
