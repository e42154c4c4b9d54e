"""The op record, declared once: every field of what a recording keeps per entry.

Each :class:`Field` says, once, its name, its type (Python, Arrow and DuckDB in one
:class:`ColumnType`), whether the recorder keeps it in its in-memory row tuple (``row``),
whether it is a catalog column of ``ops`` (``type`` set), whether it is a summary
statistic, and whether queries may name it. Everything else is derived from
:data:`OPS`:

- the recorder's row layout (:data:`ROW_FIELDS`, :func:`position`, :func:`make_row`) and
  the C header ``recorder/_record.h`` that ``_hot.c`` builds rows with
  (``python recorder/record.py`` writes it; a test checks that it is current);
- :class:`Stats` (the statistics fields are its fields);
- the catalog's DDL, Arrow schemas, inserts by name, and the query whitelist
  (``store/schema.py``, ``query/schema.py``).

Adding a column to ``ops`` is one :class:`Field` line here plus whatever produces its
values: a row field with a ``default`` flows from the recorder to the catalog and to
queries with no other change; a field the recorder does not keep is produced by the
store (``store/rows.py``'s producers).

This module imports nothing from tracelake or torch, so that it can run as a script.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import sys
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BOOL",
    "EDGES",
    "F64",
    "GRADS",
    "I32",
    "I64",
    "MODULES",
    "OPS",
    "ROW_FIELDS",
    "ROW_WIDTH",
    "STAT_FIELDS",
    "STR",
    "TIMESTAMP",
    "TRANSFORMED",
    "ColumnType",
    "Field",
    "Stats",
    "Table",
    "c_header",
    "list_of",
    "make_row",
    "position",
    "row_param",
]

#: How the query language treats a column's values.
Kind = Literal["number", "bool", "string", "other"]


@dataclass(frozen=True)
class ColumnType:
    """One column type in each place it lives: DuckDB's spelling, the Arrow type (made
    on first use, so the recorder never imports pyarrow), the Python type of its values
    and how the query language treats them."""

    duckdb: str
    python: type
    kind: Kind
    _arrow: str = dataclasses.field(repr=False)
    _item: ColumnType | None = dataclasses.field(default=None, repr=False)

    @functools.cached_property
    def arrow(self) -> Any:
        import pyarrow as pa

        if self._item is not None:
            return pa.list_(self._item.arrow)
        if self._arrow == "module_stack":
            return pa.struct([("path", pa.string()), ("pass", pa.int32())])
        if self._arrow == "timestamp":
            return pa.timestamp("us")
        return getattr(pa, self._arrow)()


I32 = ColumnType("INTEGER", int, "number", "int32")
I64 = ColumnType("BIGINT", int, "number", "int64")
F64 = ColumnType("DOUBLE", float, "number", "float64")
STR = ColumnType("VARCHAR", str, "string", "string")
BOOL = ColumnType("BOOLEAN", bool, "bool", "bool_")
TIMESTAMP = ColumnType("TIMESTAMP", object, "string", "timestamp")
#: One module call on an op's stack: its path and pass.
MODULE_CALL = ColumnType('STRUCT(path VARCHAR, "pass" INTEGER)', dict, "other", "module_stack")


def list_of(item: ColumnType) -> ColumnType:
    return ColumnType(f"{item.duckdb}[]", list, "other", "list", item)


@dataclass(frozen=True)
class Field:
    """One field of a record.

    ``type``: the catalog column's type, or ``None`` for a field only the recorder's
    row keeps (its parents become the ``edges`` table, its call site the ``source_*``
    columns). ``row``: the recorder keeps it in its row tuple; with ``has_default``,
    ``default`` is the value a row gets where its producer does not set it (and that
    an older catalog's rows read as). ``stat``: a summary statistic (a field of
    :class:`Stats`). ``query``: queries may name it."""

    name: str
    type: ColumnType | None
    doc: str
    row: bool = False
    default: Any = None
    has_default: bool = False
    stat: bool = False
    query: bool = True


@dataclass(frozen=True)
class Table:
    """A catalog table: its name and fields, in the order a new catalog lays them out
    (rows are inserted by name, so an older catalog's order does not matter)."""

    name: str
    fields: tuple[Field, ...]

    @property
    def columns(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.type is not None)

    @functools.cached_property
    def column_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.columns)

    def column_type(self, name: str) -> ColumnType:
        """The type of the catalog column ``name``."""
        type_ = self.field(name).type
        if type_ is None:
            raise KeyError(f"{self.name}.{name} is not a catalog column")
        return type_

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}")


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary statistics of one tensor. Fields are ``None`` where undefined
    (empty tensors; mean, std, min and max of complex tensors). Their order is the
    catalog's, and each is a column of ``ops``."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    absmax: float | None
    l2: float | None
    frac_zero: float | None
    nan_count: int
    inf_count: int


_STAT_DOCS = {
    "mean": "mean of all elements",
    "std": "population standard deviation (correction=0)",
    "min": "smallest element",
    "max": "largest element",
    "absmax": "largest absolute value",
    "l2": "L2 norm",
    "frac_zero": "fraction of elements that are zero",
    "nan_count": "number of NaN elements",
    "inf_count": "number of infinite elements",
}


def _stat_fields() -> tuple[Field, ...]:
    hints = {f.name: f.type for f in dataclasses.fields(Stats)}
    # Counts are integers; every other statistic is a float (None where undefined).
    return tuple(
        Field(name, I64 if hint in (int, "int") else F64, _STAT_DOCS[name], stat=True)
        for name, hint in hints.items()
    )


#: The ``ops`` table: one row per entry (model input, op output, model output).
OPS = Table(
    "ops",
    (
        Field("run_id", I32, "the run's id"),
        Field("step", I32, "the forward pass (step) of the run, from 0"),
        Field("idx", I32, "execution order within the step"),
        Field("label", STR, "TorchLens-style label, with ':pass' for multi-pass layers"),
        Field("key", STR, "stable key across runs: module call, function, ordinal"),
        Field("layer", STR, "the label without its pass"),
        Field("pass", I32, "the pass of the layer (from 1)", row=True),
        Field("num_passes", I32, "how many passes the layer ran"),
        Field("func", STR, "the torch function's name; 'input' / 'output' / 'buffer'", row=True),
        Field("kind", STR, "'input', 'op', 'output' or 'buffer'", row=True),
        Field("module", STR, "the innermost module's path ('' at top level)"),
        Field("block", I32, "the block index in the module's path (h.3.attn -> 3)"),
        Field("modules", list_of(MODULE_CALL), "the module stack, outermost first", row=True),
        Field("shape", list_of(I64), "the tensor's shape", row=True),
        Field("dtype", STR, "the tensor's dtype (torch's name, without 'torch.')", row=True),
        Field("device", STR, "the tensor's device", row=True),
        Field("nbytes", I64, "the tensor's size in bytes"),
        Field("out_index", I32, "position among the tensors one call returned", row=True),
        Field("inplace", BOOL, "whether the call wrote into an argument", row=True),
        Field("params", list_of(STR), "names of the parameters the call used", row=True),
        Field("layer_idx", I32, "the entry (idx) that first ran this layer", row=True),
        Field("n_func", I32, "the layer's number among layers of its function", row=True),
        Field("n_layer", I32, "the layer's number among all layers (0: inputs/outputs)", row=True),
        Field(
            "intervened",
            BOOL,
            "whether an intervention rule (intervene=) changed the op's output",
            row=True,
            default=False,
            has_default=True,
        ),
        Field(
            "rule",
            I32,
            "the intervention rule that changed it first (the run's rules table), else NULL",
            row=True,
            default=None,
            has_default=True,
        ),
        Field("saved", BOOL, "whether the tensor was saved"),
        Field("tensor", I32, "the saved tensor's slot in the run's tensors table"),
        Field("array", STR, "the Zarr array holding the saved tensor"),
        Field("byte_offset", I64, "where the tensor starts in a packed array"),
        Field("source_file", STR, "the user code's file that issued the call"),
        Field("source_line", I32, "its line"),
        Field("source_func", STR, "its function"),
        Field(
            "args",
            STR,
            "the call's function and non-tensor arguments as JSON (with record_args=True)",
        ),
        *_stat_fields(),
        # Kept by the recorder only: parents become the edges table, the call site the
        # source_* columns; the non-tensor arguments only key loops.
        Field("parents", None, "rows of the entries this one consumed", row=True),
        Field("parent_args", None, "argument position of each parent", row=True),
        Field("site", None, "(code, bytecode offset) of the user's call", row=True),
        Field(
            "arg_values",
            None,
            "the call's non-tensor arguments, (position or keyword, value, ...) in call "
            "order (None: it had none), for TorchLens's loop keys (recorder/argkeys.py)",
            row=True,
            default=None,
            has_default=True,
        ),
    ),
)

#: The ``edges`` table: one row per (child, parent) pair.
EDGES = Table(
    "edges",
    (
        Field("run_id", I32, "the run's id"),
        Field("step", I32, "the step"),
        Field("parent", I32, "the producing entry's idx"),
        Field("child", I32, "the consuming entry's idx"),
        Field("arg", STR, "where the parent came in: '0', 'weight', '0.2' (a list item)"),
        Field("edge", I32, "the order of the child's parents"),
    ),
)

#: The ``grads`` table: one row per op gradient a backward call recorded (a store's
#: ``rec.backward(loss)``), in the order the autograd engine ran the ops' nodes. Its
#: tensor columns are named as ``ops``' are, so ``out`` reads the gradient.
GRADS = Table(
    "grads",
    (
        Field("run_id", I32, "the run's id"),
        Field("step", I32, "the forward pass (step) of the op"),
        Field("idx", I32, "the op's idx in its step"),
        Field("label", STR, "the op's label (pass-qualified)"),
        Field("backward", I32, "which backward call of the run (from 1)"),
        Field("fire", I32, "the fire of the op's autograd node, in execution order (from 0)"),
        Field("node", STR, "the autograd node's class: AddmmBackward0, AccumulateGrad, ..."),
        Field("shape", list_of(I64), "the gradient's shape"),
        Field("dtype", STR, "the gradient's dtype"),
        Field("nbytes", I64, "the gradient's size in bytes"),
        Field("saved", BOOL, "whether the gradient was saved"),
        Field("tensor", I32, "the saved gradient's slot in the run's tensors table"),
        Field("array", STR, "the Zarr array holding it"),
        Field("byte_offset", I64, "where it starts in a packed array"),
        *_stat_fields(),
    ),
)

#: The ``modules`` table: one row per module call.
MODULES = Table(
    "modules",
    (
        Field("run_id", I32, "the run's id"),
        Field("step", I32, "the step"),
        Field("idx", I32, "order of the call"),
        Field("label", STR, "the module's path, with ':pass' when called several times"),
        Field("path", STR, "the module's named_modules() path"),
        Field("type", STR, "the module's class name"),
        Field("pass", I32, "the call's pass (from 1)"),
        Field("num_passes", I32, "how many times the module was called"),
        Field("first_op", STR, "label of the first op inside the call"),
        Field("last_op", STR, "label of the last op inside the call"),
        Field("op_start", I32, "idx of the first op inside the call"),
        Field("op_end", I32, "idx after the last op inside the call"),
        Field("input_ops", list_of(I32), "producers of the input tensors (-1: none)"),
        Field("output_ops", list_of(I32), "producers of the output tensors (-1: none)"),
        Field("input_tensors", list_of(I32), "tensor slots of the saved inputs"),
        Field("output_tensors", list_of(I32), "tensor slots of the saved outputs"),
        Field("structure", STR, "the output's structure as JSON, tensors by slot"),
    ),
)

#: Row fields whose catalog column holds a converted value (the module stack as
#: structs, the shape as a list, dtype and device as names, the parameter names as a
#: list); the catalog keeps every other row field with a column as it is.
TRANSFORMED = frozenset({"modules", "shape", "dtype", "device", "params"})

#: The recorder's row tuple: the fields with ``row=True``, in declaration order.
ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in OPS.fields if f.row)
ROW_WIDTH = len(ROW_FIELDS)
#: The statistics columns, in :class:`Stats` order.
STAT_FIELDS: tuple[str, ...] = tuple(f.name for f in OPS.fields if f.stat)
assert tuple(f.name for f in dataclasses.fields(Stats)) == STAT_FIELDS


def position(name: str) -> int:
    """Where the row field ``name`` sits in the recorder's row tuple."""
    try:
        return ROW_FIELDS.index(name)
    except ValueError:
        raise KeyError(f"the op row has no field {name!r}") from None


def row_param(name: str) -> str:
    """A row field's parameter name in :func:`make_row`: ``pass`` is a Python keyword."""
    return f"{name}_" if keyword.iskeyword(name) else name


def _row_builder() -> Any:
    """``make_row(**fields) -> tuple``: a row by field name, defaults filled in. Made
    from the declaration (as ``dataclasses`` makes ``__init__``), so that a row stays a
    plain tuple (the garbage collector stops tracking tuples of plain values) and is
    still built by name."""
    required, optional = [], []
    namespace: dict[str, Any] = {}
    for name in ROW_FIELDS:
        field = OPS.field(name)
        if not field.has_default:
            required.append(row_param(name))
        else:
            namespace[f"_default_{name}"] = field.default
            optional.append(f"{row_param(name)}=_default_{name}")
    values = ", ".join(row_param(name) for name in ROW_FIELDS)
    source = f"def make_row(*, {', '.join(required + optional)}):\n    return ({values},)\n"
    exec(source, namespace)  # text made from the declaration above only
    return namespace["make_row"]


#: ``make_row(func=..., kind=..., pass_=..., ...)``: one row tuple, fields by name
#: (``pass`` spelled ``pass_``, a Python keyword).
make_row = _row_builder()

#: Row values the recorder's C path does not set itself, by position (None: required).
ROW_DEFAULTS: tuple[Any, ...] = tuple(OPS.field(name).default for name in ROW_FIELDS)


def c_header() -> str:
    """The C header ``_hot.c`` builds rows with: each row field's position by name."""
    lines = [
        "/* Generated from recorder/record.py by `python recorder/record.py`: do not edit.",
        " * The recorder's row tuple, field by field (see record.OPS). */",
        "#ifndef TRACELAKE_RECORD_H",
        "#define TRACELAKE_RECORD_H",
        f"#define ROW_WIDTH {ROW_WIDTH}",
        *(f"#define ROW_{name.upper()} {k}" for k, name in enumerate(ROW_FIELDS)),
        '#define ROW_FIELD_NAMES "' + ",".join(ROW_FIELDS) + '"',
        "#endif",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import pathlib

    target = pathlib.Path(__file__).with_name("_record.h")
    target.write_text(c_header())
    sys.stdout.write(f"wrote {target}\n")
