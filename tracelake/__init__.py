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
    ArgumentClashError,
    CatalogError,
    ChunkCorruptError,
    ConcurrentRecordingError,
    InterventionError,
    InvalidMetaError,
    InvalidRunNameError,
    LabelError,
    MissingExtraError,
    NestedTraceError,
    QueryCompileError,
    QueryError,
    QueryLimitError,
    QueryResultError,
    QuerySyntaxError,
    QueryTypeError,
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

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, the lazy table below
    from tracelake import options
    from tracelake.query.results import Result
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
    from tracelake.recorder.capture import trace
    from tracelake.recorder.entries import ModuleEntry, OpEntry, SourceLocation
    from tracelake.recorder.intervene import when
    from tracelake.recorder.patch import patch_from
    from tracelake.recorder.selectors import Selector, func, in_module, label, module, none
    from tracelake.recorder.selectors import all_ as all
    from tracelake.recorder.stats import Stats
    from tracelake.recorder.trace import Trace
    from tracelake.recorder.validate import ValidationReport, validate
    from tracelake.store.catalog import set_query_limits
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
            "ValidationReport": "tracelake.recorder.validate",
            "VerifyReport": "tracelake.store.verify",
            "add": "tracelake.recorder.actions",
            "all": "tracelake.recorder.selectors:all_",
            "clamp": "tracelake.recorder.actions",
            "compare": "tracelake.store.compare",
            "func": "tracelake.recorder.selectors",
            "in_module": "tracelake.recorder.selectors",
            "label": "tracelake.recorder.selectors",
            "mean_ablate": "tracelake.recorder.actions",
            "module": "tracelake.recorder.selectors",
            "noise": "tracelake.recorder.actions",
            "none": "tracelake.recorder.selectors",
            "open": "tracelake.store.store:open_store",
            "options": "tracelake.options:",
            "set_query_limits": "tracelake.store.catalog",
            "patch_from": "tracelake.recorder.patch",
            "project_off": "tracelake.recorder.actions",
            "replace_with": "tracelake.recorder.actions",
            "scale": "tracelake.recorder.actions",
            "steer": "tracelake.recorder.actions",
            "trace": "tracelake.recorder.capture",
            "validate": "tracelake.recorder.validate",
            "when": "tracelake.recorder.intervene",
            "zero_ablate": "tracelake.recorder.actions",
        },
    )


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext tracelake``: the ``%tlq`` / ``%%tlq`` query magics."""
    from tracelake.magics import load_ipython_extension as load

    load(ipython)


__all__ = [
    "AmbiguousLabelError",
    "ArgumentClashError",
    "CatalogError",
    "ChunkCorruptError",
    "Comparison",
    "ConcurrentRecordingError",
    "InterventionError",
    "InvalidMetaError",
    "InvalidRunNameError",
    "LabelError",
    "LazyTensor",
    "MissingExtraError",
    "ModuleEntry",
    "NestedTraceError",
    "OpEntry",
    "Problem",
    "QueryCompileError",
    "QueryError",
    "QueryLimitError",
    "QueryResultError",
    "QuerySyntaxError",
    "QueryTypeError",
    "RecorderError",
    "Recording",
    "RenderError",
    "ReplayError",
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
    "ValidationReport",
    "VerifyReport",
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
    "set_query_limits",
    "steer",
    "trace",
    "validate",
    "when",
    "zero_ablate",
]
