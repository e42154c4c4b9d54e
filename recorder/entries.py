"""The entries a trace is made of: one per recorded tensor, one per module call.

A recording keeps its metadata as one tuple per entry in an :class:`OpTable` (cheap to
append on the forward thread, and column-shaped for a catalog); :class:`OpEntry` is a
light view of one row. Tensors live apart, in a :class:`TensorSource`, so that a stored
run can read them lazily behind the same entry classes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from . import compiled
from .record import Stats, position
from .trees import Structure, plain_spec

__all__ = [
    "ModuleEntry",
    "OpEntry",
    "OpTable",
    "SlotRef",
    "SourceLocation",
    "TensorSource",
]


class SourceLocation(NamedTuple):
    """Where user code issued a call: the first frame outside torch and tracelake."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


# Positions of the fields of an OpTable row, derived by name from the op record
# (record.OPS). SITE is (code, bytecode offset) of the user's call; LAYER is the index of
# the layer's first entry; N_FUNC / N_LAYER number the layer (for inputs and outputs:
# N_FUNC is their number and N_LAYER is 0). Every field is a plain value or a tuple of
# plain values.
FUNC = position("func")
KIND = position("kind")
MODULES = position("modules")
PARENTS = position("parents")
PARENT_ARGS = position("parent_args")
SITE = position("site")
SHAPE = position("shape")
DTYPE = position("dtype")
DEVICE = position("device")
OUT_INDEX = position("out_index")
INPLACE = position("inplace")
PARAMS = position("params")
LAYER = position("layer_idx")
PASS = position("pass")
N_FUNC = position("n_func")
N_LAYER = position("n_layer")


def _layer_label(func: str, inplace: bool, n_func: int, n_layer: int) -> str:
    if not n_layer:
        return f"{func}_{n_func}"  # input_1, output_1
    if inplace and func[-1] == "_":  # in-place variants count with their function
        return f"{func[:-1]}_{n_func}_{n_layer}"
    return f"{func}_{n_func}_{n_layer}"


def op_keys(rows: list[tuple], labels: list[str]) -> list[str]:
    """Each entry's stable key: the same op of two runs of the same model code gets the
    same key even where other parts of their graphs differ (a mask in one run only,
    prefill and decode steps), which labels, numbered across the whole graph, cannot.

    An op's key is its innermost module call, its function and its ordinal among that
    function's calls inside that module call: ``transformer.h.1.attn:softmax#1``; a
    module's later calls carry their pass (``block:2:add#1``); a call's second and later
    outputs add their position (``chunk#1.2``); ops outside any module are numbered
    among the top level's calls of their function (``arange#1``); the model's inputs
    and outputs keep their labels (``input_1``)."""
    keys: list[str] = []
    counts: dict[tuple[Any, str], int] = {}
    for index, (row, label) in enumerate(zip(rows, labels, strict=True)):
        if row[KIND] != "op":
            keys.append(label)
            continue
        out_index = row[OUT_INDEX]
        if out_index:  # a later output of the call whose first output came just before
            keys.append(f"{keys[index - out_index]}.{out_index}")
            continue
        stack, func = row[MODULES], row[FUNC]
        call = stack[-1] if stack else ("", 1)
        n = counts[call, func] = counts.get((call, func), 0) + 1
        path, pass_num = call
        where = f"{path}:{pass_num}:" if pass_num > 1 else f"{path}:" if path else ""
        keys.append(f"{where}{func}#{n}")
    return keys


@functools.cache
def block_of(path: str) -> int | None:
    """The block index of a module path: its first all-digit component
    (``transformer.h.1.attn`` -> 1), or None."""
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


class OpTable:
    """Metadata of every entry of one recording, one row tuple per entry.

    ``passes`` counts the passes of layers that ran more than once. ``finish()`` derives
    labels, children and source locations.
    """

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.passes: dict[int, int] = {}
        self.labels: list[str] = []
        #: Entry -> its name, for inputs labelled by their keyword (recorder/inputs.py).
        self.names: dict[int, str] = {}
        self._keys: list[str] | None = None
        self._blocks: list[int | None] | None = None
        self._children: list[tuple[int, ...]] | None = None
        self._sources: dict[tuple[Any, int], SourceLocation] = {}

    def layer_label(self, layer: int) -> str:
        """The label of a layer (given by its first entry), without pass."""
        if self.names:
            name = self.names.get(layer)
            if name is not None:
                return name
        row = self.rows[layer]
        return _layer_label(row[FUNC], row[INPLACE], row[N_FUNC], row[N_LAYER])

    def num_passes(self, layer: int) -> int:
        return self.passes.get(layer, 1)

    def finish(self) -> None:
        """Write the final labels: a layer's label, with ``:pass`` if it ran several."""
        hot = compiled.hot()
        if hot is not None:
            self.labels = hot.labels(self.rows, self.passes)
            self._name_inputs()
            return
        passes = self.passes
        labels: list[str] = []
        append = labels.append
        for index, row in enumerate(self.rows):
            layer = row[LAYER]
            if layer != index:
                append(f"{labels[layer][:-2]}:{row[PASS]}")
                continue
            label = _layer_label(row[FUNC], row[INPLACE], row[N_FUNC], row[N_LAYER])
            append(f"{label}:1" if layer in passes else label)
        self.labels = labels
        self._name_inputs()

    def _name_inputs(self) -> None:
        for index, name in self.names.items():
            self.labels[index] = name

    @property
    def keys(self) -> list[str]:
        """Every entry's stable key (:func:`op_keys`), computed on first use."""
        if self._keys is None:
            self._keys = op_keys(self.rows, self.labels)
        return self._keys

    @property
    def blocks(self) -> list[int | None]:
        """Every entry's block index (:func:`block_of` its innermost module), or None."""
        if self._blocks is None:
            self._blocks = [
                block_of(row[MODULES][-1][0]) if row[MODULES] else None for row in self.rows
            ]
        return self._blocks

    def children(self, index: int) -> tuple[int, ...]:
        """Entries that consumed entry ``index`` (computed for all entries on first use)."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in self.rows]
            for child, row in enumerate(self.rows):
                for parent in row[PARENTS]:
                    kids[parent].append(child)
            self._children = [tuple(dict.fromkeys(k)) for k in kids]
        return self._children[index]

    def source(self, index: int) -> SourceLocation | None:
        site = self.rows[index][SITE]
        if site is None:
            return None
        loc = self._sources.get(site)
        if loc is None:
            code, offset = site
            line = next(
                (
                    line
                    for start, end, line in code.co_lines()
                    if start <= offset < end and line is not None
                ),
                code.co_firstlineno,
            )
            loc = self._sources[site] = SourceLocation(code.co_filename, line, code.co_name)
        return loc


class TensorSource(Protocol):
    """Where saved tensors and statistics of entries are kept."""

    def op_tensor(self, index: int) -> torch.Tensor | None:
        """The saved tensor of op entry ``index``, or ``None`` when it was not saved."""

    def op_saved(self, index: int) -> bool: ...

    def op_stats(self, index: int) -> Stats | None: ...

    def slot_tensor(self, slot: int) -> torch.Tensor: ...


class SlotRef(NamedTuple):
    """Stands for a saved tensor inside a module entry's output structure."""

    slot: int


@functools.cache
def _device_name(device: torch.device) -> str:
    return str(device)


class OpEntry:
    """One recorded tensor: a model input, the output of an operation, or a model output.

    - ``label``: pass-qualified when the layer ran several passes (``linear_1_1:2``);
      ``layer`` is the label without the pass, ``pass_num`` the pass (from 1) and
      ``num_passes`` how many the layer ran.
    - ``func``: the torch function's plain name (``relu``, ``add_``, ``getitem``);
      ``input`` and ``output`` for the model's inputs and outputs.
    - ``kind``: ``"input"``, ``"op"`` or ``"output"``; ``index``: execution order.
    - ``module``: innermost module path ("" at top level); ``modules``: the whole stack as
      ``(path, pass)`` pairs, outermost first.
    - ``parents`` / ``children``: labels of the entries this one consumed / fed;
      ``parent_args`` gives, for each parent edge, the argument position it came in at.
    - ``source``: a :class:`SourceLocation` or ``None``.
    - ``shape``, ``dtype``, ``device``, ``nbytes``; ``out_index`` (position among the
      tensors one call returned), ``inplace``, ``params`` (parameter names the call used).
    - ``saved``, ``out`` (the detached copy, or ``None``) and ``stats`` (summary
      statistics, or ``None`` when the tensor was neither saved nor asked for with
      ``stats="all"``).
    """

    __slots__ = ("_row", "_table", "_tensors", "index")

    def __init__(self, table: OpTable, tensors: TensorSource | None, index: int):
        self._table = table
        self._tensors = tensors
        self._row = table.rows[index]
        self.index = index

    func = property(lambda self: self._row[FUNC])
    kind = property(lambda self: self._row[KIND])
    modules = property(lambda self: self._row[MODULES])
    dtype = property(lambda self: self._row[DTYPE])
    out_index = property(lambda self: self._row[OUT_INDEX])
    inplace = property(lambda self: self._row[INPLACE])
    params = property(lambda self: self._row[PARAMS])
    pass_num = property(lambda self: self._row[PASS])

    def field(self, name: str) -> Any:
        """The op record's row field ``name`` (one of ``record.ROW_FIELDS``) as the
        recorder keeps it."""
        return self._row[position(name)]

    @property
    def module(self) -> str:
        modules = self._row[MODULES]
        return modules[-1][0] if modules else ""

    shape = property(lambda self: self._row[SHAPE])

    @property
    def device(self) -> str:
        return _device_name(self._row[DEVICE])

    @property
    def nbytes(self) -> int:
        return math.prod(self._row[SHAPE]) * self._row[DTYPE].itemsize

    @property
    def parent_args(self) -> tuple[str, ...]:
        return tuple(str(pos) for pos in self._row[PARENT_ARGS])

    @property
    def key(self) -> str:
        """The op's stable key across runs of the same model code (see :func:`op_keys`)."""
        return self._table.keys[self.index]

    @property
    def block(self) -> int | None:
        """The block index of the op's innermost module (``h.3.attn`` -> 3), or None."""
        return self._table.blocks[self.index]

    @property
    def layer(self) -> str:
        return self._table.layer_label(self._row[LAYER])

    @property
    def num_passes(self) -> int:
        return self._table.num_passes(self._row[LAYER])

    @property
    def label(self) -> str:
        return self._table.labels[self.index]

    @property
    def parents(self) -> tuple[str, ...]:
        labels = self._table.labels
        return tuple(dict.fromkeys(labels[p] for p in self._row[PARENTS]))

    @property
    def children(self) -> tuple[str, ...]:
        labels = self._table.labels
        return tuple(labels[c] for c in self._table.children(self.index))

    @property
    def source(self) -> SourceLocation | None:
        return self._table.source(self.index)

    @property
    def saved(self) -> bool:
        return self._tensors is not None and self._tensors.op_saved(self.index)

    @property
    def out(self) -> torch.Tensor | None:
        """The saved tensor (a detached copy), or ``None`` when it was not selected."""
        return self._tensors.op_tensor(self.index) if self._tensors is not None else None

    @property
    def stats(self) -> Stats | None:
        return self._tensors.op_stats(self.index) if self._tensors is not None else None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, OpEntry) and other._table is self._table and other.index == self.index
        )

    def __hash__(self) -> int:
        return hash((id(self._table), self.index))

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        where = f" in {self.module!r}" if self.module else ""
        state = "saved" if self.saved else "not saved"
        return f"<OpEntry {self.label}: {self.func} {self.shape} {dtype}{where}, {state}>"


@dataclass(eq=False)
class ModuleEntry:
    """One call of a submodule, keyed by its ``named_modules()`` path.

    ``label`` is the path, with ``:N`` when the module was called several times.
    ``out`` is what the module returned, rebuilt through ``torch.utils._pytree`` with the
    same types (tuples, namedtuples, dicts, ``ModelOutput``, transformers caches...) and
    each tensor replaced by a detached copy; other leaves are kept when they are plain
    values (None, bool, int, float, str), else ``None``. ``outputs`` / ``inputs`` are the
    flat tuples of saved tensors; ``output_labels`` / ``input_labels`` name the entries
    that produced them.

    What a store keeps of the call, and reads it back from: ``input_indices`` /
    ``output_indices`` (the producing entries of the input and output tensors, -1 for
    none), ``op_range`` (the entries executed inside the call: ``[start, end)``),
    ``input_slots`` / ``output_slots`` (the tensor slots of the saved inputs and
    outputs, None when not saved), ``structure`` (the output's tree, tensors as
    :class:`SlotRef`) and ``tensor_source`` (where the slots' tensors are read).
    """

    path: str
    type: str
    pass_num: int
    index: int
    input_labels: tuple[str, ...] = ()
    output_labels: tuple[str, ...] = ()
    first_op: str | None = None
    last_op: str | None = None
    label: str = ""
    num_passes: int = 1
    kind: str = "module"
    input_indices: tuple[int, ...] = ()
    output_indices: tuple[int, ...] = ()
    op_range: tuple[int, int] = (0, 0)
    input_slots: tuple[int, ...] | None = None
    output_slots: tuple[int, ...] | None = None
    structure: Structure | None = None
    tensor_source: TensorSource | None = field(default=None, repr=False)

    @property
    def module(self) -> str:
        return self.path

    @property
    def saved(self) -> bool:
        return self.output_slots is not None

    def _resolve(self, slots: tuple[int, ...] | None) -> tuple[torch.Tensor, ...] | None:
        if slots is None or self.tensor_source is None:
            return None
        return tuple(self.tensor_source.slot_tensor(s) for s in slots)

    @property
    def outputs(self) -> tuple[torch.Tensor, ...] | None:
        return self._resolve(self.output_slots)

    @property
    def inputs(self) -> tuple[torch.Tensor, ...] | None:
        return self._resolve(self.input_slots)

    @property
    def out(self) -> Any:
        if self.output_slots is None or self.tensor_source is None or self.structure is None:
            return None
        return _fill(self.structure, self.tensor_source)

    def __repr__(self) -> str:
        state = "saved" if self.saved else "not saved"
        return f"<ModuleEntry {self.label}: {self.type}, {state}>"


def _fill(structure: Structure, tensors: TensorSource) -> Any:
    """Rebuild a module's output from its structure and the saved tensors. A stored
    structure whose types cannot be rebuilt here comes back as plain containers."""
    leaves = [
        tensors.slot_tensor(leaf.slot) if isinstance(leaf, SlotRef) else leaf
        for leaf in structure.leaves
    ]
    try:
        return structure.spec.unflatten(leaves)
    except Exception:  # a type's unflatten that rejects what a store gave back
        return plain_spec(structure.spec).unflatten(leaves)
