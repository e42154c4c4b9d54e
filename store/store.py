"""The store: ``tl.open(path)``, recording runs into it, listing, reading, deleting."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import inspect
import io
import itertools
import json
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, cast

from tracelake.errors import (
    ConcurrentRecordingError,
    InterventionError,
    InvalidMetaError,
    RecorderError,
    RunExistsError,
    RunNotFoundError,
    StoreError,
    TraceLakeWarning,
)
from tracelake.progress import Progress

from .boundary import CatalogCursor
from .catalog import (
    COLLECTED,
    COMPLETE,
    FAILED,
    FOLD_AFTER,
    INTERRUPTED,
    RECORDING,
    CatalogMirror,
    CatalogWriter,
    StagedRun,
    fold_or_warn,
    read_runs,
    sealed_header,
    writer_alive,
)
from .catalog import _now as _catalog_now
from .layout import (
    ARRAYS_FILE,
    DEFAULT_MAX_INFLIGHT,
    SEALED_ROWS,
    STAGED_LINES,
    StorePaths,
    begin_durable_trees,
    check_run_marker,
    durable_trees,
    from_micros,
    full_hint,
    is_utf8,
    lock_held,
    locked,
    micros,
    note_staged,
    open_staged_lines,
    remove_tree,
    staged_runs,
    trash_run_dir,
    trash_staged,
    try_lock,
    validate_name,
    write_staged,
)
from .sealed import write_sealed
from .verify import Problem, VerifyReport, tensor_rows, verify_files, verify_run

if TYPE_CHECKING:
    import pandas
    import torch

    from tracelake.query.results import Result  # (the query room sits downstream)
    from tracelake.recorder import ForwardRecording, OpTable
    from tracelake.recorder.backward import BackwardCapture, CaptureOptions, GradEdges
    from tracelake.recorder.eager import EagerStance
    from tracelake.recorder.replay import ReplayReport

    from .backend import ByteStore
    from .compare import Comparison
    from .grads import StoreGrads
    from .lake import LakeCatalog
    from .remote import RemoteArrays
    from .rows import RunSteps, Written
    from .run import Run
    from .tensors import RunArrays
    from .writer import StoreEmitter, TensorWriter

# torch, the recorder and the array code load when a run is recorded or read, not with
# the store: listing, deleting and collecting runs need only the catalog (the command
# line's `tracelake runs` starts without torch).

__all__ = ["OPEN_RUNS_KEPT", "Batch", "OpenRuns", "Recording", "Store", "last_opened", "open_store"]

log = logging.getLogger("tracelake.store")

_STATS_CHOICES = ("saved", "all")

#: The store ``tl.open`` opened last: a process-wide fact by nature (what a notebook
#: magic without a path queries). Read it through :func:`last_opened` only.
_LAST: list[Store] = []


def open_store(
    path: str | os.PathLike[str],
    create: bool = True,
    *,
    catalog: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Store:
    """Open the store at ``path`` (a directory), creating it unless ``create=False``.

    ``path`` may be an object-store URL (``s3://bucket/prefix``): the runs' arrays go
    there, and ``catalog`` names the directory that keeps the catalog, the locks and
    the run directories (``docs/architecture.md``, "Past one machine"); credentials
    from the environment or ``storage_options`` (obstore's keys: ``endpoint``,
    ``region``, ``access_key_id``, ...). Needs the ``scale`` extra. ``catalog`` may
    instead be a PostgreSQL URL (``postgresql://user@host:port/db``): the catalog is
    then a DuckLake shared by writers on any number of hosts, its data files under
    ``path/catalog/`` ("A shared catalog on DuckLake"; the ``ducklake`` extra)."""
    if "://" in str(path) and catalog is not None and _is_catalog_url(catalog):
        from .lake import LakeStore  # (DuckDB's extensions load only for such a store)

        store: Store = LakeStore(str(path), str(catalog), storage_options, create)
    elif "://" in str(path):
        if catalog is None:
            raise StoreError(
                f"a store on object storage ({str(path)!r}) needs catalog=DIRECTORY: the "
                "local directory that keeps its catalog, locks and run directories"
            )
        store = Store(catalog, create=create, arrays=str(path), storage_options=storage_options)
    elif catalog is not None:
        raise StoreError(
            "catalog= is for a store on object storage: tl.open('s3://bucket/prefix', "
            f"catalog=DIRECTORY); {str(path)!r} is a directory, which holds its own catalog"
        )
    else:
        store = Store(path, create=create, storage_options=storage_options)
    _LAST[:] = [store]
    return store


def _is_catalog_url(catalog: object) -> bool:
    """Whether ``catalog`` names a DuckLake catalog's PostgreSQL database."""
    return isinstance(catalog, str) and catalog.startswith(("postgresql://", "postgres://"))


def last_opened() -> Store:
    """The store ``tl.open`` opened last in this process: what the ``%tlq`` magic
    queries when it names no store. ``StoreError`` if none was opened yet."""
    if not _LAST:
        raise StoreError("no store is open yet: tl.open(path) first, or name the store")
    return _LAST[0]


@contextlib.contextmanager
def _os_errors(what: str) -> Any:
    """The filesystem boundary of the store's own file work (the run directories): an
    ``OSError`` leaves as ``StoreError``, the original its ``__cause__``."""
    try:
        yield
    except OSError as exc:
        raise StoreError(f"{what}: {exc}{full_hint(exc)}") from exc


def _durable_when(begun: tuple[Any, Callable[[], None] | None], what: str) -> tuple[Any, Any]:
    """What a ``_begin_durable`` returned (the bytes, the wait for the syncs going on),
    its wait raising, as :func:`_os_errors` does, ``StoreError`` saying ``what``."""
    nbytes, done = begun
    if done is None:
        return nbytes, None

    def wait() -> None:
        with _os_errors(what):
            done()

    return nbytes, wait


def _fingerprint(named: list[tuple[str, torch.Tensor]]) -> str:
    """A short hash of names, shapes, dtypes and a strided sample of values (the whole
    tensor when it is small): cheap even for large models."""
    import torch

    h = hashlib.blake2b(digest_size=12)
    # (of detached tensors: no torch.no_grad(), see recorder.emit.copy_tensor)
    with torch._C.DisableTorchFunction():
        for name, tensor in named:
            h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            if tensor.layout is not torch.strided or tensor.is_meta:
                continue
            numel = tensor.numel()
            if (
                numel <= 4096
                and type(tensor) in (torch.Tensor, torch.nn.Parameter)
                and tensor.is_cpu
                and not tensor.is_quantized
                and tensor.is_contiguous()
                and not (tensor.is_neg() or tensor.is_conj())
            ):  # its bytes as they are, the same the general path hashes (one call)
                h.update(ctypes.string_at(tensor.data_ptr(), tensor.nbytes) if numel else b"")
                continue
            flat = tensor.detach().reshape(-1)
            if numel > 4096:
                flat = flat[:: numel // 4096]
            with contextlib.suppress(RuntimeError, TypeError):
                h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


#: Numbers the names this process generates: with it no two are equal, however many
#: runs start in one second (random bits alone repeat: 24 of them within a few
#: thousand runs a second); the random part tells processes apart.
_NAMES = itertools.count()
_STAMP: list[Any] = [None, ""]  # the second a generated name last showed, as shown


def _name_and_model(
    given: tuple[Any, ...], name: str | None, model: torch.nn.Module | None
) -> tuple[str | None, torch.nn.Module | None]:
    """``Store.recording``'s run name and model from its positional arguments (a name,
    a module, or both, in either order) and its keywords; ``TypeError`` for anything
    else, or for one given twice."""
    import torch  # (not at import: the command line lists runs without it)

    if len(given) > 2:
        raise TypeError(
            f"recording() takes a run name and a model, not {len(given)} positional arguments"
        )
    for value in given:
        if value is None:
            continue
        if isinstance(value, str) and name is None:
            name = value
        elif isinstance(value, torch.nn.Module) and model is None:
            model = value
        else:
            what = "name" if isinstance(value, str) else "model"
            raise TypeError(
                f"recording() got a second {what} ({value!r:.60}) or a value that is "
                "neither: give the run's name (a str) and the model (an nn.Module) once each"
            )
    return name, model


def _generated_name(model: Any) -> str:
    now = int(time.time())
    if _STAMP[0] != now:  # (formatted once a second: a batch names many runs in one)
        _STAMP[:] = now, datetime.fromtimestamp(now, UTC).strftime("%Y%m%d-%H%M%S")
    stamp = _STAMP[1]
    return f"{type(model).__name__.lower()}-{stamp}-{os.urandom(3).hex()}{next(_NAMES):x}"


def _meta_json(meta: Any) -> str:
    """``meta`` as the JSON text the catalog keeps; ``InvalidMetaError`` for a value
    that has none (or that every ``meta.*`` query of the store would then fail on), or
    that ``meta.<key>`` could not address as given (not a dict; a key that is no string,
    which JSON would turn into one without a word)."""
    if meta is not None and not isinstance(meta, dict):
        raise InvalidMetaError(
            f"meta= takes a dict (meta.<key> in queries reads its keys), not "
            f"{type(meta).__name__}: meta={{'note': ...}}"
        )
    _check_meta_keys(meta)
    try:
        text = json.dumps(meta, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMetaError(f"meta= must be JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise InvalidMetaError("meta= is nested too deeply to store as JSON: flatten it") from None
    if not is_utf8(text):
        raise InvalidMetaError(
            "meta= holds a string with a lone surrogate (text that is not Unicode: often "
            "a file name decoded with errors='surrogateescape'); decode it properly first"
        )
    return text


def _check_meta_keys(meta: Any) -> None:
    """``InvalidMetaError`` for a dict key, at any depth, that is not a string (a walk
    with a list, not recursion: JSON's own depth limit is checked after)."""
    pending, seen = [meta], 0
    while pending and seen < 100_000:  # (a value past that is refused by JSON's checks)
        value = pending.pop()
        seen += 1
        if isinstance(value, dict):
            bad = next((k for k in value if not isinstance(k, str)), None)
            if bad is not None:
                raise InvalidMetaError(
                    f"meta= keys are strings (a query reads meta.<key>); {bad!r} is "
                    f"{type(bad).__name__}"
                )
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)


def _loads_meta(text: str | None) -> Any:
    """A run's ``meta`` as Python values (as its JSON text if nested too deeply for
    Python's parser: a store made elsewhere may hold anything)."""
    if not isinstance(text, str):  # (none: pandas may hand a NaN)
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _on_stack(frame: FrameType | None) -> bool:
    """Whether ``frame`` is one of the calling thread's running frames."""
    here = inspect.currentframe()
    while here is not None and here is not frame:
        here = here.f_back
    return here is not None


#: Recordings whose block is open in this process.
_OPEN: weakref.WeakSet[Recording] = weakref.WeakSet()


def _forked_child() -> None:
    """A process forked inside a recording's block (``os.fork``, ``multiprocessing``)
    holds a copy of the block, but neither the threads that write the run nor the right
    to end it: the parent commits or gives it up. In the child the block's model hooks
    go (its forward calls are no steps; the recorder's mode steps aside too, see
    ``recorder.intercept``) and the block's end raises without touching the store."""
    for recording in list(_OPEN):
        recording._forked = True
        while recording._hooks:
            recording._hooks.pop().remove()


os.register_at_fork(after_in_child=_forked_child)


class Recording:
    """One run being recorded: any number of forward passes, each a step (0, 1, ...).

    Use ``store.recording(name, model)`` as a context manager: every call of ``model``
    inside the block is recorded as a step (``model.generate(...)`` records each
    forward of the generation loop), and ``rec.record(model, *args)`` records one more
    explicitly. The run becomes visible when the block ends without an exception;
    otherwise it is marked failed and ``store.gc()`` reclaims its space.

    A forward pass that raises is not a step, even when the caller catches its error and
    the block goes on: its ops are dropped and the tensors it saved are left out of the
    catalog (their arrays removed), so the steps the run keeps are numbered 0, 1, ... in
    the order they completed, each holding a whole forward pass.
    """

    def __init__(
        self,
        store: Store,
        name: str | None,
        model: Any,
        save: Any,
        stats: str,
        meta: Any,
        overwrite: bool,
        max_inflight: int,
        intervene: Any = None,
        capture: Any = None,
        save_grads: Any = None,
        progress: bool | None = None,
    ):
        if stats not in _STATS_CHOICES:
            raise ValueError(f"stats= takes 'saved' or 'all', not {stats!r}")
        self._meta_json = _meta_json(meta)
        from tracelake.recorder import check_model
        from tracelake.recorder.selectors import as_selector

        if model is not None:
            check_model(model)
        self.store = store
        self.name = validate_name(name) if name is not None else None
        self.model = model
        self._selector = as_selector(save)
        from tracelake.recorder.backward import as_options
        from tracelake.recorder.capture import grad_selector
        from tracelake.recorder.intervene import Interventions, as_rules

        self.interventions = Interventions(as_rules(intervene))
        self._calls: list[str] = []
        self._grad_selector = grad_selector(capture, save, save_grads)
        self._record_args = as_options(capture).record_args
        self._keep_orphans = as_options(capture).keep_orphans
        self._grads: StoreGrads | None = None
        self._backward: BackwardCapture | None = None
        self._grad_steps: list[GradEdges] = []  # one per step, when backward-ready
        self._stats = stats
        self._meta = meta
        self._overwrite = overwrite
        self._max_inflight = max_inflight
        self._show_progress = progress
        self._progress: Progress | None = None
        self._steps: list[tuple[OpTable, list[Any], StoreEmitter]] = []
        self._writer: TensorWriter | None = None
        #: The run's writing lock, held (on DuckLake: its lease, renewed); closed to let go.
        self._lock: io.FileIO | Held | None = None
        self._hooks: list[Any] = []
        self._eager: EagerStance | None = None
        # the step the model's own hooks started: (recording, table, emitter, args, kwargs)
        self._auto: tuple[ForwardRecording, OpTable, StoreEmitter, tuple, dict] | None = None
        self._depth = 0
        #: The thread whose forward is the step running (None between steps); calls of
        #: the model from other threads meanwhile are refused, counted by thread.
        self._owner: int | None = None
        self._refused: dict[int, int] = {}
        self._call_frame: FrameType | None = None  # where the step's forward was called
        #: Set by the model's ordinary forward hook, which runs only when the forward
        #: returned: the always-called hook reads it to tell a raised forward apart.
        self._returned_ok = False
        #: The first slot of the step running, and the slots of steps that raised.
        self._step_start = 0
        self._discarded: set[int] = set()
        self._fingerprints: dict[str, str] = {}
        self._device: str | None = None
        self.run_id = -1
        self.info: dict[str, Any] | None = None  # the committed run's catalog row
        #: The store's open batch when the block began (None: committed on its own).
        self._batch: Batch | None = None
        self._dir = Path()
        self._info: dict[str, Any] = {}
        self._created = datetime.min
        self.model_class = type(model).__name__ if model is not None else None
        self._forked = False  # this is a forked child's copy of the block (_forked_child)

    # -- the block --------------------------------------------------------------------------

    def __enter__(self) -> Recording:
        import torch

        from .tensors import RunArrays
        from .writer import TensorWriter

        if self.name is None:
            self.name = _generated_name(self.model)
        info = {
            "model_class": self.model_class,
            "torch_version": torch.__version__,
            "meta": self._meta,
        }
        batch = self._batch = self.store._batch
        # Everything from here is undone if anything fails or a Ctrl-C comes: no block
        # runs then, so no __exit__ will.
        try:
            _OPEN.add(self)
            if not self.store._catalog.stages_runs:  # (DuckLake's: registered first)
                reserve = self._lake.reserve if batch is None else batch.reserve
                self.run_id, self._lock = reserve(self.name, self._overwrite, info)
                self._dir = self.store.paths.run_dir(self.run_id)
            else:  # a directory of its own, no catalog transaction before its commit's
                stage = self.store._stage if batch is None else batch.stage
                self._dir, self._lock = stage(self.name, self._overwrite)
                self._info, self._created = info, _catalog_now()
                with _os_errors(f"cannot create the run {self.name!r}"):
                    if batch is None:
                        write_staged(self._dir, self._about())
                    else:
                        batch.note(self._dir, self._about())
            with _os_errors(f"cannot create the arrays of run {self.name!r}"):
                arrays = RunArrays(
                    self.store._arrays_at(self._dir, new=True),
                    self.name,
                    create=True,
                    made=batch is not None and self.store._catalog.stages_runs,
                    flat=self.store.paths.flat_chunks,
                )
            # (its files are made durable with the run's other files, at the commit:
            # Store._durable, or the batch's, not one fdatasync each)
            self._writer = TensorWriter(arrays, self._max_inflight, sync=False)
            if self._grad_selector is not None:
                from tracelake.recorder.backward import BackwardCapture

                from .grads import StoreGrads

                self._grads = StoreGrads(self._writer)
                self._backward = BackwardCapture(self._grad_steps, self._grads)
            # Bytes written and steps, read by the bar's own thread: the forward pass never
            # calls into it (benchmarks/progress_overhead.py).
            writer, name = self._writer, self.name
            self._progress = Progress(
                f"recording {name}",
                unit="bytes",
                enabled=self._show_progress,
                poll=lambda: writer.bytes_written,
                describe=lambda: f"recording {name}: {len(self._steps)} step(s)",
            ).__enter__()
            if self.model is not None:
                # A compiled model runs eagerly for the whole block: its hooks below would
                # otherwise run inside the compiled code (model.compile()).
                from tracelake.recorder.eager import EagerStance

                self._eager = EagerStance(self.model).__enter__()
                self._hooks.append(
                    self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
                )
                self._hooks.append(  # before the next one
                    self.model.register_forward_hook(self._returned)
                )
                self._hooks.append(
                    self.model.register_forward_hook(
                        self._post_hook, with_kwargs=True, always_call=True
                    )
                )
            return self  # (inside: an interrupt on this line still undoes the above)
        except BaseException:
            self._unhook()
            self._fail()
            raise

    @property
    def _lake(self) -> LakeCatalog:
        """The store's catalog, one that registers a run before it records (DuckLake's:
        ``stages_runs`` is false)."""
        return cast("LakeCatalog", self.store._catalog)

    def _about(self, error: str | None = None) -> dict[str, Any]:
        """What listing the staged run shows until it commits (``layout.write_staged``):
        its ``runs`` row's values known before."""
        return {
            "name": self.name,
            "created": micros(self._created),
            "model_class": self._info.get("model_class"),
            "torch_version": self._info.get("torch_version"),
            "meta": json.dumps(self._info.get("meta")),
            "error": error,
        }

    def _unhook(self) -> None:
        """Remove the block's model hooks and eager stance (what ``__enter__`` installed)
        and a forward left by a ``BaseException``. Each step is safe to redo: a call cut
        short (a Ctrl-C inside torch's hook removal) is finished by the next."""
        while self._hooks:
            self._hooks[-1].remove()  # (torch's remove is idempotent)
            self._hooks.pop()
        if self.model is not None:
            self._strip_hooks(self.model)
        if self._auto is not None and self._owner == threading.get_ident():
            # a forward left by a BaseException (Ctrl-C): torch ran no always-called
            # hook for it, so its mode and hooks are still installed
            self._drop_stale()
        if self._eager is not None:
            self._eager.__exit__()
            self._eager = None

    def _strip_hooks(self, model: torch.nn.Module) -> None:
        """Remove this block's hooks that no handle holds: a Ctrl-C inside torch's
        ``register_forward_hook`` after it installed the hook, before it returned the
        handle. (Torch's hook dicts, keyed by handle id; the hooks are bound methods of
        this recording.)"""
        for hooks, extras in (
            (model._forward_pre_hooks, (model._forward_pre_hooks_with_kwargs,)),
            (
                model._forward_hooks,
                (model._forward_hooks_with_kwargs, model._forward_hooks_always_called),
            ),
        ):
            for key in [k for k, hook in hooks.items() if getattr(hook, "__self__", None) is self]:
                for extra in extras:
                    extra.pop(key, None)
                del hooks[key]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Every line inside the try: a Ctrl-C on any of them still removes what the block
        # installed and gives the run up (a committed one stays committed: _fail).
        try:
            if self._forked:
                if exc_type is None:
                    self._refuse_forked()
                return
            self._unhook()
            if exc_type is None:
                self._commit()
            else:
                self._fail(exc)
        except BaseException:
            if self._forked:
                raise
            try:
                self._unhook()  # finish what the interrupt cut short
            finally:
                self._fail(exc)  # the block's error, else the one raised here
            raise

    # -- steps ------------------------------------------------------------------------------

    def _begin(self, model: torch.nn.Module) -> tuple[OpTable, StoreEmitter]:
        from tracelake.recorder import OpTable

        from .writer import StoreEmitter

        if self._writer is None:
            raise StoreError("record steps inside the `with store.recording(...)` block")
        if self._forked:
            self._refuse_forked()
        self._writer.step = len(self._steps)
        self._step_start = len(self._writer.slots)
        table = OpTable()
        grads = self._grad_selector
        from tracelake.recorder.backward import GradEdges

        edges = None if grads is None else GradEdges(grads, table)
        return table, StoreEmitter(self._selector, self._stats, table, self._writer, edges)

    def _end(
        self,
        model: torch.nn.Module,
        recording: ForwardRecording,
        table: OpTable,
        emitter: StoreEmitter,
        args: tuple,
        kwargs: dict,
        last: bool = False,
    ) -> None:
        """``last``: the recording's commit follows at once, before any code of the
        user's runs (``store.record``): the workers may go on reading the step's tensors
        where they are, so nothing is copied for fear of what the user's code may write
        next (``settle``, which waited for the workers' chunk writes: ~11 ms a GPT-2 run)."""
        from tracelake.recorder.inputs import input_tensors

        assert self._writer is not None
        if not last:
            self._writer.settle()  # before the user's code may write what workers still read
        # tensors saved by ops pruned after the forward (orphans): left out of the run
        self._discarded.update(recording.labeller.pruned_slots)
        self._steps.append((table, recording.labeller.module_entries, emitter))
        from tracelake.recorder.replay import encode_call

        self._calls.append(encode_call(args, kwargs, recording.rng.drawn, recording.training))
        if emitter.grad_edges is not None:
            self._grad_steps.append(emitter.grad_edges)
        if not self._fingerprints:
            self._fingerprints = {
                "param_fingerprint": _fingerprint(list(model.named_parameters())),
                "input_fingerprint": _fingerprint(
                    [(str(i), t) for i, t in enumerate(input_tensors(args, kwargs))]
                ),
            }
            first = next(iter(model.parameters()), None)
            self._device = str(first.device) if first is not None else None

    def record(
        self,
        model: torch.nn.Module,
        *inputs: Any,
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> Any:
        """Record one forward pass of ``model(*inputs, **model_kwargs)`` as the next step;
        return its output. ``args=`` / ``kwargs=`` give the inputs explicitly."""
        from tracelake.recorder import check_model
        from tracelake.recorder.inputs import model_arguments

        model = check_model(model)
        inputs, model_kwargs = model_arguments(
            model, "rec.record", inputs, args, kwargs, model_kwargs, {}
        )
        return self._record(model, inputs, model_kwargs)

    def _record(
        self, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], last: bool = False
    ) -> Any:
        """One step; ``last``: the recording commits right after it (``_end``)."""
        from tracelake.recorder import ForwardRecording

        self._claim()
        table, emitter = self._begin(model)
        recording = ForwardRecording(
            model,
            emitter,
            table,
            self.interventions,
            len(self._steps),
            record_args=self._record_args,
            keep_orphans=self._keep_orphans,
        )
        self._depth += 1  # the block's own hooks must not start a second step
        self._owner, self._call_frame = threading.get_ident(), inspect.currentframe()
        stopping = False
        try:  # one handler from start to stop: a Ctrl-C anywhere leaves nothing installed
            recording.start(args, kwargs)
            from tracelake.recorder.eager import uncompiled

            output = uncompiled(model)(*args, **kwargs)  # (the wrapper would run it too)
            if not self._forked:  # (a forked child's copy of the step ends below)
                stopping = True
                recording.stop(output)
        except BaseException:  # no step; a stop cut short is not begun again
            if not self._forked:
                self._abandon(recording, stopped=stopping)
            raise
        finally:
            self._depth -= 1
            if not self._depth:
                self._owner = self._call_frame = None
        if self._forked:  # the forward forked this process
            self._refuse_forked()
        self._end(model, recording, table, emitter, args, kwargs, last)
        return output

    def backward(self, loss: Any, gradient: Any = None, **options: Any) -> None:
        """``torch.autograd.backward(loss, gradient, **options)``, storing the gradient of
        ``loss`` with respect to the output of each op of the steps recorded so far that
        ``save_grads=`` selects (the ``grads`` table: one row per op and fire, in the
        engine's order; ``run[label].grad``). Each call is a separate backward pass. The
        recording must be ``capture=tl.options.CaptureOptions(backward_ready=True)``."""
        if self._backward is None:
            raise RecorderError(
                "this recording is not backward-ready: open it with capture="
                "tl.options.CaptureOptions(backward_ready=True), then call rec.backward(loss)"
            )
        if not self._steps or self._writer is None:
            raise StoreError("call rec.backward(loss) inside the block, after a forward pass")
        self._backward.backward(loss, gradient, **options)

    def _claim(self) -> None:
        """Refuse a forward of another thread while one thread's step runs: a step is
        one thread's forward pass (the recorder follows one thread)."""
        thread = threading.get_ident()
        if self._owner is not None and self._owner != thread:
            raise ConcurrentRecordingError(
                f"the recording {self.name!r} is recording a forward pass of another "
                "thread: a recording block records one forward at a time, so call the "
                "model from one thread at a time inside it (or record each thread's "
                "forwards in a recording block of their own)"
            )

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        thread = threading.get_ident()
        if self._owner is not None and self._owner != thread:
            self._refused[thread] = self._refused.get(thread, 0) + 1
            self._claim()  # raises; the always-called hook below still runs
        if self._depth and not _on_stack(self._call_frame):
            self._drop_stale()  # the step's forward was left by Ctrl-C, which was caught
        self._depth += 1
        self._owner = thread
        if self._depth > 1 or self._auto is not None:
            return  # the model calling itself: part of the step already running
        here = inspect.currentframe()  # (then torch's call of the model's hooks)
        self._call_frame = here.f_back if here is not None else None
        try:
            from tracelake.recorder import ForwardRecording

            table, emitter = self._begin(module)
            recording = ForwardRecording(
                module,
                emitter,
                table,
                self.interventions,
                len(self._steps),
                record_args=self._record_args,
                keep_orphans=self._keep_orphans,
            )
            self._auto = (recording, table, emitter, args, kwargs)
            recording.start(args, kwargs)
        except InterventionError:  # a rule that cannot apply: never run unpatched
            self._auto = None
            raise
        except Exception as exc:
            if self._auto is not None:
                self._auto[0].abort()
            self._auto = None
            warnings.warn(
                f"tracelake could not record this forward pass of "
                f"{type(module).__name__} ({exc}); it ran unrecorded",
                TraceLakeWarning,
                stacklevel=2,
            )

    def _drop_stale(self) -> None:
        """Give up the step whose forward a ``BaseException`` (Ctrl-C) left: torch runs
        no always-called hook then, so its mode and hooks are still installed."""
        auto = self._auto
        self._owner, self._depth, self._call_frame = None, 0, None
        if auto is not None:
            try:
                self._abandon(auto[0])
            except BaseException:
                auto[0].release()  # cut short: at least nothing stays installed (redo is safe)
                raise
            finally:
                self._auto = None

    def _returned(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() == self._owner:
            self._returned_ok = True

    def _post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        thread = threading.get_ident()
        if thread != self._owner:  # a refused call of another thread
            left = self._refused.pop(thread, 0) - 1
            if left > 0:
                self._refused[thread] = left
            return
        self._depth -= 1
        returned, self._returned_ok = self._returned_ok, False
        if self._depth:
            return
        auto = self._auto
        if auto is None:
            self._owner = self._call_frame = None
            return
        # The step stays this thread's (_owner, _auto) until its recording is stopped or
        # given up, so that a Ctrl-C on any line before leaves it for _unhook to drop.
        recording, table, emitter, args, kwargs = auto
        if not returned:  # the forward raised (torch calls this hook all the same)
            self._drop_stale()
            return
        try:
            recording.stop(output)
        except BaseException:
            self._drop_stale()
            raise
        self._auto = self._owner = self._call_frame = None
        self._end(module, recording, table, emitter, args, kwargs)

    def _abandon(self, recording: ForwardRecording, stopped: bool = False) -> None:
        """A forward pass that raised: stop recording it; it does not become a step and
        the tensors it saved are left out of the run (``stopped``: its ``stop`` began
        already, and was cut short)."""
        assert self._writer is not None
        try:
            recording.abort()  # first: whatever else fails, the mode and hooks are gone
            if not stopped:
                recording.stop(None, failed=True)
        finally:
            self._writer.settle()
            self._discarded.update(range(self._step_start, len(self._writer.slots)))

    # -- the end ----------------------------------------------------------------------------

    def _commit(self) -> None:
        import pyarrow as pa

        from . import arrow
        from .grads import grads_table
        from .rows import audit_tables, run_tables

        writer = self._writer
        assert writer is not None and self.name is not None
        if not self._steps:
            raise StoreError(
                f"the recording {self.name!r} recorded no forward pass; call the "
                "model (or rec.record(model, ...)) inside the block"
            )

        done: list[tuple[tuple[Any, Any], Any]] = []

        def written() -> tuple[tuple[Any, Any], Any]:
            if not done:  # (once: asked again where a small run of a batch is built now)
                writer.close()  # the last chunks' statistics, writes and syncs: done now
                done.append((writer.stat_matrix(), writer.codec))
            return done[0]

        if self._selector.constant is None:  # a name in save= that matched nothing
            from tracelake.recorder import TraceView
            from tracelake.recorder.selectors import warn_unmatched

            views = [TraceView(table, None, modules) for table, modules, _ in self._steps]
            warn_unmatched(
                self._selector,
                (op for view in views for op in view),
                (m for view in views for m in view.modules),
                stacklevel=3,
            )
        writer.flush()  # the workers finish the last chunks while the tables are built
        steps = self._deferred(written)
        if steps is None:
            merged = run_tables(self.run_id, self._steps, writer.slots, written)
            merged.update(audit_tables(self.run_id, self.interventions, self._calls))
        else:  # (built by the batch, with its other small runs')
            merged = {}
        labels = {label for table, _, _ in self._steps for label in table.labels}
        self.interventions.warn_unused(labels, stacklevel=4)
        if writer.lost:  # rare: tensors written in place, unseen, while being stored
            self._drop(writer.lost)
            merged = run_tables(
                self.run_id, self._steps, writer.slots, lambda: (writer.stat_matrix(), writer.codec)
            )
        if self._grads is not None:
            merged["grads"] = grads_table(
                self.run_id,
                self._grads.fires,
                [table.labels for table, _, _ in self._steps],
                writer.slots,
                writer.stat_matrix(),
                writer.lost,
            )
        gone = writer.lost | self._discarded
        if gone:
            merged["tensors"] = merged["tensors"].filter(
                arrow.array([slot not in gone for slot in range(len(writer.slots))], pa.bool_())
            )
        if self._discarded:
            with _os_errors(f"cannot remove the tensors of a failed step of {self.name!r}"):
                # the arrays only dropped slots use: own ones, and packs none of whose
                # tensors stays (a pack that keeps one keeps the others' bytes, unreferenced)
                kept = {slot[0] for k, slot in enumerate(writer.slots) if k not in gone}
                for array in sorted({writer.slots[k][0] for k in self._discarded} - kept):
                    writer.arrays.delete(array)
        summary = {
            "steps": len(self._steps),
            "op_count": steps.ops if steps is not None else merged["ops"].num_rows,
            "bytes": 0,
            "device": self._device,
            **self._fingerprints,
        }
        staged = StagedRun(
            self._dir, self.name, self._overwrite, self._created, self._info, merged, summary
        )
        if self._batch is not None:  # durable and visible when the batch commits
            assert self._lock is not None
            staged.steps = steps
            lock, self._lock = self._lock, None  # the batch's now (it lets it go)
            self._steps = []
            self._batch.add(staged, lock)
            return
        if self.run_id < 0:
            # staged: sealed, its rows in the catalog a moment later (a new store's
            # first run too: the fold that inserts its rows makes the catalog)
            with _os_errors(f"cannot make run {self.name!r} durable"):
                self.store._durable_sealed(staged)  # durable before visible
            catalog = self.store._catalog
            self.info = catalog.seal(staged)
            self.run_id = self.info["id"]
            if catalog.sealed_waiting >= FOLD_AFTER:
                fold_or_warn(catalog.fold)  # (the run is complete: a failure only warns)
        else:
            with _os_errors(f"cannot make run {self.name!r} durable"):
                summary["bytes"] = self.store._durable(self._dir)  # durable before visible
            self.info = self._lake.commit(self.run_id, self.name, self._overwrite, merged, summary)
        self._release()
        self._steps = []
        for edges in self._grad_steps:
            edges.clear()  # the autograd graph is the user's again

    def _deferred(self, written: Written) -> RunSteps | None:
        """A small run of a batch: its steps, closed, for the batch to build its op
        tables with its other small runs' (``rows.runs_tables``); None for any other
        run (built now, as is one whose writer lost tensors or that has gradients or
        failed steps: the rarer paths below work on its built tables)."""
        from .rows import KeptOps, RunSteps

        if self._batch is None or self._grads is not None or self._discarded:
            return None
        if sum(len(table.rows) for table, _, _ in self._steps) > DEFERRED_RUN_OPS:
            return None
        written()  # (the writer closes: what it lost is known)
        if self._writer is None or self._writer.lost:
            return None
        return RunSteps(
            -1,
            [(t, m, KeptOps(e.op_slots, e.unsaved_stats)) for t, m, e in self._steps],
            self._writer.slots,
            written,
            (self.interventions.audit(), list(self._calls)),
        )

    def _drop(self, lost: set[int]) -> None:
        """Record the entries of tensors written in place, unseen, while being stored as
        unsaved, with a warning (as an in-memory trace drops such values)."""
        for table, modules, emitter in self._steps:
            for index, slot in list(emitter.op_slots.items()):
                if slot in lost:
                    del emitter.op_slots[index]
                    warnings.warn(
                        f"{table.labels[index]} was written in place by an operation "
                        "tracelake could not intercept while it was being stored, so its "
                        "value is not saved",
                        TraceLakeWarning,
                        stacklevel=4,
                    )
            for entry in modules:
                if lost.intersection(entry.input_slots or (), entry.output_slots or ()):
                    entry.input_slots = entry.output_slots = entry.structure = None

    def _fail(self, error: BaseException | None = None) -> None:
        """Give the run up (called while its error is on the way out, which says more
        than a second one; ``error``: that error, default the one being handled, kept as
        the run's ``error``). A run whose status could not be set stays ``recording``
        without a live writer: listed as interrupted, reclaimed by ``gc()`` all the same."""
        error = error if error is not None else sys.exc_info()[1]
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        if self.info is not None:  # committed: an interrupt after that only releases it
            self._release()
            return
        try:
            if self._writer is not None:
                self._writer.abort()
            if self.run_id >= 0:  # registered (DuckLake's)
                self._lake.set_status(self.run_id, FAILED, reason)
            elif self._batch is not None:  # nothing in the catalog: just its directory
                if self._lock is not None:
                    self.store._remove_dir(self._dir)
            elif self._lock is not None:  # staged: listed failed until gc() removes it
                write_staged(self._dir, self._about(reason or "failed"))
        except (StoreError, OSError) as exc:
            log.warning("could not mark run %r failed: %s", self.name, exc)
        finally:
            self._release()

    def _refuse_forked(self) -> None:
        raise StoreError(
            f"the recording of run {self.name!r} was forked into this process "
            f"({os.getpid()}): a forked process records no steps of it and neither "
            "commits nor gives it up (the process that began it does); record in the "
            "child with a recording of its own"
        )

    def _release(self) -> None:
        _OPEN.discard(self)
        try:
            if self._progress is not None:
                progress, self._progress = self._progress, None
                progress.close()
        finally:  # the lock goes whatever happened before
            if self._lock is not None:
                lock, self._lock = self._lock, None
                lock.close()


#: How many runs' arrays a store keeps open (:class:`OpenRuns`), the most recently read.
#: Opening one reads its identity marker and metadata (~0.1-1 ms); keeping one costs
#: ~0.7 KB, which without a bound grew with every run a long-lived store (a notebook's)
#: ever read. Enough for a query over a thousand runs (a label stacked across them) to
#: find every run open the next time: at 256 each such query opened every run again
#: (an LRU cycled through by more runs than it keeps keeps none of them).
OPEN_RUNS_KEPT = 1024


class OpenRuns:
    """The runs whose arrays a store keeps open (:class:`RunArrays`, their Zarr metadata
    read), the :data:`OPEN_RUNS_KEPT` most recently read; an older one is opened again
    when next read (a :class:`~.run.Run` keeps its own open whatever the store forgets).
    Thread-safe. Openers run one at a time (the query room's reader threads open runs
    at once, and an opener may ask the catalog mirror's one DuckDB connection, which
    refuses a second caller: "connection is busy"), outside the lock a kept run is
    found under, so that reading an open run never waits for another's opening (on
    object storage, a round trip)."""

    def __init__(self, kept: int = OPEN_RUNS_KEPT):
        self.kept = kept
        self._runs: OrderedDict[int, RunArrays] = OrderedDict()
        self._lock = threading.Lock()  # the dict's
        self._opening = threading.Lock()  # one opener at a time

    def _kept(self, run_id: int) -> RunArrays | None:
        with self._lock:
            arrays = self._runs.get(run_id)
            if arrays is not None:
                self._runs.move_to_end(run_id)
            return arrays

    def get(self, run_id: int, opener: Callable[[], RunArrays]) -> RunArrays:
        """Run ``run_id``'s arrays: kept ones, or ``opener()``'s, then kept."""
        arrays = self._kept(run_id)
        if arrays is not None:
            return arrays
        with self._opening:
            arrays = self._kept(run_id)  # (opened meanwhile by another thread)
            if arrays is not None:
                return arrays
            arrays = opener()
            with self._lock:
                self._runs[run_id] = arrays
                if len(self._runs) > self.kept:
                    self._runs.popitem(last=False)
            return arrays

    def ids(self) -> list[int]:
        """The ids of the runs kept open, least recently read first."""
        with self._lock:
            return list(self._runs)


class Held(Protocol):
    """What a run holds while it records and lets go of by ``close()``."""

    def close(self) -> None: ...


class _InBatch:
    """A batch's run's hold on its directory's writing lock: the batch's own lock,
    which the batch takes and lets go of, so this one's ``close`` does nothing."""

    def close(self) -> None:
        pass


_IN_BATCH = _InBatch()


#: A batch builds the op tables of its runs of up to this many ops together (each
#: Arrow conversion has a fixed cost, which per run dominates a run of a few ops)...
DEFERRED_RUN_OPS = 2_000
#: ... this many ops at a time (the rows wait as Python objects, ~1 KB an op).
DEFERRED_OPS = 20_000


class Batch:
    """The runs of one ``store.batch()`` block: each recorded into a directory of its
    own inside the batch's ``runs/.staging/*`` directory (whose ``writing.lock`` the
    batch holds; each run noted in its ``staged.jsonl``), their files written but not
    synced; :meth:`commit` makes them all durable at
    once and commits them in one catalog transaction."""

    def __init__(self, store: Store):
        self.store = store
        self._staged: list[tuple[StagedRun, Held]] = []
        #: Small runs' op tables, built together (``rows.runs_tables``; ``run_id``: the
        #: run's position in ``_staged``), with those positions; and about how many ops
        #: wait to be built (a run whose ``steps`` are set and no group holds).
        self._built: list[tuple[list[int], dict[str, Any]]] = []
        self._waiting_ops = 0
        self._pending: list[Run] = []  # what ``record`` returned, bound at the commit
        self._names: set[str] = set()
        self._known: Collection[str] | None = None
        #: The batch's directory and its writing lock, made by its first run (one
        #: directory and lock file a batch, not a run: each new file or directory costs
        #: an inode, on a busy filesystem the most of a tiny run's writing).
        self._dir: Path | None = None
        self._lock: io.FileIO | None = None
        self._lines: int | None = None  # its STAGED_LINES, open (``note``)
        self._made = 0  # run directories made in it
        self._unread: RunArrays | None = None  # what the runs ``record`` returned read
        #: The runs committed, in order (after the block).
        self.names: list[str] = []

    def _refuse_taken(self, name: str, overwrite: bool, complete: Collection[str] = ()) -> None:
        """``RunExistsError`` for a name this batch took already, or one of ``complete``
        (unless ``overwrite``)."""
        if not overwrite and (name in self._names or name in complete):
            raise RunExistsError(
                f"the store already has a run named {name!r} (or this batch does); choose "
                "another name, or pass overwrite=True to replace it"
            )

    def reserve(self, name: str, overwrite: bool, info: dict[str, Any]) -> tuple[int, Any]:
        """Register run ``name`` where the catalog registers runs as they begin (DuckLake:
        :class:`.lake.LakeBatch`); a local catalog stages them instead (:meth:`stage`)."""
        raise NotImplementedError

    def stage(self, name: str, overwrite: bool) -> tuple[Path, Held]:
        """A new directory for run ``name`` in the batch's, and its hold on the writing
        lock (:data:`_IN_BATCH`: the batch's lock, which the batch lets go, so closing
        it lets nothing go). A name already complete in the store, or taken earlier in
        this batch, is refused here (unless ``overwrite``), not only at the commit."""
        self._refuse_taken(name, overwrite, () if overwrite else self._complete())
        if self._lock is None:
            self._open()
        assert self._dir is not None
        staged = self._dir / str(self._made)
        self._made += 1
        with _os_errors(f"cannot create a directory for run {name!r}"):
            os.mkdir(staged)
        self._names.add(name)
        return staged, _IN_BATCH

    def _open(self) -> io.FileIO:
        """Make the batch's directory (``runs/.staging/*``, as a run's on its own) and
        take its writing lock."""
        self._dir, self._lock = self.store._staged_dir("the batch's runs")
        return self._lock

    def note(self, staged: Path, about: dict[str, Any]) -> None:
        """List run ``staged`` (a directory :meth:`stage` made) with ``about``, in the
        batch's :data:`STAGED_LINES`."""
        assert self._dir is not None
        if self._lines is None:
            self._lines = open_staged_lines(self._dir)
        note_staged(self._lines, staged, about)

    def _begin_durable(self, runs: list[StagedRun]) -> tuple[list[int], Callable[[], None] | None]:
        """Begin making the runs' files durable, all at once: each one's bytes, and what
        waits until they are (None: they are already)."""
        return begin_durable_trees([run.staged for run in runs])

    def _let_go(self) -> None:
        """Remove the batch's directory if no run is left in it (all committed or
        failed), and let its lock go; one with runs left is ``gc()``'s then."""
        lock, self._lock = self._lock, None
        lines, self._lines = self._lines, None
        if lines is not None:
            os.close(lines)
        if lock is None or self._dir is None:
            return
        try:
            with contextlib.suppress(OSError):
                left = set(os.listdir(self._dir))
                if left <= {"writing.lock", STAGED_LINES}:
                    for name in left:
                        os.unlink(self._dir / name)
                    os.rmdir(self._dir)
        finally:
            lock.close()

    def _complete(self) -> Collection[str]:
        """The names of the store's complete runs when the batch began (read once, by
        the store's writer: a reader's mirror would copy the rows of every run
        committed since its last refresh; a run committed by another writer since is
        caught by the batch's commit)."""
        if self._known is None:
            self._known = self.store._catalog.complete_names()
        return self._known

    def pending(self, name: str) -> Run:
        """The :class:`Run` ``record`` returns for run ``name`` of this batch: readable
        once the batch commits (before that, reading it raises :class:`StoreError`)."""
        from .run import Run
        from .tensors import RunArrays

        if self._unread is None:  # (one for the batch: nothing reads it)
            self._unread = RunArrays(self.store.paths.root, flat=self.store.paths.flat_chunks)

        def not_yet(*_: Any, **__: Any) -> Any:
            raise StoreError(
                f"run {name!r} belongs to an open store.batch(): it can be read once the "
                "batch's `with` block ends"
            )

        info = {"name": name, "id": -1, "steps": 1}  # (record: one step)
        run = Run(info, self._unread, not_yet)
        self._pending.append(run)
        return run

    def _bind_pending(self, rows: list[dict[str, Any]]) -> None:
        """Point the runs ``record`` returned at their committed ``rows`` (a name
        recorded twice: the later run)."""
        named = {info["name"]: info for info in rows}
        for run in self._pending:
            info = named.get(run.name)
            if info is not None:
                run._bind(info, self.store._arrays_of(info), self.store._run_query(info["id"]))

    def add(self, run: StagedRun, lock: Held) -> None:
        """A run of the batch, recorded and waiting for the commit (``lock``: its
        directory's writing lock, released after the commit)."""
        self._staged.append((run, lock))  # (first: a Ctrl-C after it leaves it the batch's)
        if run.steps is not None:
            self._waiting_ops += run.summary["op_count"]
        if self._waiting_ops > DEFERRED_OPS:
            self._build()

    def _build(self) -> None:
        """Build the op tables of the small runs waiting, together (so that no more than
        about :data:`DEFERRED_OPS` ops wait as Python rows)."""
        from .rows import runs_tables

        done = {k for positions, _ in self._built for k in positions}
        waiting = [
            k for k, (run, _) in enumerate(self._staged) if run.steps is not None and k not in done
        ]
        self._waiting_ops = 0
        if not waiting:
            return
        runs = [self._staged[k][0] for k in waiting]
        built = runs_tables(
            [dataclasses.replace(run.steps, run_id=k) for k, run in zip(waiting, runs, strict=True)]
        )
        # One statement with no call in it (no Ctrl-C inside): the runs are built once,
        # never twice and never not at all (what is built is what a group holds).
        self._built = [*self._built, (waiting, built)]
        for run in runs:
            run.steps = None  # (their Python rows go)

    def commit(self) -> None:
        """Make every run of the batch durable (``layout.durable_trees``), then visible (one
        transaction). Their locks are let go either way; what a failure leaves,
        ``gc()`` removes."""
        staged = self._staged
        if not staged:
            self._let_go()
            return
        try:
            runs = [run for run, _ in staged]
            what = "cannot make the batch's runs durable"
            with _os_errors(what):  # (their syncs go on while the tables are built and
                sizes, durable = _durable_when(self._begin_durable(runs), what)  # inserted)
            for run, nbytes in zip(runs, sizes, strict=True):
                run.summary["bytes"] = nbytes
            self._build()
            built = [tables for _, tables in self._built]
            rows = self.store._catalog.commit_batch(runs, built, durable)
            self.names += [run.name for run in runs]
            self._bind_pending(rows)
        finally:
            self._staged, self._built, self._waiting_ops = [], [], 0
            try:
                for _, lock in staged:
                    lock.close()
            finally:
                self._let_go()


class Store:
    """A directory of recorded runs: a DuckDB catalog plus Zarr arrays.

    ``store.record(model, x, name=...)`` records one forward pass as a run;
    ``store[name]`` reads it back (a :class:`Run`, lazily); ``store.runs()`` lists runs.
    Several processes may record into one store at once while others read it.
    """

    #: What ``batch()`` makes (a DuckLake store's registers its runs as they begin).
    _batch_class: type[Batch] = Batch

    def __init__(
        self,
        path: str | os.PathLike[str],
        create: bool = True,
        *,
        arrays: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        self.paths = StorePaths(path)
        existed = self.paths.marker.exists()
        with _os_errors(f"cannot open the store at {str(self.paths.root)!r}"):
            self.paths.check(create)
        if not existed:  # said aloud: a mistyped path would otherwise look like no runs
            log.info("created a new store at %s", self.paths.root)
            warnings.warn(
                f"created a new, empty store at {str(self.paths.root)!r} (to open only an "
                "existing one: tl.open(path, create=False))",
                TraceLakeWarning,
                stacklevel=3,
            )
        # The catalog file is made by the first transaction that needs it (a new store's
        # first run, usually): until then readers see no runs (no ``catalog.gen`` yet),
        # and a new store costs no transaction of its own.
        self._catalog = CatalogWriter(self.paths)
        self._mirror: CatalogMirror | None = None
        self._open_arrays = OpenRuns()
        self._batch: Batch | None = None
        #: Where the runs' arrays live when on object storage (store/remote.py); None:
        #: under each run's directory. Imported only for such a store.
        self._remote: RemoteArrays | None = None
        if arrays is not None or storage_options or (self.paths.root / ARRAYS_FILE).exists():
            from .remote import RemoteArrays

            self._remote = RemoteArrays.open(self.paths.root, arrays, storage_options, create)

    def _arrays_at(self, run_dir: Path, new: bool = False) -> ByteStore | Path:
        """Where the arrays of the run in ``run_dir`` live: its ``tensors/`` directory,
        or (a store on object storage) its objects; ``new``: a run about to write."""
        if self._remote is None:
            return run_dir / "tensors"
        if new:
            return self._remote.new_run(run_dir)
        backend = self._remote.of_run(run_dir)
        return run_dir / "tensors" if backend is None else backend

    def _stage(self, name: str, overwrite: bool) -> tuple[Path, io.FileIO]:
        """A new directory for run ``name``, recorded on its own, and its writing lock
        (the open file). A name complete in the store, or being recorded by a live
        writer, is refused here (unless ``overwrite``); the commit checks again (a run
        of that name committed meanwhile)."""
        if not overwrite:
            status = "complete" if name in self._catalog.complete_names() else None
            if status is None and self._recording_now(name):
                status = "recording"
            if status is not None:
                raise RunExistsError(
                    f"the store already has a run named {name!r} ({status}); choose "
                    "another name, or pass overwrite=True to replace it"
                )
        return self._staged_dir(f"run {name!r}")

    def _recording_now(self, name: str) -> bool:
        """Whether a live writer is recording a run named ``name`` (staged)."""
        return any(
            any(about["name"] == name for _, about in staged_runs(entry))
            and lock_held(entry / "writing.lock")
            for entry in self.paths.staging_dirs()
        )

    def _staged_dir(self, what: str) -> tuple[Path, io.FileIO]:
        """A new staged directory (``runs/.staging/*``) for ``what`` (a run, or a batch's
        runs), and its writing lock, held."""
        with _os_errors(f"cannot create a directory for {what}"):
            staged = self.paths.new_staging()
            lock = try_lock(staged / "writing.lock")
        if lock is None:
            raise StoreError(f"run directory {staged} is in use")
        return staged, lock

    def _durable(self, run_dir: Path) -> int:
        """Make a finished run's arrays durable; return their bytes."""
        return durable_trees([run_dir])[0]

    def _begin_durable(self, run_dir: Path) -> tuple[int, Callable[[], None] | None]:
        """Begin making a finished run's arrays durable: their bytes, and what waits
        until they are (None: they are already)."""
        sizes, done = begin_durable_trees([run_dir])
        return sizes[0], done

    def _durable_sealed(self, run: StagedRun) -> None:
        """Make a finished run's arrays durable, with its rows beside them (its
        ``SEALED_ROWS``, for ``CatalogWriter.seal``, saying the bytes of the arrays,
        which its summary gets too)."""

        def rows(sizes: list[int]) -> str:
            run.summary["bytes"] = sizes[0]
            run.finished = _catalog_now()
            path = run.staged / SEALED_ROWS
            write_sealed(path, sealed_header(run), run.tables)
            return str(path)

        durable_trees([run.staged], rows)

    def _remove_dir(self, path: Path) -> int:
        """Remove a run directory (and first the objects it names); return the bytes."""
        freed = self._remote.remove(path) if self._remote is not None else 0
        return freed + remove_tree(path)

    @property
    def path(self) -> str:
        """The store's directory."""
        return str(self.paths.root)

    @property
    def catalog(self) -> CatalogMirror:
        """This reader's copy of the catalog (made on first use), for the query room and
        tools: ``refresh``, ``run_ids``, ``query`` / ``arrow`` on the catalog tables,
        with DuckDB's errors converted (see :class:`~tracelake.store.catalog.CatalogMirror`)."""
        if self._mirror is None:
            self._mirror = CatalogMirror(self.paths, fold=self._catalog.fold)
        return self._mirror

    def _query(
        self, sql: str, params: list[Any] | None = None, runs: Collection[int] | None = None
    ) -> CatalogCursor:
        """``sql`` on the catalog mirror; ``runs``: the only runs whose rows it reads
        (``()``: the runs table alone), so that the mirror copies no others (None: any)."""
        return self.catalog.query(sql, params, runs)

    def _run_query(self, run_id: int) -> Callable[..., Any]:
        """``_query`` for SQL that reads the rows of run ``run_id`` only."""
        return functools.partial(self._query, runs=(run_id,))

    # -- recording ------------------------------------------------------------------------

    def recording(
        self,
        *given: str | torch.nn.Module | None,
        name: str | None = None,
        model: torch.nn.Module | None = None,
        save: Any = None,
        meta: Any = None,
        stats: str = "saved",
        overwrite: bool = False,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        intervene: Any = None,
        capture: CaptureOptions | None = None,
        save_grads: Any = None,
        progress: bool | None = None,
    ) -> Recording:
        """A run of several forward passes (steps); see :class:`Recording`. ``intervene``:
        rules applied to every step (as :meth:`record`'s). With
        ``capture=tl.options.CaptureOptions(backward_ready=True)``, ``rec.backward(loss)``
        stores gradients too (of the ops ``save_grads`` selects; default ``save``).
        ``progress``: a bar (bytes written, steps) for recordings over a second; None:
        where someone watches (a terminal, a notebook), False: never. The run's name and
        the model may be given by position in either order (``recording("gen", model)``,
        ``recording(model, name="gen")``, as :meth:`record` takes them), or by keyword."""
        name, model = _name_and_model(given, name, model)
        return Recording(
            self,
            name,
            model,
            save,
            stats,
            meta,
            overwrite,
            max_inflight,
            intervene=intervene,
            capture=capture,
            save_grads=save_grads,
            progress=progress,
        )

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """Record many runs with one commit: ``with store.batch(): ...``. Runs recorded
        in the block (``record``, ``recording``) are written as usual but made durable
        and visible together, in one catalog transaction, when the block ends (also
        when it raises: the runs that completed are committed). Each run stays atomic.
        A crash (SIGKILL, power loss) before that commit loses every run of the open
        batch and nothing else; ``gc()`` removes their files. Inside a batch, the
        :class:`Run` ``record`` returns can be read once the batch commits (it has no
        id before); afterwards ``batch.names`` lists the committed runs."""
        if self._batch is not None:
            raise StoreError("a batch is already open on this store; batches do not nest")
        batch = self._batch = self._batch_class(self)
        try:
            yield batch
        finally:
            # (nested: a Ctrl-C as either line starts still lets the other run; one as
            # the commit starts loses the batch's runs, and its locks go with the batch)
            try:
                self._batch = None  # first: no later run is staged into this batch
            finally:
                batch.commit()

    def record(
        self,
        model: torch.nn.Module,
        *inputs: Any,
        name: str | None = None,
        save: Any = None,
        meta: Any = None,
        stats: str = "saved",
        overwrite: bool = False,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        intervene: Any = None,
        capture: CaptureOptions | None = None,
        backward: Callable[[Any], Any] | None = None,
        save_grads: Any = None,
        progress: bool | None = None,
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> Run:
        """Record one forward pass of ``model(*inputs, **model_kwargs)`` as a run and
        return it (inside :meth:`batch`, the run can be read once the batch commits).

        ``save`` selects the tensors to store (default all), ``meta`` is any
        JSON-serialisable dict kept with the run, ``name`` is generated when omitted.
        Tensors stream to disk while the forward runs, at most ``max_inflight`` bytes
        buffered; the run becomes visible only once all of it is durable.
        ``intervene``: ``tl.when(selector, action)`` or a list of them, applied as the
        forward runs and kept with the run (the ``rules`` table; ``ops.intervened`` and
        ``ops.rule`` mark the ops they changed).

        ``capture``: ``tl.options.CaptureOptions`` (``record_args=True`` keeps each call's
        arguments, for ``tl.validate``). ``backward``: a function of the model's output
        returning a loss; the run then
        also stores the gradient of that loss with respect to each op ``save_grads``
        selects (default ``save``), as ``rec.backward(loss)`` does in a recording.
        ``progress``: a bar for recordings over a second (None: in a terminal or
        notebook only).

        ``args=(...)`` and ``kwargs={...}`` give the model's inputs explicitly: a model
        keyword named like one of these options goes in ``kwargs=`` (when the model's
        ``forward`` takes such a keyword and it was given at top level,
        :class:`~tracelake.errors.ArgumentClashError` says so). Keyword inputs are
        labelled by their name (``input_ids``), positional ones ``input_1``, ...
        """
        from tracelake.recorder import check_model

        model = check_model(model)
        if backward is not None and not callable(backward):
            raise TypeError(
                "backward= takes a function of the model's output returning the loss "
                f"(lambda out: out.sum()), not {type(backward).__name__}"
            )
        from tracelake.recorder.backward import as_options

        capture = as_options(capture)
        if backward is not None:
            capture = dataclasses.replace(capture, backward_ready=True)
        from tracelake.recorder.inputs import model_arguments

        inputs, model_kwargs = model_arguments(
            model,
            "store.record",
            inputs,
            args,
            kwargs,
            model_kwargs,
            {
                "name": (name, None),
                "save": (save, None),
                "meta": (meta, None),
                "stats": (stats, "saved"),
                "overwrite": (overwrite, False),
                "max_inflight": (max_inflight, DEFAULT_MAX_INFLIGHT),
                "intervene": (intervene, None),
                "capture": (capture, None),
                "backward": (backward, None),
                "save_grads": (save_grads, None),
                "progress": (progress, None),
            },
        )
        rec = Recording(
            self,
            name if name is not None else _generated_name(model),
            None,
            save,
            stats,
            meta,
            overwrite,
            max_inflight,
            intervene=intervene,
            capture=capture,
            save_grads=save_grads,
            progress=progress,
        )
        rec.model_class = type(model).__name__
        with rec:
            # (with a backward, the user's loss function runs before the commit)
            output = rec._record(model, inputs, model_kwargs, last=backward is None)
            if backward is not None:
                rec.backward(backward(output))
        if rec.info is None:  # in a batch: visible once the batch commits
            assert self._batch is not None and rec.name is not None
            return self._batch.pending(rec.name)
        from .run import Run

        # (its metadata is read, and its arrays opened, when first asked for)
        return Run(rec.info, self._arrays_of(rec.info), self._run_query(rec.info["id"]))

    # -- reading --------------------------------------------------------------------------

    def _run_info(self, where: str, params: list[Any]) -> dict[str, Any] | None:
        cursor = self._query(f"SELECT * FROM runs WHERE {where}", params, ())
        row = cursor.fetchone()
        if row is None:
            return None
        return dict(zip([d[0] for d in cursor.description], row, strict=True))

    def arrays(self, run_id: int, name: str | None = None, created: Any = None) -> RunArrays:
        """The arrays of run ``run_id`` (``name``, ``created``: the run's catalog row's,
        looked up when omitted), kept open: zarr metadata is read once. For the query
        room, which reads the tensors of many runs' rows at once. ``StoreError`` if the
        run's directory holds another run's data (its identity marker disagrees)."""
        from .tensors import RunArrays

        def opener() -> RunArrays:
            nonlocal name, created
            if name is None or created is None:  # the mirror's, as of its last refresh
                mirror = self.catalog
                name = mirror.run_names.get(run_id) if name is None else name
                created = mirror.run_created.get(run_id) if created is None else created
            if name is None or created is None:
                row = self._query(
                    "SELECT name, created FROM runs WHERE id = ?", [run_id], ()
                ).fetchone()
                name, created = (row[0], row[1]) if row else (str(run_id), None)
            check_run_marker(self.paths, run_id, name, created)
            return RunArrays(
                self._arrays_at(self.paths.run_dir(run_id)), name, flat=self.paths.flat_chunks
            )

        return self._open_arrays.get(run_id, opener)

    def _open_run(self, info: dict[str, Any]) -> Run:
        from .run import Run

        arrays = self.arrays(info["id"], info["name"], info.get("created"))
        return Run(info, arrays, self._run_query(info["id"]))

    def _arrays_of(self, info: dict[str, Any]) -> Callable[[], RunArrays]:
        """What opens the arrays of the run of catalog row ``info`` (:meth:`arrays`)."""
        return functools.partial(self.arrays, info["id"], info["name"], info.get("created"))

    def __getitem__(self, name: str) -> Run:
        if not isinstance(name, str):
            raise TypeError(f"look runs up by name (str), not {name!r}")
        info = self._run_info("name = ? AND status = ?", [name, COMPLETE])
        if info is None:
            known = [
                r[0]
                for r in self._query(
                    "SELECT name FROM runs WHERE status = ?", [COMPLETE], ()
                ).fetchall()
            ]
            raise RunNotFoundError(name, known)
        return self._open_run(info)

    def __contains__(self, name: object) -> bool:
        return (
            isinstance(name, str)
            and self._run_info("name = ? AND status = ?", [name, COMPLETE]) is not None
        )

    def __iter__(self) -> Iterator[str]:
        """The names of the complete runs, oldest first."""
        return iter([row["name"] for row in self.run_rows()])

    def __len__(self) -> int:
        """How many complete runs the store holds."""
        row = self._query("SELECT count(*) FROM runs WHERE status = ?", [COMPLETE], ()).fetchone()
        return int(row[0]) if row is not None else 0

    def run_rows(self, all: bool = False) -> list[dict[str, Any]]:
        """:meth:`runs` as plain rows (one dict per run, meta parsed), without pandas:
        what the command line prints."""
        columns = ["name", "status", "created", "steps", "op_count", "bytes", "model_class"]
        columns += ["torch_version", "meta"] + (["error"] if all else [])
        rows = []
        for info in self._listed(all):
            row = {c: info[c] for c in columns}
            row["ops"] = row.pop("op_count")
            row["meta"] = _loads_meta(row["meta"])
            rows.append(row)
        return rows

    def _listed(self, all: bool) -> list[dict[str, Any]]:
        """The ``runs`` rows :meth:`run_rows` lists (recording ones whose writer is gone
        as interrupted), read from the catalog file: listing runs copies no run's rows
        into a mirror. ``all``: after them, the staged runs (not committed: being
        recorded, failed, or interrupted), from their directories."""
        staged = self._staged_rows() if all else []  # (first: one that commits meanwhile
        where = "status = ?" if not all else "status != ?"  # is listed once, committed)
        infos = read_runs(
            self.paths, where, [COMPLETE if not all else COLLECTED], self._catalog.fold
        )
        for info in infos:
            if info["status"] == RECORDING and not writer_alive(self.paths, info["id"]):
                info["status"] = INTERRUPTED
        committed = {(info["name"], info["created"]) for info in infos}
        return infos + [row for row in staged if (row["name"], row["created"]) not in committed]

    def _staged_rows(self) -> list[dict[str, Any]]:
        """A ``runs`` row for each staged run (``runs/.staging``): recording while its
        writer holds its lock, else failed (with its error) or interrupted."""
        rows = []
        for entry in self.paths.staging_dirs():
            runs = staged_runs(entry)
            live = bool(runs) and lock_held(entry / "writing.lock")  # (a batch's: one)
            for _, about in runs:
                error = about.get("error")
                if live:
                    status, error = RECORDING, None
                else:
                    status = FAILED if error is not None else INTERRUPTED
                rows.append(
                    {
                        "name": about["name"],
                        "status": status,
                        "created": from_micros(about["created"]),
                        "steps": 0,
                        "op_count": 0,
                        "bytes": 0,
                        "model_class": about.get("model_class"),
                        "torch_version": about.get("torch_version"),
                        "meta": about.get("meta"),
                        "error": error,
                    }
                )
        return sorted(rows, key=lambda row: row["created"])

    def runs(self, all: bool = False) -> pandas.DataFrame:
        """One row per complete run (``all=True``: also recording, interrupted, failed and
        deleted ones, with ``error``: why a failed run failed): name, status, created,
        steps, ops, bytes, model class, torch version, meta."""
        import pandas

        rows = self.run_rows(all)
        columns = ["name", "status", "created", "steps", "ops", "bytes", "model_class"]
        columns += ["torch_version", "meta"] + (["error"] if all else [])
        return pandas.DataFrame(rows, columns=columns).astype(
            {"steps": "int64", "ops": "int64", "bytes": "int64"} if rows else {}
        )

    # -- queries --------------------------------------------------------------------------

    def query(self, text: str, *, progress: bool | None = None, **params: Any) -> Result:
        """Run a query (``docs/query.md``) over every complete run; returns a
        :class:`~tracelake.query.results.Result`. ``:name`` parameters are bound from
        the keyword arguments (``progress`` is not one). ``progress``: a bar while the
        query reads or compares tensors for over a second (None: only in a terminal or a
        notebook; False: never; True: always)."""
        from tracelake.query.results import run_query  # the query room sits downstream

        return run_query(self, text, params, progress=progress)

    def dask_array(self, text: str, **params: Any) -> Any:
        """The tensors a query selects (``out``, or its one tensor column) as one Dask
        array, rows first, nothing read: ``.compute()`` equals the query's ``stack()``
        bitwise. For aggregations larger than memory; needs the ``scale`` extra."""
        from tracelake.query.results import run_query

        return run_query(self, text, params, lazy=True).to_dask()

    def compare(self, a: Any, b: Any, **options: Any) -> Comparison:
        """Compare two runs (names or :class:`Run` objects) or in-memory traces op by op:
        see :func:`tracelake.store.compare.compare` for the options (``on``, ``select``,
        ``where``, ``steps``, ``atol``, ``rtol``, ``tensors``)."""
        from .compare import compare

        return compare(a, b, store=self, **options)

    def replay(
        self,
        run: Any,
        model: torch.nn.Module,
        *,
        name: str | None = None,
        atol: float = 1e-6,
        rtol: float = 1e-5,
    ) -> ReplayReport:
        """Re-execute run ``run`` (a name or :class:`Run`) on ``model`` from its stored
        inputs with its stored interventions; report op by op whether each stored value
        was reproduced (bitwise on the same device and dtype, else within ``atol`` /
        ``rtol``). ``name``: record the replay as a new run of that name (``report.run``).
        ``ReplayError`` before anything runs when the run cannot be replayed (inputs not
        saved, a user callable among its rules, inputs changed since recorded)."""
        from .replay import replay_run

        return replay_run(self, run, model, name, atol, rtol)

    def sql(self, text: str) -> pandas.DataFrame:
        """Raw, read-only SQL (one SELECT) over the catalog tables, on an in-memory
        mirror where DuckDB's external access is off; returns a DataFrame."""
        from tracelake.query.results import run_sql

        return run_sql(self, text)

    # -- maintenance ----------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove run ``name`` from view at once; ``gc()`` reclaims its space."""
        if not isinstance(name, str):  # (else DuckDB's cast error, from inside a transaction)
            raise TypeError(
                f"delete takes one run's name (str), not {name!r}; to delete several, "
                "call it once for each"
            )
        if self._catalog.delete(name) < 0:
            raise RunNotFoundError(name, list(self))

    def gc(self, progress: bool | None = None) -> dict[str, int]:
        """Reclaim the space of deleted, failed and interrupted runs, and of run
        directories the catalog does not know. Returns what was removed. ``progress``: a
        bar when it takes over a second (None: in a terminal or notebook only)."""
        dead = self._catalog.collect()  # (refused when the catalog lost runs: StoreError;
        # it folds the sealed runs first)
        freed = 0
        with (
            _os_errors(f"cannot reclaim space in {self.path!r}"),
            Progress("collecting runs", len(dead), "runs", progress) as bar,
        ):
            for run_id in dead:  # first: the catalog forgot them, so no later gc would
                trash = trash_run_dir(self.paths, run_id)
                freed += 0 if trash is None else self._remove_dir(trash)
                bar.advance()
        orphans = staged_lost = 0  # (staged: runs listed failed or interrupted)
        with _os_errors(f"cannot reclaim space in {self.path!r}"):
            # Held shared, the catalog lock keeps writers from registering a run (whose
            # directory exists before its row commits) while directories are judged;
            # they are only renamed under it, and removed after.
            # A run sealed since collect() folded is complete: its rows wait in
            # runs/.sealed (read under the lock, which a seal takes exclusively). The
            # rows are read from the file here, not the mirror, whose refresh would fold
            # (an exclusive lock, under this shared one).
            with locked(self.paths.lock, exclusive=False):
                rows = read_runs(self.paths, "status != ?", [COLLECTED])
                live = {int(r["id"]) for r in rows}.union(self.paths.sealed_ids())
                for run_id in self.paths.run_dir_ids():
                    if run_id in live or run_id in dead or writer_alive(self.paths, run_id):
                        continue  # (dirs of collected runs: a gc() killed before removing)
                    orphans += trash_run_dir(self.paths, run_id) is not None
                for staged in self.paths.staging_dirs(old=True):  # failed, or whose
                    listed = len(staged_runs(staged))  # process died (a batch: its runs)
                    if trash_staged(self.paths, staged):
                        staged_lost += listed
                        orphans += not listed
            # What this gc() renamed, and what one killed half-way left.
            for trash in self.paths.trash_dirs():
                freed += self._remove_dir(trash)
        return {"runs": len(dead) + staged_lost, "orphans": orphans, "bytes": freed}

    def verify(self, tensors: bool = True, progress: bool | None = None) -> VerifyReport:
        """Check every chunk's checksum and that catalog and arrays agree.

        ``tensors=False``: the catalog's half only (the store's own files, and that each
        complete run's directory exists and belongs to its catalog row), reading no
        chunk: quick on any store. ``progress``: a bar when it takes over a second (None:
        in a terminal or notebook only)."""
        report = VerifyReport()
        self._catalog.fold()  # (sealed runs are complete runs: checked as those)
        verify_files(self.paths, report)
        if not self.paths.catalog.exists():  # no runs to check (and, if lost, reported)
            return report
        cursor = self._query("SELECT * FROM runs WHERE status = ? ORDER BY id", [COMPLETE], ())
        names = [d[0] for d in cursor.description]
        infos = [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]
        # each batch of runs' tensor rows in one statement (never a copy run by run)
        pairs = tensor_rows(self._query, infos) if tensors else ((i, []) for i in infos)
        with Progress("verifying", len(infos), "runs", progress) as bar:
            for info, tensor_list in pairs:
                bar.advance()
                try:
                    check_run_marker(self.paths, info["id"], info["name"], info.get("created"))
                    if not self.paths.run_dir(info["id"]).is_dir():
                        raise StoreError(f"the directory of run {info['name']!r} is missing")
                    if not tensors:
                        report.runs += 1
                        continue
                    run = self._open_run(info)
                except StoreError as exc:  # its directory holds another run's data
                    report.runs += 1
                    report.problems.append(Problem(info["name"], "-", str(exc)))
                    continue
                verify_run(run, tensor_list, report)
        return report

    def flush(self) -> None:
        """Insert the rows of every sealed run into the catalog file now. A run
        ``record`` returns is complete and durable, and every query (of any process)
        sees it; its rows reach ``catalog.duckdb`` itself with the next catalog
        transaction (every :data:`~tracelake.store.catalog.FOLD_AFTER` runs, a batch, a
        delete, ``gc()``, a reader's refresh, ``close()``, the process's exit). Call
        this before reading the file with DuckDB directly."""
        self._catalog.fold()

    def close(self) -> None:
        """Insert the rows of the runs it sealed into the catalog file, and let go of the
        catalog mirror (a store is usable again after: it reopens)."""
        if self._catalog.sealed_waiting:
            self._catalog.fold()
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _repr_html_(self) -> str:
        from tracelake.reprs import store_html  # notebook display sits downstream

        return store_html(self)

    def __repr__(self) -> str:
        return f"<Store {self.path!r}>"
