"""tracelake: a persistent, queryable store of PyTorch execution traces.

import tracelake as tl

log = tl.trace(model, x, save=tl.func("relu"))
log["relu_1_2"].out

store = tl.open("runs.tl")
run = store.record(model, x, name="baseline", save=tl.func("relu"))
store["baseline"]["relu_1_2"].out
"""

from tracelake.errors import (
    AmbiguousLabelError,
    CatalogError,
    ChunkCorruptError,
    ConcurrentRecordingError,
    InvalidMetaError,
    InvalidRunNameError,
    LabelError,
    NestedTraceError,
    QueryCompileError,
    QueryError,
    QueryLimitError,
    QueryResultError,
    QuerySyntaxError,
    QueryTypeError,
    RecorderError,
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
)
from tracelake.recorder import all_ as all
from tracelake.store import Comparison, Run, Store
from tracelake.store import open_store as open
from tracelake.store.catalog import set_query_limits
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
    "ConcurrentRecordingError",
    "InvalidMetaError",
    "InvalidRunNameError",
    "LabelError",
    "ModuleEntry",
    "NestedTraceError",
    "OpEntry",
    "QueryCompileError",
    "QueryError",
    "QueryLimitError",
    "QueryResultError",
    "QuerySyntaxError",
    "QueryTypeError",
    "RecorderError",
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
    "all",
    "compare",
    "func",
    "in_module",
    "label",
    "module",
    "none",
    "open",
    "set_query_limits",
    "trace",
]
