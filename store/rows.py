"""Catalog rows to and from a recording's in-memory tables.

:func:`run_tables` turns a run's recorded steps (each an :class:`OpTable`, module entries
and the slots its tensors went to) into Arrow tables for the catalog; :func:`load_step`
turns catalog rows back into the same :class:`OpTable` and :class:`ModuleEntry` objects,
so that a stored run answers through the very classes an in-memory trace uses.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracelake.recorder.emit import SelectingEmitter
from tracelake.recorder.entries import (
    DEVICE,
    DTYPE,
    KIND,
    LAYER,
    MODULES,
    PARAMS,
    PARENT_ARGS,
    PARENTS,
    SHAPE,
    SITE,
    ModuleEntry,
    OpTable,
    SourceLocation,
)
from tracelake.recorder.record import (
    EDGES,
    OPS,
    ROW_FIELDS,
    ROW_WIDTH,
    STAT_FIELDS,
    TRANSFORMED,
    Stats,
    position,
)
from tracelake.recorder.record import (
    MODULES as MODULES_TABLE,
)

from . import arrow
from .schema import CALLS, RULES, TENSORS, arrow_schema, ident
from .structure import decode_structure, encode_structure
from .tensors import dtype_name, parse_dtype

__all__ = [
    "STAT_FIELDS",
    "StoredOpTable",
    "Written",
    "audit_tables",
    "decode_structure",
    "distinct_codes",
    "load_step",
    "run_tables",
    "runs_tables",
    "stat_columns",
]

_I32, _I64, _F64, _STR = pa.int32(), pa.int64(), pa.float64(), pa.string()

#: Row fields the catalog keeps as they are (a column of the same name and value); the
#: other row fields are converted (``record.TRANSFORMED``) or become other tables and
#: columns (parents: edges; the call site: source_*).
PLAIN_ROW_COLUMNS = tuple(
    f.name for f in OPS.fields if f.row and f.type is not None and f.name not in TRANSFORMED
)
#: Whether each statistics column holds integers (counts) rather than floats.
_STAT_IS_INT = tuple(OPS.column_type(name).python is int for name in STAT_FIELDS)


def _transposed(rows: list[tuple[Any, ...]], width: int) -> list[tuple[Any, ...]]:
    """The columns of ``rows``. ``zip(*rows)`` holds an iterator per row (20,000 for a run
    of that many ops): were the garbage collector to run meanwhile, it would promote
    them all to its oldest generation, and a full collection of the whole heap would come
    with every run or two. So it does not run meanwhile (no user code does either); one
    ``map`` per column instead is several times slower."""
    if not rows:
        return [()] * width
    enabled = gc.isenabled()
    gc.disable()
    try:
        return list(zip(*rows, strict=True))
    finally:
        if enabled:
            gc.enable()


def distinct_codes(values: Sequence[Any], identity: bool = False) -> tuple[list[Any], np.ndarray]:
    """A column's distinct values (in order of first appearance) and each row's index
    into them: rows share module stacks, shapes, dtypes, layers and call sites, so each
    distinct value is converted once and Arrow ``take``s the rest.

    One hash per row (each row's first equal row, then ranks), and none for a column of
    one value (``count``'s comparisons start with identity, which is far cheaper than
    hashing every row). ``identity``: rows are found equal by
    being the same object, so equal values that are other objects may get codes of their
    own (for values whose hash is slow, such as call sites holding a code object, where
    the caller only needs each value converted about once)."""
    n = len(values)
    if n and values.count(values[0]) == n:
        return [values[0]], np.zeros(n, dtype=np.int32)
    keys = map(id, values) if identity else values
    seen: dict[Any, int] = {}
    first = np.fromiter(map(seen.setdefault, keys, range(n)), np.int64, n)
    heads = np.flatnonzero(first == np.arange(n))
    rank = np.empty(n, dtype=np.int32)
    rank[heads] = np.arange(len(heads), dtype=np.int32)
    return [values[k] for k in heads.tolist()], rank[first]


def _taken(distinct: list[Any], codes: np.ndarray, type_: pa.DataType) -> pa.Array:
    if len(codes) <= _TAKE_MIN:  # (a tiny run: each take costs more than converting)
        return arrow.array([distinct[k] for k in codes.tolist()], type_)
    return arrow.array(distinct, type_).take(arrow.indices(codes))


#: Up to this many rows a column is converted row by row rather than taken from its
#: distinct values: Arrow's ``take`` has a fixed cost (~20-250 us a call, nested types
#: most) that a few rows' conversion does not (~10-20 us for 5 rows; even at 128 rows).
_TAKE_MIN = 128


#: What a run's writer computes in its workers: the statistics by tensor slot (as
#: ``TensorWriter.stat_matrix`` gives them) and a function from array name to codec.
Written = Callable[[], tuple[tuple[np.ndarray, np.ndarray], Callable[[str], str]]]


@dataclass
class RunSteps:
    """One run's recorded steps, as :func:`runs_tables` takes them: its id, its steps
    (each an :class:`OpTable`, its module entries, and what the step's emitter kept:
    ``op_slots`` and ``unsaved_stats``), its writer's slots (``TensorWriter.slots``),
    and ``written`` (see :func:`run_tables`)."""

    run_id: int
    steps: Sequence[tuple[OpTable, list[ModuleEntry], Any]]
    slots: list[Any]
    written: Written
    #: Its intervention rules (``Interventions.audit()``) and calls, where the ``rules``
    #: and ``calls`` tables are built with the others (:func:`audit_tables` otherwise).
    audit: tuple[list[dict[str, Any]], list[str]] | None = None

    @property
    def ops(self) -> int:
        return sum(len(table.rows) for table, _, _ in self.steps)


@dataclass
class KeptOps:
    """What :func:`runs_tables` reads of a step's emitter (``op_slots`` and
    ``unsaved_stats``): kept in its place while a run waits for its batch's commit,
    so that the emitter, its writer and selector go."""

    op_slots: dict[int, int]
    unsaved_stats: dict[int, Stats]


def run_tables(
    run_id: int,
    steps: Sequence[tuple[OpTable, list[ModuleEntry], SelectingEmitter]],
    slots: list[Any],
    written: Written,
) -> dict[str, pa.Table]:
    """The ``ops``, ``edges``, ``modules`` and ``tensors`` tables of a run's recorded
    steps. ``slots``: its writer's slots (``TensorWriter.slots``: an op's row carries its
    tensor's array and byte offset, so a query finds the bytes without another join);
    ``written()`` is asked for last, so that the writer's workers finish the run's last
    chunks (statistics, encoding, writes) while the rest is built."""
    return runs_tables([RunSteps(run_id, steps, slots, written)])


def runs_tables(runs: Sequence[RunSteps]) -> dict[str, pa.Table]:
    """:func:`run_tables` of several runs at once, their rows in one table each (a
    batch's small runs: each Arrow conversion has a fixed cost, which per run would
    dominate runs of a few ops).

    Built column by column, all steps of all runs at once (this runs for every op of
    every stored run, and per step the conversions' fixed cost would dominate runs of
    many small steps): what rows share (module stacks, shapes, dtypes, layers, call
    sites) is converted once per distinct value, and the tensor columns are gathered by
    slot."""
    steps = [step for run in runs for step in run.steps]
    tensors, arrays, slot_start = _tensor_columns(runs)
    ops, slot_of, edges = _op_columns(runs, steps, tensors, slot_start)
    modules = _modules(
        [
            (run.run_id, k, m)
            for run in runs
            for k, (_, entries, _) in enumerate(run.steps)
            for m in entries
        ]
    )
    written = [run.written() for run in runs]  # last: the workers finish meanwhile
    stats = (
        _stacked([values for (values, _), _ in written]),
        _stacked([valid for (_, valid), _ in written]),
    )
    _add_stats(ops, steps, stats, slot_of)
    tensors["codec"] = _codecs(arrays, [codec for _, codec in written])
    tables = {
        "ops": _assembled(arrow_schema(OPS), ops),
        "edges": edges,
        "modules": modules,
        "tensors": _assembled(arrow_schema(TENSORS), tensors),
    }
    audits = [(run.run_id, *run.audit) for run in runs if run.audit is not None]
    if audits:
        assert len(audits) == len(runs), "every run's audit, or none"
        tables.update(_audit_tables(audits))
    return tables


def _stacked(matrices: list[np.ndarray]) -> np.ndarray:
    """Runs' statistics matrices (``TensorWriter.stat_matrix``: a row a slot and one
    last, undefined row) as one, slots in run order, with one last undefined row."""
    if len(matrices) == 1:
        return matrices[0]
    return np.concatenate([m[:-1] for m in matrices] + [matrices[0][-1:]])


def audit_tables(run_id: int, interventions: Any, calls: list[str]) -> dict[str, pa.Table]:
    """The ``rules`` table (the run's intervention rules: ``Interventions.audit()``) and
    the ``calls`` table (how each step called the model) of a run."""
    return _audit_tables([(run_id, interventions.audit(), calls)])


def _audit_tables(runs: list[tuple[int, list[dict[str, Any]], list[str]]]) -> dict[str, pa.Table]:
    """:func:`audit_tables` of several runs: (run id, rules, calls) each."""
    rules = [(run_id, rule) for run_id, run_rules, _ in runs for rule in run_rules]
    return {
        "rules": _assembled(
            arrow_schema(RULES),
            {
                name: [run_id for run_id, _ in rules]
                if name == "run_id"
                else [r[name] for _, r in rules]
                for name in RULES.column_names
            },
        ),
        "calls": _assembled(
            arrow_schema(CALLS),
            {
                "run_id": [run_id for run_id, _, calls in runs for _ in calls],
                "step": [k for _, _, calls in runs for k in range(len(calls))],
                "call": [call for _, _, calls in runs for call in calls],
            },
        ),
    }


class OpRows:
    """A run's op rows, all steps, as columns: what a producer of a derived ``ops``
    column reads (``column(name)``: a row field's values, one per op)."""

    def __init__(
        self, columns: list[tuple[Any, ...]], labels: list[str], step: np.ndarray, idx: np.ndarray
    ):
        self._columns = columns
        self.labels = labels
        self.step = step
        self.idx = idx

    def __len__(self) -> int:
        return len(self.labels)

    def column(self, name: str) -> tuple[Any, ...]:
        return self._columns[position(name)]


#: Producers of the ``ops`` columns the store derives beyond those built in
#: :func:`_op_columns`: column name -> function of the run's :class:`OpRows` returning
#: one value per op. A column declared in ``record.OPS`` that nothing produces is an
#: error at the first commit.
PRODUCERS: dict[str, Callable[[OpRows], Sequence[Any]]] = {}


def _assembled(schema: pa.Schema, columns: dict[str, Any]) -> pa.Table:
    missing = [f.name for f in schema if f.name not in columns]
    if missing:
        raise KeyError(f"no producer for the declared column(s) {', '.join(missing)}")
    return pa.Table.from_arrays(
        [arrow.array(columns[f.name], f.type) for f in schema], schema=schema
    )


def _op_columns(
    runs: Sequence[RunSteps],
    steps: Sequence[tuple[OpTable, list[ModuleEntry], Any]],
    tensors: dict[str, Any],
    slot_start: np.ndarray,
) -> tuple[dict[str, Any], np.ndarray, pa.Table]:
    """The ``ops`` columns but the statistics, each op's tensor slot among all the
    runs' (-1: none; ``slot_start``: each run's first), and the ``edges`` table.

    What an op's row gives (its label, layer, modules, shape, call site, parents...) is
    built once per distinct graph (:func:`_distinct_steps`: every step of a loop over one
    graph has the very rows and labels of the first) and gathered into each step's place;
    the rest (step, slot, statistics) per op."""
    tables = [table for table, _, _ in steps]
    sizes = np.array([len(table.rows) for table in tables], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes  # each step's first row
    n = int(sizes.sum())
    per_run = np.array([len(run.steps) for run in runs], dtype=np.int64)
    step_run = np.repeat(np.arange(len(runs)), per_run)  # each step's run
    local = np.arange(len(steps), dtype=np.int32) - np.repeat(
        (np.cumsum(per_run) - per_run).astype(np.int32), per_run
    )
    step_of = np.repeat(local, sizes)  # each row's step within its run
    run_of = np.repeat(np.array([run.run_id for run in runs], dtype=np.int32)[step_run], sizes)
    idx = np.arange(n, dtype=np.int64) - np.repeat(starts, sizes)  # the row within its step
    slot_of = np.full(n, -1, dtype=np.int64)  # among all the runs' slots
    for start, first, (_, _, emitter) in zip(
        starts.tolist(), slot_start[step_run].tolist(), steps, strict=True
    ):
        op_slot = emitter.op_slots
        if op_slot:
            slot_of[start + np.fromiter(op_slot.keys(), np.int64, len(op_slot))] = first + (
                np.fromiter(op_slot.values(), np.int64, len(op_slot))
            )
    saved = slot_of >= 0
    tensor = arrow.array(slot_of, _I64, mask=~saved)  # (its run's: below)
    if len(runs) > 1:
        first_slot = np.repeat(slot_start[step_run], sizes)
        own = arrow.array(slot_of - first_slot, _I64, mask=~saved)
    else:
        own = tensor

    # The distinct graphs' rows ("templates"), and each op's row among them (``source``).
    distinct, template_of = _distinct_steps(tables)
    templates = [tables[k] for k in distinct]
    t_sizes = sizes[distinct]
    t_starts = np.cumsum(t_sizes) - t_sizes
    t_n = int(t_sizes.sum())
    source = None if t_n == n else idx + np.repeat(t_starts[template_of], sizes)

    def spread(values: Any) -> Any:
        """A column of the templates' rows as one of every op (numpy or Arrow)."""
        if source is None:
            return values
        if isinstance(values, np.ndarray):
            return values[source]
        return values.take(arrow.indices(source))

    def strings(values: list[Any], type_: pa.DataType = _STR) -> Any:
        return values if source is None else spread(arrow.array(values, type_))

    rows = list(itertools.chain.from_iterable(table.rows for table in templates))
    columns = _transposed(rows, len(rows[0]) if t_n else ROW_WIDTH)

    def template_rows(rows_: list[int]) -> tuple[list[OpTable], list[int]]:
        """The templates' tables and the rows within them of template-wide rows (two
        lists, not a tuple per row: as many objects as rows would wake the garbage
        collector)."""
        which = np.searchsorted(t_starts, rows_, side="right") - 1
        return (
            [templates[k] for k in which.tolist()],
            (np.asarray(rows_) - t_starts[which]).tolist(),
        )

    stacks, stack_of = distinct_codes(columns[MODULES])
    shapes, shape_of = distinct_codes(columns[SHAPE])
    dtypes, dtype_of = distinct_codes(columns[DTYPE])
    devices, device_of = distinct_codes(columns[DEVICE])
    params, params_of = distinct_codes(columns[PARAMS])
    layer_rows = np.array(columns[LAYER], dtype=np.int64) + np.repeat(t_starts, t_sizes)
    layers_, layer_of = np.unique(layer_rows, return_inverse=True)  # a layer: the
    layers = layers_.tolist()  # template-wide row of its first entry
    labels = list(itertools.chain.from_iterable(table.labels for table in templates))
    # A layer's label is its first entry's, less the ":1" of a layer of several passes.
    layer_names = list(map(labels.__getitem__, layers))
    passes = np.ones(len(layers), dtype=np.int32)
    layer_at = {row: k for k, row in enumerate(layers)} if any(t.passes for t in templates) else {}
    for start, table in zip(t_starts.tolist(), templates, strict=True):
        for lay, count in table.passes.items():
            k = layer_at[start + lay]
            layer_names[k] = table.layer_label(lay)
            passes[k] = count
    _, site_of = distinct_codes(columns[SITE], identity=True)  # a site: (code, offset)
    first = np.unique(site_of, return_index=True)[1].tolist()  # each site's first row
    where = [table.source(row) for table, row in zip(*template_rows(first), strict=True)]
    numel = np.array([math.prod(sh) for sh in shapes], dtype=np.int64)
    itemsize = np.array([dt.itemsize for dt in dtypes], dtype=np.int64)
    keys = list(itertools.chain.from_iterable(table.keys for table in templates))
    blocks = list(itertools.chain.from_iterable(table.blocks for table in templates))
    if source is not None:  # each op's codes: one take of the distinct values per column
        stack_of, shape_of, dtype_of, device_of, params_of, layer_of, site_of = (
            codes[source]
            for codes in (stack_of, shape_of, dtype_of, device_of, params_of, layer_of, site_of)
        )
    cols: dict[str, Any] = {
        "run_id": run_of,
        "step": step_of,
        "idx": idx,
        "label": strings(labels),
        "key": strings(keys),
        "block": strings(blocks, _I32),
        "layer": _taken(layer_names, layer_of, _STR),
        "num_passes": passes[layer_of],
        "module": _taken([st[-1][0] if st else "" for st in stacks], stack_of, _STR),
        "modules": _taken(
            [[{"path": p, "pass": k} for p, k in st] for st in stacks],
            stack_of,
            OPS.column_type("modules").arrow,
        ),
        "shape": _taken([list(sh) for sh in shapes], shape_of, pa.list_(_I64)),
        "dtype": _taken([dtype_name(dt) for dt in dtypes], dtype_of, _STR),
        "device": _taken([str(dev) for dev in devices], device_of, _STR),
        "nbytes": numel[shape_of] * itemsize[dtype_of],
        "params": _taken([list(p) for p in params], params_of, pa.list_(_STR)),
        "saved": saved,
        "tensor": own,
        "array": tensors["array"].take(tensor),
        "byte_offset": tensors["byte_offset"].take(tensor),
        "source_file": _taken([w.file if w else None for w in where], site_of, _STR),
        "source_line": _taken([w.line if w else None for w in where], site_of, _I32),
        "source_func": _taken([w.function if w else None for w in where], site_of, _STR),
        "args": _call_args(tables, n),
    }
    for name in PLAIN_ROW_COLUMNS:
        values = columns[position(name)]
        cols[name] = (
            values if source is None else spread(arrow.array(values, OPS.column_type(name).arrow))
        )
    if PRODUCERS:
        every = (
            columns
            if source is None
            else _transposed(
                list(itertools.chain.from_iterable(table.rows for table in tables)), ROW_WIDTH
            )
        )
        all_labels = list(itertools.chain.from_iterable(table.labels for table in tables))
        ops = OpRows(every, all_labels, step_of, idx)
        for name, produce in PRODUCERS.items():
            cols[name] = produce(ops)
    edges = _edges(run_of, step_of, idx, columns[PARENTS], columns[PARENT_ARGS], source)
    return cols, slot_of, edges


def _distinct_steps(tables: list[OpTable]) -> tuple[list[int], np.ndarray]:
    """The steps whose rows stand for all (the first of each distinct graph), and the
    one that stands for each step (its index among them). Steps are one graph when they
    were finished as the same settled graph (``OpTable.settled_as``: the very rows,
    labels and passes); any other step stands for itself."""
    distinct: list[int] = []
    seen: dict[tuple[str, int], int] = {}
    template_of = np.empty(len(tables), dtype=np.int64)
    for k, table in enumerate(tables):
        settled = table.settled_as()
        key = ("graph", id(settled)) if settled is not None else ("step", k)
        at = seen.get(key)
        if at is None:
            at = seen[key] = len(distinct)
            distinct.append(k)
        template_of[k] = at
    return distinct, template_of


def _call_args(tables: list[OpTable], n: int) -> list[str | None]:
    """Each op's encoded call as JSON (recordings with ``record_args``), encoded here, at
    commit, rather than on the forward thread."""
    if not any(table.call_args for table in tables):
        return [None] * n
    encoded: dict[int, str] = {}  # one text per call (a call's several outputs share it)

    def text(call: Any) -> str | None:
        if call is None:
            return None
        known = encoded.get(id(call))
        if known is None:
            known = encoded[id(call)] = json.dumps(call, allow_nan=False)
        return known

    return [text(t.call_args.get(i)) for t in tables for i in range(len(t.rows))]


def _add_stats(
    cols: dict[str, Any],
    steps: Sequence[tuple[OpTable, list[ModuleEntry], Any]],
    stats: tuple[np.ndarray, np.ndarray],
    slot_of: np.ndarray,
) -> None:
    """The statistics columns: saved ops' from the writer's, by slot; with
    ``stats="all"``, unsaved ops' from their emitters."""
    values, valid = stats[0][slot_of], stats[1][slot_of]  # slot -1: the undefined row
    start = 0
    for table, _, emitter in steps:
        for index, st in emitter.unsaved_stats.items():  # stats="all": unsaved ops, one by one
            row = [getattr(st, name) for name in STAT_FIELDS]
            values[start + index] = [0.0 if v is None else v for v in row]
            valid[start + index] = [v is not None for v in row]
        start += len(table.rows)
    cols.update(_stat_arrays(values, valid))


def stat_columns(stats: tuple[np.ndarray, np.ndarray], slot_of: np.ndarray) -> dict[str, Any]:
    """The statistics columns of rows whose tensors are in slots ``slot_of`` (-1: none),
    from a writer's statistics matrix (``TensorWriter.stat_matrix``)."""
    return _stat_arrays(stats[0][slot_of], stats[1][slot_of])


def _stat_arrays(values: np.ndarray, valid: np.ndarray) -> dict[str, Any]:
    cols = {}
    for k, (name, is_int) in enumerate(zip(STAT_FIELDS, _STAT_IS_INT, strict=True)):
        column = values[:, k].astype(np.int64) if is_int else values[:, k]
        cols[name] = arrow.array(column, _I64 if is_int else _F64, mask=~valid[:, k])
    return cols


def _edges(
    run_of: np.ndarray,
    step_of: np.ndarray,
    idx: np.ndarray,
    parents: Sequence[tuple[int, ...]],
    args: Sequence[tuple[Any, ...]],
    source: np.ndarray | None = None,
) -> pa.Table:
    """One row per (child, parent) pair; ``edge`` numbers a child's parents. ``parents``
    and ``args``: each template row's (:func:`_op_columns`); ``source``: each op's
    template row (None: the ops are the template rows)."""
    counts = np.fromiter(map(len, parents), np.int64, len(parents))
    total = int(counts.sum())
    edge = np.arange(total, dtype=np.int32) - np.repeat(
        (np.cumsum(counts) - counts).astype(np.int32), counts
    )
    names, name_of = distinct_codes(list(itertools.chain.from_iterable(args)))
    parent: Any = list(itertools.chain.from_iterable(parents))
    arg = _taken([str(a) for a in names], name_of, _STR)
    if source is not None:  # each op's template row's edges, in the op's place
        first = np.cumsum(counts) - counts  # each template row's first edge
        counts = counts[source]
        total = int(counts.sum())
        at = np.arange(total, dtype=np.int64) + np.repeat(
            first[source] - (np.cumsum(counts) - counts), counts
        )
        parent = np.fromiter(parent, np.int64, len(parent))[at]
        edge, arg = edge[at], arg.take(arrow.indices(at))
    columns = {
        "run_id": np.repeat(run_of, counts),
        "step": np.repeat(step_of, counts),
        "parent": parent,
        "child": np.repeat(idx, counts),
        "arg": arg,
        "edge": edge,
    }
    return _assembled(arrow_schema(EDGES), columns)


def _modules(modules: list[tuple[int, int, ModuleEntry]]) -> pa.Table:
    """The module entries of runs' steps, as (run id, step, entry)."""

    def column(value: Callable[[ModuleEntry], Any]) -> list[Any]:
        return [value(m) for _, _, m in modules]

    def saved(value: Callable[[ModuleEntry], Any]) -> list[Any]:
        return [None if m.output_slots is None else value(m) for _, _, m in modules]

    columns = {
        "run_id": [run_id for run_id, _, _ in modules],
        "step": [step for _, step, _ in modules],
        "idx": column(lambda m: m.index),
        "label": column(lambda m: m.label),
        "path": column(lambda m: m.path),
        "type": column(lambda m: m.type),
        "pass": column(lambda m: m.pass_num),
        "num_passes": column(lambda m: m.num_passes),
        "first_op": column(lambda m: m.first_op),
        "last_op": column(lambda m: m.last_op),
        "op_start": column(lambda m: m.op_range[0]),
        "op_end": column(lambda m: m.op_range[1]),
        "input_ops": column(lambda m: list(m.input_indices)),
        "output_ops": column(lambda m: list(m.output_indices)),
        "input_tensors": column(lambda m: None if m.input_slots is None else list(m.input_slots)),
        "output_tensors": saved(lambda m: list(m.output_slots or ())),
        "structure": saved(lambda m: json.dumps(encode_structure(m.structure))),
    }
    return _assembled(arrow_schema(MODULES_TABLE), columns)


def _tensor_columns(
    runs: Sequence[RunSteps],
) -> tuple[dict[str, Any], list[tuple[list[str], np.ndarray]], np.ndarray]:
    """The ``tensors`` columns but the codec, from the runs' writers' slots (slot =
    position): (array, byte offset or -1, nbytes, shape, dtype, step) tuples; each
    run's distinct array names with its slots' indexes into them (for the codecs, known
    once written); and each run's first slot among all."""
    counts = np.array([len(run.slots) for run in runs], dtype=np.int64)
    slot_start = np.cumsum(counts) - counts
    slots = runs[0].slots if len(runs) == 1 else [s for run in runs for s in run.slots]
    n = len(slots)
    array, offset, nbytes, shape, dtype, step = _transposed(slots, 6)
    offsets = np.array(offset, dtype=np.int64)
    arrays = (
        [distinct_codes(array)]
        if len(runs) == 1
        else [
            distinct_codes(array[int(first) : int(first + count)])
            for first, count in zip(slot_start, counts, strict=True)
        ]
    )
    shapes, shape_of = distinct_codes(shape)
    dtypes, dtype_of = distinct_codes(dtype)
    columns = {
        "run_id": np.repeat(np.array([run.run_id for run in runs], dtype=np.int32), counts),
        "step": step,
        "slot": np.arange(n, dtype=np.int32) - np.repeat(slot_start.astype(np.int32), counts),
        "array": _codes_taken(arrays, lambda _, names: names),
        "byte_offset": arrow.array(offsets, _I64, mask=offsets < 0),
        "nbytes": nbytes,
        "shape": _taken([list(sh) for sh in shapes], shape_of, pa.list_(_I64)),
        "dtype": _taken([dtype_name(dt) for dt in dtypes], dtype_of, _STR),
    }
    return columns, arrays, slot_start


def _codes_taken(
    parts: list[tuple[list[str], np.ndarray]], values: Callable[[int, list[str]], list[str]]
) -> pa.Array:
    """A string column of the runs' slots from each run's distinct array names and its
    slots' indexes into them: ``values(k, names)`` is what run ``k``'s names become."""
    if len(parts) == 1:
        return _taken(values(0, parts[0][0]), parts[0][1], _STR)
    distinct: list[str] = []
    codes = []
    for k, (names, of) in enumerate(parts):
        codes.append(of + len(distinct))
        distinct += values(k, names)
    return _taken(distinct, np.concatenate(codes) if codes else np.zeros(0, np.int32), _STR)


def _codecs(
    arrays: list[tuple[list[str], np.ndarray]], codecs: list[Callable[[str], str]]
) -> pa.Array:
    """The ``codec`` column: each slot's array's codec, by its run's writer."""
    return _codes_taken(arrays, lambda k, names: [codecs[k](name) for name in names])


class StoredOpTable(OpTable):
    """An :class:`OpTable` rebuilt from the catalog: labels and source locations as
    stored, no code objects."""

    def __init__(
        self,
        rows: list[tuple[Any, ...]],
        labels: list[str],
        passes: dict[int, int],
        sources: list[SourceLocation | None],
        keys: list[str | None],
    ):
        super().__init__()
        self.rows = rows
        self.labels = labels
        self.passes = passes
        self.names = {i: labels[i] for i, row in enumerate(rows) if row[KIND] == "input"}
        self._locations = sources
        if None not in keys:  # a run recorded before keys were stored: derived on use
            self._keys = keys  # type: ignore[assignment]

    def source(self, index: int) -> SourceLocation | None:
        return self._locations[index]


#: The ``ops`` columns a stored step's op table is rebuilt from, and each one's place.
_LOAD_COLUMNS = (
    "idx",
    "label",
    "key",
    "num_passes",
    "tensor",
    "source_file",
    "source_line",
    "source_func",
    *TRANSFORMED,
    *PLAIN_ROW_COLUMNS,
    *STAT_FIELDS,
)
_AT = {name: k for k, name in enumerate(_LOAD_COLUMNS)}
#: The row fields ``load_step`` makes from the columns, in the order it appends them to
#: an ``ops`` row of ``_LOAD_COLUMNS``.
_MADE = ("modules", "parents", "parent_args", "site", "shape", "dtype", "device", "params")


def _row_picker() -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The op row, field by field in ``record.ROW_FIELDS`` order, from an ``ops`` row of
    ``_LOAD_COLUMNS`` + the ``_MADE`` fields + every field's default: one ``itemgetter``
    (``make_row`` by keyword matched each of its ~40 names per op, most of a stored
    run's loading time)."""
    made, defaults = len(_LOAD_COLUMNS), len(_LOAD_COLUMNS) + len(_MADE)
    picks = []
    for k, name in enumerate(ROW_FIELDS):
        if name in _MADE:
            picks.append(made + _MADE.index(name))
        elif name in PLAIN_ROW_COLUMNS:
            picks.append(_AT[name])
        elif OPS.field(name).has_default:
            picks.append(defaults + k)
        else:  # (a new required field needs a column or a line in _MADE)
            raise TypeError(f"load_step makes no value for the op row's field {name!r}")
    return operator.itemgetter(*picks)


_ROW_OF = _row_picker()
_DEFAULTS = tuple(OPS.field(name).default for name in ROW_FIELDS)
_STATS_AT = slice(_AT[STAT_FIELDS[0]], _AT[STAT_FIELDS[-1]] + 1)
_SELECT_LOAD = ", ".join(ident(name) for name in _LOAD_COLUMNS)


def load_step(
    query: Any, run_id: int, step: int
) -> tuple[StoredOpTable, list[ModuleEntry], dict[int, int], dict[int, Stats]]:
    """The op table, module entries, op -> tensor slot map and op stats of one step.
    ``query(sql, params)`` runs SQL on the catalog and returns a cursor."""
    ops = query(
        f"SELECT {_SELECT_LOAD} FROM ops WHERE run_id = ? AND step = ? ORDER BY idx",
        [run_id, step],
    ).fetchall()
    # each child's parents and their arguments, as the row takes them
    parents: dict[int, tuple[list[int], list[int | str]]] = {}
    for parent, child, arg in query(
        "SELECT parent, child, arg FROM edges WHERE run_id = ? AND step = ? ORDER BY child, edge",
        [run_id, step],
    ).fetchall():
        got = parents.get(child)
        if got is None:
            got = parents[child] = ([], [])
        got[0].append(parent)
        got[1].append(_arg(arg))
    orphan: tuple[list[int], list[int | str]] = ([], [])
    rows: list[tuple[Any, ...]] = []
    labels: list[str] = []
    keys: list[str | None] = []
    sources: list[SourceLocation | None] = []
    passes: dict[int, int] = {}
    slots: dict[int, int] = {}
    stats: dict[int, Stats] = {}
    dtypes: dict[str, torch.dtype] = {}
    devices: dict[str, torch.device] = {}
    at = _AT
    for op in ops:
        idx = op[at["idx"]]
        edge = parents.get(idx, orphan)
        dtype, device = op[at["dtype"]], op[at["device"]]
        dt = dtypes.get(dtype) or dtypes.setdefault(dtype, parse_dtype(dtype))
        dev = devices.get(device) or devices.setdefault(device, torch.device(device))
        made = (  # in _MADE's order
            tuple([(m["path"], m["pass"]) for m in op[at["modules"]]]),
            tuple(edge[0]),
            tuple(edge[1]),
            None,
            tuple(op[at["shape"]]),
            dt,
            dev,
            tuple(op[at["params"]]),
        )
        rows.append(_ROW_OF(op + made + _DEFAULTS))
        labels.append(op[at["label"]])
        keys.append(op[at["key"]])
        sfile = op[at["source_file"]]
        sources.append(
            SourceLocation(sfile, op[at["source_line"]], op[at["source_func"]])
            if sfile is not None
            else None
        )
        if op[at["num_passes"]] > 1:
            passes[op[at["layer_idx"]]] = op[at["num_passes"]]
        if op[at["tensor"]] is not None:
            slots[idx] = op[at["tensor"]]
        if op[at["nan_count"]] is not None:  # set whenever statistics were computed
            stats[idx] = Stats(*op[_STATS_AT])
    table = StoredOpTable(rows, labels, passes, sources, keys)
    modules_out = []
    for (
        idx,
        label,
        path,
        type_,
        pass_num,
        num_passes,
        first_op,
        last_op,
        op_start,
        op_end,
        input_ops,
        output_ops,
        input_tensors,
        output_tensors,
        structure,
    ) in query(
        'SELECT idx, label, path, type, "pass", num_passes, first_op, last_op, '
        "op_start, op_end, input_ops, output_ops, input_tensors, output_tensors, "
        "structure FROM modules WHERE run_id = ? AND step = ? ORDER BY idx",
        [run_id, step],
    ).fetchall():
        entry = ModuleEntry(
            path,
            type_,
            pass_num,
            idx,
            label=label,
            num_passes=num_passes,
            first_op=first_op,
            last_op=last_op,
        )
        entry.op_range = (op_start, op_end)
        entry.input_indices = tuple(input_ops)
        entry.output_indices = tuple(output_ops)
        entry.input_labels = tuple(labels[i] for i in input_ops if i >= 0)
        entry.output_labels = tuple(labels[i] for i in output_ops if i >= 0)
        if output_tensors is not None:
            entry.input_slots = tuple(input_tensors or ())
            entry.output_slots = tuple(output_tensors)
            entry.structure = decode_structure(json.loads(structure))
        modules_out.append(entry)
    return table, modules_out, slots, stats


def _arg(text: str) -> int | str:
    return int(text) if text.isdigit() else text
