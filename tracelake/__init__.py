"""tracelake: a persistent, queryable store of PyTorch execution traces.

import tracelake as tl

log = tl.trace(model, x, save=tl.func("relu"))
log["relu_1_2"].out

store = tl.open("runs.tl")
run = store.record(model, x, name="baseline", save=tl.func("relu"))
store["baseline"]["relu_1_2"].out
"""

from typing import TYPE_CHECKING

from tracelake.errors import (
    AmbiguousLabelError,
    CatalogError,
    ChunkCorruptError,
    InvalidRunNameError,
    LabelError,
    NestedTraceError,
    QueryCompileError,
    QueryError,
    QuerySyntaxError,
    RecorderError,
    RunExistsError,
    RunNotFoundError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    TraceLakeError,
    TraceLakeWarning,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, the lazy table below
    from tracelake.query.results import Result
    from tracelake.recorder.capture import trace
    from tracelake.recorder.entries import ModuleEntry, OpEntry, SourceLocation
    from tracelake.recorder.selectors import Selector, func, in_module, label, module, none
    from tracelake.recorder.selectors import all_ as all
    from tracelake.recorder.stats import Stats
    from tracelake.recorder.trace import Trace
    from tracelake.store.compare import Comparison, compare
    from tracelake.store.run import LazyTensor, Run, StepView
    from tracelake.store.store import Recording, Store
    from tracelake.store.store import open_store as open
    from tracelake.store.verify import Problem, VerifyReport
else:
    from tracelake._lazy import lazy_exports

    # torch loads with the first of these a program uses, not with `import tracelake`:
    # the command line's catalog-only commands never need it.
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "Comparison": "tracelake.store.compare",
            "LazyTensor": "tracelake.store.run",
            "ModuleEntry": "tracelake.recorder.entries",
            "OpEntry": "tracelake.recorder.entries",
            "Problem": "tracelake.store.verify",
            "Recording": "tracelake.store.store",
            "Result": "tracelake.query.results",
            "Run": "tracelake.store.run",
            "Selector": "tracelake.recorder.selectors",
            "SourceLocation": "tracelake.recorder.entries",
            "Stats": "tracelake.recorder.stats",
            "StepView": "tracelake.store.run",
            "Store": "tracelake.store.store",
            "Trace": "tracelake.recorder.trace",
            "VerifyReport": "tracelake.store.verify",
            "all": "tracelake.recorder.selectors:all_",
            "compare": "tracelake.store.compare",
            "func": "tracelake.recorder.selectors",
            "in_module": "tracelake.recorder.selectors",
            "label": "tracelake.recorder.selectors",
            "module": "tracelake.recorder.selectors",
            "none": "tracelake.recorder.selectors",
            "open": "tracelake.store.store:open_store",
            "trace": "tracelake.recorder.capture",
        },
    )


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext tracelake``: the ``%tlq`` / ``%%tlq`` query magics."""
    from tracelake.magics import load_ipython_extension as load

    load(ipython)


__all__ = [
    "AmbiguousLabelError",
    "CatalogError",
    "ChunkCorruptError",
    "Comparison",
    "InvalidRunNameError",
    "LabelError",
    "LazyTensor",
    "ModuleEntry",
    "NestedTraceError",
    "OpEntry",
    "Problem",
    "QueryCompileError",
    "QueryError",
    "QuerySyntaxError",
    "RecorderError",
    "Recording",
    "Result",
    "Run",
    "RunExistsError",
    "RunNotFoundError",
    "Selector",
    "SourceLocation",
    "Stats",
    "StepView",
    "Store",
    "StoreError",
    "StoreFormatError",
    "StoreNotFoundError",
    "Trace",
    "TraceLakeError",
    "TraceLakeWarning",
    "VerifyReport",
    "__version__",
    "all",
    "compare",
    "func",
    "in_module",
    "label",
    "module",
    "none",
    "open",
    "trace",
]
