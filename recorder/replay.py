"""Replay: run a recording's forward pass again from its saved inputs, with its
interventions, and say op by op whether the values came out the same.

A recording keeps how the model was called (:func:`encode_call`: the arguments as
JSON, each tensor named by the input entry that holds it) and its rules as JSON specs;
:func:`replay_plan` checks, before anything runs, that both can be rebuilt and that the
inputs were saved, and says what stands in the way otherwise (:class:`ReplayError`).
:func:`compare_views` compares two recordings of the same graph op by op: bitwise where
device and dtype agree, within a tolerance where they do not.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tracelake.errors import ReplayError

from .eager import named_modules
from .inputs import input_tensors
from .rng import drawing_as_recorded

if TYPE_CHECKING:
    import pandas

    from .intervene import Rule
    from .trace import TraceView

__all__ = [
    "ReplayReport",
    "as_recorded",
    "bitwise_equal",
    "compare_views",
    "decode_call",
    "encode_call",
    "replay_trace",
    "training_modes",
]

_PLAIN = (type(None), bool, int, str)


def training_modes(
    model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> bool | list[str]:
    """Which of ``model``'s modules are in training mode: ``True`` or ``False`` for all
    of them alike, else the paths of those that are (``named_modules()``'s; ``modules``:
    them, where the caller has them already)."""
    modules = named_modules(model) if modules is None else modules
    training = [path for path, module in modules if module.training]
    if not modules:
        return model.training
    return training if 0 < len(training) < len(modules) else bool(training)


@contextlib.contextmanager
def as_recorded(text: str, model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model`` runs as the forward the recorded call ``text``
    describes did: its modules in the training modes they had (``"training"``, set on
    each module, not through ``train()``) and torch's generators where they began
    (``"rng"``, :func:`.rng.drawing_as_recorded`); on leaving, the modes and generators
    the caller had come back. A call recorded before these were kept leaves them alone."""
    call = json.loads(text)
    recorded = call.get("training")
    kept: list[tuple[torch.nn.Module, bool]] = []
    if isinstance(recorded, (bool, list)):
        train = set(recorded) if isinstance(recorded, list) else None
        for path, module in named_modules(model):
            kept.append((module, module.training))
            module.training = bool(recorded) if train is None else path in train
    try:
        drawn = call.get("rng")
        with drawing_as_recorded(drawn if isinstance(drawn, dict) else None):
            yield
    finally:
        for module, training in kept:
            module.training = training


def encode_call(
    args: tuple,
    kwargs: dict,
    drawn: dict[str, str] | None = None,
    training: bool | list[str] | None = None,
) -> str:
    """How the model was called, as JSON: ``{"args": [...], "kwargs": {...}}`` (and
    ``"rng"``: the generator states a forward that drew random numbers began with,
    :attr:`.rng.RngWatch.drawn`; ``"training"``: its modules' training modes,
    :func:`training_modes`) with each
    tensor as ``{"$input": k}`` (the k-th input entry: :func:`.inputs.input_tensors`),
    lists, tuples and str-keyed dicts as they are, and anything else as
    ``{"$unsupported": type}`` (such a call cannot be replayed, which
    :func:`decode_call` says)."""
    position = {id(tensor): k for k, tensor in enumerate(input_tensors(args, kwargs))}

    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            k = position.get(id(value))
            return {"$input": k} if k is not None else {"$unsupported": "Tensor"}
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        if type(value) in (list, tuple):
            return (
                {"$tuple": [encode(v) for v in value]}
                if type(value) is tuple
                else [encode(v) for v in value]
            )
        if type(value) is dict and all(isinstance(k, str) for k in value):
            return {"$dict": {k: encode(v) for k, v in value.items()}}
        return {"$unsupported": type(value).__qualname__}

    call = {"args": [encode(a) for a in args], "kwargs": encode(dict(kwargs))}
    if drawn:
        call["rng"] = drawn
    if training is not None:
        call["training"] = training
    return json.dumps(call)


def decode_call(text: str, inputs: list[torch.Tensor]) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` :func:`encode_call` described, with the given input
    tensors; :class:`ReplayError` for what it could not describe."""

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if isinstance(value, dict):
            if "$input" in value:
                return inputs[value["$input"]]
            if "$tuple" in value:
                return tuple(decode(v) for v in value["$tuple"])
            if "$dict" in value:
                return {k: decode(v) for k, v in value["$dict"].items()}
            if "$float" in value:
                return float(value["$float"])
            raise ReplayError(
                f"the model was called with a {value.get('$unsupported', '?')} argument, "
                "which a recording does not keep; this call cannot be replayed"
            )
        return value

    call = json.loads(text)
    return tuple(decode(a) for a in call["args"]), decode(call["kwargs"])


def call_problems(text: str | None) -> list[str]:
    """What keeps a stored call from being rebuilt (empty: nothing)."""
    if text is None:
        return ["the run keeps no record of how the model was called (recorded before replay)"]
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            if "$unsupported" in value:
                found.append(f"an argument of type {value['$unsupported']} is not kept")
            for v in value.values():
                walk(v)

    walk(json.loads(text))
    return found


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    try:
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    except RuntimeError:
        return bool(torch.equal(a, b))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    try:
        diff = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
    except RuntimeError:
        return None
    return float(diff.max()) if diff.numel() else 0.0


@dataclass
class ReplayReport:
    """What a replay found, op by op: ``rows`` (step, idx, label, key, status,
    max_abs_diff), status ``same`` (bitwise), ``close`` (within tolerance, where device
    or dtype differ), ``differs``, ``missing`` (the replay has no such op), ``unsaved``
    (the recording did not save it: nothing to compare). ``run`` is the replay's own
    stored run when it was recorded as one; ``traces`` the in-memory ones otherwise."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    run: Any = None
    traces: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every saved op was reproduced."""
        return all(r["status"] in ("same", "close", "unsaved") for r in self.rows)

    @property
    def mismatches(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] in ("differs", "missing")]

    @property
    def compared(self) -> int:
        return sum(r["status"] != "unsaved" for r in self.rows)

    def df(self) -> pandas.DataFrame:
        import pandas

        return pandas.DataFrame(
            self.rows, columns=["step", "idx", "label", "key", "status", "max_abs_diff"]
        )

    def __repr__(self) -> str:
        bad = self.mismatches
        head = f"<ReplayReport: {self.compared} saved ops compared, "
        if not bad:
            return head + "all reproduced>"
        first = bad[0]
        return head + f"{len(bad)} not reproduced, first {first['label']} ({first['status']})>"


def compare_views(
    step: int,
    stored: TraceView,
    replayed: TraceView,
    report: ReplayReport,
    atol: float,
    rtol: float,
) -> None:
    """Add one row per op of ``stored`` to ``report``: the replayed op at the same place
    (same label) compared with it."""
    others = list(replayed)
    for op in stored:
        row = {"step": step, "idx": op.index, "label": op.label, "key": op.key}
        other = others[op.index] if op.index < len(others) else None
        if other is None or other.label != op.label:
            report.rows.append({**row, "status": "missing", "max_abs_diff": None})
            continue
        expected = op.out
        if expected is None:
            report.rows.append({**row, "status": "unsaved", "max_abs_diff": None})
            continue
        got = other.out
        if got is None:
            report.rows.append({**row, "status": "missing", "max_abs_diff": None})
            continue
        if op.device == other.device and expected.dtype == got.dtype:
            same = bitwise_equal(expected, got)
            status = "same" if same else "differs"
        else:
            same = expected.shape == got.shape and torch.allclose(
                expected.detach().cpu().double(),
                got.detach().cpu().double(),
                atol=atol,
                rtol=rtol,
                equal_nan=True,
            )
            status = "close" if same else "differs"
        diff = 0.0 if status == "same" else _max_diff(expected, got)
        report.rows.append({**row, "status": status, "max_abs_diff": diff})


def saved_inputs(view: TraceView, what: str) -> list[torch.Tensor]:
    """The saved values of a recording's inputs, in order; :class:`ReplayError` naming
    the inputs it did not save."""
    inputs = view.inputs
    missing = [op.label for op in inputs if not op.saved]
    if missing:
        raise ReplayError(
            f"{what} cannot be replayed: its inputs {', '.join(missing)} were not saved "
            "(record with save= selecting them, e.g. save=tl.all() or tl.label('input_1'))"
        )
    return [op.out for op in inputs]  # type: ignore[misc]


def replay_plan(what: str, problems: list[str]) -> None:
    """Raise :class:`ReplayError` listing ``problems``, if any."""
    if problems:
        raise ReplayError(f"{what} cannot be replayed: " + "; ".join(problems))


def replay_trace(
    trace: Any, model: torch.nn.Module, atol: float = 1e-6, rtol: float = 1e-5
) -> ReplayReport:
    """Run ``trace``'s forward pass again (``trace.replay(model)``)."""
    from .capture import trace as record
    from .intervene import rules_from_audit

    what = f"this trace of {trace.model_class}"
    interventions = getattr(trace, "interventions", None)
    problems = call_problems(getattr(trace, "call", None))
    if interventions is not None:
        problems += interventions.not_replayable
    replay_plan(what, problems)
    inputs = [t.clone() for t in saved_inputs(trace, what)]
    args, kwargs = decode_call(trace.call, inputs)
    rules: tuple[Rule, ...] = rules_from_audit(interventions.audit()) if interventions else ()
    with as_recorded(trace.call, model):
        again = record(model, *args, intervene=list(rules) or None, **kwargs)
    report = ReplayReport(traces=[again])
    compare_views(0, trace, again, report, atol, rtol)
    return report
