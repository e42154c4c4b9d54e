"""Recorded call arguments: each call's function and non-tensor arguments, with its
tensor arguments named by where they came from, as plain JSON-ready values.

With ``CaptureOptions(record_args=True)`` the interception mode hands every call to
:meth:`ArgsRecorder.encode` (before the labeller makes the call's outputs the producers
of their tensors, so an in-place op's first argument names the op it overwrites) and
the rows the call added get the encoded call (``OpTable.call_args``). The encoding:

- the function as ``[module, qualified name]`` within torch (``["torch.nn.functional",
  "linear"]``, ``["torch._C", "TensorBase.view"]``), or ``["getattr", name]`` for a
  Tensor property such as ``.T``; a function outside torch as ``["", name]``;
- tensors as ``{"$op": idx}`` (the entry that produced it), ``{"$param": name}`` (a
  parameter or buffer of the model) or ``{"$tensor": [shape, dtype]}`` (anything else);
- plain values as themselves (non-finite floats as ``{"$float": "nan"}``), tuples as
  ``{"$tuple": [...]}``, lists as lists, dicts with string keys as ``{"$dict": {...}}``,
  and torch's own values (``dtype``, ``device``, ``Size``, ``memory_format``, ``layout``,
  slices, ``...``) tagged; anything else as ``{"$unknown": type name}``.

:func:`decode` turns an encoding back into arguments, given the tensors; nothing is
imported or called on the way: :func:`resolve_function` looks names up only among
torch's modules that are already imported.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from .record import position

_KIND = position("kind")

__all__ = ["ArgsRecorder", "decode", "encode_value", "function_name", "resolve_function"]

_SCALARS = (bool, int, str, type(None))
_TORCH_VALUES = (torch.memory_format, torch.layout)


def function_name(func: Any) -> list[str]:
    """``[module, qualified name]`` of a torch function (see the module docstring)."""
    if getattr(func, "__name__", None) == "__get__":  # a Tensor property: .T, .data
        owner = getattr(func, "__self__", None)
        return ["getattr", str(getattr(owner, "__name__", ""))]
    owner = getattr(func, "__objclass__", None)
    qualname = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", ""))
    if owner is not None:
        module = owner.__module__
        if not qualname.startswith(owner.__qualname__ + "."):
            qualname = f"{owner.__qualname__}.{getattr(func, '__name__', qualname)}"
    else:
        module = getattr(func, "__module__", None) or ""
        if not module and getattr(func, "__self__", None) is not None:
            module = getattr(func.__self__, "__name__", "")  # torch._C._nn.linear
    if "<locals>" in qualname:  # made by a factory (F.max_pool2d): named as exported
        qualname = getattr(func, "__name__", qualname)
    if qualname.startswith("_VariableFunctionsClass."):  # torch.arange and the like
        module, qualname = "torch", qualname.split(".", 1)[1]
    if not (module == "torch" or module.startswith("torch.")):
        return ["", str(qualname)]
    return [module, str(qualname)]


def resolve_function(name: list[str]) -> Any:
    """The function :func:`function_name` named, or ``None`` when it is not a torch
    function of an imported torch module (names from a stored run are data: nothing
    is imported for them)."""
    if not (isinstance(name, list) and len(name) == 2 and all(isinstance(n, str) for n in name)):
        return None
    module_name, qualname = name
    if module_name == "getattr":
        return None  # a property: the caller reads it with getattr
    if not (module_name == "torch" or module_name.startswith("torch.")):
        return None
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        if obj is None or (part.startswith("__") and part not in _DUNDERS):
            return None
        obj = getattr(obj, part, None)
    return obj if callable(obj) else None


#: Dunder methods a recorded call may name (operators, indexing).
_DUNDERS = frozenset(
    f"__{n}__"
    for n in [
        "getitem",
        "setitem",
        "add",
        "radd",
        "iadd",
        "sub",
        "rsub",
        "isub",
        "mul",
        "rmul",
        "imul",
        "truediv",
        "rtruediv",
        "itruediv",
        "floordiv",
        "rfloordiv",
        "mod",
        "rmod",
        "pow",
        "rpow",
        "matmul",
        "rmatmul",
        "neg",
        "pos",
        "abs",
        "invert",
        "and",
        "rand",
        "or",
        "ror",
        "xor",
        "rxor",
        "lshift",
        "rshift",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
    ]
)


def encode_value(value: Any, tensor: Any) -> Any:
    """One argument as JSON-ready values; ``tensor(t)`` encodes a tensor."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, tensor) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, tensor) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$dict": {k: encode_value(v, tensor) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, _TORCH_VALUES):
        return {"$torch": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"$slice": [encode_value(v, tensor) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(value, complex):
        return {"$complex": [value.real, value.imag]}
    return {"$unknown": type(value).__name__}


class Unresolved(Exception):
    """An encoded argument that cannot be turned back into a value; ``str`` says why."""


def decode(value: Any, tensor: Any) -> Any:
    """Arguments back from :func:`encode_value`'s encoding; ``tensor(spec)`` supplies
    each tensor (or raises :class:`Unresolved`)."""
    if isinstance(value, list):
        return [decode(v, tensor) for v in value]
    if not isinstance(value, dict):
        return value
    ((tag, body),) = value.items()
    if tag in ("$op", "$param", "$tensor"):
        return tensor(value)
    if tag == "$float":
        return float(body)
    if tag == "$size":
        return torch.Size(body)
    if tag == "$tuple":
        return tuple(decode(v, tensor) for v in body)
    if tag == "$dict":
        return {k: decode(v, tensor) for k, v in body.items()}
    if tag == "$dtype":
        dtype = getattr(torch, body, None)
        if not isinstance(dtype, torch.dtype):
            raise Unresolved(f"unknown dtype {body!r}")
        return dtype
    if tag == "$device":
        return torch.device(body)
    if tag == "$torch":
        found = getattr(torch, body, None)
        if not isinstance(found, _TORCH_VALUES):
            raise Unresolved(f"unknown torch value {body!r}")
        return found
    if tag == "$slice":
        return slice(*(decode(v, tensor) for v in body))
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$complex":
        return complex(*body)
    raise Unresolved(f"an argument of type {body!r} was not recorded")


class ArgsRecorder:
    """Encodes each call of a recording (see the module docstring) into
    ``table.call_args``; ``producer(t)`` gives the entry that produced a tensor (-1:
    none) and ``params`` maps ``id()`` of the model's parameters and buffers to names."""

    def __init__(self, call_args: dict[int, Any], rows: list[Any], producer: Any, params: Any):
        self._call_args = call_args
        self._rows = rows
        self._producer = producer
        self._params = params

    def _tensor(self, value: torch.Tensor) -> Any:
        index = self._producer(value)
        if index >= 0:
            return {"$op": index}
        name = self._params.get(id(value))
        if name.__class__ is str or name.__class__ is tuple:  # a parameter's, a buffer's
            return {"$param": name if name.__class__ is str else name[0]}
        return {"$tensor": [list(value.shape), str(value.dtype).removeprefix("torch.")]}

    def encode(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The call, encoded (before its outputs become producers)."""
        tensor = self._tensor
        return {
            "fn": function_name(func),
            "args": [encode_value(v, tensor) for v in args],
            "kwargs": {str(k): encode_value(v, tensor) for k, v in kwargs.items()},
        }

    def row_count(self) -> int:
        """How many rows the recording has (where the next call's rows begin)."""
        return len(self._rows)

    def assign(self, call: Any, start: int, count: int) -> None:
        """The first ``count`` op rows from row ``start`` on came from the encoded
        ``call`` (a call may also add buffer entries: a buffer's first read before its
        outputs, the buffers batch_norm writes after them)."""
        rows = self._rows
        index = start
        while count and index < len(rows):
            if rows[index][_KIND] == "op":
                self._call_args[index] = call
                count -= 1
            index += 1


def renumber_ops(value: Any, new: list[int]) -> Any:
    """An encoding with every ``{"$op": idx}`` renumbered to ``new[idx]`` (entries
    renumbered after orphans were pruned: an op's tensor arguments are kept with it)."""
    if isinstance(value, dict):
        if len(value) == 1 and "$op" in value:
            return {"$op": new[value["$op"]]}
        return {key: renumber_ops(item, new) for key, item in value.items()}
    if isinstance(value, list):
        return [renumber_ops(item, new) for item in value]
    return value
