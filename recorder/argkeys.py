"""Non-tensor call arguments, kept as TorchLens keys its loop detection by them.

TorchLens 2.36.1 tells two calls of one function apart by their non-tensor arguments:
a parameter-free op's equivalence class is its function plus a hash of every argument
(``backends/torch/tensor_tracking._get_hash_from_args``: scalars by type and value,
tensors by shape, positions as ``pos{i}``, keywords as ``kw_{key}``, containers walked),
so ``x * 1`` and ``x * 2`` in a loop are two layers, not two passes of one; an op with
parameters is split by a structural signature of them where one parameter set is called
with different ones (``postprocess/loop_detection._structural_arg_signature``:
``padding=0`` and ``padding=1`` are two layers).

The recorder keeps each call's non-tensor arguments in its row (the op record's
``arg_values``: ``(position or keyword, value, ...)`` in call order, ``None`` for a
call of tensors only), as :func:`capture` makes them: plain values (numbers, strings,
``None``) and torch's small value types (:data:`VALUE_TYPES`) as they are, a tuple or
list of only those as a tuple, anything else (a nested list, an object) as an
:class:`Opaque` holding its tokens, computed at the call: a row never holds a tensor or
a user's object. :func:`hash_tokens` and
:func:`signature` turn a row's values into TorchLens's tokens once the forward is over
(:mod:`.loops`); tensors' own tokens come from the op's parents there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "EMPTY_LIST",
    "KEPT",
    "SEP",
    "VALUE_TYPES",
    "Opaque",
    "all_tensors",
    "capture",
    "hash_tokens",
    "signature",
]

#: Types kept in a row as they are (exactly these classes; the compiled path keeps them
#: too): small values whose ``str`` and ``repr`` are their content.
VALUE_TYPES: tuple[type, ...] = (
    torch.dtype,
    torch.device,
    torch.memory_format,
    torch.layout,
    torch.Size,
    slice,
    range,
    type(...),
    complex,
)
_PLAIN = frozenset({int, float, bool, str, type(None), *VALUE_TYPES})
# TorchLens's value types of the structural signature, and torch's value types it
# spells by ``str`` there (loop_detection._SIGNATURE_VALUE_TYPES / _SAFE_TORCH_TYPES).
_SIGNATURE_VALUES = (type(None), bool, int, float, complex, str, bytes, slice, range, type(...))
_SIGNATURE_TORCH = {
    ("torch", "dtype"),
    ("torch", "device"),
    ("torch", "memory_format"),
    ("torch", "layout"),
}
#: Tokens longer than this are kept as their digest (a long list argument).
_LONG = 4096
#: Joins tokens (a character no argument's ``str`` is expected to hold).
SEP = "\x1f"


def _extend(tokens: list[str], prefix: str, joined: str) -> None:
    """An :class:`Opaque`'s tokens under the argument's prefix: TorchLens's tokens (an
    empty container has none)."""
    if joined:
        tokens.extend(prefix + token for token in joined.split(SEP))


@dataclass(frozen=True, slots=True)
class Opaque:
    """An argument kept by its tokens, made with an empty prefix and joined by
    :data:`SEP`: ``text`` its hash tokens (a digest for a long one), ``sig`` its
    signature tokens (``None``: not a non-tensor argument to TorchLens, such as a list
    holding tensors). Under the argument's ``pos{i}`` / ``kw_{key}`` prefix they are
    TorchLens's tokens."""

    text: str
    sig: str | None


#: What a row keeps for an empty list argument (``torch.tensor([])``), one object.
EMPTY_LIST = Opaque("", "=list[0]")
#: What the compiled path keeps as Python keeps it: these types, and empty lists as this.
KEPT = (VALUE_TYPES, EMPTY_LIST)


class _List(tuple):
    """A list argument of plain values, kept as an immutable tuple (TorchLens's
    signature spells it a list)."""

    __slots__ = ()


def _joined(tokens: list[str]) -> str:
    """Tokens made with the prefix ``""``, as one string (:func:`_extend` splits it)."""
    text = SEP.join(tokens)
    if len(text) > _LONG:
        return "_sha" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()
    return text


def capture(value: Any) -> Any:
    """A non-tensor argument as a row keeps it (see the module docstring)."""
    cls = value.__class__
    if cls in _PLAIN:
        return value
    if (cls is tuple or cls is list) and all(item.__class__ in _PLAIN for item in value):
        # (the common x.view((b, -1))): kept, its tokens spelled after the forward
        if cls is tuple:
            return value
        return _List(value) if value else EMPTY_LIST  # (as the compiled path keeps [])
    tokens: list[str] = []
    _hash(value, "", tokens)
    sig: str | None = None
    if not _holds_tensor(value):
        signs: list[str] = []
        _sign(value, "", signs)
        sig = _joined(signs)
    return Opaque(_joined(tokens), sig)


def all_tensors(value: list | tuple) -> bool:
    """Whether a list or tuple argument holds tensors only (its tokens are its tensors',
    which the op's parents give)."""
    return bool(value) and all(isinstance(item, torch.Tensor) for item in value)


def _holds_tensor(value: Any) -> bool:
    """TorchLens's ``_check_if_tensor_arg``: a tensor, or a list, tuple or dict with one
    at the top."""
    if isinstance(value, torch.Tensor):
        return True
    if type(value) in (list, tuple):
        return any(isinstance(item, torch.Tensor) for item in value)
    if type(value) is dict:
        return any(isinstance(item, torch.Tensor) for item in value.values())
    return False


# -- TorchLens's argument hash (tensor_tracking._append_arg_hash) ------------------------


def hash_tokens(values: tuple) -> list[str]:
    """TorchLens's hash tokens of a row's non-tensor arguments, in call order."""
    tokens: list[str] = []
    for k in range(0, len(values), 2):
        where = values[k]
        prefix = f"pos{where}" if where.__class__ is int else f"kw_{where}"
        _hash(values[k + 1], prefix, tokens)
    return tokens


def _hash(arg: Any, prefix: str, tokens: list[str], depth: int = 0) -> None:
    if depth > 10:
        tokens.append(f"{prefix}_deep")
    elif isinstance(arg, Opaque):
        _extend(tokens, prefix, arg.text)
    elif isinstance(arg, torch.nn.Parameter):
        pass  # TorchLens leaves parameters out (they key the op by themselves)
    elif isinstance(arg, torch.Tensor):
        tokens.append(f"{prefix}_tensor{arg.shape}")
    elif isinstance(arg, (torch.TypedStorage, torch.UntypedStorage)):
        tokens.append(f"{prefix}_storage{arg.size()}_{getattr(arg, 'dtype', None)}")
    elif isinstance(arg, dict):
        for key, item in arg.items():
            _hash(item, f"{prefix}_dk{key}", tokens, depth + 1)
    elif isinstance(arg, (list, tuple)):
        for i, item in enumerate(arg):
            _hash(item, f"{prefix}_i{i}", tokens, depth + 1)
    elif isinstance(arg, (set, frozenset)):
        members = []
        for item in arg:
            inner: list[str] = []
            _hash(item, "", inner, depth + 1)
            members.append(tuple(inner))
        for i, member in enumerate(sorted(members)):
            tokens.extend(f"{prefix}_s{i}{token}" for token in member)
    else:
        tokens.append(prefix + _leaf(arg))


def _leaf(arg: Any) -> str:
    """TorchLens's ``_leaf_arg_token`` after its prefix: the value's ``str``, or its type
    where that would show a memory address."""
    kind = type(arg)
    opaque = f"_obj:{kind.__module__}.{kind.__qualname__}"
    if kind.__repr__ is object.__repr__ and kind.__str__ is object.__str__:
        return opaque
    text = f"_{arg}"
    return opaque if " at 0x" in text else text


# -- TorchLens's structural signature (loop_detection._structural_arg_signature) ---------


def signature(values: tuple | None) -> str:
    """TorchLens's structural signature of a row's non-tensor arguments (equal exactly
    where TorchLens's are; its md5 digest is left out)."""
    if not values:
        return "no_args"
    tokens: list[str] = []
    kwargs: list[tuple[str, Any]] = []
    index = 0
    for k in range(0, len(values), 2):
        where, value = values[k], values[k + 1]
        if isinstance(value, Opaque) and value.sig is None:
            continue  # holds a tensor: not among TorchLens's non-tensor arguments
        if where.__class__ is int:
            _sign(value, f"pos{index}", tokens)
            index += 1
        else:
            kwargs.append((where, value))
    for key, value in sorted(kwargs, key=lambda item: str(item[0])):
        _sign(value, f"kw_{key}", tokens)
    return SEP.join(tokens) if tokens else "no_args"


def _sign(arg: Any, prefix: str, tokens: list[str], depth: int = 0) -> None:
    if depth > 6:
        tokens.append(f"{prefix}=deep")
        return
    if isinstance(arg, Opaque):
        _extend(tokens, prefix, arg.sig or "")
        return
    if isinstance(arg, _SIGNATURE_VALUES):
        tokens.append(f"{prefix}={type(arg).__name__}:{arg!r}")
        return
    if isinstance(arg, dict):
        keyed = sorted(((_key(key, depth + 1), key) for key in arg), key=lambda kv: kv[0])
        for token, key in keyed:
            _sign(arg[key], f"{prefix}.k{token}", tokens, depth + 1)
        return
    if isinstance(arg, (list, tuple, set, frozenset)):
        items: Any = arg
        if isinstance(arg, (set, frozenset)):
            items = sorted(arg, key=lambda item: _element_key(item, depth + 1))
        name = "list" if arg.__class__ is _List else type(arg).__name__
        tokens.append(f"{prefix}={name}[{len(arg)}]")
        for i, item in enumerate(items):
            _sign(item, f"{prefix}.{i}", tokens, depth + 1)
        return
    tokens.append(f"{prefix}={_type_token(arg)}")


def _element_key(arg: Any, depth: int) -> tuple[str, ...]:
    tokens: list[str] = []
    _sign(arg, "element", tokens, depth)
    return tuple(tokens)


def _key(key: Any, depth: int) -> str:
    """A dict key's signature token (loop_detection._signature_key_token)."""
    if depth > 6:
        return "deep"
    if isinstance(key, _SIGNATURE_VALUES):
        return f"{type(key).__name__}:{key!r}"
    if isinstance(key, tuple):
        return f"tuple[{','.join(_key(item, depth + 1) for item in key)}]"
    if isinstance(key, frozenset):
        return f"frozenset[{','.join(sorted(_key(item, depth + 1) for item in key))}]"
    return _type_token(key)


def _type_token(value: Any) -> str:
    """The token of a value no other rule covers: torch's small types by their text,
    anything else by its type's module and qualified name."""
    kind = (getattr(type(value), "__module__", ""), getattr(type(value), "__qualname__", ""))
    if kind in _SIGNATURE_TORCH:
        return f"{kind[1]}:{value!s}"
    return f"<{kind[0]}.{kind[1]}>"
