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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracelake.recorder.emit import SelectingEmitter
from tracelake.recorder.entries import (
    DEVICE,
    DTYPE,
    FUNC,
    INPLACE,
    KIND,
    LAYER,
    MODULES,
    N_FUNC,
    N_LAYER,
    OUT_INDEX,
    PARAMS,
    PARENT_ARGS,
    PARENTS,
    PASS,
    SHAPE,
    SITE,
    ModuleEntry,
    OpTable,
    SourceLocation,
)
from tracelake.recorder.stats import Stats

from .structure import decode_structure, encode_structure
from .tensors import dtype_name, parse_dtype

__all__ = [
    "STAT_FIELDS",
    "StoredOpTable",
    "Written",
    "decode_structure",
    "distinct_codes",
    "load_step",
    "run_tables",
]

STAT_FIELDS = ("mean", "std", "min", "max", "absmax", "l2", "frac_zero", "nan_count", "inf_count")

_I32, _I64, _F64, _STR, _BOOL = pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_()
_MODULES = pa.list_(pa.struct([("path", _STR), ("pass", _I32)]))

_OPS_SCHEMA = pa.schema(
    [
        ("run_id", _I32),
        ("step", _I32),
        ("idx", _I32),
        ("label", _STR),
        ("layer", _STR),
        ("pass", _I32),
        ("num_passes", _I32),
        ("func", _STR),
        ("kind", _STR),
        ("module", _STR),
        ("modules", _MODULES),
        ("shape", pa.list_(_I64)),
        ("dtype", _STR),
        ("device", _STR),
        ("nbytes", _I64),
        ("out_index", _I32),
        ("inplace", _BOOL),
        ("params", pa.list_(_STR)),
        ("layer_idx", _I32),
        ("n_func", _I32),
        ("n_layer", _I32),
        ("saved", _BOOL),
        ("tensor", _I32),
        ("array", _STR),
        ("byte_offset", _I64),
        ("source_file", _STR),
        ("source_line", _I32),
        ("source_func", _STR),
        *[(name, _F64) for name in STAT_FIELDS[:7]],
        ("nan_count", _I64),
        ("inf_count", _I64),
    ]
)
_EDGES_SCHEMA = pa.schema(
    [
        ("run_id", _I32),
        ("step", _I32),
        ("parent", _I32),
        ("child", _I32),
        ("arg", _STR),
        ("edge", _I32),
    ]
)
_MODULES_SCHEMA = pa.schema(
    [
        ("run_id", _I32),
        ("step", _I32),
        ("idx", _I32),
        ("label", _STR),
        ("path", _STR),
        ("type", _STR),
        ("pass", _I32),
        ("num_passes", _I32),
        ("first_op", _STR),
        ("last_op", _STR),
        ("op_start", _I32),
        ("op_end", _I32),
        ("input_ops", pa.list_(_I32)),
        ("output_ops", pa.list_(_I32)),
        ("input_tensors", pa.list_(_I32)),
        ("output_tensors", pa.list_(_I32)),
        ("structure", _STR),
    ]
)
_TENSORS_SCHEMA = pa.schema(
    [
        ("run_id", _I32),
        ("step", _I32),
        ("slot", _I32),
        ("array", _STR),
        ("byte_offset", _I64),
        ("nbytes", _I64),
        ("shape", pa.list_(_I64)),
        ("dtype", _STR),
        ("codec", _STR),
    ]
)


def _transposed(rows: list[tuple[Any, ...]], width: int) -> list[tuple[Any, ...]]:
    """The columns of ``rows``. ``zip(*rows)`` holds an iterator per row (20,000 for a run
    of that many ops): were the garbage collector to run meanwhile, it would promote
    them all to its oldest generation, and a full collection (~250 ms) came with every
    run or two. So it does not run meanwhile (no user code does either); one ``map`` per
    column instead took 6x as long."""
    if not rows:
        return [()] * width
    enabled = gc.isenabled()
    gc.disable()
    try:
        return list(zip(*rows, strict=True))
    finally:
        if enabled:
            gc.enable()


def _table(schema: pa.Schema, rows: list[tuple[Any, ...]]) -> pa.Table:
    columns = _transposed(rows, len(schema))
    return pa.Table.from_arrays(
        [pa.array(col, type=f.type) for col, f in zip(columns, schema, strict=True)],
        schema=schema,
    )


def distinct_codes(values: Sequence[Any], identity: bool = False) -> tuple[list[Any], np.ndarray]:
    """A column's distinct values (in order of first appearance) and each row's index
    into them: rows share module stacks, shapes, dtypes, layers and call sites, so each
    distinct value is converted once and Arrow ``take``s the rest.

    One hash per row (each row's first equal row, then ranks), and none for a column of
    one value (``count``'s comparisons start with identity): a 20,000-row column of one
    value took ~2.3 ms hashed twice, ~0.1 ms so. ``identity``: rows are found equal by
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
    return pa.array(distinct, type=type_).take(codes)


#: What a run's writer computes in its workers: the statistics by tensor slot (as
#: ``TensorWriter.stat_matrix`` gives them) and a function from array name to codec.
Written = Callable[[], tuple[tuple[np.ndarray, np.ndarray], Callable[[str], str]]]


def run_tables(
    run_id: int,
    steps: list[tuple[OpTable, list[ModuleEntry], SelectingEmitter]],
    slots: list[Any],
    written: Written,
) -> dict[str, pa.Table]:
    """The ``ops``, ``edges``, ``modules`` and ``tensors`` tables of a run's recorded
    steps. ``slots``: its writer's slots (``TensorWriter.slots``: an op's row carries its
    tensor's array and byte offset, so a query finds the bytes without another join);
    ``written()`` is asked for last, so that the writer's workers finish the run's last
    chunks (statistics, encoding, writes) while the rest is built.

    Built column by column, all steps at once (this runs for every op of every stored
    run, and each Arrow conversion has a fixed cost: 2.5 ms per step of 10 ops): what
    rows share (module stacks, shapes, dtypes, layers, call sites) is converted once per
    distinct value, and the tensor columns are gathered by slot."""
    tensors, (arrays, array_of) = _tensor_columns(run_id, slots)
    ops, slot_of, edges = _op_columns(run_id, steps, tensors)
    modules = _modules(run_id, [(k, m) for k, (_, entries, _) in enumerate(steps) for m in entries])
    stats, codec = written()
    _add_stats(ops, steps, stats, slot_of)
    tensors["codec"] = _taken([codec(name) for name in arrays], array_of, _STR)
    return {
        "ops": _assembled(_OPS_SCHEMA, ops),
        "edges": edges,
        "modules": modules,
        "tensors": _assembled(_TENSORS_SCHEMA, tensors),
    }


def _assembled(schema: pa.Schema, columns: dict[str, Any]) -> pa.Table:
    return pa.Table.from_arrays([_array(columns[f.name], f.type) for f in schema], schema=schema)


def _op_columns(
    run_id: int,
    steps: list[tuple[OpTable, list[ModuleEntry], SelectingEmitter]],
    tensors: dict[str, Any],
) -> tuple[dict[str, Any], np.ndarray, pa.Table]:
    """The ``ops`` columns but the statistics, each op's tensor slot (-1: none), and the
    ``edges`` table."""
    tables = [table for table, _, _ in steps]
    sizes = np.array([len(table.rows) for table in tables], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes  # each step's first row
    n = int(sizes.sum())
    rows = list(itertools.chain.from_iterable(table.rows for table in tables))
    columns = _transposed(rows, len(rows[0]) if n else 16)
    step_of = np.repeat(np.arange(len(steps), dtype=np.int32), sizes)
    idx = np.arange(n, dtype=np.int64) - np.repeat(starts, sizes)  # the row within its step
    slot_of = np.full(n, -1, dtype=np.int64)
    for start, (_, _, emitter) in zip(starts.tolist(), steps, strict=True):
        op_slot = emitter._op_slot
        if op_slot:
            slot_of[start + np.fromiter(op_slot.keys(), np.int64, len(op_slot))] = np.fromiter(
                op_slot.values(), np.int64, len(op_slot)
            )
    saved = slot_of >= 0
    tensor = pa.array(slot_of, mask=~saved, type=_I64)

    def local(rows_: list[int]) -> tuple[list[OpTable], list[int]]:
        """The steps' tables and the rows within them of run-wide rows (two lists, not a
        tuple per row: as many objects as rows would wake the garbage collector)."""
        which = np.searchsorted(starts, rows_, side="right") - 1
        return [tables[k] for k in which.tolist()], (np.asarray(rows_) - starts[which]).tolist()

    stacks, stack_of = distinct_codes(columns[MODULES])
    shapes, shape_of = distinct_codes(columns[SHAPE])
    dtypes, dtype_of = distinct_codes(columns[DTYPE])
    devices, device_of = distinct_codes(columns[DEVICE])
    params, params_of = distinct_codes(columns[PARAMS])
    layer_rows = np.array(columns[LAYER], dtype=np.int64) + np.repeat(starts, sizes)
    layers_, layer_of = np.unique(layer_rows, return_inverse=True)  # a layer: the run-wide
    layers = layers_.tolist()  # row of its first entry
    labels = list(itertools.chain.from_iterable(table.labels for table in tables))
    # A layer's label is its first entry's, less the ":1" of a layer of several passes.
    layer_names = list(map(labels.__getitem__, layers))
    passes = np.ones(len(layers), dtype=np.int32)
    position = {row: k for k, row in enumerate(layers)} if any(t.passes for t in tables) else {}
    for start, table in zip(starts.tolist(), tables, strict=True):
        for lay, count in table.passes.items():
            k = position[start + lay]
            layer_names[k] = table.layer_label(lay)
            passes[k] = count
    _, site_of = distinct_codes(columns[SITE], identity=True)  # a site: (code, offset)
    first = np.unique(site_of, return_index=True)[1].tolist()  # each site's first row
    where = [table.source(row) for table, row in zip(*local(first), strict=True)]
    numel = np.array([math.prod(sh) for sh in shapes], dtype=np.int64)
    itemsize = np.array([dt.itemsize for dt in dtypes], dtype=np.int64)
    cols: dict[str, Any] = {
        "run_id": np.full(n, run_id, dtype=np.int32),
        "step": step_of,
        "idx": idx,
        "label": labels,
        "layer": _taken(layer_names, layer_of, _STR),
        "pass": columns[PASS],
        "num_passes": passes[layer_of],
        "func": columns[FUNC],
        "kind": columns[KIND],
        "module": _taken([st[-1][0] if st else "" for st in stacks], stack_of, _STR),
        "modules": _taken(
            [[{"path": p, "pass": k} for p, k in st] for st in stacks], stack_of, _MODULES
        ),
        "shape": _taken([list(sh) for sh in shapes], shape_of, pa.list_(_I64)),
        "dtype": _taken([dtype_name(dt) for dt in dtypes], dtype_of, _STR),
        "device": _taken([str(dev) for dev in devices], device_of, _STR),
        "nbytes": numel[shape_of] * itemsize[dtype_of],
        "out_index": columns[OUT_INDEX],
        "inplace": columns[INPLACE],
        "params": _taken([list(p) for p in params], params_of, pa.list_(_STR)),
        "layer_idx": columns[LAYER],
        "n_func": columns[N_FUNC],
        "n_layer": columns[N_LAYER],
        "saved": saved,
        "tensor": tensor,
        "array": tensors["array"].take(tensor),
        "byte_offset": tensors["byte_offset"].take(tensor),
        "source_file": _taken([w.file if w else None for w in where], site_of, _STR),
        "source_line": _taken([w.line if w else None for w in where], site_of, _I32),
        "source_func": _taken([w.function if w else None for w in where], site_of, _STR),
    }
    return cols, slot_of, _edges(run_id, step_of, idx, columns[PARENTS], columns[PARENT_ARGS])


def _add_stats(
    cols: dict[str, Any],
    steps: list[tuple[OpTable, list[ModuleEntry], Any]],
    stats: tuple[np.ndarray, np.ndarray],
    slot_of: np.ndarray,
) -> None:
    """The statistics columns: saved ops' from the writer's, by slot; with
    ``stats="all"``, unsaved ops' from their emitters."""
    values, valid = stats[0][slot_of], stats[1][slot_of]  # slot -1: the undefined row
    start = 0
    for table, _, emitter in steps:
        for index, st in emitter._stats.items():  # stats="all": unsaved ops, one by one
            row = [getattr(st, name) for name in STAT_FIELDS]
            values[start + index] = [0.0 if v is None else v for v in row]
            valid[start + index] = [v is not None for v in row]
        start += len(table.rows)
    for k, name in enumerate(STAT_FIELDS):
        column = values[:, k] if k < 7 else values[:, k].astype(np.int64)
        cols[name] = pa.array(column, mask=~valid[:, k])


def _array(values: Any, type_: pa.DataType) -> Any:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = values if values.type == type_ else values.cast(type_)
        return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    integer = _INTEGERS.get(type_)
    if integer is not None and isinstance(values, (tuple, list)):
        try:  # Python ints through numpy: ~0.7 ms per 20,000 rather than ~1.2
            return pa.array(np.fromiter(values, integer, len(values)))
        except (TypeError, OverflowError):  # None among them, or out of range
            pass
    return pa.array(values, type=type_)


_INTEGERS = {_I32: np.int32, _I64: np.int64}


def _edges(
    run_id: int,
    step_of: np.ndarray,
    idx: np.ndarray,
    parents: Sequence[tuple[int, ...]],
    args: Sequence[tuple[Any, ...]],
) -> pa.Table:
    """One row per (child, parent) pair; ``edge`` numbers a child's parents."""
    counts = np.fromiter(map(len, parents), np.int64, len(parents))
    total = int(counts.sum())
    edge = np.arange(total, dtype=np.int32) - np.repeat(
        (np.cumsum(counts) - counts).astype(np.int32), counts
    )
    names, name_of = distinct_codes(list(itertools.chain.from_iterable(args)))
    columns = (
        np.full(total, run_id, dtype=np.int32),
        np.repeat(step_of, counts),
        list(itertools.chain.from_iterable(parents)),
        np.repeat(idx, counts),
        _taken([str(a) for a in names], name_of, _STR),
        edge,
    )
    return pa.Table.from_arrays(
        [_array(c, f.type) for c, f in zip(columns, _EDGES_SCHEMA, strict=True)],
        schema=_EDGES_SCHEMA,
    )


def _modules(run_id: int, modules: list[tuple[int, ModuleEntry]]) -> pa.Table:
    """The module entries of a run's steps, as (step, entry)."""
    rows = [
        (
            run_id,
            step,
            m.index,
            m.label,
            m.path,
            m.type,
            m.pass_num,
            m.num_passes,
            m.first_op,
            m.last_op,
            m._op_range[0],
            m._op_range[1],
            list(m._input_indices),
            list(m._output_indices),
            None if m._input_slots is None else list(m._input_slots),
            None if m._output_slots is None else list(m._output_slots),
            None if m._output_slots is None else json.dumps(encode_structure(m._structure)),
        )
        for step, m in modules
    ]
    return _table(_MODULES_SCHEMA, rows)


def _tensor_columns(
    run_id: int, slots: list[Any]
) -> tuple[dict[str, Any], tuple[list[str], np.ndarray]]:
    """The ``tensors`` columns but the codec, from a writer's slots (slot = position):
    (array, byte offset or -1, nbytes, shape, dtype, step) tuples; and the distinct
    array names with each slot's index into them (for the codecs, known once written)."""
    n = len(slots)
    array, offset, nbytes, shape, dtype, step = _transposed(slots, 6)
    offsets = np.array(offset, dtype=np.int64)
    arrays, array_of = distinct_codes(array)
    shapes, shape_of = distinct_codes(shape)
    dtypes, dtype_of = distinct_codes(dtype)
    columns = {
        "run_id": np.full(n, run_id, dtype=np.int32),
        "step": step,
        "slot": np.arange(n, dtype=np.int32),
        "array": _taken(arrays, array_of, _STR),
        "byte_offset": pa.array(offsets, mask=offsets < 0),
        "nbytes": nbytes,
        "shape": _taken([list(sh) for sh in shapes], shape_of, pa.list_(_I64)),
        "dtype": _taken([dtype_name(dt) for dt in dtypes], dtype_of, _STR),
    }
    return columns, (arrays, array_of)


class StoredOpTable(OpTable):
    """An :class:`OpTable` rebuilt from the catalog: labels and source locations as
    stored, no code objects."""

    def __init__(
        self,
        rows: list[tuple[Any, ...]],
        labels: list[str],
        passes: dict[int, int],
        sources: list[SourceLocation | None],
    ):
        super().__init__()
        self.rows = rows
        self.labels = labels
        self.passes = passes
        self._locations = sources

    def source(self, index: int) -> SourceLocation | None:
        return self._locations[index]


_OP_COLUMNS = (
    "idx, label, func, kind, modules, shape, dtype, device, out_index, inplace, "
    'params, layer_idx, "pass", num_passes, n_func, n_layer, tensor, source_file, '
    f"source_line, source_func, {', '.join(STAT_FIELDS)}"
)


def load_step(
    query: Any, run_id: int, step: int
) -> tuple[StoredOpTable, list[ModuleEntry], dict[int, int], dict[int, Stats]]:
    """The op table, module entries, op -> tensor slot map and op stats of one step.
    ``query(sql, params)`` runs SQL on the catalog and returns a cursor."""
    ops = query(
        f"SELECT {_OP_COLUMNS} FROM ops WHERE run_id = ? AND step = ? ORDER BY idx", [run_id, step]
    ).fetchall()
    parents: dict[int, list[tuple[int, str]]] = {}
    for parent, child, arg in query(
        "SELECT parent, child, arg FROM edges WHERE run_id = ? AND step = ? ORDER BY child, edge",
        [run_id, step],
    ).fetchall():
        parents.setdefault(child, []).append((parent, arg))
    rows: list[tuple[Any, ...]] = []
    labels: list[str] = []
    sources: list[SourceLocation | None] = []
    passes: dict[int, int] = {}
    slots: dict[int, int] = {}
    stats: dict[int, Stats] = {}
    dtypes: dict[str, torch.dtype] = {}
    devices: dict[str, torch.device] = {}
    for (
        idx,
        label,
        func,
        kind,
        modules,
        shape,
        dtype,
        device,
        out_index,
        inplace,
        params,
        layer,
        pass_num,
        num_passes,
        n_func,
        n_layer,
        tensor,
        sfile,
        sline,
        sfunc,
        *stat,
    ) in ops:
        edge = parents.get(idx, ())
        dt = dtypes.get(dtype) or dtypes.setdefault(dtype, parse_dtype(dtype))
        dev = devices.get(device) or devices.setdefault(device, torch.device(device))
        rows.append(
            (
                func,
                kind,
                tuple((m["path"], m["pass"]) for m in modules),
                tuple(p for p, _ in edge),
                tuple(_arg(a) for _, a in edge),
                None,
                tuple(shape),
                dt,
                dev,
                out_index,
                inplace,
                tuple(params),
                layer,
                pass_num,
                n_func,
                n_layer,
            )
        )
        labels.append(label)
        sources.append(SourceLocation(sfile, sline, sfunc) if sfile is not None else None)
        if num_passes > 1:
            passes[layer] = num_passes
        if tensor is not None:
            slots[idx] = tensor
        if stat[7] is not None:  # nan_count: set whenever statistics were computed
            stats[idx] = Stats(*stat)
    table = StoredOpTable(rows, labels, passes, sources)
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
        entry._op_range = (op_start, op_end)
        entry._input_indices = tuple(input_ops)
        entry._output_indices = tuple(output_ops)
        entry.input_labels = tuple(labels[i] for i in input_ops if i >= 0)
        entry.output_labels = tuple(labels[i] for i in output_ops if i >= 0)
        if output_tensors is not None:
            entry._input_slots = tuple(input_tensors or ())
            entry._output_slots = tuple(output_tensors)
            entry._structure = decode_structure(json.loads(structure))
        modules_out.append(entry)
    return table, modules_out, slots, stats


def _arg(text: str) -> int | str:
    return int(text) if text.isdigit() else text
