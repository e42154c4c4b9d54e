"""Intervention actions: what ``tl.when(selector, action)`` does to a selected op's output.

Spelled and signed as TorchLens 2.36.1's helpers: ``tl.zero_ablate()``,
``tl.mean_ablate(source=None, over="self")``, ``tl.scale(factor)``, ``tl.add(delta)``,
``tl.clamp(min=, max=)``, ``tl.noise(std, seed=)``, ``tl.steer(direction, magnitude)``,
``tl.project_off(direction)``, ``tl.replace_with(value)`` and ``tl.patch_from(source)``
(in :mod:`.patch`). Each is an :class:`Action`: a name and its arguments, kept as a JSON
spec (tensors as ``{"$tensor": ...}``: dtype, shape and the bytes in base64, so a spec
rebuilds the very same action, bit for bit, without pickle). A plain Python callable
``fn(out, *, hook)`` is an action too, recorded by its qualified name and not replayable.
"""

from __future__ import annotations

import base64
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tracelake.errors import InterventionError

from .selectors import Selector

__all__ = [
    "HELPERS",
    "Action",
    "HookContext",
    "action_from_spec",
    "add",
    "as_action",
    "clamp",
    "decode_value",
    "encode_value",
    "mean_ablate",
    "noise",
    "project_off",
    "replace_with",
    "scale",
    "steer",
    "zero_ablate",
]

#: The one mean policy TorchLens implements for ``mean_ablate(over=)``.
_MEAN_OVER = ("self",)


@dataclass(frozen=True)
class HookContext:
    """What an action learns about the op it changes: its layer label and pass as
    numbered so far (the final ones are written when the recording ends), its stable
    key, function, innermost module, position in execution order, the number of the
    rule, and ``label``: its final label where a graph recorded before in this process
    tells it (the same model again), else the one numbered so far."""

    layer: str
    pass_num: int
    key: str
    func: str
    module: str
    index: int
    rule: int
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:  # (no final label known yet: the one numbered so far)
            label = self.layer if self.pass_num == 1 else f"{self.layer}:{self.pass_num}"
            object.__setattr__(self, "label", label)

    @property
    def where(self) -> str:
        """How messages name the op: ``add_5_20 (transformer.h.3:add#2)``."""
        return f"{self.label} ({self.key})"


Apply = Callable[[torch.Tensor, HookContext], torch.Tensor]


class Action:
    """One intervention action: ``apply(out, hook)`` returns the op's new output.

    ``name`` and ``params`` are its spec (``spec()``, JSON); ``replayable`` says whether a
    spec rebuilds it (``reason`` says why not)."""

    def __init__(
        self,
        name: str,
        params: dict[str, Any],
        apply: Apply,
        replayable: bool = True,
        reason: str | None = None,
    ):
        self.name = name
        self.params = params
        self._apply = apply
        self.replayable = replayable
        self.reason = reason

    def apply(self, out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        return self._apply(out, hook)

    def prepare(self, step: int, selector: Selector | None = None) -> None:
        """Called before each forward pass (step) the action may run in, with the
        selector of its rule."""

    def spec(self) -> dict[str, Any]:
        return {"helper": self.name, "params": encode_value(self.params)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"tl.{self.name}({args})"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    return repr(value)


# -- JSON specs -------------------------------------------------------------------------


def encode_value(value: Any) -> Any:
    """``value`` as JSON: plain values as they are, tensors as ``{"$tensor": {dtype,
    shape, data}}`` (data: the bytes, base64), lists, tuples and str-keyed dicts
    recursively."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {
            "$tensor": {
                "dtype": str(data.dtype).removeprefix("torch."),
                "shape": list(data.shape),
                "data": base64.b64encode(raw).decode("ascii"),
            }
        }
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode_value(v) for k, v in value.items()}
    raise TypeError(f"cannot keep a {type(value).__name__} in an intervention spec")


def decode_value(value: Any) -> Any:
    """The inverse of :func:`encode_value`."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            spec = value["$tensor"]
            dtype = getattr(torch, str(spec["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise InterventionError(f"unknown dtype {spec['dtype']!r} in a stored spec")
            raw = bytearray(base64.b64decode(spec["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0)
            return (
                flat.view(dtype).reshape(spec["shape"])
                if raw
                else torch.empty(spec["shape"], dtype=dtype)
            )
        return {k: decode_value(v) for k, v in value.items()}
    return value


# -- checks -----------------------------------------------------------------------------


def _number(helper: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"tl.{helper}({name}=...) takes a number, not {value!r}")
    return value


def _tensor_or_number(helper: str, name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return _number(helper, name, value)


def _source_tensor(helper: str, source: Any) -> torch.Tensor:
    """A tensor, or an op entry's saved value (``trace[label]``)."""
    if isinstance(source, torch.Tensor):
        return source.detach().clone()
    out = getattr(source, "out", None)
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    raise TypeError(
        f"tl.{helper}(source) takes a tensor or a saved op (trace[label]), not {source!r}"
    )


def _same_as(value: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return value.to(device=out.device, dtype=out.dtype)


def _align(direction: torch.Tensor, out: torch.Tensor, axis: int | None) -> torch.Tensor:
    """``direction`` shaped to broadcast against ``out`` (as TorchLens aligns it): the
    same shape, a vector along ``feature_axis``, or anything that broadcasts."""
    if tuple(direction.shape) == tuple(out.shape):
        return direction
    if direction.ndim == 1 and out.ndim > 1:
        if axis is None:
            raise InterventionError(
                "a vector direction needs feature_axis= to say which axis of the output it "
                f"runs along (the output has shape {list(out.shape)})"
            )
        axis = axis % out.ndim
        if direction.shape[0] != out.shape[axis]:
            raise InterventionError(
                f"direction length {direction.shape[0]} does not match axis {axis} of the "
                f"output (size {out.shape[axis]})"
            )
        shape = [1] * out.ndim
        shape[axis] = direction.shape[0]
        return direction.reshape(shape)
    try:
        torch.broadcast_shapes(tuple(direction.shape), tuple(out.shape))
    except RuntimeError as exc:
        raise InterventionError(
            f"direction shape {list(direction.shape)} cannot broadcast to the output's "
            f"{list(out.shape)}"
        ) from exc
    return direction


# -- the helpers ------------------------------------------------------------------------


def zero_ablate() -> Action:
    """Replace the output with zeros."""
    return Action("zero_ablate", {}, lambda out, hook: torch.zeros_like(out))


def mean_ablate(source: Any = None, *, over: str = "self") -> Action:
    """Fill the output with one mean: of ``source`` (a tensor or a saved op) when given,
    else of the output itself (``over="self"``, the one policy TorchLens implements)."""
    if over not in _MEAN_OVER:
        raise ValueError(f"tl.mean_ablate(over={over!r}): the only mean policy is 'self'")
    fixed = None if source is None else _source_tensor("mean_ablate", source)

    def apply(out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        base = out if fixed is None else _same_as(fixed, out)
        return torch.zeros_like(out) + base.mean()

    return Action("mean_ablate", {"source": fixed, "over": over}, apply)


def scale(factor: float) -> Action:
    """Multiply the output by ``factor``."""
    factor = _number("scale", "factor", factor)
    return Action("scale", {"factor": factor}, lambda out, hook: out * factor)


def add(delta: torch.Tensor | float) -> Action:
    """Add ``delta`` (a number or a tensor that broadcasts) to the output."""
    delta = _tensor_or_number("add", "delta", delta)

    def apply(out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        return out + (_same_as(delta, out) if isinstance(delta, torch.Tensor) else delta)

    return Action("add", {"delta": delta}, apply)


def clamp(*, min: float | None = None, max: float | None = None) -> Action:
    """Clamp the output to ``[min, max]`` (either may be left out, not both)."""
    if min is None and max is None:
        raise ValueError("tl.clamp() needs min=, max= or both")
    low = None if min is None else _number("clamp", "min", min)
    high = None if max is None else _number("clamp", "max", max)
    return Action(
        "clamp",
        {"min": low, "max": high},
        lambda out, hook: torch.clamp(out, min=low, max=high),
    )


def noise(std: float, *, seed: int | None = None) -> Action:
    """Add Gaussian noise of standard deviation ``std``. With ``seed``, a generator of
    its own (the global RNG is untouched) seeded anew for each forward pass, so a replay
    draws the same noise; without, the run is not replayable."""
    std = _number("noise", "std", std)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"tl.noise(seed=...) takes an int, not {seed!r}")
    generator = torch.Generator() if seed is not None else None

    def apply(out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        if generator is None:
            sample = torch.randn(out.shape, dtype=out.dtype, device=out.device)
        else:
            sample = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)
        return out + sample * std

    action = Action(
        "noise",
        {"std": std, "seed": seed},
        apply,
        replayable=seed is not None,
        reason=None if seed is not None else "tl.noise without seed= draws from the global RNG",
    )
    if generator is not None and seed is not None:
        start = seed

        def reseed(step: int, selector: Selector | None = None) -> None:
            generator.manual_seed(start)  # each forward pass draws the same noise

        action.prepare = reseed  # type: ignore[method-assign]
    return action


def steer(
    direction: torch.Tensor, magnitude: float = 1.0, *, feature_axis: int | None = None
) -> Action:
    """Add ``magnitude * direction`` (a vector needs ``feature_axis``)."""
    if not isinstance(direction, torch.Tensor):
        raise TypeError(f"tl.steer(direction) takes a tensor, not {direction!r}")
    direction = direction.detach().clone()
    magnitude = _number("steer", "magnitude", magnitude)

    def apply(out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        aligned = _same_as(_align(direction, out, feature_axis), out)
        return out + aligned * magnitude

    params = {"direction": direction, "magnitude": magnitude, "feature_axis": feature_axis}
    return Action("steer", params, apply)


def project_off(direction: torch.Tensor, *, feature_axis: int | None = None) -> Action:
    """Remove the output's component along ``direction`` (over the whole output, or
    along ``feature_axis`` for a vector)."""
    if not isinstance(direction, torch.Tensor):
        raise TypeError(f"tl.project_off(direction) takes a tensor, not {direction!r}")
    direction = direction.detach().clone()

    def apply(out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        aligned = _same_as(_align(direction, out, feature_axis), out)
        dims: Any = tuple(range(out.ndim)) if feature_axis is None else feature_axis % out.ndim
        denom = torch.sum(aligned * aligned, dim=dims, keepdim=True)
        if bool(torch.any(denom == 0)):
            raise InterventionError(f"tl.project_off at {hook.where}: the direction is zero")
        return out - aligned * (torch.sum(out * aligned, dim=dims, keepdim=True) / denom)

    return Action("project_off", {"direction": direction, "feature_axis": feature_axis}, apply)


def replace_with(value: torch.Tensor | Callable[[], torch.Tensor]) -> Action:
    """Replace the output with ``value`` (a tensor of the output's shape, or a function
    of no arguments returning one: recorded by name, not replayable)."""
    if isinstance(value, torch.Tensor):
        fixed = value.detach().clone()
        return Action(
            "replace_with", {"value": fixed}, lambda out, hook: _same_as(fixed, out).clone()
        )
    if callable(value):
        name = qualified_name(value)
        return Action(
            "replace_with",
            {"value": {"callable": name}},
            lambda out, hook: _same_as(value(), out).clone(),
            replayable=False,
            reason=f"tl.replace_with takes a user callable ({name})",
        )
    raise TypeError(f"tl.replace_with(value) takes a tensor or a function, not {value!r}")


def qualified_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


def _user_callable(fn: Callable[..., Any]) -> Action:
    """``fn(out, *, hook)`` as an action: recorded by its qualified name only."""
    try:
        inspect.signature(fn).bind(torch.empty(0), hook=None)
    except TypeError as exc:
        raise TypeError(
            f"an intervention callable is called as fn(out, *, hook); "
            f"{qualified_name(fn)} cannot be ({exc})"
        ) from None
    except ValueError:  # builtins without a signature: called as they are
        pass
    name = qualified_name(fn)

    def apply(out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        result = fn(out, hook=hook)
        if not isinstance(result, torch.Tensor):
            raise InterventionError(
                f"the intervention callable {name} returned {type(result).__name__} at "
                f"{hook.where}; it must return a tensor"
            )
        return result

    return Action(
        "callable",
        {"qualname": name},
        apply,
        replayable=False,
        reason=f"a user callable ({name}) is recorded by name only",
    )


def as_action(action: Any) -> Action:
    if isinstance(action, Action):
        return action
    if callable(action):
        return _user_callable(action)
    raise TypeError(
        f"tl.when(selector, action) takes a helper such as tl.zero_ablate() or a callable "
        f"fn(out, *, hook), not {type(action).__name__} {action!r}"
    )


#: The helpers a stored spec may name, by name (``patch_from`` is added by .patch).
HELPERS: dict[str, Callable[..., Action]] = {
    "zero_ablate": zero_ablate,
    "mean_ablate": mean_ablate,
    "scale": scale,
    "add": add,
    "clamp": clamp,
    "noise": noise,
    "steer": steer,
    "project_off": project_off,
    "replace_with": replace_with,
}


def action_from_spec(spec: dict[str, Any], **context: Any) -> Action:
    """The action a stored spec describes (``context``: what rebuilding needs besides
    the spec, such as the store a ``patch_from`` reads from)."""
    name = spec.get("helper")
    build = HELPERS.get(str(name))
    if build is None:
        raise InterventionError(f"a stored intervention names no known helper: {name!r}")
    params = decode_value(spec.get("params") or {})
    if name == "patch_from":
        return build(**params, **context)
    if name == "replace_with" and isinstance(params.get("value"), dict):
        raise InterventionError("tl.replace_with of a user callable cannot be rebuilt")
    return build(**params)
