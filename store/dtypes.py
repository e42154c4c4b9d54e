"""Torch dtypes in the store: their names, and their bytes as numpy sees them.

**Bits, not values:** dtypes numpy lacks (bfloat16, float8, ...) are stored as unsigned
integers of the same width and the torch dtype is recorded beside them (the array
attribute ``torch_dtype`` and the catalog), so every dtype round-trips bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from tracelake.errors import StoreError

__all__ = [
    "dtype_name",
    "memory_at",
    "memory_bits",
    "memory_tensor",
    "numpy_dtype",
    "parse_dtype",
    "tensor_from_bytes",
]

_NUMPY_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"the store names a dtype this torch lacks: {name!r}")
    return dtype


@functools.cache
def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """numpy's dtype for ``dtype`` when numpy has one, else ``None`` (store the bits)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


class _Memory:
    """Memory at an address as numpy sees it (``__array_interface__``), holding the
    object that owns it: an array made from it keeps the owner alive, not a view of it."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def memory_at(address: int, nbytes: int, owner: object) -> np.ndarray:
    """The ``nbytes`` bytes of memory at ``address`` as a uint8 array that keeps
    ``owner`` (what owns that memory: a tensor) alive, and makes nothing else: a writer's
    worker reads the forward's tensors so, because a view of a tensor, ``numpy()``'s
    included, is a handle on its storage, which the end of a step counts as a holder."""
    if not nbytes:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_Memory(address, nbytes, owner))


def memory_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as numpy, in numpy's dtype or as same-width unsigned bits,
    through :func:`memory_at` (no handle on its storage; the tensor object kept alive by
    the array)."""
    if not (tensor.is_cpu and tensor.is_contiguous()):
        raise ValueError("memory_bits reads a contiguous CPU tensor's memory as it lies")
    dtype = numpy_dtype(tensor.dtype)
    if dtype is None:
        dtype = np.dtype(_NUMPY_BITS[tensor.element_size()])
    bits = memory_at(tensor.data_ptr(), tensor.nbytes, tensor).view(dtype)
    return bits.reshape(tuple(tensor.shape))


def memory_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's values as a tensor on :func:`memory_bits` (a storage of
    its own over the same memory) rather than a view: torch's reductions of it make no
    handle on the tensor's storage."""
    return torch.from_numpy(memory_bits(tensor)).view(tensor.dtype)


def tensor_from_bytes(data: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` from its raw bytes (an owned uint8 array)."""
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    if dtype.itemsize != 1 or dtype is not torch.uint8:
        raw = raw.view(dtype)
    return raw.reshape(tuple(shape))
