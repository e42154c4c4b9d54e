"""Intercept: turn a forward pass into a stream of raw events.

A private ``TorchFunctionMode`` sees every torch call (functional calls, Tensor methods,
operators, in-place ops) and torch's global module hooks see every module call. Both hand
raw events to an :class:`Events` receiver; nothing here knows about labels or saving.
Nothing in torch is patched: the mode is pushed and the hooks registered on entry, and
both are removed in ``finally`` even when the forward pass raises.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_map_only

from tracelake.errors import NestedTraceError

from . import compiled, fastpath, sources
from .argkeys import KEPT
from .compiled import _hot
from .forks import fork_safe_lock
from .names import (
    INPLACE_DUNDERS,
    OPERATOR_FUNCS,
    func_name,
    has_operator_calls,
    operator_name,
)
from .record import ROW_DEFAULTS
from .trees import leaves_of

__all__ = [
    "BUFFER_WRITERS",
    "Events",
    "Interceptor",
    "SourceFinder",
    "Swaps",
    "body_of",
    "flatten_tensors",
]

_Tensor = torch.Tensor
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_NO_KWARGS: dict[str, Any] = {}
#: SourceFinder's cache: the size at which the first sweep runs, and a hard bound.
_SWEEP_MIN = 1024
_CODES_MAX = 65536


class Events(Protocol):
    """What the interceptor reports. Implementations must not raise into the forward."""

    def before_write(self, name: str, args: tuple, kwargs: dict) -> None:
        """An in-place call is about to run: it writes into ``args[0]`` or ``out=``."""

    def on_call(
        self,
        name: str,
        args: tuple,
        kwargs: dict,
        tensors: tuple,
        inplace: bool,
        passed: frozenset[int] = frozenset(),
    ) -> None:
        """A torch call returned ``tensors`` (its tensor outputs, flattened); ``inplace``
        says whether it wrote into an argument; ``passed``: the positions in ``tensors``
        of arguments the call handed back unchanged inside its result (``passed_through``)."""

    def on_module_enter(
        self, module: torch.nn.Module, args: tuple, kwargs: dict | None = None
    ) -> None:
        """A module's forward is about to run, given ``args`` (and ``kwargs``, where
        known)."""

    def on_module_exit(self, module: torch.nn.Module, output: Any) -> None:
        """A module's forward returned (or raised: then ``output`` is ``None``)."""

    # Optional: ``fused_state()`` returns what the compiled hot path needs to do
    # ``on_call``'s work itself (see labels.Labeller.fused_state); without it, every
    # call goes through ``on_call``.


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside ``obj``, in pytree order, at any depth: every pytree node (tuples,
    lists, dicts, namedtuples, ``ModelOutput``...) and opened objects (transformers
    caches) are looked into (see :mod:`.trees`)."""
    if isinstance(obj, _Tensor):
        return [obj]
    # The common cases: a flat tuple or list (module arguments, torch.Size, several
    # outputs) of tensors and plain values, which are leaves whatever the container.
    if isinstance(obj, (tuple, list)):
        found = []
        for item in obj:
            if isinstance(item, _Tensor):
                found.append(item)
            elif not isinstance(item, _PLAIN):
                break
        else:
            return found
    return [leaf for leaf in leaves_of(obj) if isinstance(leaf, _Tensor)]


_PLAIN = (type(None), bool, int, float, str)
_Parameter = torch.nn.Parameter


def _call_kwargs(frame: Any) -> dict | None:
    """A module call's keyword arguments, from ``frame``, the caller of a global forward
    pre-hook: the hooks are not given them, but the frame of torch's
    ``Module._call_impl`` that calls them holds them (None where it is not that)."""
    kwargs = frame.f_locals.get("kwargs") if frame.f_code.co_name == "inner" else None
    return kwargs if isinstance(kwargs, dict) else None


def passed_through(name: str, args: tuple, kwargs: dict, tensors: tuple) -> frozenset[int]:
    """The positions in ``tensors`` (the tensors of a call's tuple or list result) of
    argument tensors handed back unchanged: ``torch.broadcast_tensors(x, y)`` returns
    ``x`` itself where its shape is already the common one, ``torch.atleast_2d(x, y)``
    likewise. As TorchLens 2.36.1 does (``_ops_exhaustive``: such a member is logged
    against a copy), each is an entry of the call, but later reads of the tensor still
    read what it was before: the call did not make it. Not so for a tensor the call
    wrote: an ``out=`` destination, or a member of the list an in-place call
    (``torch._foreach_add_``) takes first and returns."""
    given = {id(t) for t in _argument_tensors(args)}
    given.update(id(t) for t in _argument_tensors(kwargs.values()))
    if not given:
        return frozenset()
    written = _argument_tensors((kwargs.get("out"),))
    if name[-1] == "_" and name[:2] != "__" and args and isinstance(args[0], (list, tuple)):
        written += _argument_tensors((args[0],))
    given.difference_update(id(t) for t in written)
    return frozenset(at for at, tensor in enumerate(tensors) if id(tensor) in given)


def _argument_tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values`` and in the lists and tuples among them (not
    parameters): the arguments TorchLens takes a call's tensors from."""
    found = []
    for value in values:
        items = value if isinstance(value, (list, tuple)) else (value,)
        found += [t for t in items if isinstance(t, _Tensor) and not isinstance(t, _Parameter)]
    return found


def _internal_roots() -> tuple[tuple[str, ...], frozenset[str]]:
    """Folders whose frames are never "user code" (torch, the recorder, store and query),
    and the facade's own files (its demo model is user code, so it stays out).

    The facade's folder comes from its import spec, not from importing it: the recorder
    does not depend on the facade."""
    here = os.path.dirname(os.path.abspath(__file__))
    top = os.path.dirname(here)
    roots = [os.path.dirname(torch.__file__)] + [
        os.path.join(top, sub) for sub in ("recorder", "store", "query")
    ]
    files: frozenset[str] = frozenset()
    spec = importlib.util.find_spec(__name__.split(".", 1)[0])
    locations = spec.submodule_search_locations if spec is not None else None
    if locations:
        facade = os.path.abspath(next(iter(locations)))
        files = frozenset(
            os.path.join(facade, name)
            for name in os.listdir(facade)
            if name.endswith(".py") and name != "demo.py"
        )
    return tuple(r.rstrip(os.sep) + os.sep for r in roots), files


class SourceFinder:
    """Finds the first frame outside torch and tracelake; classifies each code object once
    (the folders never change, and the classification of a code object cannot either),
    so a new recording starts warm.

    The cache is shared by recordings and kept across them; :meth:`trim`, run before each
    recording, forgets the code objects nothing else holds any more (the functions of a
    notebook cell that was re-run), so it follows the code that is alive instead of
    growing with every definition a session ever made."""

    _roots: ClassVar[tuple[str, ...] | None] = None
    _files: ClassVar[frozenset[str]] = frozenset()
    #: id(code) -> False for internal code, else the call sites seen in that code by
    #: bytecode offset: one ``(code, offset)`` tuple per site, shared by every call it
    #: issues (a loop over layers issues the same sites again and again). The compiled
    #: hot path reads this dict and calls :meth:`classify` on a miss.
    codes: ClassVar[dict[int, Any]] = {}
    #: id(code) -> code, for every key of ``codes``: an entry keeps its code alive, so
    #: the id is never reused by another code while the entry exists.
    _seen: ClassVar[dict[int, Any]] = {}
    #: ``codes`` and ``_seen`` change together under this lock (recordings in other
    #: threads may classify while one trims).
    _lock: ClassVar[threading.Lock] = fork_safe_lock()
    #: trim() sweeps once ``codes`` reaches this size, then sets it to twice what is left:
    #: the sweeps' cost stays proportional to the entries added.
    _sweep_at: ClassVar[int] = _SWEEP_MIN

    @classmethod
    def classify(cls, code: Any) -> Any:
        if cls._roots is None:
            cls._roots, cls._files = _internal_roots()
        filename = code.co_filename
        internal = (
            filename.startswith(cls._roots)
            or filename in cls._files
            or filename.startswith("<frozen")
        )
        sites: Any = False if internal else {}
        with cls._lock:
            cls.codes[id(code)] = sites
            cls._seen[id(code)] = code
        return sites

    @classmethod
    def trim(cls) -> None:
        """Forget the code objects that only this cache still holds, and past
        ``_CODES_MAX`` entries the oldest ones. Forgetting is always safe: an entry is
        made again when its code is met again."""
        if len(cls.codes) < cls._sweep_at:
            return
        before = len(cls.codes)
        cls._sweep()
        if 2 * len(cls.codes) > before:
            # Most entries still alive: dead code often waits in reference cycles (a
            # notebook cell's class and its globals) for the cycle collector, and the next
            # sweep would wait twice as long. Collect once, outside the lock (finalizers
            # run here), and sweep again. Sweeps are rare: the collection is amortised.
            gc.collect()
            cls._sweep()
        cls._sweep_at = max(_SWEEP_MIN, 2 * len(cls.codes))

    @classmethod
    def _sweep(cls) -> None:
        with cls._lock:
            codes, seen = cls.codes, cls._seen
            for key in list(seen):
                code = seen[key]
                sites = codes[key]
                # References this cache holds: _seen's and one per site tuple; two more
                # are getrefcount's argument and the variable ``code``.
                if sys.getrefcount(code) <= 3 + (len(sites) if sites else 0):
                    del codes[key], seen[key]
                del code, sites
            if len(seen) > _CODES_MAX:  # still too many: forget the oldest half
                for key in list(seen)[: len(seen) - _CODES_MAX // 2]:
                    del codes[key], seen[key]


#: Functions that may update the buffers they read (batch norm's running statistics):
#: each buffer they take gets a new entry after the call (labels.Labeller.on_call). They
#: always take the Python path (their cache entry says ``None`` for "writes").
BUFFER_WRITERS = frozenset({"batch_norm", "instance_norm"})


#: Markers in ``_FUNCS`` (in place of "writes") for calls the compiled path hands to
#: Python. ``_OPEN``: a torch function written in Python that calls other torch
#: functions (``F.normalize``, ``Tensor.norm``, ``F.multi_head_attention_forward``).
#: TorchLens records the calls inside it, and the call itself only where none of them
#: made its output, so the mode runs its body with itself active (``_Mode._open``).
#: ``_HIDDEN``: a ``torch._C._nn`` function that TorchLens does not wrap
#: (``F.mse_loss`` calls ``torch._C._nn.mse_loss``): inside an opened body it is not
#: recorded, and the opened function is recorded in its place.
_OPEN = "open"
_HIDDEN = "hidden"
#: The one function torch's Python code calls (``torch.unique(x, dim=0)``) that
#: TorchLens does not wrap besides ``torch._C._nn``'s: it has no name in ``torch``.
_UNIQUE_DIM = torch._C._VariableFunctions.unique_dim
#: The dispatch checks at the head of torch's Python functions, answered "no" in an
#: opened body's globals (the calls inside it still dispatch to the mode).
_DISPATCH_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _no_torch_function(*args: Any, **kwargs: Any) -> bool:
    return False


class _BodyGlobals(dict):
    """An opened function's globals: its module's, but for the dispatch checks."""

    __slots__ = ("real",)
    real: dict[str, Any]

    def __missing__(self, key: str) -> Any:
        return self.real[key]


#: func -> (its body: a copy of the function whose dispatch checks say "no", whether
#: the body applies an operator torch reports under another name), or None where the
#: function cannot be opened (it dispatched again from its body).
_BODIES: dict[Any, tuple[Any, bool] | None] = {}
#: The code of torch's ``boolean_dispatch`` functions, and their branches' names.
_BOOLEAN_DISPATCH = "boolean_dispatch.<locals>.fn"
_BRANCHES = ("if_true", "if_false")


def _opened(func: Any) -> tuple[Any, bool] | None:
    if func in _BODIES:
        return _BODIES[func]
    scope = _BodyGlobals({name: _no_torch_function for name in _DISPATCH_CHECKS})
    scope.real = func.__globals__
    scope["__builtins__"] = func.__globals__.get("__builtins__", __builtins__)
    code, closure = func.__code__, func.__closure__
    operators = has_operator_calls(code)
    if code.co_qualname == _BOOLEAN_DISPATCH:
        # A boolean_dispatch function has no dispatch check: it calls the branch its
        # flag picks, which dispatches under the function's name (so the mode sees it
        # again). Its body calls the branches opened instead (``torch.unique`` ->
        # ``_return_output`` -> ``torch._unique2``; ``F.adaptive_max_pool2d`` ->
        # ``adaptive_max_pool2d_with_indices``), as TorchLens sees them.
        cells = []
        for free, cell in zip(code.co_freevars, closure or (), strict=True):
            value = cell.cell_contents
            branch = _opened(value) if free in _BRANCHES else None
            if branch is not None:
                value, more = branch
                operators = operators or more
            cells.append(types.CellType(value))
        closure = tuple(cells)
    else:
        operators = operators or any(
            has_operator_calls(cell.cell_contents.__code__)
            for cell in closure or ()
            if isinstance(cell.cell_contents, types.FunctionType)
        )
    body = types.FunctionType(code, scope, func.__name__, func.__defaults__, closure)
    body.__kwdefaults__ = func.__kwdefaults__
    known = _BODIES[func] = (body, operators)
    return known


def body_of(func: Any) -> Any:
    """The function ``func`` (a torch function written in Python) with its own torch
    function dispatch skipped: the calls in its body still dispatch. None where it
    cannot be opened."""
    known = _opened(func)
    return None if known is None else known[0]


def _calls_kind(func: Any, name: str) -> Any:
    """What ``_FUNCS`` keeps beside a function's name: whether it writes in place, or a
    marker (``None``: see BUFFER_WRITERS; ``_OPEN``, ``_HIDDEN``)."""
    if name in BUFFER_WRITERS:
        return None
    if isinstance(func, types.FunctionType) and (func.__module__ or "").startswith("torch"):
        return _OPEN if _BODIES.get(func, True) is not None else _writes(name)
    if getattr(func, "__self__", None) is torch._C._nn and func not in _nn_functional():
        return _HIDDEN
    if func is _UNIQUE_DIM:
        return _HIDDEN
    return _writes(name)


@functools.cache
def _dispatched() -> dict[Any, tuple[Any, str]]:
    """torch's functions that a ``boolean_dispatch`` function calls by one of its flags
    (``F.max_pool2d(x, 2, return_indices=True)`` calls ``F.max_pool2d_with_indices``):
    each with the dispatching function's code and name."""
    found: dict[Any, tuple[Any, str]] = {}
    for module in (torch.nn.functional, torch.functional):
        for value in vars(module).values():
            code = getattr(value, "__code__", None)
            if code is None or code.co_qualname != _BOOLEAN_DISPATCH:
                continue
            cells = dict(zip(code.co_freevars, value.__closure__ or (), strict=True))
            for branch in _BRANCHES:
                if branch in cells:
                    found[cells[branch].cell_contents] = (code, value.__name__)
    return found


def _dispatched_name(func: Any, name: str) -> str:
    """The name of a call of ``func`` (see :func:`_dispatched`): the dispatching
    function's where that called it (TorchLens sees the outer call: ``max_pool2d``),
    else its own (a direct ``F.max_pool2d_with_indices`` call)."""
    code, outer = _dispatched()[func]
    frame: Any = sys._getframe(2)
    for _ in range(8):  # (up through torch.overrides to the call of func itself)
        if frame is None or frame.f_code is func.__code__:
            break
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    return outer if caller is not None and caller.f_code is code else name


@functools.cache
def _nn_functional() -> frozenset[Any]:
    """``torch.nn.functional``'s builtins (``F.linear`` is ``torch._C._nn.linear``)."""
    return frozenset(
        value
        for value in vars(torch.nn.functional).values()
        if isinstance(value, types.BuiltinFunctionType)
    )


def _stack_depth() -> int:
    """How many torch function modes this thread's stack holds."""
    return int(torch._C._len_torch_function_stack())


def _pop_to(depth: int) -> None:
    """Pop this thread's torch function modes down to ``depth`` of them."""
    while _stack_depth() > depth:
        torch._C._pop_torch_function_stack()


def _writes(name: str) -> bool:
    """Whether a function of this name writes into an argument, whatever its arguments:
    a trailing underscore (add_), an augmented assignment (iadd) and x[i] = v. ``out=`` and
    ``inplace=True`` are decided per call."""
    return name[-1] == "_" or name == "setitem" or name in INPLACE_DUNDERS


#: func -> (name, writes), decided once per function object and process: torch's
#: functions live as long as torch, so the next recording starts warm. A user function
#: that dispatches through ``handle_torch_function`` lands here too; _trim_funcs forgets
#: the functions only this dict still holds (a notebook cell's old definitions).
_FUNCS: dict[Any, tuple[str, bool]] = {}
_FUNCS_MAX = 10_000


def _cacheable(func: Any) -> bool:
    """Whether ``func`` goes into ``_FUNCS``: not a user's Python function, whose
    ``__globals__`` and closure could hold a whole notebook namespace (models included)
    and which would be held alive in a reference cycle the sweep cannot see."""
    return not isinstance(func, types.FunctionType) or (func.__module__ or "").startswith("torch.")


def _trim_funcs(sweep_at: int) -> int:
    """Between recordings: forget the functions nothing but ``_FUNCS`` holds once it has
    ``sweep_at`` entries, then everything past ``_FUNCS_MAX``; return the next size at
    which to sweep (twice what is left: the sweeps' cost stays proportional to the
    entries added)."""
    if len(_FUNCS) < sweep_at:
        return sweep_at
    for func in list(_FUNCS):
        # References: _FUNCS's key, the list's, the loop variable and getrefcount's argument.
        if sys.getrefcount(func) <= 4:
            _FUNCS.pop(func, None)
    if len(_FUNCS) > _FUNCS_MAX:
        _FUNCS.clear()
    return max(_SWEEP_MIN, 2 * len(_FUNCS))


class _Mode(TorchFunctionMode):
    """The private interception mode. torch disables it while its handler runs, so the
    recorder's own torch calls (copies, statistics) are never recorded."""

    _sweep_funcs_at: ClassVar[int] = _SWEEP_MIN

    def __init__(self, events: Events, on_error: Callable[[str, BaseException], None]):
        super().__init__()
        self._events = events
        self._on_call = events.on_call
        self._on_error = on_error
        #: CaptureOptions(record_args=True): encodes each call (see arguments.py)
        self._call_args = getattr(events, "call_args", None)
        _Mode._sweep_funcs_at = _trim_funcs(_Mode._sweep_funcs_at)
        self._funcs = _FUNCS
        #: the opened functions running, innermost last (see _open)
        self._opened: list[Any] = []
        #: the producer of a tensor (-1: none), where the receiver tells
        self._producer: Callable[[torch.Tensor], int] | None = getattr(events, "producer", None)
        # (with producer: entries so far, and whether one from a number on is a tensor's)
        self._count: Callable[[], int] = getattr(events, "count", int)
        self._made_since: Callable[[int, torch.Tensor], bool] | None = getattr(
            events, "made_since", None
        )
        #: the compiled path's state list, while bound: one more item sends every call
        #: to Python (its length is checked first)
        self._live: list[Any] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Runs once per torch call of the user's forward pass: kept lean.
        known = self._funcs.get(func)
        if known is None:
            name = func_name(func)
            known = (name, _calls_kind(func, name))
            if _cacheable(func):
                self._funcs[func] = known
        name, writes = known
        if writes.__class__ is not bool:
            if writes is None:  # see BUFFER_WRITERS
                writes = False
                self._before_write(name, args, kwargs or _NO_KWARGS)
            elif writes is _OPEN:
                return self._open(func, name, args, kwargs or _NO_KWARGS)
            else:  # _HIDDEN
                if self._opened:
                    return func(*args, **(kwargs or _NO_KWARGS))
                writes = _writes(name)
        if self._opened and name in OPERATOR_FUNCS:
            name = self._operator(name)
        if kwargs:
            # One rule says what writes in place: the name (above), out=, and
            # inplace=True (F.relu(x, inplace=True)).
            if not writes and (kwargs.get("out") is not None or kwargs.get("inplace") is True):
                writes = True
            if writes:
                self._before_write(name, args, kwargs)
            out = func(*args, **kwargs)
        else:
            kwargs = _NO_KWARGS
            if writes:
                self._before_write(name, args, kwargs)
            out = func(*args)
        return self._record(name, func, args, kwargs, out, writes)

    def _record(
        self, name: str, func: Any, args: tuple, kwargs: dict, out: Any, writes: bool
    ) -> Any:
        if out.__class__ is _Tensor or isinstance(out, _Tensor):
            if out.__class__ is not _Tensor and isinstance(out, _Parameter):
                return out  # a parameter handed back (w.float()): a source, as in TorchLens
            try:
                if self._call_args is not None:
                    self._with_args(func, name, args, kwargs, (out,), writes)
                else:
                    self._on_call(name, args, kwargs, (out,), writes)
            except Exception as exc:  # never break the user's forward pass
                self._on_error(name, exc)
            return out
        return self._record_outputs(name, func, args, kwargs, out, writes)

    def _open(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        """Run torch's Python function ``func`` with the mode active inside it, so that
        the torch calls in its body are recorded (TorchLens's granularity); the call
        itself is recorded only where none of them made its output."""
        if func in _dispatched():
            name = _dispatched_name(func, name)
        opened = self._opened
        if opened and opened[-1] is func:
            # the body dispatched again (a check the copy could not answer): run it
            # plainly, as one op, from now on
            _BODIES[func] = None
            self._funcs.pop(func, None)
            out = func(*args, **kwargs)
            return self._record(name, func, args, kwargs, out, _writes(name))
        writes = _writes(name) or kwargs.get("inplace") is True
        if writes:
            self._before_write(name, args, kwargs)
        known = _opened(func)
        if known is None:  # cannot be opened (found so in another recording)
            out = func(*args, **kwargs)
            return self._record(name, func, args, kwargs, out, writes)
        body, operators = known
        # TorchLens takes the call's parents as they were when it began (a body may
        # hand an argument back as a new op's output: broadcast_tensors)
        producer = self._producer
        before = [(t, producer(t)) for t in args if isinstance(t, _Tensor)] if producer else []
        start = self._count()
        # an operator in the body is named from its instruction (_operator), which only
        # Python reads: the compiled path then hands every call to Python
        live = self._live if operators else None
        # What the finally undoes is measured here, not assumed: a Ctrl-C can land
        # before the push, just after it (signals are checked when a call returns) or in
        # the body (whose own modes then lose their exit); putting back the sizes found
        # here is right whichever happened.
        depth, running, size = _stack_depth(), len(opened), len(live or ())
        try:
            opened.append(func)
            if live is not None:
                live.append(None)
            torch._C._push_on_torch_function_stack(self)
            out = body(*args, **kwargs)
        finally:
            _pop_to(depth)
            del opened[running:]
            if live is not None:
                del live[size:]
        tensors = (out,) if isinstance(out, _Tensor) else flatten_tensors(out)
        if producer is None or all(self._made_inside(t, before, start) for t in tensors):
            return out
        if self._opened and name in OPERATOR_FUNCS:
            name = self._operator(name)
        moved = [(t, was, producer(t)) for t, was in before if was >= 0 and producer(t) != was]
        for t, was, _ in moved:
            self._events.rebind(was, t)  # type: ignore[attr-defined]
        try:
            return self._record(name, func, args, kwargs, out, writes)
        finally:
            for t, was, now in moved:
                if producer(t) == was:  # not the call's own output
                    self._events.rebind(now, t)  # type: ignore[attr-defined]

    def _made_inside(self, tensor: torch.Tensor, before: list, start: int) -> bool:
        """Whether a call in an opened body made ``tensor`` (an output of the body, whose
        entries are numbered from ``start``): it has an entry from the body, or a
        producer other than the one it had (``before``: the arguments' producers). An
        argument written in place by a call TorchLens does not see either was not:
        ``F.silu(x, inplace=True)`` runs ``torch._C._nn.silu_``, so ``F.silu`` is the op."""
        assert self._producer is not None
        now = self._producer(tensor)
        if now < 0:
            return False
        was = next((was for t, was in before if t is tensor), None)
        made_since = self._made_since
        return now != was or made_since is None or made_since(start, tensor)

    def _operator(self, name: str) -> str:
        """Inside an opened body: an operator's name from the instruction that called it
        (``input / denom`` in ``F.normalize`` is ``truediv``)."""
        frame: Any = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_HERE):
            frame = frame.f_back
        if frame is None:
            return name
        return operator_name(name, (frame.f_code, frame.f_lasti))

    def _record_outputs(
        self, name: str, func: Any, args: tuple, kwargs: dict, out: Any, writes: bool
    ) -> Any:
        """A call that returned something other than one tensor (the compiled path
        hands these here too): its tensors, if any, are recorded."""
        several = isinstance(out, (tuple, list))
        if several:
            tensors = tuple(t for t in flatten_tensors(out) if not isinstance(t, _Parameter))
            if not tensors:
                return out
        elif out is None and func is _Tensor.__setitem__:
            tensors = (args[0],)  # x[i] = v writes into x
        else:
            return out
        try:
            passed = passed_through(name, args, kwargs, tensors) if several else frozenset()
            if self._call_args is not None:
                self._with_args(func, name, args, kwargs, tensors, writes, passed)
            else:
                self._on_call(name, args, kwargs, tensors, writes, passed)
        except Exception as exc:  # never break the user's forward pass
            self._on_error(name, exc)
        return out

    def _with_args(
        self,
        func: Any,
        name: str,
        args: tuple,
        kwargs: dict,
        tensors: tuple,
        writes: bool,
        passed: frozenset[int] = frozenset(),
    ) -> None:
        """``on_call``, the call's arguments encoded first (before its outputs become
        the producers of their tensors) and given to the rows it added."""
        recorder = self._call_args
        assert recorder is not None
        call = recorder.encode(func, args, kwargs)
        start = recorder.row_count()
        self._on_call(name, args, kwargs, tensors, writes, passed)
        recorder.assign(call, start, len(tensors))

    def _before_write(self, name: str, args: tuple, kwargs: dict) -> None:
        try:
            self._events.before_write(name, args, kwargs)
        except Exception as exc:
            self._on_error(name, exc)


if _hot is not None:

    class _FusedMode(_hot.Fused, _Mode):
        """The mode whose ``__torch_function__`` is compiled (recorder/_hot.c). It
        records the common call (a function named before, no in-place write, tensor and
        scalar arguments, one tensor out, outside a repeated module call) and hands
        every other call to ``_Mode.__torch_function__``."""

        def bind(self, fused_state: tuple) -> None:  # type: ignore[override]
            """Point the compiled path at the labeller's state (for one recording)."""
            state, producers, refs, params, rows, shapes, counts, codes, classify, emit = (
                fused_state
            )
            self._live = state
            super().bind(
                state,
                self._funcs,
                producers,
                refs,
                params,
                rows,
                shapes,
                counts,
                codes,
                classify,
                emit,
                _Mode.__torch_function__,
                _Mode._record,
                self._on_error,
                _Tensor,
                ROW_DEFAULTS,
                KEPT,
            )


class Swaps(Protocol):
    """Where an intervening recording leaves what replaces a call's outputs."""

    #: id() of an output tensor -> the tensor the forward goes on with instead
    swaps: dict[int, torch.Tensor]
    #: what an intervention raised while the call was recorded, to raise into the forward
    error: BaseException | None


class _InterveningMode(_Mode):
    """The mode of a recording with interventions (Python only): a call's outputs that
    a rule replaced are returned replaced, and a rule's error is raised at that call."""

    def __init__(
        self, events: Events, on_error: Callable[[str, BaseException], None], swaps: Swaps
    ):
        super().__init__(events, on_error)
        self._swaps = swaps

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = _Mode.__torch_function__(self, func, types, args, kwargs)
        state = self._swaps
        if state.error is not None:
            error, state.error = state.error, None
            state.swaps.clear()
            raise error
        swaps = state.swaps
        if swaps:
            if isinstance(out, _Tensor):
                out = swaps.get(id(out), out)
            else:
                out = tree_map_only(_Tensor, lambda t: swaps.get(id(t), t), out)
            swaps.clear()
        return out


#: The interceptors entered and not yet closed in this process.
_ENTERED: weakref.WeakSet[Interceptor] = weakref.WeakSet()


def _forked_child() -> None:
    """A process forked while a recording runs (a ``DataLoader``'s workers inside the
    forward, ``multiprocessing``) starts with the forking thread's mode stack and the
    global module hooks, but without the threads that write the recording: its torch
    calls must not reach the recording, whose writer would wait for them for ever. Each
    interceptor steps aside in the child as if its recording had ended there; the parent's
    recording goes on unaffected."""
    for interceptor in list(_ENTERED):
        interceptor.close()


os.register_at_fork(after_in_child=_forked_child)


class Interceptor:
    """Context manager: push the mode and register global module hooks for one thread.

    Refuses to nest: one recording per thread at a time. ``swaps``: a recording with
    interventions, whose replaced outputs the mode returns (Python mode only).
    """

    def __init__(
        self,
        events: Events,
        on_error: Callable[[str, BaseException], None],
        swaps: Swaps | None = None,
    ):
        self._events = events
        self._on_error = on_error
        # The compiled path cannot hand back a changed tensor (interventions) and does not
        # see arguments (recordings that encode them): those use Python's.
        fused = compiled.ENABLED and swaps is None and getattr(events, "call_args", None) is None
        self._fused_state = getattr(events, "fused_state", None) if fused else None
        self._mode: Any = (
            _InterveningMode(events, on_error, swaps)
            if swaps is not None
            else (_FusedMode if self._fused_state is not None else _Mode)(events, on_error)
        )
        self._thread = threading.get_ident()
        self._handles: list[Any] = []
        self._entered = False
        #: (module, fused function, keyword arguments) while a module call runs torch's
        #: fused fast path with the mode stepped aside; module types without one.
        self._fused: tuple[torch.nn.Module, str, dict] | None = None
        self._plain_types: set[type] = set()

    @staticmethod
    def refuse_nesting() -> None:
        """Raise :class:`NestedTraceError` if a recording is active in this thread."""
        if any(isinstance(m, _Mode) for m in _get_current_function_mode_stack()):
            raise NestedTraceError(
                "a tracelake recording is already active in this thread; "
                "finish it before starting another (recordings cannot be nested)"
            )

    # The hooks' ``with`` bodies are one call each: on Python 3.11 the first instruction
    # of some lines (a ``try:``, a loop's head) lies outside the exception table, so an
    # exception raised there (a trace function's Ctrl-C) would skip the ``with``'s exit
    # and leave torch functions disabled for the thread (tests/test_interrupts.py
    # checks that no recorder line is left so).

    def _pre_hook(self, module: torch.nn.Module, args: tuple) -> None:
        if threading.get_ident() != self._thread or self._fused is not None:
            return  # another thread's call, or one inside a fused call (not recorded)
        with torch._C.DisableTorchFunction():
            self._entered_module(module, args, sys._getframe(1))

    def _entered_module(self, module: torch.nn.Module, args: tuple, caller: Any) -> None:
        try:
            self._events.on_module_enter(module, args, _call_kwargs(caller))
        except Exception as exc:
            self._on_error(f"module {type(module).__name__}", exc)
        if type(module) in self._plain_types:
            return
        try:
            self._maybe_fuse(module, args, caller)
        except Exception as exc:
            self._on_error(f"module {type(module).__name__}", exc)

    def _maybe_fuse(self, module: torch.nn.Module, args: tuple, frame: Any) -> None:
        """Step the mode aside for a module call that takes torch's fused fast path in a
        plain forward (see :mod:`.fastpath`): the call then runs exactly as it would
        unrecorded, and ``_post_hook`` records it as one op. ``frame``: the hook's
        caller."""
        if not fastpath.has_rule(type(module)):
            self._plain_types.add(type(module))
            return
        kwargs = _call_kwargs(frame)
        if kwargs is None:
            return
        func = fastpath.fused_call(module, args, kwargs)
        if func is None or _get_current_function_mode_stack()[-1:] != [self._mode]:
            return
        self._mode.__exit__(None, None, None)
        self._fused = (module, func, kwargs)

    def _post_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        fused = self._fused
        if fused is not None:
            if fused[0] is not module:
                return  # a module called inside the fused call
            self._fused = None
            self._mode.__enter__()
        with torch._C.DisableTorchFunction():
            self._left_module(module, args, output, fused)

    def _left_module(
        self,
        module: torch.nn.Module,
        args: tuple,
        output: Any,
        fused: tuple[torch.nn.Module, str, dict] | None,
    ) -> None:
        if fused is not None:
            try:
                self._record_fused(module, fused[1], args, fused[2], output)
            except Exception as exc:
                self._on_error(fused[1], exc)
        try:
            self._events.on_module_exit(module, output)
        except Exception as exc:
            self._on_error(f"module {type(module).__name__}", exc)

    def _record_fused(
        self, module: torch.nn.Module, func: str, args: tuple, kwargs: dict, output: Any
    ) -> None:
        """The fused call's outputs, as one op whose arguments are the module call's
        and the module's parameters."""
        tensors = tuple(flatten_tensors(output))
        if tensors:
            self._events.on_call(func, (*args, *module.parameters()), kwargs, tensors, False)

    def __enter__(self) -> Interceptor:
        if self._entered:
            raise NestedTraceError("this interceptor is already in use")
        self.refuse_nesting()
        self._entered = True
        SourceFinder.trim()
        try:
            _ENTERED.add(self)
            self._handles.append(nn_module.register_module_forward_pre_hook(self._pre_hook))
            self._handles.append(
                nn_module.register_module_forward_hook(self._post_hook, always_call=True)
            )
            sources.hold(self)  # torch.from_numpy, torch.Tensor(...): see sources.py
            if self._fused_state is not None:
                self._mode.bind(self._fused_state())
            self._mode.__enter__()
            return self  # (inside: an interrupt on this line still undoes the above)
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Take the mode off this thread's stack and remove the hooks, whatever of them
        is still installed: safe to call again, and after an interrupt (Ctrl-C) left the
        entry or the forward half-way (torch runs no always-called hook for a
        ``KeyboardInterrupt``, so whoever cleans up calls this)."""
        try:
            stack = _get_current_function_mode_stack()
            ours = [k for k, mode in enumerate(stack) if mode is self._mode]
            if ours:
                # modes above ours were pushed inside the interrupted forward and lost
                # their exit with it (ours again too, by an opened function: _open):
                # they go too, or ours could not be reached
                _pop_to(ours[0])
            self._fused = None
        finally:
            try:
                if self._fused_state is not None:
                    self._mode.unbind()
            finally:
                try:
                    self._remove_hooks()
                finally:
                    sources.release(self)
                    _ENTERED.discard(self)

    def _remove_hooks(self) -> None:
        while self._handles:  # removed, then forgotten: a removal cut short is redone
            self._handles[-1].remove()  # by the next call (torch's remove is idempotent)
            self._handles.pop()
        # a hook registered but not yet in _handles when an interrupt came
        for hooks in (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks):
            for key, hook in list(hooks.items()):
                if getattr(hook, "__self__", None) is self:
                    del hooks[key]
                    nn_module._global_forward_hooks_always_called.pop(key, None)
