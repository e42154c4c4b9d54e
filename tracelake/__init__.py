"""tracelake: a persistent, queryable store of PyTorch execution traces.

    import tracelake as tl

    log = tl.trace(model, x, save=tl.func("relu"))
    log["relu_1_2"].out
"""

from tracelake.errors import (
    AmbiguousLabelError,
    LabelError,
    NestedTraceError,
    RecorderError,
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

__version__ = "0.1.0"

__all__ = [
    "AmbiguousLabelError",
    "LabelError",
    "ModuleEntry",
    "NestedTraceError",
    "OpEntry",
    "RecorderError",
    "Selector",
    "SourceLocation",
    "Stats",
    "Trace",
    "TraceLakeError",
    "TraceLakeWarning",
    "__version__",
    "all",
    "func",
    "in_module",
    "label",
    "module",
    "none",
    "trace",
]
