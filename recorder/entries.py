"""The entries a trace is made of: one per recorded tensor, one per module call.

These classes are the one interface that an in-memory ``Trace`` and a stored run share:
everything but the tensor itself is plain metadata, and the tensor is reached through
``out``, which an entry either holds or reads lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tracelake.errors import RecorderError

from .stats import Stats, compute_stats

__all__ = ["ModuleEntry", "OpEntry", "SourceLocation"]


class SourceLocation(NamedTuple):
    """Where user code issued a call: the first frame outside torch and tracelake."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def _freed_error() -> RecorderError:
    return RecorderError("this trace was freed by cleanup(); record it again to read its tensors")


class OpEntry:
    """One recorded tensor: a model input, the output of an operation, or a model output.

    Attributes are read-only metadata:

    - ``label``: pass-qualified when the layer ran several passes (``linear_1_1:2``);
      ``layer`` is the label without the pass, ``pass_num`` the pass (from 1) and
      ``num_passes`` how many the layer ran.
    - ``func``: the torch function's plain name (``relu``, ``add_``, ``getitem``);
      ``input`` and ``output`` for the model's inputs and outputs.
    - ``kind``: ``"input"``, ``"op"`` or ``"output"``.
    - ``index``: position in execution order among all entries.
    - ``module``: innermost module path ("" at top level); ``modules``: the whole stack as
      ``(path, pass)`` pairs, outermost first.
    - ``parents`` / ``children``: labels of the entries this one consumed / fed;
      ``parent_args`` gives, for each parent, the argument position it was passed at.
    - ``source``: a :class:`SourceLocation` or ``None``.
    - ``shape``, ``dtype``, ``device``, ``nbytes``; ``out_index`` (position among the
      tensors one call returned), ``inplace``, ``params`` (parameter names the call used).
    - ``saved``: whether ``out`` holds the tensor; ``stats``: summary statistics, or
      ``None`` when the tensor was neither saved nor asked for with ``stats="all"``.
    """

    __slots__ = (
        "_freed",
        "_layer",
        "_out",
        "_stats",
        "_version",
        "children",
        "device",
        "dtype",
        "func",
        "index",
        "inplace",
        "kind",
        "label",
        "layer",
        "modules",
        "num_passes",
        "out_index",
        "params",
        "parent_args",
        "parent_indices",
        "parents",
        "pass_num",
        "saved",
        "shape",
        "source",
    )

    def __init__(
        self,
        index: int,
        func: str,
        kind: str,
        tensor: torch.Tensor,
        modules: tuple[tuple[str, int], ...],
        parent_indices: tuple[int, ...],
        parent_args: tuple[str, ...],
        source: SourceLocation | None,
        out_index: int = 0,
        inplace: bool = False,
        params: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.func = func
        self.kind = kind
        self.modules = modules
        self.parent_indices = parent_indices
        self.parent_args = parent_args
        self.source = source
        self.out_index = out_index
        self.inplace = inplace
        self.params = params
        self.shape: tuple[int, ...] = tuple(tensor.shape)
        self.dtype: torch.dtype = tensor.dtype
        self.device: str = str(tensor.device)
        # Filled in by the labeller as the recording goes and when it finishes.
        self._layer: Any = None
        self.layer = ""
        self.label = ""
        self.pass_num = 1
        self.num_passes = 1
        self.parents: tuple[str, ...] = ()
        self.children: tuple[str, ...] = ()
        self.saved = False
        self._out: torch.Tensor | None = None
        self._version: int | None = None
        self._stats: Stats | None = None
        self._freed = False

    @property
    def module(self) -> str:
        return self.modules[-1][0] if self.modules else ""

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    @property
    def out(self) -> torch.Tensor | None:
        """The saved tensor (a detached copy), or ``None`` when it was not selected."""
        if self._freed:
            raise _freed_error()
        return self._out

    @property
    def stats(self) -> Stats | None:
        # Stats of a saved tensor are computed from the immutable saved copy on first
        # use: the same numbers as at record time, without charging the forward pass.
        if self._stats is None and self._out is not None:
            self._stats = compute_stats(self._out)
        return self._stats

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        where = f" in {self.module!r}" if self.module else ""
        state = "saved" if self.saved else "not saved"
        return f"<OpEntry {self.label}: {self.func} {self.shape} {dtype}{where}, {state}>"


@dataclass(eq=False)
class ModuleEntry:
    """One call of a submodule, keyed by its ``named_modules()`` path.

    ``label`` is the path, with ``:N`` when the module was called several times.
    ``out`` has the structure the module returned (tensor, tuple, list or dict) with each
    tensor replaced by a detached copy; ``outputs`` / ``inputs`` are the flat tuples of
    saved tensors; ``output_labels`` / ``input_labels`` name the entries that produced them.
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
    _inputs: tuple[torch.Tensor, ...] | None = None
    _outputs: tuple[torch.Tensor, ...] | None = None
    _out: Any = None
    saved: bool = False
    _freed: bool = False

    @property
    def module(self) -> str:
        return self.path

    def _check(self) -> None:
        if self._freed:
            raise _freed_error()

    @property
    def out(self) -> Any:
        self._check()
        return self._out

    @property
    def outputs(self) -> tuple[torch.Tensor, ...] | None:
        self._check()
        return self._outputs

    @property
    def inputs(self) -> tuple[torch.Tensor, ...] | None:
        self._check()
        return self._inputs

    def __repr__(self) -> str:
        state = "saved" if self.saved else "not saved"
        return f"<ModuleEntry {self.label}: {self.type}, {state}>"
