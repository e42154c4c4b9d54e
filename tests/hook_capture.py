"""Module calls as plain PyTorch forward hooks see them: the reference the recorder and
the store are compared against, bit for bit."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HookRun",
    "assert_all_bitwise",
    "assert_bitwise",
    "call_label",
    "clone_leaves",
    "flatten",
    "run_with_hooks",
]


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """``a`` and ``b`` have the same dtype, shape and device and identical bits.

    Compares the raw bytes, so NaNs with equal payloads compare equal and ``-0.0`` differs
    from ``0.0``: stricter than ``torch.equal``.
    """
    where = f" ({what})" if what else ""
    assert isinstance(a, torch.Tensor), f"not a tensor{where}: {type(a).__name__}"
    assert isinstance(b, torch.Tensor), f"not a tensor{where}: {type(b).__name__}"
    assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}{where}"
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}{where}"
    assert a.device == b.device, f"device {a.device} != {b.device}{where}"
    a_bytes = a.detach().contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.detach().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a_bytes, b_bytes):
        diff = (a.detach().double() - b.detach().double()).abs()
        raise AssertionError(
            f"tensors differ{where}: max abs diff {diff.nan_to_num(nan=float('inf')).max()}"
        )


def _cache_layers(obj: Any) -> list[Any] | None:
    """The layers of a transformers cache (its tensors are ``keys`` and ``values``)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is not None and isinstance(obj, cache_utils.Cache):
        return list(obj.layers)
    return None


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def flatten(obj: Any) -> list[torch.Tensor]:
    """Tensor leaves of ``obj``: inside tuples, lists, dict values (``ModelOutput``s too)
    and transformers caches (each layer's keys, then values), depth-first."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    layers = _cache_layers(obj)
    if layers is not None:
        for layer in layers:
            found.extend(t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            found.extend(flatten(item))
    elif isinstance(obj, dict):
        for item in obj.values():
            found.extend(flatten(item))
    return found


def clone_leaves(obj: Any) -> Any:
    """``obj`` with each tensor leaf replaced by ``t.detach().clone()``, of the same types
    (namedtuples, ``ModelOutput``s and caches too); other leaves kept when plain, else None."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    layers = _cache_layers(obj)
    if layers is not None:
        cache = copy.copy(obj)
        cache.layers = [copy.copy(layer) for layer in layers]
        for layer in cache.layers:
            for name in ("keys", "values"):
                if isinstance(getattr(layer, name, None), torch.Tensor):
                    setattr(layer, name, getattr(layer, name).detach().clone())
        return cache
    if _is_namedtuple(obj):
        return type(obj)(*(clone_leaves(item) for item in obj))
    if isinstance(obj, (tuple, list)):
        items = [clone_leaves(item) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        items = {key: clone_leaves(value) for key, value in obj.items()}
        return items if type(obj) is dict else type(obj)(**items)  # ModelOutput
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else None


def assert_all_bitwise(got: tuple | list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} tensors recorded, hooks saw {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise(g, w, f"{what}[{i}]")


@dataclass
class HookRun:
    output: Any
    outputs: dict[tuple[str, int], list[torch.Tensor]]  # (path, call) -> flat output clones
    inputs: dict[tuple[str, int], list[torch.Tensor]]  # (path, call) -> flat arg clones
    structures: dict[tuple[str, int], Any]  # (path, call) -> output with cloned leaves
    order: list[tuple[str, int]]  # calls in the order they began


def run_with_hooks(model: torch.nn.Module, inputs: tuple) -> HookRun:
    """A plain forward with a forward hook and a pre-hook on every named submodule."""
    run = HookRun(None, {}, {}, {}, [])
    started: Counter[str] = Counter()
    finished: Counter[str] = Counter()
    handles = []

    def make_hooks(path: str):
        def pre_hook(module, args):
            started[path] += 1
            key = (path, started[path])
            run.order.append(key)
            run.inputs[key] = [t.detach().clone() for t in flatten(args)]

        def hook(module, args, output):
            finished[path] += 1
            key = (path, finished[path])
            structure = clone_leaves(output)
            run.structures[key] = structure
            run.outputs[key] = flatten(structure)

        return pre_hook, hook

    try:
        for path, module in model.named_modules():
            if not path:
                continue
            pre_hook, hook = make_hooks(path)
            handles.append(module.register_forward_pre_hook(pre_hook))
            handles.append(module.register_forward_hook(hook))
        run.output = model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    assert started == finished
    return run


def call_label(path: str, call: int, calls: Counter[str]) -> str:
    return path if calls[path] == 1 else f"{path}:{call}"
