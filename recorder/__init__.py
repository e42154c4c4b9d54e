"""The recorder: capture a forward pass at operation resolution.

Stages, each in its own module and none importing a later one:
``intercept`` (torch function mode + module hooks) → ``label`` (entries, layers,
passes) → ``emit`` (what to keep); ``capture`` wires them for ``tl.trace``.
"""

from .capture import ForwardRecording, check_model, record_forward, trace
from .entries import ModuleEntry, OpEntry, OpTable, SourceLocation
from .selectors import Selector, all_, func, in_module, label, module, none
from .stats import Stats, compute_stats
from .trace import Trace, TraceView
from .validate import ValidationReport, validate

__all__ = [
    "ForwardRecording",
    "ModuleEntry",
    "OpEntry",
    "OpTable",
    "Selector",
    "SourceLocation",
    "Stats",
    "Trace",
    "TraceView",
    "ValidationReport",
    "all_",
    "check_model",
    "compute_stats",
    "func",
    "in_module",
    "label",
    "module",
    "none",
    "record_forward",
    "trace",
    "validate",
]
