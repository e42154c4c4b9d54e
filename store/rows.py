"""Catalog rows to and from a recording's in-memory tables.

:func:`step_tables` turns one recorded step (its :class:`OpTable`, module entries and
the slots its tensors went to) into Arrow tables for the catalog; :func:`load_step`
turns catalog rows back into the same :class:`OpTable` and :class:`ModuleEntry` objects,
so that a stored run answers through the very classes an in-memory trace uses.
"""

from __future__ import annotations

import json
import math
from typing import Any

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
    SlotRef,
    SourceLocation,
)
from tracelake.recorder.stats import Stats

from .tensors import dtype_name, parse_dtype

__all__ = ["STAT_FIELDS", "StoredOpTable", "decode_structure", "load_step", "step_tables"]

STAT_FIELDS = ("mean", "std", "min", "max", "absmax", "l2", "frac_zero", "nan_count",
               "inf_count")

_I32, _I64, _F64, _STR, _BOOL = pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_()
_MODULES = pa.list_(pa.struct([("path", _STR), ("pass", _I32)]))

_OPS_SCHEMA = pa.schema([
    ("run_id", _I32), ("step", _I32), ("idx", _I32), ("label", _STR), ("layer", _STR),
    ("pass", _I32), ("num_passes", _I32), ("func", _STR), ("kind", _STR), ("module", _STR),
    ("modules", _MODULES), ("shape", pa.list_(_I64)), ("dtype", _STR), ("device", _STR),
    ("nbytes", _I64), ("out_index", _I32), ("inplace", _BOOL), ("params", pa.list_(_STR)),
    ("layer_idx", _I32), ("n_func", _I32), ("n_layer", _I32), ("saved", _BOOL),
    ("tensor", _I32), ("array", _STR), ("byte_offset", _I64), ("source_file", _STR),
    ("source_line", _I32), ("source_func", _STR),
    *[(name, _F64) for name in STAT_FIELDS[:7]], ("nan_count", _I64), ("inf_count", _I64),
])
_EDGES_SCHEMA = pa.schema([("run_id", _I32), ("step", _I32), ("parent", _I32),
                           ("child", _I32), ("arg", _STR), ("edge", _I32)])
_MODULES_SCHEMA = pa.schema([
    ("run_id", _I32), ("step", _I32), ("idx", _I32), ("label", _STR), ("path", _STR),
    ("type", _STR), ("pass", _I32), ("num_passes", _I32), ("first_op", _STR),
    ("last_op", _STR), ("op_start", _I32), ("op_end", _I32), ("input_ops", pa.list_(_I32)),
    ("output_ops", pa.list_(_I32)), ("input_tensors", pa.list_(_I32)),
    ("output_tensors", pa.list_(_I32)), ("structure", _STR),
])
_TENSORS_SCHEMA = pa.schema([
    ("run_id", _I32), ("step", _I32), ("slot", _I32), ("array", _STR), ("byte_offset", _I64),
    ("nbytes", _I64), ("shape", pa.list_(_I64)), ("dtype", _STR), ("codec", _STR),
])


def _table(schema: pa.Schema, rows: list[tuple[Any, ...]]) -> pa.Table:
    columns: list[Any] = list(zip(*rows, strict=True)) if rows else [[] for _ in schema]
    return pa.Table.from_arrays(
        [pa.array(col, type=f.type) for col, f in zip(columns, schema, strict=True)],
        schema=schema,
    )


def encode_structure(obj: Any) -> Any:
    """A module output's structure as JSON: tensors become ``{"$t": slot}``."""
    if isinstance(obj, SlotRef):
        return {"$t": obj.slot}
    if isinstance(obj, tuple):
        return {"$tuple": [encode_structure(x) for x in obj]}
    if isinstance(obj, list):
        return [encode_structure(x) for x in obj]
    if isinstance(obj, dict):
        return {"$dict": [[encode_structure(k), encode_structure(v)] for k, v in obj.items()]}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"$float": repr(obj)}
    return obj


def decode_structure(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode_structure(x) for x in obj]
    if isinstance(obj, dict):
        if "$t" in obj:
            return SlotRef(int(obj["$t"]))
        if "$tuple" in obj:
            return tuple(decode_structure(x) for x in obj["$tuple"])
        if "$dict" in obj:
            return {decode_structure(k): decode_structure(v) for k, v in obj["$dict"]}
        if "$float" in obj:
            return float(obj["$float"])
    return obj


def step_tables(run_id: int, step: int, table: OpTable, modules: list[ModuleEntry],
                emitter: SelectingEmitter, stats: dict[int, Stats],
                locations: list[Any]) -> dict[str, pa.Table]:
    """Arrow tables of one recorded step. ``stats``: statistics by tensor slot;
    ``locations``: where each slot was written (an op's row carries its tensor's array
    and byte offset, so a query finds the bytes without another join).

    Built column by column from the transposed rows, converting what rows share (module
    stacks, shapes, dtypes, layers, call sites) once per distinct value: this runs for
    every op of every stored run."""
    rows = table.rows
    n = len(rows)
    if not n:
        columns: tuple[tuple[Any, ...], ...] = ((),) * 16
    else:
        columns = tuple(zip(*rows, strict=True))

    def mapped(column: int, convert: Any) -> list[Any]:
        values = columns[column]
        cache = {v: convert(v) for v in set(values)}
        return [cache[v] for v in values]

    stacks = mapped(MODULES, lambda st: (st[-1][0] if st else "",
                                         [{"path": p, "pass": k} for p, k in st]))
    shapes = mapped(SHAPE, lambda sh: (list(sh), math.prod(sh)))
    layers = mapped(LAYER, lambda lay: (table.layer_label(lay), table.num_passes(lay)))
    dtypes = columns[DTYPE]
    sites: dict[Any, tuple[Any, Any, Any]] = {}
    for index, site in enumerate(columns[SITE]):
        if site not in sites:
            loc = table.source(index)
            sites[site] = (loc.file, loc.line, loc.function) if loc else (None, None, None)
    where = [sites[site] for site in columns[SITE]]
    slots = emitter._op_slot
    slot_of = [slots.get(i) for i in range(n)]
    unsaved = emitter._stats
    stat_of = [stats.get(slot) if slot is not None else unsaved.get(i)
               for i, slot in enumerate(slot_of)]
    cols: dict[str, list[Any] | tuple[Any, ...]] = {
        "run_id": [run_id] * n, "step": [step] * n, "idx": list(range(n)),
        "label": table.labels, "layer": [lay[0] for lay in layers], "pass": columns[PASS],
        "num_passes": [lay[1] for lay in layers], "func": columns[FUNC],
        "kind": columns[KIND], "module": [st[0] for st in stacks],
        "modules": [st[1] for st in stacks], "shape": [sh[0] for sh in shapes],
        "dtype": mapped(DTYPE, dtype_name), "device": mapped(DEVICE, str),
        "nbytes": [sh[1] * dt.itemsize for sh, dt in zip(shapes, dtypes, strict=True)],
        "out_index": columns[OUT_INDEX], "inplace": columns[INPLACE],
        "params": columns[PARAMS], "layer_idx": columns[LAYER], "n_func": columns[N_FUNC],
        "n_layer": columns[N_LAYER], "saved": [slot is not None for slot in slot_of],
        "tensor": slot_of,
        "array": [None if slot is None else locations[slot].array for slot in slot_of],
        "byte_offset": [None if slot is None or locations[slot].offset < 0
                        else locations[slot].offset for slot in slot_of],
        "source_file": [w[0] for w in where],
        "source_line": [w[1] for w in where], "source_func": [w[2] for w in where],
    }
    for name in STAT_FIELDS:
        cols[name] = [getattr(st, name) if st is not None else None for st in stat_of]
    ops = pa.Table.from_arrays([pa.array(cols[f.name], type=f.type) for f in _OPS_SCHEMA],
                               schema=_OPS_SCHEMA)
    edge_rows = [(parent, child, str(arg), k)
                 for child, (parents, args) in enumerate(zip(columns[PARENTS],
                                                             columns[PARENT_ARGS], strict=True))
                 if parents
                 for k, (parent, arg) in enumerate(zip(parents, args, strict=True))]
    edges = _table(_EDGES_SCHEMA, [(run_id, step, *e) for e in edge_rows])
    mods = []
    for m in modules:
        mods.append((
            run_id, step, m.index, m.label, m.path, m.type, m.pass_num, m.num_passes,
            m.first_op, m.last_op, m._op_range[0], m._op_range[1], list(m._input_indices),
            list(m._output_indices),
            None if m._input_slots is None else list(m._input_slots),
            None if m._output_slots is None else list(m._output_slots),
            None if m._output_slots is None else json.dumps(encode_structure(m._structure)),
        ))
    return {"ops": ops, "edges": edges, "modules": _table(_MODULES_SCHEMA, mods)}


def tensors_table(run_id: int, locations: list[Any]) -> pa.Table:
    """The ``tensors`` table of a run from its writer's locations (slot = position)."""
    n = len(locations)
    shapes: dict[tuple[int, ...], list[int]] = {}
    columns = (
        [run_id] * n, [loc.step for loc in locations], list(range(n)),
        [loc.array for loc in locations],
        [loc.offset if loc.offset >= 0 else None for loc in locations],
        [loc.nbytes for loc in locations],
        [shapes.get(loc.shape) or shapes.setdefault(loc.shape, list(loc.shape))
         for loc in locations],
        [dtype_name(loc.dtype) for loc in locations], [loc.codec for loc in locations],
    )
    return pa.Table.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(columns, _TENSORS_SCHEMA, strict=True)],
        schema=_TENSORS_SCHEMA)


class StoredOpTable(OpTable):
    """An :class:`OpTable` rebuilt from the catalog: labels and source locations as
    stored, no code objects."""

    def __init__(self, rows: list[tuple[Any, ...]], labels: list[str],
                 passes: dict[int, int], sources: list[SourceLocation | None]):
        super().__init__()
        self.rows = rows
        self.labels = labels
        self.passes = passes
        self._locations = sources

    def source(self, index: int) -> SourceLocation | None:
        return self._locations[index]


_OP_COLUMNS = ("idx, label, func, kind, modules, shape, dtype, device, out_index, inplace, "
               'params, layer_idx, "pass", num_passes, n_func, n_layer, tensor, source_file, '
               f"source_line, source_func, {', '.join(STAT_FIELDS)}")


def load_step(query: Any, run_id: int, step: int
              ) -> tuple[StoredOpTable, list[ModuleEntry], dict[int, int], dict[int, Stats]]:
    """The op table, module entries, op -> tensor slot map and op stats of one step.
    ``query(sql, params)`` runs SQL on the catalog and returns a cursor."""
    ops = query(f"SELECT {_OP_COLUMNS} FROM ops WHERE run_id = ? AND step = ? ORDER BY idx",
                [run_id, step]).fetchall()
    parents: dict[int, list[tuple[int, str]]] = {}
    for parent, child, arg in query(
            "SELECT parent, child, arg FROM edges WHERE run_id = ? AND step = ? "
            "ORDER BY child, edge", [run_id, step]).fetchall():
        parents.setdefault(child, []).append((parent, arg))
    rows: list[tuple[Any, ...]] = []
    labels: list[str] = []
    sources: list[SourceLocation | None] = []
    passes: dict[int, int] = {}
    slots: dict[int, int] = {}
    stats: dict[int, Stats] = {}
    dtypes: dict[str, torch.dtype] = {}
    devices: dict[str, torch.device] = {}
    for (idx, label, func, kind, modules, shape, dtype, device, out_index, inplace, params,
         layer, pass_num, num_passes, n_func, n_layer, tensor, sfile, sline, sfunc,
         *stat) in ops:
        edge = parents.get(idx, ())
        dt = dtypes.get(dtype) or dtypes.setdefault(dtype, parse_dtype(dtype))
        dev = devices.get(device) or devices.setdefault(device, torch.device(device))
        rows.append((
            func, kind, tuple((m["path"], m["pass"]) for m in modules),
            tuple(p for p, _ in edge), tuple(_arg(a) for _, a in edge), None, tuple(shape),
            dt, dev, out_index, inplace, tuple(params), layer, pass_num, n_func, n_layer,
        ))
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
    for (idx, label, path, type_, pass_num, num_passes, first_op, last_op, op_start, op_end,
         input_ops, output_ops, input_tensors, output_tensors, structure) in query(
            "SELECT idx, label, path, type, \"pass\", num_passes, first_op, last_op, "
            "op_start, op_end, input_ops, output_ops, input_tensors, output_tensors, "
            "structure FROM modules WHERE run_id = ? AND step = ? ORDER BY idx",
            [run_id, step]).fetchall():
        entry = ModuleEntry(path, type_, pass_num, idx, label=label, num_passes=num_passes,
                            first_op=first_op, last_op=last_op)
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
