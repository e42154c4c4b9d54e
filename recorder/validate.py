"""``tl.validate``: recompute each saved op from its saved parents and its recorded
arguments, and compare with what was saved.

A trace or stored run recorded with ``CaptureOptions(record_args=True)`` knows, for
each op, its torch function and arguments (:mod:`.arguments`); its tensor arguments
are its parents' saved values and the model's parameters. Each saved op is recomputed
(without gradients, on copies of its inputs) and compared with its saved value: equal
bits, or within the dtype's tolerance (``torch.testing``'s defaults) since a saved
parent may have another memory layout than the live one had. Ops that cannot be
recomputed are listed with the reason (random ops in training mode, arguments or
parents that were not kept, functions outside torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from tracelake.errors import RecorderError

from .arguments import Unresolved, decode, resolve_function
from .backward import CaptureOptions
from .entries import OpEntry
from .held import held_tensors
from .intercept import flatten_tensors

__all__ = ["Mismatch", "ValidationReport", "validate"]

#: Functions whose result depends on the random number generator's state.
_RANDOM = frozenset(
    [
        "dropout",
        "dropout_",
        "alpha_dropout",
        "feature_alpha_dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "native_dropout",
        "rrelu",
        "rrelu_",
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "bernoulli_",
        "multinomial",
        "normal",
        "normal_",
        "uniform_",
        "poisson",
        "exponential_",
        "random_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "empty",
        "empty_like",
        "new_empty",
    ]
)
#: (rtol, atol) by dtype, as torch.testing.assert_close's defaults.
_TOLERANCE = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


@dataclass(frozen=True)
class Mismatch:
    """A saved op whose recomputation differs: ``max_diff`` is the largest absolute
    difference (``inf`` where shape or dtype differ)."""

    label: str
    func: str
    max_diff: float
    detail: str = ""

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.label} ({self.func}): max abs diff {self.max_diff:.3g}{extra}"


@dataclass
class ValidationReport:
    """What :func:`validate` found: ``matched`` (labels recomputed to their saved
    value), ``mismatches`` (:class:`Mismatch`), ``skipped`` (label -> why it could not
    be recomputed); labels of a run of several steps start with ``step k:``. True
    (``bool(report)``) when nothing mismatched."""

    matched: list[str] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether no recomputed op mismatched its saved value."""
        return not self.mismatches

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        lines = [
            f"{len(self.matched)} ops recomputed to their saved values, "
            f"{len(self.mismatches)} mismatched, {len(self.skipped)} skipped"
        ]
        lines += [f"  mismatch: {m}" for m in self.mismatches]
        return "\n".join(lines)


def _params_of(model: Any) -> dict[str, torch.Tensor]:
    if model is None:
        return {}
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model= takes the recorded torch.nn.Module, not {type(model).__name__}")
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    for name, tensor in held_tensors(model):  # recorded as buffers (held.py)
        named.setdefault(name, tensor)
    return named


def _compare(saved: torch.Tensor, got: Any) -> tuple[bool, float, str]:
    if not isinstance(got, torch.Tensor):
        return False, float("inf"), f"recomputed {type(got).__name__}, not a tensor"
    if got.shape != saved.shape or got.dtype != saved.dtype:
        return False, float("inf"), f"recomputed {tuple(got.shape)} {got.dtype}"
    got = got.detach().to(saved.device)
    if torch.equal(got, saved) or (saved.numel() == 0):
        return True, 0.0, ""
    if saved.dtype.is_floating_point or saved.dtype.is_complex:
        a, b = (
            got.to(torch.complex128 if saved.dtype.is_complex else torch.float64),
            saved.to(torch.complex128 if saved.dtype.is_complex else torch.float64),
        )
        same_nan = torch.isnan(a) == torch.isnan(b)
        diff = (a - b).abs().nan_to_num(nan=0.0)
        worst = float(diff.max()) if bool(same_nan.all()) else float("inf")
        rtol, atol = _TOLERANCE.get(saved.dtype, (1e-7, 1e-7))
        close = bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all())
        return close, worst, ""
    diff = (got.to(torch.float64) - saved.to(torch.float64)).abs()
    return False, float(diff.max()), ""


class _Recompute:
    """Recomputes the ops of one trace view."""

    def __init__(self, view: Any, calls: dict[int, Any], params: dict[str, torch.Tensor]):
        self.view = view
        self.calls = calls
        self.params = params
        self.model_missing = not params

    def _tensor(self, spec: dict[str, Any]) -> torch.Tensor:
        ((tag, body),) = spec.items()
        if tag == "$op":
            parent = self.view[int(body)]
            value = parent.out if parent.saved else None
            if value is None:
                raise Unresolved(f"its input {parent.label} was not saved")
            return value.clone()
        if tag == "$param":
            value = self.params.get(body)
            if value is None:
                raise Unresolved(
                    f"it uses {body}: pass the recorded model (model=)"
                    if self.model_missing
                    else f"the model has no parameter or buffer {body}"
                )
            return value.detach().clone()
        raise Unresolved("it uses a tensor that is neither a recorded op nor a parameter")

    def why_not(self, op: OpEntry, call: Any) -> str | None:
        """Why ``op`` cannot be recomputed, or None."""
        if call is None:
            return "its call's arguments were not recorded"
        base = op.func.rstrip("_") if op.inplace else op.func
        if op.func in _RANDOM or base in _RANDOM:
            training = call["kwargs"].get("training", call["kwargs"].get("train", True))
            if len(call["args"]) > 2 and isinstance(call["args"][2], bool):
                training = call["args"][2]
            if training is not False:
                return "a random op: its RNG state was not recorded"
        return None

    def run(self, op: OpEntry, call: Any) -> Any:
        name = call["fn"]
        args = decode(call["args"], self._tensor)
        kwargs = decode({"$dict": call["kwargs"]}, self._tensor) if call["kwargs"] else {}
        if name[0] == "getattr":
            return getattr(args[0], name[1])
        func = resolve_function(name)
        if func is None:
            raise Unresolved(f"{'.'.join(name) or op.func} is not a torch function")
        with torch.no_grad():
            out = func(*args, **kwargs)
        if out is None and name[1].endswith("__setitem__"):
            out = args[0]  # x[i] = v writes into x
        return flatten_tensors(out)[op.out_index]


def _calls_of(view: Any) -> dict[int, Any]:
    calls = view.call_args()
    return {i: json.loads(c) if isinstance(c, str) else c for i, c in calls.items()}


def _validate_view(
    view: Any, params: dict[str, torch.Tensor], report: ValidationReport, prefix: str = ""
) -> None:
    calls = _calls_of(view)
    if not calls:
        raise RecorderError(
            "this trace has no recorded call arguments, so its ops cannot be recomputed: "
            "record it with capture=tl.options.CaptureOptions(record_args=True), or call "
            "tl.validate(model, *inputs)"
        )
    recompute = _Recompute(view, calls, params)
    for op in view:
        if op.kind != "op" or not op.saved:
            continue
        call = calls.get(op.index)
        reason = recompute.why_not(op, call)
        if reason is None:
            try:
                got = recompute.run(op, call)
            except Unresolved as exc:
                reason = f"cannot recompute: {exc}"
            except Exception as exc:  # the function refused the recorded arguments
                reason = f"recomputing raised {type(exc).__name__}: {exc}"
        if reason is not None:
            report.skipped[prefix + op.label] = reason
            continue
        saved = op.out
        assert saved is not None
        same, worst, detail = _compare(saved, got)
        if same:
            report.matched.append(prefix + op.label)
        else:
            report.mismatches.append(Mismatch(prefix + op.label, op.func, worst, detail))


def validate(target: Any, *args: Any, model: Any = None, **kwargs: Any) -> ValidationReport:
    """Recompute each saved op of ``target`` from its saved parents and recorded
    arguments and report mismatches (by label, with the largest difference) and ops
    that could not be recomputed (with the reason).

    ``target``: a trace or stored run recorded with ``capture=tl.options.CaptureOptions(
    record_args=True)`` (``model=``: the recorded model, whose parameters the ops used;
    an in-memory trace remembers its model while it lives), or a model: then
    ``tl.validate(model, *inputs, **model_kwargs)`` records it first (every op saved)."""
    if isinstance(target, torch.nn.Module):
        from .capture import trace

        recorded = trace(target, *args, capture=CaptureOptions(record_args=True), **kwargs)
        try:
            return validate(recorded, model=target)
        finally:
            recorded.cleanup()
    if args or kwargs:
        raise TypeError(
            "model inputs go with a model (tl.validate(model, x)); a trace or run takes only model="
        )
    if model is None:
        ref = getattr(target, "model_ref", None)
        model = ref() if ref is not None else None
    params = _params_of(model)
    report = ValidationReport()
    views = target.steps if hasattr(target, "steps") else [target]
    for k, view in enumerate(views):
        if not hasattr(view, "call_args"):
            raise TypeError(
                f"tl.validate takes a model, a trace or a stored run, not {type(target).__name__}"
            )
        _validate_view(view, params, report, f"step {k}: " if len(views) > 1 else "")
    return report
