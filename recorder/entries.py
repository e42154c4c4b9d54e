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
from .stats import Stats
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


# Fields of an OpTable row, in order. SITE is (code, bytecode offset) of the user's call;
# LAYER is the index of the layer's first entry;
# N_FUNC / N_LAYER number the layer (for inputs and outputs: N_FUNC is their number and
# N_LAYER is 0). Every field is a plain value or a tuple of plain values.
(
    FUNC,
    KIND,
    MODULES,
    PARENTS,
    PARENT_ARGS,
    SITE,
    SHAPE,
    DTYPE,
    DEVICE,
    OUT_INDEX,
    INPLACE,
    PARAMS,
    LAYER,
    PASS,
    N_FUNC,
    N_LAYER,
) = range(16)


def _layer_label(func: str, inplace: bool, n_func: int, n_layer: int) -> str:
    if not n_layer:
        return f"{func}_{n_func}"  # input_1, output_1
    if inplace and func[-1] == "_":  # in-place variants count with their function
        return f"{func[:-1]}_{n_func}_{n_layer}"
    return f"{func}_{n_func}_{n_layer}"


class OpTable:
    """Metadata of every entry of one recording, one row tuple per entry.

    ``passes`` counts the passes of layers that ran more than once. ``finish()`` derives
    labels, children and source locations.
    """

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.passes: dict[int, int] = {}
        self.labels: list[str] = []
        self._children: list[tuple[int, ...]] | None = None
        self._sources: dict[tuple[Any, int], SourceLocation] = {}

    def layer_label(self, layer: int) -> str:
        """The label of a layer (given by its first entry), without pass."""
        row = self.rows[layer]
        return _layer_label(row[FUNC], row[INPLACE], row[N_FUNC], row[N_LAYER])

    def num_passes(self, layer: int) -> int:
        return self.passes.get(layer, 1)

    def finish(self) -> None:
        """Write the final labels: a layer's label, with ``:pass`` if it ran several."""
        hot = compiled.hot()
        if hot is not None:
            self.labels = hot.labels(self.rows, self.passes)
            return
        passes = self.passes
        labels: list[str] = []
        append = labels.append
        for index, (
            func,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            inplace,
            _,
            layer,
            pass_num,
            n_func,
            n_layer,
        ) in enumerate(self.rows):
            if layer != index:
                append(f"{labels[layer][:-2]}:{pass_num}")
                continue
            label = _layer_label(func, inplace, n_func, n_layer)
            append(f"{label}:1" if layer in passes else label)
        self.labels = labels

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
    _input_indices: tuple[int, ...] = ()
    _output_indices: tuple[int, ...] = ()
    _op_range: tuple[int, int] = (0, 0)
    _input_slots: tuple[int, ...] | None = None
    _output_slots: tuple[int, ...] | None = None
    _structure: Structure | None = None
    _tensors: TensorSource | None = field(default=None, repr=False)

    @property
    def module(self) -> str:
        return self.path

    @property
    def saved(self) -> bool:
        return self._output_slots is not None

    def _resolve(self, slots: tuple[int, ...] | None) -> tuple[torch.Tensor, ...] | None:
        if slots is None or self._tensors is None:
            return None
        return tuple(self._tensors.slot_tensor(s) for s in slots)

    @property
    def outputs(self) -> tuple[torch.Tensor, ...] | None:
        return self._resolve(self._output_slots)

    @property
    def inputs(self) -> tuple[torch.Tensor, ...] | None:
        return self._resolve(self._input_slots)

    @property
    def out(self) -> Any:
        if self._output_slots is None or self._tensors is None or self._structure is None:
            return None
        return _fill(self._structure, self._tensors)

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
