"""The catalog's tables, derived from their declarations: DDL, Arrow schemas, the SQL
that inserts and copies rows by column name.

``ops``, ``edges`` and ``modules`` are declared with the op record
(:mod:`tracelake.recorder.record`); ``runs`` and ``tensors`` belong to the store and are
declared here, with the same :class:`Field`. A catalog written by an older version may
lack a column declared since: writers add it (with its default) in their first
transaction, readers select it as its default, so every catalog reads as the
declarations say.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

from tracelake.recorder.record import (
    BOOL,
    EDGES,
    GRADS,
    I32,
    I64,
    MODULES,
    OPS,
    STR,
    TIMESTAMP,
    Field,
    Table,
    list_of,
)

if TYPE_CHECKING:  # the catalog's connections; DuckDB itself is catalog.py's to import
    import duckdb
    import pyarrow as pa

__all__ = [
    "CALLS",
    "RULES",
    "RUNS",
    "RUN_TABLES",
    "TABLES",
    "TENSORS",
    "accept_rows",
    "arrow_schema",
    "create_schema",
    "ident",
    "insert",
    "present_columns",
    "select_list",
]

#: The ``runs`` table: one row per run, whatever its status.
RUNS = Table(
    "runs",
    (
        Field("id", I32, "the run's id (never reused)"),
        Field("name", STR, "the run's name"),
        Field("status", STR, "recording, complete, failed, deleted or collected"),
        Field("created", TIMESTAMP, "when recording began (UTC)"),
        Field("finished", TIMESTAMP, "when the run was committed (UTC)"),
        Field("steps", I32, "how many forward passes the run recorded"),
        Field("op_count", I64, "how many op entries, all steps"),
        Field("bytes", I64, "bytes of saved tensors"),
        Field("model_class", STR, "the model's class"),
        Field("param_fingerprint", STR, "a hash of the model's parameters and buffers"),
        Field("input_fingerprint", STR, "a hash of the first step's inputs"),
        Field("torch_version", STR, "torch's version"),
        Field("device", STR, "the model's device"),
        Field("meta", STR, "the user's metadata, as JSON"),
        Field("host", STR, "the recording host"),
        Field("pid", I32, "the recording process"),
        # Queries see complete runs only, where it is always NULL: not one of their columns.
        Field(
            "error",
            STR,
            "why a failed run failed: its exception's type and message",
            query=False,
        ),
        Field("seq", I64, "commit order"),
    ),
)

#: The ``tensors`` table: one row per saved tensor (slot) of a run.
TENSORS = Table(
    "tensors",
    (
        Field("run_id", I32, "the run's id"),
        Field("step", I32, "the step that saved it"),
        Field("slot", I32, "the tensor's slot, from 0 within the run"),
        Field("array", STR, "the Zarr array holding it"),
        Field("byte_offset", I64, "where it starts in a packed array (NULL: its own array)"),
        Field("nbytes", I64, "its size in bytes"),
        Field("shape", list_of(I64), "its shape"),
        Field("dtype", STR, "its dtype"),
        Field("codec", STR, "how its array is encoded"),
    ),
)

#: The ``rules`` table: one row per intervention rule of a run (``intervene=``).
RULES = Table(
    "rules",
    (
        Field("run_id", I32, "the run's id"),
        Field("rule", I32, "the rule's number (ops.rule names it)"),
        Field("selector", STR, "the rule's selector, as tl.func(...) & ... spells it"),
        Field("action", STR, "the helper's name (zero_ablate, patch_from, callable...)"),
        Field("spec", STR, "the action and its arguments as JSON (tensors in base64)"),
        Field("replayable", BOOL, "whether the spec rebuilds the action"),
        Field("reason", STR, "why not, where it does not (a user callable, ...)"),
        Field("touched", I64, "how many ops the rule changed, all steps"),
    ),
)

#: The ``calls`` table: one row per step, how the model was called (for replay).
CALLS = Table(
    "calls",
    (
        Field("run_id", I32, "the run's id"),
        Field("step", I32, "the step"),
        Field("call", STR, "the call's arguments as JSON, tensors as the input entries"),
    ),
)

#: Every catalog table, in the order a new catalog creates them.
TABLES: dict[str, Table] = {
    t.name: t for t in (RUNS, OPS, TENSORS, EDGES, MODULES, GRADS, RULES, CALLS)
}
#: The tables holding a run's rows (by ``run_id``).
RUN_TABLES = ("ops", "tensors", "edges", "modules", "grads", "rules", "calls")


def ident(name: str) -> str:
    """The one quoting function for SQL identifiers (catalog names, and names a query
    uses once the query room's whitelist admitted them)."""
    return '"' + name.replace('"', '""') + '"'


def _literal(value: Any) -> str:
    """A declared default as SQL (declarations only: never user input)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    raise TypeError(f"a column default must be None, a bool, a number or a str: {value!r}")


def _definition(field: Field) -> str:
    assert field.type is not None
    default = f" DEFAULT {_literal(field.default)}" if field.has_default else ""
    return f"{ident(field.name)} {field.type.duckdb}{default}"


def arrow_schema(table: Table) -> pa.Schema:
    """The Arrow schema of ``table``'s rows, columns in declaration order."""
    known = _SCHEMAS.get(id(table))
    if known is None or known[0] is not table:
        import pyarrow as pa  # (not for listing runs: the command line starts without it)

        schema = pa.schema([(f.name, f.type.arrow) for f in table.columns if f.type is not None])
        known = _SCHEMAS[id(table)] = (table, schema)
    return known[1]


#: id(table) -> (table, its schema). By identity, not by the table's value: a frozen
#: dataclass's hash walks every column's declaration (~0.1 ms, three times a run).
_SCHEMAS: dict[int, tuple[Table, pa.Schema]] = {}


def present_columns(con: duckdb.DuckDBPyConnection) -> dict[str, set[str]]:
    """The columns each table of the connection's current database has."""
    present: dict[str, set[str]] = {}
    for table, column in con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() "
        "WHERE database_name = current_database() AND schema_name = 'main'"
    ).fetchall():
        present.setdefault(table, set()).add(column)
    return present


def create_schema(con: duckdb.DuckDBPyConnection, empty: bool = False) -> None:
    """Create every table the catalog lacks, and every column an older catalog's tables
    lack (filled with the column's default): run in a writer's transaction, or on a
    reader's own in-memory database. ``empty``: the database is known to hold no table
    (a catalog file just made), so nothing is looked up first."""
    present = {} if empty else present_columns(con)
    for table in TABLES.values():
        if table.name not in present:
            columns = ", ".join(_definition(f) for f in table.columns)
            con.execute(f"CREATE TABLE {ident(table.name)} ({columns})")
            continue
        for field in table.columns:
            if field.name not in present[table.name]:
                con.execute(f"ALTER TABLE {ident(table.name)} ADD COLUMN {_definition(field)}")


def select_list(table: Table, present: set[str]) -> str:
    """The columns of ``table`` in declaration order, for a ``SELECT`` over a catalog
    whose table has the columns ``present``: a column it lacks reads as its default."""
    items = []
    for field in table.columns:
        assert field.type is not None
        if field.name in present:
            items.append(ident(field.name))
        else:
            value = _literal(field.default) if field.has_default else "NULL"
            items.append(f"CAST({value} AS {field.type.duckdb}) AS {ident(field.name)}")
    return ", ".join(items)


class _Incoming:
    """The rows an :func:`insert` is adding to one table, behind a view that
    :func:`accept_rows` registers once per connection; between inserts, none (an empty
    table of the table's declared schema). DuckDB 1.x fixes a view's columns when it is
    made (2.x reads them again at each statement), so only rows of exactly that schema
    go through it."""

    __slots__ = ("empty", "rows")

    def __init__(self, schema: pa.Schema) -> None:
        import pyarrow as pa

        # (not Schema.empty_table(), which imports pandas: ~0.25 s of a reader's first
        # open in a process that has no other use for it, `tracelake verify` for one)
        self.empty = pa.Table.from_batches([], schema=schema)
        self.rows = self.empty

    def __arrow_c_schema__(self) -> object:
        return self.rows.schema.__arrow_c_schema__()

    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        return self.rows.__arrow_c_stream__(requested_schema)


#: Each connection's :class:`_Incoming` by table name (:func:`accept_rows`).
_INCOMING: weakref.WeakKeyDictionary[Any, dict[str, _Incoming]] = weakref.WeakKeyDictionary()


def _incoming_view(table: str) -> str:
    return f"_incoming_{table}"


def accept_rows(con: duckdb.DuckDBPyConnection) -> None:
    """Make ``con`` ready for :func:`insert`: register a view for each table's rows,
    outside any transaction (a view registered inside one goes with its rollback).
    Registering an Arrow table for each insert, and dropping it after, cost more than
    inserting a tiny run's rows (``benchmarks/many_runs.py``)."""
    holders = {}
    for name, table in TABLES.items():
        holders[name] = _Incoming(arrow_schema(table))
        con.register(_incoming_view(name), holders[name])
    _INCOMING[con] = holders


def insert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
    """Insert an Arrow table's rows by column name (a column the rows lack gets its
    default; a column the table lacks is an error): rows of the table's declared schema
    (all a writer builds) through the view :func:`accept_rows` registered on ``con``,
    others (or on a connection not made ready) through a view of their own, registered
    for the statement. (DuckDB's replacement scan of a Python variable would need no
    view, but a Ctrl-C landing while it looks the variable up comes out as 'table does
    not exist', not as an interrupt: ``test_interrupts``.)"""
    if not rows.num_rows:
        return
    holder = _INCOMING.get(con, {}).get(table)
    if holder is not None and rows.schema.equals(holder.empty.schema):
        holder.rows = rows
        try:
            con.execute(f"INSERT INTO {ident(table)} BY NAME SELECT * FROM {_incoming_view(table)}")
        finally:
            holder.rows = holder.empty
        return
    con.register("_incoming", rows)
    try:
        con.execute(f"INSERT INTO {ident(table)} BY NAME SELECT * FROM _incoming")
    except BaseException:
        # a failed (or interrupted) statement aborts the transaction, and so would
        # the unregister (a DuckDB error; this module leaves DuckDB to catalog.py):
        # the first error is the one to report
        with contextlib.suppress(Exception):
            con.unregister("_incoming")
        raise
    con.unregister("_incoming")
