"""The entries a trace is made of: one per recorded tensor, one per module call.

A recording keeps its metadata as one tuple per entry in an :class:`OpTable` (cheap to
append on the forward thread, and column-shaped for a catalog); :class:`OpEntry` is a
light view of one row. Tensors live apart, in a :class:`TensorSource`, so that a stored
run can read them lazily behind the same entry classes.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from . import compiled
from .arguments import renumber_ops
from .loops import group_layers
from .names import OPERATOR_FUNCS, operator_name, spelling
from .parents import in_torchlens_order
from .prune import kept_entries, renumber
from .record import Stats, position
from .trees import Structure, plain_spec

__all__ = [
    "ModuleEntry",
    "OpEntry",
    "OpTable",
    "SlotRef",
    "SourceLocation",
    "TensorSource",
    "next_op_key",
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
INTERVENED = position("intervened")
RULE = position("rule")


def _layer_label(func: str, n_func: int, n_layer: int) -> str:
    if not n_layer:
        return f"{func}_{n_func}"  # input_1, output_1
    # TorchLens's spelling: in-place variants count with their function (add_ is add).
    return f"{spelling(func)}_{n_func}_{n_layer}"


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
        keys.append(next_op_key(counts, row))
    return keys


def next_op_key(counts: dict[tuple[Any, str], int], row: tuple) -> str:
    """The key of the first output of the op ``row``, the ops before it having been
    counted in ``counts`` (which this advances): one step of :func:`op_keys`, for
    whoever needs keys while the forward runs (interventions)."""
    stack, func = row[MODULES], row[FUNC]
    call = stack[-1] if stack else ("", 1)
    n = counts[call, func] = counts.get((call, func), 0) + 1
    path, pass_num = call
    where = f"{path}:{pass_num}:" if pass_num > 1 else f"{path}:" if path else ""
    return f"{where}{func}#{n}"


@functools.cache
def block_of(path: str) -> int | None:
    """The block index of a module path: its first all-digit component
    (``transformer.h.1.attn`` -> 1), or None."""
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


#: The kinds of entries listed after the other children of their parent.
_LISTED_LAST = frozenset({"buffer", "output"})


def _with(row: tuple, field: int, value: Any) -> tuple:
    """``row`` with the value at position ``field`` replaced."""
    return (*row[:field], value, *row[field + 1 :])


#: The last finished recordings: (raw rows, final rows, labels, passes, the raw rows
#: kept or None for all, whether orphans were kept, what is derived from the final rows
#: and labels once asked: ``keys`` and ``blocks``). A model recorded again with the
#: same graph (every training step) skips pruning and grouping, whose cost grows with
#: the graph: equal raw rows (plain values only) give equal final ones.
_Settled = tuple[
    tuple, list[tuple], list[str], dict[int, int], list[int] | None, bool, dict[str, Any]
]
_SETTLED: collections.deque[_Settled] = collections.deque(maxlen=8)
_SETTLED_MAX_ROWS = 100_000


class OpTable:
    """Metadata of every entry of one recording, one row tuple per entry.

    ``passes`` counts the passes of layers that ran more than once. ``finish()`` derives
    labels, children and source locations.
    """

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.passes: dict[int, int] = {}
        self.labels: list[str] = []
        #: Entry -> its call, encoded (recordings with ``record_args``; see arguments.py).
        self.call_args: dict[int, Any] = {}
        #: Entry -> its name, for inputs labelled by their keyword (recorder/inputs.py).
        self.names: dict[int, str] = {}
        #: Keep the entries connected to neither an input nor an output (TorchLens's
        #: ``keep_orphans``); by default :meth:`finish` prunes them (recorder/prune.py).
        self.keep_orphans = False
        self._keys: list[str] | None = None
        #: While recording: the settled graphs whose raw rows this one has matched so
        #: far, and how many of its rows were checked (:meth:`settled_label`).
        self._alike: list[_Settled] | None = None
        self._alike_checked = 0
        self._blocks: list[int | None] | None = None
        #: The settled graph this one's rows and labels were finished as (its derived
        #: columns computed once for every recording of that graph), if any.
        self._settled: _Settled | None = None
        self._children: list[tuple[int, ...]] | None = None
        self._sources: dict[tuple[Any, int], SourceLocation] = {}

    def layer_label(self, layer: int) -> str:
        """The label of a layer (given by its first entry), without pass."""
        if self.names:
            name = self.names.get(layer)
            if name is not None:
                return name
        row = self.rows[layer]
        return _layer_label(row[FUNC], row[N_FUNC], row[N_LAYER])

    def num_passes(self, layer: int) -> int:
        return self.passes.get(layer, 1)

    def finish(self) -> list[int] | None:
        """Prune orphans, group ops into layers and write the final labels, as TorchLens
        does; return the indices (before pruning) of the entries kept, or None when all
        are (and always with :attr:`keep_orphans`).

        Entries connected to neither an input, an output nor a written buffer are dropped
        (:func:`~.prune.kept_entries`); rows and the tables keyed by entry are renumbered
        first, so labels count only what is kept, as TorchLens's do.

        Operators get their own names where torch reported another (``x / y`` came as
        ``div``: :func:`~.intercept.operator_name`); layers and passes are TorchLens's
        (:func:`~.loops.group_layers`); a layer is ``{function}_{n_func}_{n_layer}`` in
        TorchLens's spelling of the function (:func:`~.intercept.spelling`), ``n_func``
        counting that spelling's layers and ``n_layer`` all layers in the order of their
        first passes, with ``:pass`` if it ran several passes. Rows whose fields change
        are rewritten."""
        rows = self.rows
        raw = tuple(rows)
        keep_orphans = self.keep_orphans
        # A graph recorded before (the same model again) is labelled as then. Comparing
        # rows is cheap: equal rows share their values (sites, shapes, names; in the
        # compiled path row numbers too), which same_rows checks inline.
        hot = compiled.hot()
        same = operator.eq if hot is None else hot.same_rows
        for settled in _SETTLED:
            if settled[5] == keep_orphans and same(settled[0], raw):
                _SETTLED.remove(settled)
                _SETTLED.append(settled)
                _, final, labels, passes, kept, _, _ = settled
                self._settled = settled
                if kept is not None:
                    self._renumber(kept)
                rows[:] = final
                self.labels = list(labels)
                self.passes = dict(passes)
                self._name_inputs()
                return kept
        kept = None if keep_orphans else kept_entries(rows)
        if kept is not None:
            self._renumber(kept)
            rows[:] = [rows[index] for index in kept]
            new = renumber(kept, len(raw))
            for index, row in enumerate(rows):
                parents = tuple(new[parent] for parent in row[PARENTS])
                rows[index] = _with(_with(row, PARENTS, parents), LAYER, index)
        self._settle()
        if len(rows) <= _SETTLED_MAX_ROWS:
            labels = list(self.labels)
            cached: _Settled = (raw, list(rows), labels, dict(self.passes), kept, keep_orphans, {})
            _SETTLED.append(cached)
            self._settled = cached
        self._name_inputs()  # after the cache took the labels: names are per call
        return kept

    def _renumber(self, kept: list[int]) -> None:
        """Renumber what is keyed by entry (names, recorded calls) to the entries
        ``kept``; the rows themselves are the caller's."""
        new = renumber(kept, len(self.rows))
        self.names = {new[i]: name for i, name in self.names.items() if new[i] >= 0}
        calls: dict[int, Any] = {}  # (a call's outputs share its encoding: renumbered once)
        call_args: dict[int, Any] = {}
        for i, call in self.call_args.items():
            if new[i] >= 0:
                if id(call) not in calls:
                    calls[id(call)] = renumber_ops(call, new)
                call_args[new[i]] = calls[id(call)]
        self.call_args = call_args

    def settled_label(self, index: int) -> str | None:
        """While recording: the final label entry ``index`` will get, where a graph
        recorded before in this process began with the same rows (the same model again),
        else None. Final labels come from grouping the whole graph (:meth:`finish`), so a
        selector naming one (``tl.label("add_12_170:2")``) can only be matched during
        the forward through a graph seen before; the check is incremental (each row is
        compared once) and is made only for label selectors."""
        if len(self.labels) > index:  # finished: the labels are final
            return self.labels[index]
        named = self.names.get(index)  # an input given by keyword: its name
        if named is not None:
            return named
        rows = self.rows
        if self._alike is None:
            self._alike = [s for s in _SETTLED if s[5] == self.keep_orphans]
        alike = self._alike
        while self._alike_checked <= index and alike:
            at = self._alike_checked
            row = rows[at]
            alike[:] = [s for s in alike if len(s[0]) > at and s[0][at] == row]
            self._alike_checked += 1
        if not alike or index >= self._alike_checked:
            return None
        _, _, labels, _, kept, _, _ = alike[0]
        if kept is not None:  # labels count the entries kept (binary search: kept is sorted)
            at = bisect.bisect_left(kept, index)
            if at == len(kept) or kept[at] != index:
                return None  # pruned
            index = at
        return labels[index]

    def _settle(self) -> None:
        rows = self.rows
        for index, row in enumerate(rows):
            func = row[FUNC]
            if func in OPERATOR_FUNCS:  # x / y reached the recording as div
                named = operator_name(func, row[SITE])
                if named != func:
                    rows[index] = _with(row, FUNC, named)
        layers, pass_nums = group_layers(rows)
        # Only now (the grouping keys ops by every tensor argument in argument order,
        # as TorchLens does): the parents in TorchLens's order, where it is another
        # (parents.in_torchlens_order: crawled calls list each entry once).
        for index, row in enumerate(rows):
            parents = row[PARENTS]
            if len(parents) > 1:
                listed = in_torchlens_order(row[FUNC], parents, row[PARENT_ARGS])
                if listed is not None:
                    row = _with(row, PARENTS, listed[0])
                    rows[index] = _with(row, PARENT_ARGS, listed[1])
        passes: dict[int, int] = {}
        for layer, pass_num in zip(layers, pass_nums, strict=True):
            if pass_num > 1:
                passes[layer] = max(passes.get(layer, 1), pass_num)
        self.passes = passes
        labels: list[str] = []
        append = labels.append
        counts: dict[str, int] = {}
        n_layer = 0
        for index, row in enumerate(rows):
            layer, pass_num = layers[index], pass_nums[index]
            if row[KIND] != "op":
                append(f"{row[FUNC]}_{row[N_FUNC]}")
                continue
            if layer != index:
                first = rows[layer]
                n_func, n_this = first[N_FUNC], first[N_LAYER]
                append(f"{labels[layer][:-2]}:{pass_num}")
            else:
                spelled = spelling(row[FUNC])
                n_func = counts[spelled] = counts.get(spelled, 0) + 1
                n_layer += 1
                n_this = n_layer
                label = f"{spelled}_{n_func}_{n_this}"
                append(f"{label}:1" if layer in passes else label)
            if (row[LAYER], row[PASS], row[N_FUNC], row[N_LAYER]) != (
                layer,
                pass_num,
                n_func,
                n_this,
            ):
                row = _with(row, LAYER, layer)
                row = _with(row, PASS, pass_num)
                rows[index] = _with(_with(row, N_FUNC, n_func), N_LAYER, n_this)
        self.labels = labels

    def _name_inputs(self) -> None:
        """Inputs given by keyword take their name as label (recorder/inputs.py)."""
        for index, name in self.names.items():
            self.labels[index] = name

    @property
    def keys(self) -> list[str]:
        """Every entry's stable key (:func:`op_keys`), computed on first use."""
        if self._keys is None:
            derived = self._derived()
            if derived is None:
                self._keys = op_keys(self.rows, self.labels)
            else:
                keys = derived.get("keys")
                if keys is None:  # (the settled graph's labels: its inputs not named)
                    assert self._settled is not None
                    keys = derived["keys"] = op_keys(self._settled[1], self._settled[2])
                keys = list(keys)
                for index in self.names:  # an input named by its keyword: its key too
                    if self.rows[index][KIND] != "op":
                        keys[index] = self.labels[index]
                self._keys = keys
        return self._keys

    @property
    def blocks(self) -> list[int | None]:
        """Every entry's block index (:func:`block_of` its innermost module), or None."""
        if self._blocks is None:
            derived = self._derived()
            blocks = None if derived is None else derived.get("blocks")
            if blocks is None:
                blocks = [
                    block_of(row[MODULES][-1][0]) if row[MODULES] else None for row in self.rows
                ]
                if derived is not None:
                    derived["blocks"] = blocks
            self._blocks = list(blocks)
        return self._blocks

    def settled_as(self) -> _Settled | None:
        """The settled graph this table is, row for row, label for label and pass for
        pass (a step of a loop over one graph: the very rows and labels of the first),
        else None: what tables of one graph share may be computed once for all (the
        store's ``ops`` columns). Inputs named by keyword: None (their labels are
        this call's)."""
        settled = self._settled
        if (
            settled is None
            or self.names
            or self._derived() is None
            or self.labels != settled[2]
            or self.passes != settled[3]
        ):
            return None
        return settled

    def _derived(self) -> dict[str, Any] | None:
        """The settled graph's derived columns, where this table's rows are still its
        final rows (a 1,000-op step's keys took ~0.6 ms, every step of a loop)."""
        settled = self._settled
        if settled is None or settled[1] != self.rows:  # (identity first: ~5 us)
            return None
        return settled[6]

    def children(self, index: int) -> tuple[int, ...]:
        """Entries that consumed entry ``index`` (computed for all entries on first use)."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in self.rows]
            writes: list[tuple[int, int]] = []
            outputs: list[tuple[int, int]] = []
            for child, row in enumerate(self.rows):
                if row[KIND] in _LISTED_LAST and row[PARENTS]:
                    (writes if row[KIND] == "buffer" else outputs).append((row[PARENTS][0], child))
                    continue
                for parent in row[PARENTS]:
                    kids[parent].append(child)
            # As TorchLens lists them: the buffers a call wrote after its other children
            # (it links them after the forward), and the model's outputs after those.
            for parent, child in writes + outputs:
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
            loc = self._sources[site] = SourceLocation(
                code.co_filename, _line_at(code, offset), code.co_name
            )
        return loc


@functools.lru_cache(maxsize=1024)
def _line_table(code: Any) -> tuple[list[int], list[int], list[int]]:
    """``code``'s instruction ranges that have a line: starts (ascending, as
    ``co_lines`` gives them, without overlaps), ends and lines. Scanning ``co_lines``
    for every call site cost ~0.3 ms a site in a long forward; one table per function
    is read by bisection."""
    starts: list[int] = []
    ends: list[int] = []
    lines: list[int] = []
    for start, end, line in code.co_lines():
        if line is not None and end > start:
            starts.append(start)
            ends.append(end)
            lines.append(line)
    return starts, ends, lines


def _line_at(code: Any, offset: int) -> int:
    """The line of the instruction at byte ``offset`` of ``code`` (the function's first
    line if that instruction has none)."""
    starts, ends, lines = _line_table(code)
    k = bisect.bisect_right(starts, offset) - 1
    if k >= 0 and offset < ends[k]:
        return lines[k]
    return int(code.co_firstlineno)


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
    - ``grad`` / ``grads``: gradients of a loss with respect to ``out`` after
      ``trace.backward(loss)`` (a recording made ``backward_ready``).
    """

    __slots__ = ("_row", "_table", "_tensors", "index")

    def __init__(self, table: OpTable, tensors: TensorSource | None, index: int):
        self._table = table
        self._tensors = tensors
        self._row = table.rows[index]
        self.index = index

    func = property(
        lambda self: self._row[FUNC],
        doc="The torch function's plain name (``relu``, ``add_``); ``input`` / ``output``.",
    )
    kind = property(lambda self: self._row[KIND], doc='``"input"``, ``"op"`` or ``"output"``.')
    modules = property(
        lambda self: self._row[MODULES],
        doc="The module stack as ``(path, pass)`` pairs, outermost first.",
    )
    dtype = property(lambda self: self._row[DTYPE], doc="The tensor's dtype.")
    out_index = property(
        lambda self: self._row[OUT_INDEX], doc="Its position among the tensors one call returned."
    )
    inplace = property(
        lambda self: self._row[INPLACE], doc="Whether the call wrote its output in place."
    )
    params = property(
        lambda self: self._row[PARAMS], doc="The names of the parameters the call used."
    )
    pass_num = property(lambda self: self._row[PASS], doc="Which pass of its layer (from 1).")
    intervened = property(
        lambda self: self._row[INTERVENED], doc="Whether an intervention rule changed it."
    )
    rule = property(
        lambda self: self._row[RULE],
        doc="The number of the intervention rule that changed this op first, or None.",
    )

    def field(self, name: str) -> Any:
        """The op record's row field ``name`` (one of ``record.ROW_FIELDS``) as the
        recorder keeps it."""
        return self._row[position(name)]

    @property
    def module(self) -> str:
        """The innermost module's path ("" at top level)."""
        modules = self._row[MODULES]
        return modules[-1][0] if modules else ""

    shape = property(lambda self: self._row[SHAPE], doc="The tensor's shape.")

    @property
    def device(self) -> str:
        """The tensor's device (``cpu``, ``cuda:0``)."""
        return _device_name(self._row[DEVICE])

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self._row[SHAPE]) * self._row[DTYPE].itemsize

    @property
    def parent_args(self) -> tuple[str, ...]:
        """For each parent edge, the argument position it came in at."""
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
        """The label without the pass (``linear_1_1``)."""
        return self._table.layer_label(self._row[LAYER])

    def settled_label(self) -> str | None:
        """The final label, or while recording the one a graph seen before gave this
        entry (None if none did: :meth:`OpTable.settled_label`)."""
        return self._table.settled_label(self.index)

    @property
    def num_passes(self) -> int:
        """How many passes the op's layer ran."""
        return self._table.num_passes(self._row[LAYER])

    @property
    def label(self) -> str:
        """The op's label, pass-qualified where its layer ran several (``linear_1_1:2``)."""
        return self._table.labels[self.index]

    @property
    def parents(self) -> tuple[str, ...]:
        """The labels of the entries this one consumed, once per argument that took
        one, in argument order (as TorchLens lists them: ``x * x`` has ``input_1``
        twice)."""
        labels = self._table.labels
        return tuple(labels[p] for p in self._row[PARENTS])

    @property
    def children(self) -> tuple[str, ...]:
        """The labels of the entries this one fed."""
        labels = self._table.labels
        return tuple(labels[c] for c in self._table.children(self.index))

    @property
    def source(self) -> SourceLocation | None:
        """The user code's file and line that issued the call, or None."""
        return self._table.source(self.index)

    @property
    def saved(self) -> bool:
        """Whether the tensor was saved (``out`` holds it)."""
        return self._tensors is not None and self._tensors.op_saved(self.index)

    @property
    def out(self) -> torch.Tensor | None:
        """The saved tensor (a detached copy), or ``None`` when it was not selected."""
        return self._tensors.op_tensor(self.index) if self._tensors is not None else None

    @property
    def stats(self) -> Stats | None:
        """Summary statistics, or None when neither saved nor asked for (``stats="all"``)."""
        return self._tensors.op_stats(self.index) if self._tensors is not None else None

    @property
    def grads(self) -> list[torch.Tensor | None]:
        """The gradients of the loss with respect to this op's output, one per backward
        call that reached it, in order (``trace.backward(loss)``); ``None`` for a value
        that could not be kept."""
        read = getattr(self._tensors, "op_grads", None)
        return [] if read is None else list(read(self.index))

    @property
    def grad(self) -> torch.Tensor | None:
        """The gradient from the latest backward call that reached this op, or None."""
        grads = self.grads
        return grads[-1] if grads else None

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
        """The module's path (as ``path``)."""
        return self.path

    @property
    def saved(self) -> bool:
        """Whether the module call's outputs were saved."""
        return self.output_slots is not None

    def _resolve(self, slots: tuple[int, ...] | None) -> tuple[torch.Tensor, ...] | None:
        if slots is None or self.tensor_source is None:
            return None
        return tuple(self.tensor_source.slot_tensor(s) for s in slots)

    @property
    def outputs(self) -> tuple[torch.Tensor, ...] | None:
        """The saved output tensors of the call, flattened, or None."""
        return self._resolve(self.output_slots)

    @property
    def inputs(self) -> tuple[torch.Tensor, ...] | None:
        """The saved input tensors of the call, flattened, or None."""
        return self._resolve(self.input_slots)

    @property
    def out(self) -> Any:
        """What the module returned, rebuilt with its own types from the saved copies, or None."""
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
