"""Label: turn raw interception events into entries with TorchLens-compatible labels.

Labels are ``{func}_{n_func}_{n_layer}``: ``n_func`` counts layers of that function,
``n_layer`` layers overall, both from 1, inputs and outputs not counted. When a module is
called again (weight tying, a loop over one block), the k-th op of that call belongs to the
same layer as the k-th op of the module's first call, provided the function matches; its
label then carries the pass (``linear_1_1:2``). The module that decides is the outermost
one on the stack that is on a repeated call. Whether a layer ends with several passes is
known only at the end, so final labels are written by :meth:`OpTable.finish`.

``on_call`` runs once per torch call of the user's forward pass: it is written for speed
(locals, one row tuple per entry, no per-op objects beyond that tuple).
"""

from __future__ import annotations

import bisect
import sys
import weakref
from typing import Any, Protocol

import torch

from . import compiled
from .argkeys import all_tensors, capture
from .arguments import ArgsRecorder
from .eager import module_path, module_tree
from .entries import FUNC, LAYER, N_FUNC, N_LAYER, OUT_INDEX, ModuleEntry, OpTable
from .held import held_tensors
from .inputs import input_entries
from .intercept import BUFFER_WRITERS, SourceFinder, flatten_tensors
from .parents import FOREACH, zipped
from .prune import renumber
from .record import make_row

__all__ = ["Emitter", "Labeller"]

_Tensor = torch.Tensor
_getframe = sys._getframe
_ref = weakref.ref
_NO_PARAMS: tuple[str, ...] = ()
_NO_KWARGS: dict[str, Any] = {}
_SCALARS = frozenset({int, float, bool, type(None), str})
_NOT_PASSED: frozenset[int] = frozenset()
# Argument positions of a single parent, shared rather than a new tuple per op.
_N_SINGLE = 16
_SINGLE = tuple((pos,) for pos in range(_N_SINGLE))
# The labeller's changing state, in one list that the compiled path (recorder/_hot.c)
# reads and advances too: the stack top's root (a repeated module call, or None), the
# module stack's key, and the number of layers so far.
_ROOT, _STACK_KEY, _N_LAYERS = range(3)


class _Alias:
    """In ``Labeller._params``: a tensor written in place through a view of it
    (``x.unsqueeze(0).fill_(0)``): its reads are children of the write, as in TorchLens.
    Its id leaves ``_producers``, so the compiled path, finding a non-str value here,
    hands its reads to Python."""

    __slots__ = ("index", "ref")

    def __init__(self, index: int, ref: weakref.ref):
        self.index = index
        self.ref = ref


class Emitter(Protocol):
    """Where labelled entries go (the emit stage): memory, or a store's writer."""

    #: False when no op entry needs anything; on_entry is then never called.
    wants_ops: bool

    def on_entry(self, index: int, tensor: torch.Tensor, same_as: int) -> None:
        """Entry ``index`` was added; ``same_as`` is the entry that produced this very
        tensor object (model outputs), or -1."""

    def before_write(self, tensor: torch.Tensor) -> None:
        """An in-place op is about to write into ``tensor``'s storage."""

    def finish_ops(self) -> None:
        """The forward pass is over: no more entries."""

    def renumber(self, new: list[int], modules: list[ModuleEntry]) -> set[int]:
        """Orphans were pruned: entry ``i`` is now ``new[i]`` (-1: pruned). Return the
        slots of saved tensors that only pruned entries used (none of ``modules``)."""

    def on_module_enter(
        self, entry: ModuleEntry, tensors: list[torch.Tensor], producers: list[int]
    ) -> None:
        """A module call began with these input tensors (producer entries, -1 if none)."""

    def on_module_exit(
        self, entry: ModuleEntry, output: Any, tensors: list[torch.Tensor], producers: list[int]
    ) -> None:
        """A module call returned ``output`` (its tensors flattened in ``tensors``)."""


class _Frame:
    """One module call on the stack."""

    __slots__ = ("entry", "given", "module", "pass_num", "path", "root", "start")

    def __init__(
        self, module: torch.nn.Module, path: str, pass_num: int, start: int, entry: ModuleEntry
    ):
        self.module = module
        self.path = path
        self.pass_num = pass_num
        self.start = start
        self.entry = entry
        self.root: _Frame | None = None
        #: The producers of every tensor the call was given, its keyword arguments' too
        #: (what an output handed back unchanged is looked for among, as TorchLens does).
        self.given: tuple[int, ...] = entry.input_indices


def _parameters(model: torch.nn.Module, named: list[tuple[str, torch.nn.Module]]) -> dict[int, Any]:
    """id() -> name of every parameter of ``model``, and id() -> (name,) of every buffer,
    named as ``named_parameters()`` and ``named_buffers()`` name them (each tensor once,
    under its first name; no ``_orig_mod``), read from the modules of ``named``
    (``named_modules(model)``) where the model's class does not change how they are
    listed (the members of each module, in their order: what torch's methods walk)."""
    kind = type(model)
    if not (
        kind.named_parameters is _Module.named_parameters
        and kind.named_buffers is _Module.named_buffers
        and kind._named_members is _Module._named_members
    ):
        params: dict[int, Any] = {id(p): module_path(n) for n, p in model.named_parameters()}
        params.update({id(b): (module_path(n),) for n, b in model.named_buffers()})
        return params
    params, buffers = {}, {}
    for path, module in named:
        prefix = f"{path}." if path else ""
        for name, p in module._parameters.items():
            if p is not None and id(p) not in params:
                params[id(p)] = prefix + name
        if module._buffers:
            for name, b in module._buffers.items():
                if b is not None and id(b) not in buffers:
                    buffers[id(b)] = (prefix + name,)
    params.update(buffers)
    return params


_Module = torch.nn.Module


class Labeller:
    """Receives interception events, appends rows to an :class:`OpTable`, and hands each
    entry to an emitter."""

    def __init__(self, model: torch.nn.Module, emitter: Emitter, table: OpTable):
        self.table = table
        self.module_entries: list[ModuleEntry] = []
        self._emitter = emitter
        self._emit = emitter.on_entry if emitter.wants_ops else None
        self._rows = table.rows
        self._passes = table.passes
        #: ``named_modules(model)`` as the recording began (one walk of the modules for
        #: every use of them at its start), and whether one of them is compiled
        #: (``eager.is_compiled``).
        self.named, self.compiled = module_tree(model)
        self._modules: dict[int, tuple[weakref.ref, str]] = {
            id(m): (weakref.ref(m), path) for path, m in self.named if path
        }
        # Parameters by name; a buffer as a 1-tuple of its name, which the compiled path
        # hands to Python (it takes str names only): a buffer's first read makes its
        # buffer_N entry (TorchLens's), later reads are its children. (No `_orig_mod.`
        # from a compiled model's wrapper.)
        self._params: dict[int, Any] = _parameters(model, self.named)
        for name, tensor in held_tensors(model, self.named):  # (a buffer keeps its name)
            self._params.setdefault(id(tensor), (name,))
        # A tensor's producer: the row index under its id(), confirmed by the weak
        # reference to the row's tensor (one per row), so a dead tensor whose id was
        # reused is never confused with it. Plain ints as values keep the GC's tracked
        # objects at one per entry (the weak reference).
        hot = compiled.hot()
        self._producers: dict[int, int] = {} if hot is None else hot.producers_dict()
        self._refs: list[weakref.ref] = []
        #: whether a tensor was written through a view of it (see _Alias)
        self._aliases = False
        self._identities: dict[type, bool] = {}
        # Shapes, one tuple per distinct shape shared by its rows: fewer objects for the
        # GC to look at, and less memory in long recordings.
        self._shapes: dict[torch.Size, tuple[int, ...]] = {}
        self._stack: list[_Frame] = []
        self._live: list[Any] = [None, (), 0]  # _ROOT, _STACK_KEY, _N_LAYERS
        self._calls: dict[str, int] = {}
        self._first_call: dict[str, list[int]] = {}
        self._func_counts: dict[str, int] = {}
        self._numbers: dict[str, int] = {}  # inputs, outputs, buffers so far
        self._codes = SourceFinder.codes
        self._classify = SourceFinder.classify
        #: Encodes each call's arguments (CaptureOptions(record_args=True)), or None.
        self.call_args: ArgsRecorder | None = None
        #: After :meth:`finish`: the emitter's slots that only pruned entries used.
        self.pruned_slots: set[int] = set()
        events = getattr(hot, "ModuleEvents", None)
        emit_enter = getattr(emitter, "on_module_enter", None)
        emit_exit = getattr(emitter, "on_module_exit", None)
        if events is not None and emit_enter is not None and emit_exit is not None:
            # The common module call's entry compiled (recorder/_hot.c, ``ModuleEvents``):
            # what on_module_enter and on_module_exit below do for it, without their
            # frames; any other call goes to them, the reference.
            compiled_events = events(
                self,
                self.on_module_enter,
                self.on_module_exit,
                self._modules,
                self._calls,
                self._first_call,
                self._rows,
                self.module_entries,
                self._stack,
                self._live,
                self._producers,
                self._refs,
                self._params,
                self._identities,
                ModuleEntry,
                _Frame,
                emit_enter,
                emit_exit,
                _Tensor,
            )
            self.on_module_enter = compiled_events.enter  # type: ignore[method-assign]
            self.on_module_exit = compiled_events.exit  # type: ignore[method-assign]

    def record_args(self) -> None:
        """Encode every call's arguments into ``table.call_args`` (before the recording
        starts; the interception then runs in Python, see arguments.py)."""
        self.call_args = ArgsRecorder(
            self.table.call_args, self._rows, self._producer, self._params
        )

    # -- producers -------------------------------------------------------------------

    def _producer(self, tensor: torch.Tensor) -> int:
        index = self._producers.get(id(tensor))
        if index is not None and self._refs[index]() is tensor:
            return index
        known = self._params.get(id(tensor))
        if known.__class__ is _Alias:
            return self._aliased(tensor, known)
        return -1

    def _aliased(self, tensor: torch.Tensor, alias: _Alias) -> int:
        """The write through a view that last changed ``tensor`` (-1: the alias was
        another tensor's, whose id this one reuses)."""
        if alias.ref() is tensor:
            return alias.index
        del self._params[id(tensor)]
        return -1

    def _written_through_view(self, view: torch.Tensor, index: int) -> None:
        """Entry ``index`` wrote into ``view``: the tensor it views now reads as its
        child."""
        base = view._base
        if base is None:
            return
        known = self._params.get(id(base))
        if known is not None and known.__class__ is not _Alias:
            return  # a view of a parameter or buffer
        self._producers.pop(id(base), None)
        self._params[id(base)] = _Alias(index, _ref(base))
        self._aliases = True

    #: The entry that produced a tensor (-1: none); for the interceptor (one call, not two).
    producer = _producer

    def count(self) -> int:
        """How many entries there are so far."""
        return len(self._refs)

    def made_since(self, start: int, tensor: torch.Tensor) -> bool:
        """Whether an entry from number ``start`` on stands for ``tensor``."""
        refs = self._refs
        return any(refs[index]() is tensor for index in range(start, len(refs)))

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        """Entry ``index`` now stands for ``tensor`` (an intervention replaced the call's
        output with it): later calls that consume ``tensor`` find that entry as their
        producer."""
        self._producers[id(tensor)] = index
        self._refs[index] = _ref(tensor)

    def _scan_more(
        self, items: Any, parents: tuple[int, ...], where: tuple[Any, ...], params: tuple[str, ...]
    ) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[str, ...]]:
        """The uncommon arguments: keyword tensors and tensors inside lists / tuples."""
        for pos, value in items:
            if isinstance(value, _Tensor):
                candidates: Any = ((pos, value),)
            elif type(value) in (list, tuple):
                candidates = ((f"{pos}.{j}", item) for j, item in enumerate(value))
            else:
                continue
            for key, tensor in candidates:
                if not isinstance(tensor, _Tensor):
                    continue
                producer = self._producer(tensor)
                known = self._params.get(id(tensor)) if producer < 0 else None
                if known is not None and known.__class__ is tuple:
                    producer = self._boundary("buffer", tensor, -1)
                if producer >= 0:
                    parents += (producer,)
                    where += (key,)
                elif known.__class__ is str:
                    params = (*params, known)
        return parents, where, params

    # -- events from the interceptor ---------------------------------------------------

    def fused_state(self) -> tuple:
        """What the compiled hot path (recorder/_hot.c) needs to do ``on_call``'s work for
        the common call: the changing state (``_live``: it reads the root and the stack
        key and advances the layer count there, so both paths share them) and the
        containers it reads and appends to."""
        return (
            self._live,
            self._producers,
            self._refs,
            self._params,
            self._rows,
            self._shapes,
            self._func_counts,
            self._codes,
            self._classify,
            self._emit,
        )

    def before_write(self, name: str, args: tuple, kwargs: dict) -> None:
        if name in BUFFER_WRITERS:
            # batch_norm / instance_norm update the running statistics they are given
            # where training= / use_input_stats= (position 5) says so
            training = args[5] if len(args) > 5 else kwargs.get("training")
            if not (training or kwargs.get("use_input_stats")):
                return
            # (only buffers: TorchLens saves other tensors it updates as they end up)
            params = self._params
            values = (*args, *kwargs.values())
            tensors = [t for t in values if params.get(id(t)).__class__ is tuple]
        else:
            written = kwargs.get("out") if kwargs else None
            tensors = flatten_tensors(args[0] if written is None and args else written)
        producers, params = self._producers, self._params
        for tensor in tensors:
            if id(tensor) not in producers and params.get(id(tensor)).__class__ is tuple:
                # a buffer read first by the call that writes it: its entry, and the
                # value it saves, are what it held before the call
                self._boundary("buffer", tensor, -1)
            self._emitter.before_write(tensor)

    def on_call(
        self,
        name: str,
        args: tuple,
        kwargs: dict,
        tensors: tuple,
        inplace: bool,
        passed: frozenset[int] = _NOT_PASSED,
    ) -> None:
        # Hot path, once per torch call: everything inline, locals only, and no per-op
        # objects beyond the row and the tensor's weak reference.
        producers = self._producers
        refs = self._refs
        parents: tuple[int, ...] = ()
        where: tuple[Any, ...] = ()
        params = _NO_PARAMS
        values: tuple[Any, ...] = ()  # the non-tensor arguments (argkeys.py)
        pos = -1
        for value in args:
            pos += 1
            index = producers.get(id(value))
            if index is not None and refs[index]() is value:
                parents += (index,)
                where = (*where, pos) if where or pos >= _N_SINGLE else _SINGLE[pos]
            elif value.__class__ in _SCALARS:
                values += (pos, value)
            elif isinstance(value, _Tensor):
                known = self._params.get(id(value))
                if known is None:
                    continue
                if known.__class__ is str:
                    params = (*params, known)
                elif known.__class__ is _Alias:
                    index = self._aliased(value, known)
                    if index >= 0:
                        parents += (index,)
                        where = (*where, pos)
                else:  # a buffer's first read
                    parents += (self._boundary("buffer", value, -1),)
                    where = (*where, pos)
            elif (value.__class__ is list or value.__class__ is tuple) and value:
                parents, where, params = self._scan_more(((pos, value),), parents, where, params)
                if not all_tensors(value):
                    values += (pos, capture(value))
            else:
                values += (pos, capture(value))
        if kwargs:
            parents, where, params = self._scan_more(kwargs.items(), parents, where, params)
            for key, value in kwargs.items():
                if not isinstance(value, _Tensor) and not (
                    (value.__class__ is list or value.__class__ is tuple) and all_tensors(value)
                ):
                    values += (key, capture(value))
            if kwargs.get("inplace") is True:  # F.relu(x, inplace=True) runs relu_
                name += "_"

        # The first frame outside torch and tracelake (0: here, 1: the mode).
        frame: Any = _getframe(2)
        codes = self._codes
        site = None
        while frame is not None:
            code = frame.f_code
            sites = codes.get(id(code))
            if sites is None:
                sites = self._classify(code)
            if sites is not False:
                # (code, offset): the line is looked up when asked for.
                offset = frame.f_lasti
                site = sites.get(offset)
                if site is None:
                    site = sites[offset] = (code, offset)
                break
            frame = frame.f_back

        # Rows keep tuples of plain values only: Python's GC then stops tracking them, so a
        # long recording does not make every full collection of a large heap slower.
        rows = self._rows
        live = self._live
        root = live[_ROOT]
        shapes = self._shapes
        # a torch._foreach_* call's outputs: each with its own members' parents
        members = zipped(name, parents, where, len(tensors)) if name.startswith(FOREACH) else None
        i = 0
        for tensor in tensors:
            if members is not None:
                parents, where = members[i]
            index = len(rows)
            size = tensor.shape
            try:
                shape = shapes.get(size)
                if shape is None:
                    shape = shapes[size] = tuple(size)
            except TypeError:  # symbolic sizes are not hashable
                shape = tuple(size)
            if root is None or (layer := self._repeat_of(root, index, name, i)) < 0:
                # A new layer, identified by this row; in-place variants count with
                # their function (mul_ is labelled mul_2_7).
                base = name[:-1] if inplace and name[-1] == "_" else name
                counts = self._func_counts
                layer, pass_num = index, 1
                n_func = counts[base] = counts.get(base, 0) + 1
                n_layer = live[_N_LAYERS] = live[_N_LAYERS] + 1
            else:
                first = rows[layer]
                pass_num = self._passes[layer] = self._passes.get(layer, 1) + 1
                n_func, n_layer = first[N_FUNC], first[N_LAYER]
            rows.append(
                make_row(
                    func=name,
                    kind="op",
                    modules=live[_STACK_KEY],
                    parents=parents,
                    parent_args=where,
                    site=site,
                    arg_values=values or None,
                    shape=shape,
                    dtype=tensor.dtype,
                    device=tensor.device,
                    out_index=i,
                    inplace=inplace,
                    params=params,
                    layer_idx=layer,
                    pass_=pass_num,
                    n_func=n_func,
                    n_layer=n_layer,
                )
            )
            if not passed or i not in passed:  # (an argument handed back keeps its producer)
                producers[id(tensor)] = index
            refs.append(_ref(tensor))
            if self._emit is not None:
                self._emit(index, tensor, -1)
            i += 1  # a counter costs a third of enumerate here, per op
        if inplace and i:
            self._written_through_view(tensors[0], len(rows) - i)
            if self._params.get(id(tensors[0])).__class__ is tuple and name not in BUFFER_WRITERS:
                # a buffer written in place (self.ema.mul_(0.9), BatchNorm's
                # num_batches_tracked.add_(1)): a new entry, as TorchLens gives it
                self._boundary("buffer", tensors[0], len(rows) - i)
        if name in BUFFER_WRITERS:
            # batch_norm may update the running statistics it reads: as TorchLens does,
            # each buffer it takes gets a new entry, a child of the call, which later
            # reads see.
            written = len(rows) - i
            for value in (*args, *kwargs.values()) if kwargs else args:
                known = self._params.get(id(value)) if isinstance(value, _Tensor) else None
                if known.__class__ is tuple:
                    self._boundary("buffer", value, written)

    def _repeat_of(self, root: _Frame, index: int, name: str, out_index: int) -> int:
        """The layer this op repeats: the op at the same position of the first call of
        ``root`` (the outermost module on a repeated call), if it ran the same function."""
        start, end = self._first_call[root.path]
        candidate = start + index - root.start
        if candidate < end:
            other = self._rows[candidate]
            if other[FUNC] == name and other[OUT_INDEX] == out_index:
                return int(other[LAYER])
        return -1

    def _path_of(self, module: torch.nn.Module) -> str | None:
        rec = self._modules.get(id(module))
        if rec is None or rec[0]() is not module:
            return None  # the model itself, or a module that is not part of it
        return rec[1]

    def on_module_enter(
        self, module: torch.nn.Module, args: tuple, kwargs: dict | None = None
    ) -> None:
        path = self._path_of(module)
        if path is None:
            return
        calls = self._calls.get(path, 0) + 1
        self._calls[path] = calls
        start = len(self._rows)
        if calls == 1:
            self._first_call[path] = [start, -1]
        entry = ModuleEntry(path, type(module).__name__, calls, len(self.module_entries))
        tensors = flatten_tensors(args)
        producers = [self._producer(t) for t in tensors]
        entry.input_indices = tuple(producers)
        frame = _Frame(module, path, calls, start, entry)
        if kwargs:
            frame.given += tuple(map(self._producer, flatten_tensors(kwargs)))
        parent = self._stack[-1] if self._stack else None
        if parent is not None and parent.root is not None:
            frame.root = parent.root
        elif calls > 1:
            frame.root = frame
        self._stack.append(frame)
        live = self._live
        live[_STACK_KEY] = (*live[_STACK_KEY], (path, calls))
        live[_ROOT] = frame.root
        self.module_entries.append(entry)
        self._emitter.on_module_enter(entry, tensors, producers)

    def on_module_exit(self, module: torch.nn.Module, output: Any) -> None:
        if self._path_of(module) is None:
            return
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth].module is module:
                break
        else:
            return
        frame = self._stack[depth]
        tensors = flatten_tensors(output)
        producer = self._producer
        producers = [producer(t) for t in tensors]
        if producers and depth == len(self._stack) - 1:
            given = frame.given
            if self._is_identity(module) or any(p >= 0 and p in given for p in producers):
                self._pass_through(module, frame, tensors)
                producers = [producer(t) for t in tensors]
        del self._stack[depth:]
        live = self._live
        live[_STACK_KEY] = live[_STACK_KEY][:depth]
        live[_ROOT] = self._stack[-1].root if self._stack else None
        end = len(self._rows)
        if frame.pass_num == 1:
            self._first_call[frame.path][1] = end
        entry = frame.entry
        entry.op_range = (frame.start, end)
        entry.output_indices = tuple(producers)
        # the emitter shares a producer's saved slot: only for that very tensor (a
        # producer found through an alias wrote into a view of it)
        same = producers
        if self._aliases:
            same = [
                p if p >= 0 and self._refs[p]() is t else -1
                for p, t in zip(producers, tensors, strict=True)
            ]
        self._emitter.on_module_exit(entry, output, tensors, same)

    def _is_identity(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is an ``Identity`` (by its class name, as TorchLens tells)."""
        cls = type(module)
        known = self._identities.get(cls)
        if known is None:
            known = self._identities[cls] = cls.__name__.lower() == "identity"
        return known

    def _pass_through(self, module: torch.nn.Module, frame: _Frame, tensors: list) -> None:
        """A module that returns an input tensor unchanged (``nn.Identity``, a skipped
        block) gets an ``identity`` op inside it, the output's producer, as TorchLens
        makes one; so does every output of an ``Identity`` module."""
        given = frame.given
        identity = self._is_identity(module)
        for tensor in tensors:
            producer = self._producer(tensor)
            if identity or (producer >= 0 and producer in given):
                self.on_call("identity", (tensor,), _NO_KWARGS, (tensor,), False)

    # -- the model's inputs and outputs --------------------------------------------------

    def _boundary(
        self, kind: str, tensor: torch.Tensor, parent: int, name: str | None = None
    ) -> int:
        """Add an entry that is not an op: a model input (``name``: its keyword's) or
        output, or a buffer (read first, or written by ``parent``); return its index."""
        number = self._numbers[kind] = self._numbers.get(kind, 0) + 1
        rows = self._rows
        index = len(rows)
        parents = (parent,) if parent >= 0 else ()
        rows.append(
            make_row(
                func=kind,
                kind=kind,
                modules=self._live[_STACK_KEY] if kind == "buffer" else (),
                parents=parents,
                parent_args=(0,) * len(parents),
                site=None,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                device=tensor.device,
                out_index=0,
                inplace=False,
                params=_NO_PARAMS,
                layer_idx=index,
                pass_=1,
                n_func=number,
                n_layer=0,
            )
        )
        if name is not None:
            self.table.names[index] = name
        self._producers[id(tensor)] = index
        self._refs.append(_ref(tensor))
        if self._emit is not None:
            # the same tensor as the parent's (not a tensor it wrote through a view)
            same = kind == "output" and parent >= 0 and self._refs[parent]() is tensor
            self._emit(index, tensor, parent if same else -1)
        return index

    def add_inputs(self, args: tuple, kwargs: dict) -> None:
        """Input entries: ``input_N`` positionally, keyword inputs by name (recorder/inputs.py)."""
        taken = [path for _, path in self._modules.values()]
        for tensor, name in input_entries(args, kwargs, taken):
            self._boundary("input", tensor, -1, name)

    def add_outputs(self, output: Any) -> None:
        tensors = flatten_tensors(output)
        # Producers first: a tensor returned twice (return y, y) is two outputs of y's op.
        producers = [self._producer(tensor) for tensor in tensors]
        for tensor, producer in zip(tensors, producers, strict=True):
            self._boundary("output", tensor, producer)

    # -- final labels --------------------------------------------------------------------

    def finish(self) -> None:
        """The forward is over: prune orphans (unless ``table.keep_orphans``), label,
        and renumber the module entries and the emitter's tables to the entries kept."""
        # no more module calls: drop the compiled events, and with them the cycle through
        # their Python fallbacks (this labeller's methods)
        self.__dict__.pop("on_module_enter", None)
        self.__dict__.pop("on_module_exit", None)
        self._emitter.finish_ops()
        table = self.table
        size = len(table.rows)
        kept = table.finish()
        if kept is not None:
            new = renumber(kept, size)
            for m in self.module_entries:
                m.input_indices = tuple(new[i] if i >= 0 else -1 for i in m.input_indices)
                m.output_indices = tuple(new[i] if i >= 0 else -1 for i in m.output_indices)
                start, end = m.op_range  # the kept entries of [start, end)
                m.op_range = (bisect.bisect_left(kept, start), bisect.bisect_left(kept, end))
            self.pruned_slots = self._emitter.renumber(new, self.module_entries)
        labels = table.labels

        def named(indices: tuple[int, ...]) -> tuple[str, ...]:
            return tuple(labels[i] for i in indices if i >= 0)

        for m in self.module_entries:
            m.num_passes = self._calls[m.path]
            m.label = m.path if m.num_passes == 1 else f"{m.path}:{m.pass_num}"
            m.input_labels = named(m.input_indices)
            m.output_labels = named(m.output_indices)
            start, end = m.op_range
            if end > start:
                m.first_op, m.last_op = labels[start], labels[end - 1]
