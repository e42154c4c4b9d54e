"""Torch's fused fast paths: which module calls take one, so that recording keeps them.

In eval mode with autograd off, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``
and ``nn.TransformerEncoder`` (given a ``src_key_padding_mask``: nested tensors) call one
fused kernel instead of their Python code, but only when no argument "has a torch
function": any active ``TorchFunctionMode`` (the recorder's) turns the fast path off, and
the outputs then differ (by rounding, and at padded positions entirely). The recorder asks
:func:`fused_call` in each such module's pre-hook and, where the fast path would run,
steps its mode aside for that call and records the call as one op named after the fused
function (see ``Interceptor``).

The conditions are torch's own (``torch/nn/modules/activation.py`` and
``transformer.py``), less the torch-function check; the tests compare recorded outputs
bitwise with plain forwards across the cases.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.activation import _check_arg_device, _is_make_fx_tracing

__all__ = ["CANDIDATES", "FUSED_FUNCS", "fused_call", "has_rule"]

MHA_FUNC = "_native_multi_head_attention"
LAYER_FUNC = "_transformer_encoder_layer_fwd"
#: What an nn.TransformerEncoder's nested-tensor path is recorded as: one op for the
#: whole call (it converts to nested tensors, runs each layer's fused kernel and pads).
ENCODER_FUNC = "_transformer_encoder_fwd"
FUSED_FUNCS = (MHA_FUNC, LAYER_FUNC, ENCODER_FUNC)

_Tensor = torch.Tensor


def _mask_float(mask: Any) -> bool:
    return isinstance(mask, _Tensor) and torch.is_floating_point(mask)


def _grad_blocks(tensors: tuple) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, _Tensor) and t.requires_grad for t in tensors
    )


def _mha(m: nn.MultiheadAttention, a: dict[str, Any]) -> str | None:
    query, key, value = a["query"], a["key"], a["value"]
    kpm, attn_mask = a.get("key_padding_mask"), a.get("attn_mask")
    if _mask_float(attn_mask) or _mask_float(kpm):
        return None
    if not isinstance(query, _Tensor) or query.dim() != 3:
        return None
    if query is not key or key is not value:
        return None
    if m.in_proj_weight is None or m.in_proj_bias is None:
        return None
    if query.dtype != m.in_proj_bias.dtype or query.dtype != m.in_proj_weight.dtype:
        return None
    if m.training or m.num_heads % 2 or not m.batch_first:
        return None
    if m.bias_k is not None or m.bias_v is not None or m.add_zero_attn:
        return None
    if not m._qkv_same_embed_dim:
        return None
    if query.is_nested and (kpm is not None or attn_mask is not None):
        return None
    tensors = (
        query,
        key,
        value,
        m.in_proj_weight,
        m.in_proj_bias,
        m.out_proj.weight,
        m.out_proj.bias,
    )
    if not all(_check_arg_device(x) for x in tensors):
        return None
    if _grad_blocks(tensors) or _is_make_fx_tracing():
        return None
    return MHA_FUNC


def _layer_tensors(layer: nn.TransformerEncoderLayer) -> tuple:
    attn = layer.self_attn
    return (
        attn.in_proj_weight,
        attn.in_proj_bias,
        attn.out_proj.weight,
        attn.out_proj.bias,
        layer.norm1.weight,
        layer.norm1.bias,
        layer.norm2.weight,
        layer.norm2.bias,
        layer.linear1.weight,
        layer.linear1.bias,
        layer.linear2.weight,
        layer.linear2.bias,
    )


_DEVICES = ("cpu", "cuda", "xpu")


def _on_devices(tensors: tuple) -> bool:
    allowed = (*_DEVICES, torch.utils.backend_registration._privateuse1_backend_name)
    return all(t.device.type in allowed for t in tensors if isinstance(t, _Tensor))


def _layer(m: nn.TransformerEncoderLayer, a: dict[str, Any]) -> str | None:
    src = a["src"]
    kpm, src_mask = a.get("src_key_padding_mask"), a.get("src_mask")
    attn = m.self_attn
    if not isinstance(src, _Tensor) or src.dim() != 3 or m.training:
        return None
    if not attn.batch_first or attn.in_proj_bias is None or not attn._qkv_same_embed_dim:
        return None
    if not m.activation_relu_or_gelu or m.norm1.eps != m.norm2.eps:
        return None
    if src.is_nested and (kpm is not None or src_mask is not None):
        return None
    if attn.num_heads % 2:
        return None
    if any(len(sub._forward_hooks) + len(sub._forward_pre_hooks) for sub in m.modules()):
        return None
    tensors = (src, *_layer_tensors(m))
    if not _on_devices(tensors) or _grad_blocks(tensors):
        return None
    return LAYER_FUNC


def _encoder(m: nn.TransformerEncoder, a: dict[str, Any]) -> str | None:
    src = a["src"]
    kpm, mask = a.get("src_key_padding_mask"), a.get("mask")
    first = m.layers[0]
    if not isinstance(first, nn.TransformerEncoderLayer):
        return None  # (use_nested_tensor is False then; checked for clarity)
    if not getattr(m, "use_nested_tensor", False) or first.training:
        return None
    if not isinstance(src, _Tensor) or src.dim() != 3 or kpm is None or mask is not None:
        return None
    if src.is_nested:
        return None
    if getattr(m, "mask_check", True):
        if torch.compiler.is_compiling():
            return None
        canonical = nn.functional._canonical_mask(
            mask=kpm,
            mask_name="src_key_padding_mask",
            other_type=None,
            other_name="mask",
            target_type=src.dtype,
        )
        if canonical is None or not torch._nested_tensor_from_mask_left_aligned(
            src, canonical.logical_not()
        ):
            return None
    tensors = (src, *_layer_tensors(first))
    if not _on_devices(tensors[:1]) or _grad_blocks(tensors):
        return None
    return ENCODER_FUNC


_Rule = Callable[[Any, dict[str, Any]], "str | None"]
#: The module classes with a fused fast path, and the rule saying when it runs.
CANDIDATES: dict[type[nn.Module], _Rule] = {
    nn.MultiheadAttention: _mha,
    nn.TransformerEncoderLayer: _layer,
    nn.TransformerEncoder: _encoder,
}


#: Module class -> its rule, or None; weakly held (a notebook's re-run cell makes new
#: classes, whose methods' globals must not be kept alive from here).
_RULES: weakref.WeakKeyDictionary[type, tuple[_Rule, inspect.Signature] | None] = (
    weakref.WeakKeyDictionary()
)


def _rule_of(cls: type[nn.Module]) -> tuple[_Rule, inspect.Signature] | None:
    """The fast-path rule of a module class: its own, or its base's when it keeps the
    base's ``forward`` (a subclass that overrides it decides for itself)."""
    if cls not in _RULES:
        _RULES[cls] = next(
            (
                (rule, inspect.signature(base.forward))
                for base, rule in CANDIDATES.items()
                if issubclass(cls, base) and cls.forward is base.forward
            ),
            None,
        )
    return _RULES[cls]


def fused_call(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The fused function a plain forward of ``module(*args, **kwargs)`` would call
    (outside any torch function mode), or ``None`` when it runs its Python code."""
    found = _rule_of(type(module))
    if found is None:
        return None
    rule, signature = found
    if not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled():
        return None
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:
        return None  # the forward will raise by itself
    return rule(module, bound.arguments)


def has_rule(cls: type[nn.Module]) -> bool:
    """Whether calls of modules of class ``cls`` may take a fused fast path."""
    return _rule_of(cls) is not None
