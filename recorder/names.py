"""Names of torch functions as tracelake and TorchLens write them: torch's own
(``layer_norm``, ``add_``), an operator's (``truediv`` for ``x / y``), TorchLens's
spelling that labels use (``layernorm``), and the families ``tl.func`` and the ``func``
column compare. Plain strings only: the query room reads this without importing torch.
"""

from __future__ import annotations

import dis
import functools
from typing import Any

__all__ = [
    "INPLACE_DUNDERS",
    "N_SPELLINGS",
    "OPERATOR_ALIASES",
    "OPERATOR_FUNCS",
    "func_family",
    "func_name",
    "func_spellings",
    "has_operator_calls",
    "operator_name",
    "spelling",
]


# Operators are named as TorchLens names them (its labels are the ones users key on): by
# their dunder's core (``x / y`` is ``truediv``, ``x += y`` is ``iadd``, ``x % y`` is
# ``mod``), except where torch implements the dunder in Python by calling another torch
# function, which TorchLens then sees instead: ``x // y`` is ``floor_divide``, ``2 ** x``
# is ``pow``. A reflected commutative operator is its plain one (``1 + x`` is ``add``).
_DUNDER_NAMES = {
    "floordiv": "floor_divide",
    "rpow": "pow",
    "radd": "add",
    "rmul": "mul",
    "rmatmul": "matmul",
    "rand": "and",
    "ror": "or",
    "rxor": "xor",
    "rtruediv": "rdiv",
    "itruediv": "idiv",
}
#: The augmented assignments (``x += y`` is ``iadd``): they write into their left operand.
_AUGMENTED = "add sub mul matmul pow div truediv floordiv mod and or xor lshift rshift"
INPLACE_DUNDERS = frozenset("i" + op for op in _AUGMENTED.split())
#: Where TorchLens's name for a call differs from torch's name beyond spelling: the
#: property ``x.data`` is its ``detach``. Namespaced functions (``torch.fft.fft``, whose
#: name is ``fft_fft``; ``torch.linalg.vector_norm``) lose their namespace.
_TORCHLENS_NAMES = {"data": "detach"}
_NAMESPACES = ("fft_", "linalg_", "special_")
#: TorchLens's spelling of an operator next to torch's name of the same function: either
#: selects both (``tl.func("div")`` selects ``x / y``).
OPERATOR_ALIASES = {
    "truediv": "div",
    "idiv": "div",
    "iadd": "add",
    "isub": "sub",
    "imul": "mul",
    "ipow": "pow",
    "imatmul": "matmul",
    "ifloordiv": "floordivide",
    "mod": "remainder",
    "imod": "remainder",
    "and": "bitwiseand",
    "or": "bitwiseor",
    "xor": "bitwisexor",
    "iand": "bitwiseand",
    "ior": "bitwiseor",
    "ixor": "bitwisexor",
    "invert": "bitwisenot",
    "lshift": "bitwiseleftshift",
    "rshift": "bitwiserightshift",
    "ilshift": "bitwiseleftshift",
    "irshift": "bitwiserightshift",
    "rdiv": "div",
}


def func_name(func: Any) -> str:
    """The plain name of a torch function: ``relu``, ``add``, ``add_``, ``getitem``,
    ``truediv`` (``x / y``), ``iadd`` (``x += y``), ``T``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a Tensor property such as .T or .data
        owner = getattr(func, "__self__", None)
        return str(getattr(owner, "__name__", "attribute"))
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        core = name[2:-2]
        return _DUNDER_NAMES.get(core, core)
    return name


# What an operator dispatches as: ``x / y`` reaches the mode as torch's ``div``, ``x += y``
# as ``add_``, ``x % y`` as ``remainder``; only the caller's instruction (BINARY_OP and
# its operator) tells them from ``x.div(y)``. By (torch's name, BINARY_OP's argument).
_BINARY_OP = dis.opmap["BINARY_OP"]
_OPERATOR_CALLS = {
    ("div", 11): "truediv",
    ("remainder", 6): "mod",
    ("add_", 13): "iadd",
    ("mul_", 18): "imul",
    ("remainder_", 19): "imod",
    ("sub_", 23): "isub",
    ("div_", 24): "idiv",
    ("floor_divide_", 15): "ifloordiv",
    ("pow_", 21): "ipow",
}
OPERATOR_FUNCS = frozenset(func for func, _ in _OPERATOR_CALLS)
_OPERATOR_ARGS = frozenset(arg for _, arg in _OPERATOR_CALLS)


def has_operator_calls(code: Any) -> bool:
    """Whether ``code`` applies an operator that reaches the mode under another name
    (``x / y`` as ``div``)."""
    return any(
        ins.opcode == _BINARY_OP and ins.arg in _OPERATOR_ARGS for ins in dis.get_instructions(code)
    )


def operator_name(func: str, site: Any) -> str:
    """The name of a call that torch reports as ``func`` from call site ``site`` (code,
    bytecode offset): the operator's (``truediv``) when the site is that operator, else
    ``func``."""
    if site is None or func not in OPERATOR_FUNCS:
        return func
    code, offset = site
    raw = code.co_code
    if offset + 1 >= len(raw) or raw[offset] != _BINARY_OP:
        return func
    return _OPERATOR_CALLS.get((func, raw[offset + 1]), func)


@functools.cache
def spelling(func: str) -> str:
    """TorchLens's spelling of a function name, which labels use: lower case without
    underscores and without a namespace (``layer_norm`` -> ``layernorm``, ``add_`` ->
    ``add``, ``fft_fft`` -> ``fft``, ``T`` -> ``t``)."""
    func = _TORCHLENS_NAMES.get(func, func)
    for prefix in _NAMESPACES:
        if func.startswith(prefix) and len(func) > len(prefix):
            func = func[len(prefix) :]
            break
    return func.lower().replace("_", "")


#: How many spellings :func:`func_spellings` gives: always this many, so that the query
#: that compares with them does not depend on the name.
N_SPELLINGS = 24


@functools.cache
def func_spellings(name: str) -> tuple[str, ...]:
    """The ``func`` values of ``name``'s family (:func:`func_family`) with only case and
    underscores taken out (``fft_fft`` is ``fftfft``): what a query compares
    ``replace(lower(func), '_', '')`` with, so that ``func = 'layernorm'`` selects
    ``layer_norm``. Padded to :data:`N_SPELLINGS` by repeating the first."""
    family = func_family(name)
    plain = [family, *(a for a, b in OPERATOR_ALIASES.items() if b == family)]
    plain += [a for a, b in _TORCHLENS_NAMES.items() if b == family]
    found = [*plain, *(p.rstrip("_") + f for f in plain for p in _NAMESPACES)]
    found = list(dict.fromkeys(found))[:N_SPELLINGS]
    return tuple(found + found[:1] * (N_SPELLINGS - len(found)))


@functools.cache
def func_family(name: str) -> str:
    """What ``tl.func(name)`` and the ``func`` column compare: the spelling, with an
    operator's TorchLens name taken to torch's (``truediv`` and ``div`` are one family,
    as are ``layer_norm`` and ``layernorm``)."""
    spelled = spelling(name)
    return OPERATOR_ALIASES.get(spelled, spelled)
