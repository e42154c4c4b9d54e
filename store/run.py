"""A stored run: the same entries as an in-memory trace, tensors read lazily from Zarr."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from tracelake.errors import RecorderError
from tracelake.recorder.entries import ModuleEntry, OpEntry
from tracelake.recorder.stats import Stats
from tracelake.recorder.trace import TraceView

from .rows import load_step
from .tensors import RunArrays, parse_dtype

if TYPE_CHECKING:
    from collections.abc import Iterable

    import pandas

    from tracelake.graph import OpGraph

    from .compare import Comparison

__all__ = ["LazyTensor", "Run", "StepView", "StoredOpEntry", "TensorSlot", "index_tensor"]


class TensorSlot:
    """Where one saved tensor of a run lives: its array, its byte offset in that array
    when it is packed with others (``None``: the array is its own), its size, shape and
    dtype, as the ``tensors`` table (and the ``__array`` ... columns of a compiled
    query) give them. With a run's :class:`~tracelake.store.tensors.RunArrays`, what a
    :class:`LazyTensor` needs."""

    __slots__ = ("array", "dtype", "nbytes", "offset", "shape")

    def __init__(self, array: str, offset: int | None, nbytes: int, shape: list[int], dtype: str):
        self.array = array
        self.offset = offset
        self.nbytes = nbytes
        self.shape = tuple(shape)
        self.dtype = parse_dtype(dtype)


class LazyTensor:
    """A stored tensor, read only when indexed: ``entry.array[0, :, 5:9]`` reads only the
    chunks that selection needs and returns a torch tensor; ``entry.array[...]`` reads it
    all. Basic indexing: ints, slices (negative bounds and steps too) and ``...``."""

    def __init__(self, arrays: RunArrays, slot: TensorSlot, label: str):
        self._arrays = arrays
        self._slot = slot
        self.label = label
        self.shape = slot.shape
        self.dtype = slot.dtype

    @property
    def ndim(self) -> int:
        """How many dimensions the tensor has."""
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def read(self) -> torch.Tensor:
        """The whole tensor, read from disk."""
        slot = self._slot
        if slot.offset is not None:
            return self._arrays.read_packed(
                slot.array, slot.offset, slot.nbytes, slot.dtype, slot.shape, self.label
            )
        return self._arrays.read_array(slot.array, slot.dtype, slot.shape, self.label)

    def __getitem__(self, key: Any) -> torch.Tensor:
        slot = self._slot
        if slot.offset is not None or not self.shape:
            return index_tensor(self.read(), key)  # packed tensors are small: read whole
        keys, flips = _normalise(key, self.shape)
        data = self._arrays.read_array(slot.array, slot.dtype, self.shape, self.label, keys)
        return data.flip(flips) if flips else data

    def __repr__(self) -> str:
        return f"<LazyTensor {self.label}: {list(self.shape)} {self.dtype}>"


def _normalise(key: Any, shape: tuple[int, ...]) -> tuple[tuple[Any, ...], list[int]]:
    """Basic indexing as zarr reads it: one int (dropped from the result, as numpy does)
    or forward slice per dimension, and the result's dimensions to flip afterwards
    (negative steps)."""
    if not isinstance(key, tuple):
        key = (key,)
    if any(k is None for k in key):
        raise TypeError("None (newaxis) is not supported here; index, then unsqueeze")
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = key[:at] + (slice(None),) * (len(shape) - len(key) + 1) + key[at + 1 :]
    if len(key) > len(shape):
        raise IndexError(f"too many indices for a tensor of {len(shape)} dimensions")
    key = key + (slice(None),) * (len(shape) - len(key))
    out: list[Any] = []
    squeeze: set[int] = set()
    flips: list[int] = []
    for dim, (k, n) in enumerate(zip(key, shape, strict=True)):
        if isinstance(k, bool) or (not isinstance(k, (int, slice)) and not hasattr(k, "__index__")):
            raise TypeError(f"unsupported index {k!r}: use ints, slices and '...'")
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step < 0:  # read the same elements forwards, flip afterwards
                count = len(range(start, stop, step))
                last = start + (count - 1) * step if count else start
                start, stop, step = (last, start + 1, -step) if count else (0, 0, 1)
                flips.append(dim - len(squeeze))
            out.append(slice(start, stop, step))
        else:
            i = int(k)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {dim} of size {n}")
            out.append(i % n)
            squeeze.add(dim)
    return tuple(out), flips


def index_tensor(tensor: torch.Tensor, key: Any) -> torch.Tensor:
    """``tensor[key]`` with basic indexing as :class:`LazyTensor` takes it (negative steps
    too, which torch itself refuses)."""
    if not tensor.dim():
        return tensor[key]
    keys, flips = _normalise(key, tuple(tensor.shape))
    out = tensor[keys]
    return out.flip(flips) if flips else out


class _RunTensors:
    """The :class:`TensorSource` of one step of a stored run."""

    def __init__(
        self,
        arrays: RunArrays,
        slots: dict[int, TensorSlot],
        op_slots: dict[int, int],
        stats: dict[int, Stats],
        labels: list[str],
        grads: Callable[[], dict[int, list[int | None]]] | None = None,
    ):
        self._grads_of = grads
        self._grads: dict[int, list[int | None]] | None = None
        self.arrays = arrays
        self._slots = slots
        self._op_slots = op_slots
        self._stats = stats
        self._labels = labels

    def lazy(self, index: int) -> LazyTensor | None:
        slot = self._op_slots.get(index)
        if slot is None:
            return None
        return LazyTensor(self.arrays, self._slots[slot], self._labels[index])

    def op_tensor(self, index: int) -> torch.Tensor | None:
        lazy = self.lazy(index)
        return None if lazy is None else lazy.read()

    def op_saved(self, index: int) -> bool:
        return index in self._op_slots

    def op_stats(self, index: int) -> Stats | None:
        return self._stats.get(index)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return LazyTensor(self.arrays, self._slots[slot], f"tensor {slot}").read()

    def op_grads(self, index: int) -> list[torch.Tensor | None]:
        """Op ``index``'s stored gradients, in fire order (read from the catalog's
        ``grads`` rows of this step on first use)."""
        if self._grads is None:
            self._grads = self._grads_of() if self._grads_of is not None else {}
        label = f"the gradient of {self._labels[index]}"
        return [
            None if slot is None else LazyTensor(self.arrays, self._slots[slot], label).read()
            for slot in self._grads.get(index, ())
        ]


class StoredOpEntry(OpEntry):
    """An :class:`OpEntry` of a stored run; ``array`` is the lazy, indexable tensor."""

    __slots__ = ("_source",)

    def __init__(self, table: Any, tensors: _RunTensors, index: int):
        super().__init__(table, tensors, index)
        self._source = tensors

    @property
    def array(self) -> LazyTensor | None:
        return self._source.lazy(self.index)


class StepView(TraceView):
    """One forward pass (step) of a stored run."""

    def __init__(
        self, run: Run, step: int, table: Any, tensors: _RunTensors, modules: list[ModuleEntry]
    ):
        for m in modules:
            if m.output_slots is not None:
                m.tensor_source = tensors
        super().__init__(table, tensors, modules)
        self._op_table = table
        self._source = tensors
        self.run = run
        self.step = step

    def call_args(self) -> dict[int, Any]:
        """Op idx -> its call as JSON text, from the catalog's ``args`` column."""
        rows = self.run._query(
            "SELECT idx, args FROM ops WHERE run_id = ? AND step = ? AND args IS NOT NULL",
            [self.run.id, self.step],
        ).fetchall()
        return dict(rows)

    def _entry(self, index: int) -> OpEntry:  # the view's hook: entries of its class
        return StoredOpEntry(self._op_table, self._source, index)

    def __repr__(self) -> str:
        saved = sum(1 for op in self if op.saved)
        return (
            f"<Step {self.step} of run {self.run.name!r}: {len(self)} ops ({saved} saved), "
            f"{len(self.modules)} module calls>"
        )


class Run:
    """A complete run of a store. With one step (``store.record``) it answers exactly like
    an in-memory :class:`~tracelake.Trace`: ``run[label]``, ``run.labels``, ``run.df()``,
    iteration. A run recorded over several forward passes has ``run.step(k)`` for each."""

    def __init__(
        self,
        info: dict[str, Any],
        arrays: RunArrays | Callable[[], RunArrays],
        query: Callable[[str, list[Any]], Any],
    ):
        self._bind(info, arrays, query)

    def _bind(
        self,
        info: dict[str, Any],
        arrays: RunArrays | Callable[[], RunArrays],
        query: Callable[[str, list[Any]], Any],
    ) -> None:
        """Point this object at a catalog row (again, for a run of a batch, once committed).
        ``arrays``: the run's arrays, or what opens them when first read (the run
        ``record`` returns: most are never read back, and a loop of many runs would keep
        every one's open)."""
        self.info = info
        self.name: str = info["name"]
        self.id: int = info["id"]
        self.num_steps: int = info["steps"]
        self.meta: Any = json.loads(info["meta"]) if info.get("meta") else None
        self.model_class: str | None = info.get("model_class")
        self._opened: RunArrays | None = None if callable(arrays) else arrays
        self._open: Callable[[], RunArrays] | None = arrays if callable(arrays) else None
        self._query = query
        self._steps: dict[int, StepView] = {}
        self._slots: dict[int, TensorSlot] | None = None

    @property
    def _arrays(self) -> RunArrays:
        if self._opened is None:
            assert self._open is not None
            self._opened = self._open()
        return self._opened

    def _load_slots(self) -> dict[int, TensorSlot]:
        if self._slots is None:
            rows = self._query(
                'SELECT slot, "array", byte_offset, nbytes, shape, dtype FROM tensors '
                "WHERE run_id = ?",
                [self.id],
            ).fetchall()
            self._slots = {r[0]: TensorSlot(*r[1:]) for r in rows}
        return self._slots

    def _load_grads(self, step: int) -> dict[int, list[int | None]]:
        """Op idx -> the slots of its stored gradients in fire order (None: not saved)."""
        grads: dict[int, list[int | None]] = {}
        for idx, slot in self._query(
            "SELECT idx, tensor FROM grads WHERE run_id = ? AND step = ? ORDER BY fire",
            [self.id, step],
        ).fetchall():
            grads.setdefault(idx, []).append(slot)
        return grads

    def step(self, k: int) -> StepView:
        """Step ``k`` (from 0) of the run: one forward pass, as a trace."""
        if not isinstance(k, int) or not 0 <= k < self.num_steps:
            raise RecorderError(
                f"run {self.name!r} has steps 0..{self.num_steps - 1}; step {k!r} does not exist"
            )
        view = self._steps.get(k)
        if view is None:
            table, modules, op_slots, stats = load_step(self._query, self.id, k)
            tensors = _RunTensors(
                self._arrays,
                self._load_slots(),
                op_slots,
                stats,
                table.labels,
                functools.partial(self._load_grads, k),
            )
            view = self._steps[k] = StepView(self, k, table, tensors, modules)
        return view

    @property
    def steps(self) -> list[StepView]:
        """Every step of the run, in order."""
        return [self.step(k) for k in range(self.num_steps)]

    def _only(self) -> StepView:
        if self.num_steps != 1:
            raise RecorderError(
                f"run {self.name!r} has {self.num_steps} steps; pick one with run.step(k) "
                f"(k from 0 to {self.num_steps - 1})"
            )
        return self.step(0)

    def __getitem__(self, key: str | int) -> Any:
        """An op entry by label or index, or a module entry by path (``run["encoder"]``)."""
        return self._only()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._only()

    def __iter__(self) -> Iterator[OpEntry]:
        return iter(self._only())

    def __len__(self) -> int:
        return len(self._only())

    # What a one-step run answers as an in-memory Trace does (real members, not
    # forwarded: tab completion and type checkers see them).

    @property
    def labels(self) -> list[str]:
        """Every op label in execution order (one-step runs; else ``run.step(k)``)."""
        return self._only().labels

    @property
    def ops(self) -> list[OpEntry]:
        """Every op entry, in execution order."""
        return self._only().ops

    @property
    def modules(self) -> list[ModuleEntry]:
        """Module call entries, in the order the calls began."""
        return self._only().modules

    @property
    def module_labels(self) -> list[str]:
        """The labels of the module calls (``encoder``, ``encoder:2``)."""
        return self._only().module_labels

    @property
    def inputs(self) -> list[OpEntry]:
        """The entries of the model's inputs."""
        return self._only().inputs

    @property
    def outputs(self) -> list[OpEntry]:
        """The entries of the model's outputs."""
        return self._only().outputs

    def find(self, func: str | None = None, module: str | None = None) -> list[OpEntry]:
        """Ops by function name and/or innermost module path (exact match)."""
        return self._only().find(func=func, module=module)

    def df(self) -> pandas.DataFrame:
        """One row per op entry: metadata, edges, source and summary statistics."""
        return self._only().df()

    def graph(
        self,
        step: int | None = None,
        *,
        depth: int | None = None,
        color: str | None = None,
        diff: Comparison | None = None,
        collapse: Iterable[str] = (),
        max_nodes: int | None = None,
        log: bool | None = None,
        rankdir: str = "TB",
    ) -> OpGraph:
        """The op graph of the run's step ``step`` (default: its only one), drawn with
        Graphviz; the options as :meth:`TraceView.graph` takes them."""
        view = self._only() if step is None else self.step(step)
        return view.graph(
            depth=depth,
            color=color,
            diff=diff,
            collapse=collapse,
            max_nodes=max_nodes,
            log=log,
            rankdir=rankdir,
        )

    def _repr_html_(self) -> str:
        from tracelake.reprs import run_html  # notebook display sits downstream

        return run_html(self)

    def __repr__(self) -> str:
        return f"<Run {self.name!r}: {self.model_class}, {self.num_steps} step(s)>"
