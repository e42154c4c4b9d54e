"""The recorder: capture a forward pass at operation resolution.

Stages, each in its own module and none importing a later one:
``intercept`` (torch function mode + module hooks) → ``label`` (entries, layers,
passes) → ``emit`` (what to keep); ``capture`` wires them for ``tl.trace``.

The names below load their module when first read (``tracelake._lazy``): importing
``tracelake.recorder.record`` (the row layout the store and the query room derive their
tables from) does not import torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .capture import ForwardRecording, check_model, record_forward, trace
    from .entries import ModuleEntry, OpEntry, OpTable, SourceLocation
    from .selectors import Selector, all_, func, in_module, label, module, none
    from .stats import Stats, compute_stats
    from .trace import Trace, TraceView
    from .validate import ValidationReport, validate
else:
    from tracelake._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            **dict.fromkeys(
                ("ForwardRecording", "check_model", "record_forward", "trace"), ".capture"
            ),
            **dict.fromkeys(("ModuleEntry", "OpEntry", "OpTable", "SourceLocation"), ".entries"),
            **dict.fromkeys(
                ("Selector", "all_", "func", "in_module", "label", "module", "none"), ".selectors"
            ),
            **dict.fromkeys(("Stats", "compute_stats"), ".stats"),
            # (`trace` is the function: the module recorder/trace.py is reached by its path)
            **dict.fromkeys(("Trace", "TraceView"), ".trace"),
            **dict.fromkeys(("ValidationReport", "validate"), ".validate"),
        },
    )

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
