"""Label: turn raw interception events into entries with TorchLens-compatible labels.

Labels are ``{func}_{n_func}_{n_layer}``: ``n_func`` counts layers of that function,
``n_layer`` layers overall, both from 1, inputs and outputs not counted. When a module is
called again (weight tying, a loop over one block), the k-th op of that call belongs to the
same layer as the k-th op of the module's first call, provided the function matches; its
label then carries the pass (``linear_1_1:2``). The module that decides is the outermost
one on the stack that is on a repeated call. Whether a layer ends with several passes is
known only at the end, so final labels are written by :meth:`Labeller.finish`.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Protocol

import torch

from .entries import ModuleEntry, OpEntry
from .intercept import SourceFinder, flatten_tensors

__all__ = ["Emitter", "Labeller"]


class Emitter(Protocol):
    """Where labelled entries go (the emit stage): memory, or a store's writer."""

    def on_entry(self, entry: OpEntry, tensor: torch.Tensor, same_as: OpEntry | None) -> None:
        """A new entry; ``same_as`` is the entry that produced this very tensor, if any."""

    def on_module_enter(
        self, entry: ModuleEntry, tensors: list[torch.Tensor], producers: list[OpEntry | None]
    ) -> None:
        """A module call began with these input tensors."""

    def on_module_exit(
        self,
        entry: ModuleEntry,
        output: Any,
        tensors: list[torch.Tensor],
        producers: list[OpEntry | None],
    ) -> None:
        """A module call returned ``output`` (its tensors flattened in ``tensors``)."""


class _Layer:
    __slots__ = ("label", "passes")

    def __init__(self, label: str):
        self.label = label
        self.passes = 0


class _Frame:
    """One module call on the stack."""

    __slots__ = ("entry", "module", "pass_num", "path", "root", "start")

    def __init__(self, module: torch.nn.Module, path: str, pass_num: int, start: int,
                 entry: ModuleEntry):
        self.module = module
        self.path = path
        self.pass_num = pass_num
        self.start = start
        self.entry = entry
        self.root: _Frame | None = None


def _is_inplace(name: str, kwargs: dict) -> bool:
    return (name.endswith("_") and not name.startswith("_")) or name == "setitem" or (
        kwargs.get("out") is not None
    )


class Labeller:
    """Receives interception events, builds entries and passes them to an emitter."""

    def __init__(self, model: torch.nn.Module, emitter: Emitter):
        self._emitter = emitter
        self.entries: list[OpEntry] = []
        self.module_entries: list[ModuleEntry] = []
        self._modules: dict[int, tuple[weakref.ref, str]] = {
            id(m): (weakref.ref(m), path) for path, m in model.named_modules() if path
        }
        self._params: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
        self._params.update({id(b): n for n, b in model.named_buffers()})
        self._producers: dict[int, tuple[weakref.ref, int]] = {}
        self._stack: list[_Frame] = []
        self._stack_key: tuple[tuple[str, int], ...] = ()
        self._calls: dict[str, int] = {}
        self._first_call: dict[str, list[int]] = {}
        self._func_counts: dict[str, int] = {}
        self._n_layers = 0
        self._n_inputs = 0
        self._n_outputs = 0
        self._source = SourceFinder()

    # -- producers -------------------------------------------------------------------

    def _producer(self, tensor: torch.Tensor) -> int:
        rec = self._producers.get(id(tensor))
        if rec is not None and rec[0]() is tensor:
            return rec[1]
        return -1

    def _scan(self, value: Any, where: str, parents: list[int], args: list[str],
              params: list[str], nested: bool = False) -> None:
        if isinstance(value, torch.Tensor):
            producer = self._producer(value)
            if producer >= 0:
                parents.append(producer)
                args.append(where)
            else:
                name = self._params.get(id(value))
                if name is not None:
                    params.append(name)
        elif not nested and isinstance(value, (list, tuple)):
            for j, item in enumerate(value):
                self._scan(item, f"{where}.{j}", parents, args, params, nested=True)

    def _append(self, entry: OpEntry, tensor: torch.Tensor, same_as: OpEntry | None) -> None:
        self.entries.append(entry)
        self._producers[id(tensor)] = (weakref.ref(tensor), entry.index)
        self._emitter.on_entry(entry, tensor, same_as)

    # -- events from the interceptor ---------------------------------------------------

    def on_call(self, func: Any, name: str, args: tuple, kwargs: dict, tensors: tuple) -> None:
        parents: list[int] = []
        parent_args: list[str] = []
        params: list[str] = []
        for pos, value in enumerate(args):
            self._scan(value, str(pos), parents, parent_args, params)
        for key, value in kwargs.items():
            self._scan(value, key, parents, parent_args, params)
        source = self._source.find(sys._getframe(1))
        if kwargs.get("inplace") is True:  # F.relu(x, inplace=True) runs relu_
            name += "_"
        inplace = _is_inplace(name, kwargs)
        frame = self._stack[-1] if self._stack else None
        parent_t, args_t, params_t = tuple(parents), tuple(parent_args), tuple(params)
        for i, tensor in enumerate(tensors):
            entry = OpEntry(len(self.entries), name, "op", tensor, self._stack_key, parent_t,
                            args_t, source, i, inplace, params_t)
            self._assign_layer(entry, frame)
            self._append(entry, tensor, None)

    def _assign_layer(self, entry: OpEntry, frame: _Frame | None) -> None:
        layer = None
        root = frame.root if frame is not None else None
        if root is not None:
            start, end = self._first_call[root.path]
            candidate = start + (entry.index - root.start)
            if candidate < end:
                other = self.entries[candidate]
                if other.func == entry.func and other.out_index == entry.out_index:
                    layer = other._layer
        if layer is None:
            # In-place variants count with their function: mul_ is labelled mul_2_7.
            base = entry.func[:-1] if entry.inplace and entry.func.endswith("_") else entry.func
            n_func = self._func_counts.get(base, 0) + 1
            self._func_counts[base] = n_func
            self._n_layers += 1
            layer = _Layer(f"{base}_{n_func}_{self._n_layers}")
        layer.passes += 1
        entry._layer = layer
        entry.layer = layer.label
        entry.pass_num = layer.passes

    def _path_of(self, module: torch.nn.Module) -> str | None:
        rec = self._modules.get(id(module))
        if rec is None or rec[0]() is not module:
            return None  # the model itself, or a module that is not part of it
        return rec[1]

    def on_module_enter(self, module: torch.nn.Module, args: tuple) -> None:
        path = self._path_of(module)
        if path is None:
            return
        calls = self._calls.get(path, 0) + 1
        self._calls[path] = calls
        start = len(self.entries)
        if calls == 1:
            self._first_call[path] = [start, -1]
        entry = ModuleEntry(path, type(module).__name__, calls, len(self.module_entries))
        tensors = flatten_tensors(args)
        producers = [self._producer(t) for t in tensors]
        entry._input_indices = tuple(producers)
        frame = _Frame(module, path, calls, start, entry)
        parent = self._stack[-1] if self._stack else None
        if parent is not None and parent.root is not None:
            frame.root = parent.root
        elif calls > 1:
            frame.root = frame
        self._stack.append(frame)
        self._stack_key = (*self._stack_key, (path, calls))
        self.module_entries.append(entry)
        self._emitter.on_module_enter(entry, tensors, self._entries_at(producers))

    def on_module_exit(self, module: torch.nn.Module, output: Any) -> None:
        if self._path_of(module) is None:
            return
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth].module is module:
                break
        else:
            return
        frame = self._stack[depth]
        del self._stack[depth:]
        self._stack_key = self._stack_key[:depth]
        end = len(self.entries)
        if frame.pass_num == 1:
            self._first_call[frame.path][1] = end
        entry = frame.entry
        entry._op_range = (frame.start, end)
        tensors = flatten_tensors(output)
        producers = [self._producer(t) for t in tensors]
        entry._output_indices = tuple(producers)
        self._emitter.on_module_exit(entry, output, tensors, self._entries_at(producers))

    def _entries_at(self, indices: list[int]) -> list[OpEntry | None]:
        return [self.entries[i] if i >= 0 else None for i in indices]

    # -- the model's inputs and outputs --------------------------------------------------

    def _boundary(self, kind: str, tensor: torch.Tensor, parent: int) -> None:
        if kind == "input":
            self._n_inputs += 1
            label = f"input_{self._n_inputs}"
        else:
            self._n_outputs += 1
            label = f"output_{self._n_outputs}"
        parents = (parent,) if parent >= 0 else ()
        entry = OpEntry(len(self.entries), kind, kind, tensor, (), parents,
                        ("0",) * len(parents), None)
        layer = _Layer(label)
        layer.passes = 1
        entry._layer = layer
        entry.layer = label
        self._append(entry, tensor, self.entries[parent] if parent >= 0 else None)

    def add_inputs(self, args: tuple, kwargs: dict) -> None:
        for tensor in flatten_tensors(list(args) + list(kwargs.values())):
            self._boundary("input", tensor, -1)

    def add_outputs(self, output: Any) -> None:
        for tensor in flatten_tensors(output):
            self._boundary("output", tensor, self._producer(tensor))

    # -- final labels --------------------------------------------------------------------

    def finish(self) -> None:
        entries = self.entries
        for entry in entries:
            layer = entry._layer
            entry.num_passes = layer.passes
            entry.label = layer.label if layer.passes == 1 else f"{layer.label}:{entry.pass_num}"
        children: list[list[str]] = [[] for _ in entries]
        for entry in entries:
            entry.parents = tuple(dict.fromkeys(entries[p].label for p in entry.parent_indices))
            for p in entry.parent_indices:
                children[p].append(entry.label)
        for entry, kids in zip(entries, children, strict=True):
            entry.children = tuple(dict.fromkeys(kids))

        def labels(indices: tuple[int, ...]) -> tuple[str, ...]:
            return tuple(entries[i].label for i in indices if i >= 0)

        for m in self.module_entries:
            m.num_passes = self._calls[m.path]
            m.label = m.path if m.num_passes == 1 else f"{m.path}:{m.pass_num}"
            m.input_labels = labels(m._input_indices)
            m.output_labels = labels(m._output_indices)
            start, end = m._op_range
            if end > start:
                m.first_op, m.last_op = entries[start].label, entries[end - 1].label
