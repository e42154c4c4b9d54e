"""The trace interface: look up entries by label, list them, tabulate them.

:class:`TraceView` holds the logic every kind of trace shares (in memory here; stored
runs later answer through the same class); :class:`Trace` is the in-memory result of
``tl.trace``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tracelake.errors import AmbiguousLabelError, LabelError, RecorderError, TraceLakeWarning

from .backward import BackwardCapture, MemoryGrads
from .entries import ModuleEntry, OpEntry, OpTable, TensorSource
from .record import OPS, STAT_FIELDS, TRANSFORMED

if TYPE_CHECKING:
    from collections.abc import Iterable

    import pandas

    from tracelake.graph import OpGraph
    from tracelake.store.compare import Comparison

    from .emit import MemoryEmitter
    from .intervene import Interventions
    from .replay import ReplayReport

__all__ = ["GradRecord", "Trace", "TraceView"]


class GradRecord(NamedTuple):
    """One op's gradient from one fire of its autograd node (see ``Trace.grad_fires``)."""

    backward: int  # which backward call (from 1)
    fire: int  # the node's fire, in the engine's execution order (from 0)
    node: str  # the autograd node: AddmmBackward0, AccumulateGrad, ...
    label: str  # the forward op (pass-qualified)
    grad: torch.Tensor | None


#: Row fields ``df()`` shows as they are (those a catalog column keeps unconverted),
#: besides the columns it derives itself.
_EXTRA_FIELDS = tuple(
    f.name
    for f in OPS.fields
    if f.row and f.type is not None and f.name not in ("pass", "func", "kind", *TRANSFORMED)
)


class TraceView:
    """Entries of one recorded forward pass, in execution order.

    ``view[label]`` returns an :class:`OpEntry` (``"relu_1_2"``, ``"linear_1_1:2"``,
    ``"input_1"``, ``"output_1"``) or a :class:`ModuleEntry` (``"encoder.layers.0"``,
    ``"encoder:2"``); an ``int`` indexes ops in execution order.
    """

    def __init__(self, table: OpTable, tensors: TensorSource | None, modules: list[ModuleEntry]):
        self._table = table
        self._tensors = tensors
        self._modules = modules
        self._by_label: dict[str, int] | None = None
        self._module_by_label = {m.label: m for m in modules}
        self._passes: dict[str, list[str]] | None = None

    @property
    def _index_by_label(self) -> dict[str, int]:
        """Label -> op index, built on first lookup (not while recording)."""
        if self._by_label is None:
            labels = self._table.labels
            self._by_label = dict(zip(labels, range(len(labels)), strict=True))
        return self._by_label

    def _entry(self, index: int) -> OpEntry:
        return OpEntry(self._table, self._tensors, index)

    def _multi_pass(self) -> dict[str, list[str]]:
        """Bare layer labels and module paths that ran several passes -> their labels."""
        if self._passes is None:
            passes: dict[str, list[str]] = {}
            table = self._table
            for layer in sorted(table.passes):
                bare = table.layer_label(layer)
                passes[bare] = [f"{bare}:{n}" for n in range(1, table.passes[layer] + 1)]
            for m in self._modules:
                if m.num_passes > 1:
                    passes.setdefault(m.path, []).append(m.label)
            self._passes = passes
        return self._passes

    @property
    def labels(self) -> list[str]:
        """Every op label in execution order, pass-qualified where a layer ran several."""
        return list(self._table.labels)

    @property
    def ops(self) -> list[OpEntry]:
        """Every op entry, in execution order."""
        return [self._entry(i) for i in range(len(self._table.rows))]

    @property
    def modules(self) -> list[ModuleEntry]:
        """Module call entries, in the order the calls began."""
        return list(self._modules)

    @property
    def module_labels(self) -> list[str]:
        """The labels of the module calls (``encoder``, ``encoder:2``)."""
        return [m.label for m in self._modules]

    @property
    def inputs(self) -> list[OpEntry]:
        """The entries of the model's inputs."""
        return [op for op in self if op.kind == "input"]

    @property
    def outputs(self) -> list[OpEntry]:
        """The entries of the model's outputs."""
        return [op for op in self if op.kind == "output"]

    def __len__(self) -> int:
        return len(self._table.rows)

    def __iter__(self) -> Iterator[OpEntry]:
        return map(self._entry, range(len(self._table.rows)))

    def __contains__(self, key: object) -> bool:
        return key in self._index_by_label or key in self._module_by_label

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            try:
                return self._entry(range(len(self))[key])
            except IndexError:
                raise LabelError(
                    key, message=f"op index {key} out of range: this trace has {len(self)} ops"
                ) from None
        if not isinstance(key, str):
            raise TypeError(f"look entries up by label (str) or index (int), not {key!r}")
        index = self._index_by_label.get(key)
        if index is not None:
            return self._entry(index)
        module = self._module_by_label.get(key)
        if module is not None:
            return module
        passes = self._multi_pass()
        if key in passes:
            raise AmbiguousLabelError(key, passes[key])
        raise LabelError(key, [*self._index_by_label, *self._module_by_label])

    def find(self, func: str | None = None, module: str | None = None) -> list[OpEntry]:
        """Ops by function name and/or innermost module path (exact match)."""
        return [
            op
            for op in self
            if (func is None or op.func == func) and (module is None or op.module == module)
        ]

    def df(self) -> pandas.DataFrame:
        """One row per op entry: metadata, edges, source and summary statistics."""
        import pandas

        rows = []
        for op in self:
            stats = op.stats
            row = {
                "index": op.index,
                "label": op.label,
                "layer": op.layer,
                "pass": op.pass_num,
                "func": op.func,
                "kind": op.kind,
                "module": op.module,
                "shape": op.shape,
                "dtype": str(op.dtype).removeprefix("torch."),
                "device": op.device,
                "nbytes": op.nbytes,
                "saved": op.saved,
                "parents": op.parents,
                "source": str(op.source) if op.source else None,
            }
            for name in _EXTRA_FIELDS:
                row[name] = op.field(name)
            for name in STAT_FIELDS:
                row[name] = getattr(stats, name) if stats is not None else None
            rows.append(row)
        return pandas.DataFrame(rows)

    def graph(
        self,
        *,
        depth: int | None = None,
        color: str | None = None,
        diff: Comparison | None = None,
        collapse: Iterable[str] = (),
        max_nodes: int | None = None,
        log: bool | None = None,
        rankdir: str = "TB",
    ) -> OpGraph:
        """The op graph, drawn with Graphviz (displays as SVG in a notebook; ``.save(
        "ops.svg")``): module calls as clusters, those deeper than ``depth`` (default:
        as deep as ``max_nodes`` nodes allow) or named in ``collapse`` as one node each;
        nodes coloured by a statistic (``color="absmax"``) or by a comparison's
        difference (``diff=comparison``, this trace as its side ``a``). See
        :mod:`tracelake.graph`."""
        from tracelake.graph import MAX_NODES, build_graph  # drawing sits downstream

        return build_graph(
            self,
            depth=depth,
            color=color,
            diff=diff,
            collapse=collapse,
            max_nodes=MAX_NODES if max_nodes is None else max_nodes,
            log=log,
            rankdir=rankdir,
        )

    def _repr_html_(self) -> str:
        from tracelake.reprs import trace_html

        return trace_html(self)

    def call_args(self) -> dict[int, Any]:
        """Op index -> its call, encoded (recordings with ``CaptureOptions(
        record_args=True)``; see ``recorder/arguments.py``): what ``tl.validate`` reads."""
        return self._table.call_args

    def _summary(self) -> str:
        saved = sum(1 for op in self if op.saved)
        return f"{len(self)} ops ({saved} saved), {len(self._modules)} module calls"


class Trace(TraceView):
    """The in-memory result of :func:`tracelake.trace`.

    ``output`` is what the model returned, untouched. ``cleanup()`` frees every saved
    tensor; the trace can also be used as a context manager that cleans up on exit.
    """

    #: The recording's intervention rules and what they touched (``.audit()``: one row
    #: per rule), set by ``tl.trace``.
    interventions: Interventions | None = None
    #: How the model was called, as JSON (what ``replay`` calls it with again).
    call: str | None = None

    def __init__(
        self,
        table: OpTable,
        emitter: MemoryEmitter,
        modules: list[ModuleEntry],
        output: Any,
        model_class: str,
    ):
        super().__init__(table, emitter, modules)
        self._emitter = emitter
        self.output = output
        self.model_class = model_class
        self._backward: BackwardCapture | None = None
        #: The recorded model, while it lives (``tl.validate`` reads its parameters).
        self.model_ref: Callable[[], Any] | None = None
        if emitter.grad_edges is not None:
            emitter.grads = MemoryGrads()
            self._backward = BackwardCapture([emitter.grad_edges], emitter.grads)

    def replay(self, model: Any, atol: float = 1e-6, rtol: float = 1e-5) -> ReplayReport:
        """Run this forward pass again on ``model`` from the saved inputs, with the same
        interventions, and report op by op whether each saved value was reproduced
        (bitwise on the same device and dtype, else within ``atol`` / ``rtol``).
        ``ReplayError`` up front when it cannot be (inputs not saved, a user callable)."""
        from .replay import replay_trace

        return replay_trace(self, model, atol, rtol)

    @property
    def nbytes_saved(self) -> int:
        """Bytes held by saved tensors; tensors sharing memory are counted once."""
        return self._emitter.nbytes

    def cleanup(self) -> None:
        """Free every saved tensor and the model output; metadata stays readable."""
        self._emitter.cleanup()
        self.output = None
        self._backward = None

    # -- backward --------------------------------------------------------------------------

    def backward(self, loss: Any, gradient: Any = None, **options: Any) -> None:
        """Run ``torch.autograd.backward(loss, gradient, **options)`` and record, for each
        op selected by ``save_grads=`` (default ``save=``), the gradient of ``loss`` with
        respect to its output: ``trace[label].grad`` (the latest call's), ``.grads`` (one
        per call), and :attr:`grad_fires` (every fire of an op's autograd node, in the
        order the engine ran them). ``options`` are torch's (``retain_graph``,
        ``create_graph``, ``inputs``); each call is a separate backward pass. The trace
        must have been recorded with ``capture=tl.options.CaptureOptions(
        backward_ready=True)``; ``loss`` may be computed outside the model."""
        if self._emitter.slots.freed:
            raise RecorderError("this trace was freed by cleanup(); record it again")
        if self._backward is None:
            raise RecorderError(
                "this trace was not recorded backward-ready: record it with "
                "capture=tl.options.CaptureOptions(backward_ready=True), then call "
                "trace.backward(loss)"
            )
        grads = self._emitter.grads
        assert grads is not None
        self._backward.backward(loss, gradient, **options)
        for fire in grads.done():
            warnings.warn(
                f"the gradient of {self._table.labels[fire.op]} (backward call "
                f"{fire.backward}) was written in place after autograd handed it over, "
                "so it is not kept",
                TraceLakeWarning,
                stacklevel=2,
            )

    @property
    def grad_fires(self) -> list[GradRecord]:
        """Every gradient recorded by :meth:`backward`, in the order the autograd engine
        ran the ops' nodes: which backward call, which fire, the node, the op's label
        (pass-qualified) and the gradient (``None`` once freed)."""
        grads = self._emitter.grads
        if grads is None:
            return []
        labels = self._table.labels
        return [
            GradRecord(f.backward, f.fire, f.node, labels[f.op], grad)
            for f, grad in zip(grads.fires, grads.tensors, strict=True)
        ]

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"<Trace of {self.model_class}: {self._summary()}>"
