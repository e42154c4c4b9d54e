"""tracelake: a persistent, queryable store of PyTorch execution traces.

import tracelake as tl

log = tl.trace(model, x, save=tl.func("relu"))
log["relu_1_2"].out

store = tl.open("runs.tl")
run = store.record(model, x, name="baseline", save=tl.func("relu"))
store["baseline"]["relu_1_2"].out
"""

from tracelake import options
from tracelake.errors import (
    AmbiguousLabelError,
    CatalogError,
    ChunkCorruptError,
    InterventionError,
    InvalidRunNameError,
    LabelError,
    NestedTraceError,
    QueryCompileError,
    QueryError,
    QuerySyntaxError,
    RecorderError,
    RenderError,
    ReplayError,
    RunExistsError,
    RunNotFoundError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    TraceLakeError,
    TraceLakeWarning,
)
from tracelake.recorder import (
    ModuleEntry,
    OpEntry,
    Selector,
    SourceLocation,
    Stats,
    Trace,
    func,
    in_module,
    label,
    module,
    none,
    trace,
    validate,
)
from tracelake.recorder import all_ as all
from tracelake.recorder.actions import (
    add,
    clamp,
    mean_ablate,
    noise,
    project_off,
    replace_with,
    scale,
    steer,
    zero_ablate,
)
from tracelake.recorder.intervene import when
from tracelake.recorder.patch import patch_from
from tracelake.store import Comparison, Run, Store
from tracelake.store import open_store as open
from tracelake.store.compare import compare

__version__ = "0.1.0"


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext tracelake``: the ``%tlq`` / ``%%tlq`` query magics."""
    from tracelake.magics import load_ipython_extension as load

    load(ipython)


__all__ = [
    "AmbiguousLabelError",
    "CatalogError",
    "ChunkCorruptError",
    "Comparison",
    "InterventionError",
    "InvalidRunNameError",
    "LabelError",
    "ModuleEntry",
    "NestedTraceError",
    "OpEntry",
    "QueryCompileError",
    "QueryError",
    "QuerySyntaxError",
    "RecorderError",
    "RenderError",
    "ReplayError",
    "Run",
    "RunExistsError",
    "RunNotFoundError",
    "Selector",
    "SourceLocation",
    "Stats",
    "Store",
    "StoreError",
    "StoreFormatError",
    "StoreNotFoundError",
    "Trace",
    "TraceLakeError",
    "TraceLakeWarning",
    "__version__",
    "add",
    "all",
    "clamp",
    "compare",
    "func",
    "in_module",
    "label",
    "mean_ablate",
    "module",
    "noise",
    "none",
    "open",
    "options",
    "patch_from",
    "project_off",
    "replace_with",
    "scale",
    "steer",
    "trace",
    "validate",
    "when",
    "zero_ablate",
]
