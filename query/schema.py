"""What a query may name: tables, columns and functions, and nothing else.

The columns come from the catalog's declarations (:data:`tracelake.store.schema.TABLES`:
each field's kind and whether queries may name it), so the whitelist follows the schema.
Every identifier the compiler writes into SQL is looked up here first and quoted by
:func:`ident`, the one quoting function.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

from tracelake.recorder.record import Kind
from tracelake.store.schema import TABLES, ident

__all__ = [
    "AGGREGATES",
    "COLUMNS",
    "FUNCTIONS",
    "HIDDEN",
    "HIDDEN_COLUMNS",
    "PAIR_FUNCTIONS",
    "QUALIFIERS",
    "REDUCTIONS",
    "SCALARS",
    "STATS",
    "TABLE_NAMES",
    "TENSOR_TABLES",
    "Kind",
    "closest",
    "ident",
    "json_path",
    "star",
]

#: Tables a query can read, in the order error messages list them.
TABLE_NAMES = ("ops", "runs", "modules", "edges", "grads", "rules", "calls")
#: Tables whose rows locate a tensor (``out``: an op's output; a grad row's gradient).
TENSOR_TABLES = ("ops", "grads")

#: Whole-tensor reductions of ``out``, each answered by a statistics column of ``ops`` (and
#: of ``grads``)
#: (the language says ``norm`` for the ``l2`` column). ``sum`` has no column of its own:
#: it is ``mean`` times the element count.
STATS = {"mean": "mean", "std": "std", "min": "min", "max": "max", "absmax": "absmax", "norm": "l2"}
assert all(TABLES["ops"].field(column).stat for column in STATS.values())
REDUCTIONS = (*STATS, "sum")

#: Aggregates over columns (``count(*)`` too), for ``group by`` queries.
AGGREGATES = ("count", "avg", "sum", "min", "max")
#: Functions of a number.
SCALARS = ("abs",)
#: Functions of two tensors (``allclose`` also takes ``atol`` and ``rtol``), computed by
#: reading both: ``store.compare``'s metrics.
PAIR_FUNCTIONS = ("max_abs_diff", "mean_abs_diff", "rel_l2", "cosine", "allclose")
FUNCTIONS = tuple(dict.fromkeys((*REDUCTIONS, *AGGREGATES, *SCALARS, *PAIR_FUNCTIONS)))

#: Words that qualify names without naming a table, so no table may be aliased so.
QUALIFIERS = ("meta", "parent", "child")

#: Columns the SQL adds after the visible ones when a query selects tensors: what the
#: executor needs to read them (the ``tensor`` slot is NULL for unsaved ops).
#: Each hidden column's name and the ops column it holds.
HIDDEN_COLUMNS = {
    "__run_id": "run_id",
    "__step": "step",
    "__tensor": "tensor",
    "__array": "array",
    "__offset": "byte_offset",
    "__nbytes": "nbytes",
    "__shape": "shape",
    "__dtype": "dtype",
}
HIDDEN = tuple(HIDDEN_COLUMNS)


def _columns(table: str) -> dict[str, Kind]:
    own = {f.name: f.type.kind for f in TABLES[table].columns if f.type and f.query}
    if table == "runs":
        return {**own, "run": "string"}
    return {"run": "string", **own}


#: Visible columns of each table and their kinds. ``run`` is the run's name everywhere
#: (``runs.name``); ``*`` expands to these, in this order (``run`` first except in runs).
COLUMNS: dict[str, dict[str, Kind]] = {table: _columns(table) for table in TABLE_NAMES}
_STAR = {
    table: tuple(c for c in cols if not (table == "runs" and c == "run"))
    for table, cols in COLUMNS.items()
}


def star(table: str) -> tuple[str, ...]:
    """The columns ``*`` stands for."""
    return _STAR[table]


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def json_path(keys: Iterable[str]) -> str:
    """The SQL string constant ``'$.a.b'`` for ``meta.a.b``. Keys are identifiers (the
    grammar's NAME); anything else is refused here, never written into SQL."""
    keys = tuple(keys)
    if not keys or not all(isinstance(k, str) and _KEY.fullmatch(k) for k in keys):
        raise ValueError(f"meta keys are letters, digits and underscores: {keys!r}")
    return "'$." + ".".join(keys) + "'"


def closest(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the nearest known name, or ``""``."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""
