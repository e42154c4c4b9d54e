"""Summary statistics of a tensor, computed while it exists.

Many questions ("which layer blew up?", "where did the first NaN appear?") are answered
from these numbers alone, so the catalog keeps them for every saved op and, on request,
for every op. They are taken over all elements; ``std`` is the population standard
deviation (``correction=0``), defined for a single element too. NaNs propagate into mean,
std, min, max, absmax and l2, and are counted in ``nan_count``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Stats", "compute_stats"]


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary statistics of one tensor. Fields are ``None`` where undefined
    (empty tensors; mean, std, min and max of complex tensors)."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    absmax: float | None
    l2: float | None
    frac_zero: float | None
    nan_count: int
    inf_count: int


_EMPTY = Stats(None, None, None, None, None, None, None, 0, 0)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_stats(tensor: torch.Tensor) -> Stats:
    """Compute :class:`Stats` of ``tensor`` (any dtype, any device) with one host sync.

    Cheap reductions only (sum, norm, min/max, nonzeros); ``std`` comes from the first
    two moments when that is well conditioned, else from a second pass; NaN and Inf are
    counted only when the sum or norm shows there are any.
    """
    with torch.no_grad():
        x = tensor.detach()
        numel = x.numel()
        if numel == 0 or x.device.type == "meta":
            return _EMPTY
        if x.is_complex():
            return _complex_stats(x.abs(), numel)
        if not x.is_floating_point():
            # Integers are exact in float64 up to 2**53; bools become 0/1.
            x = x.to(torch.float64)
        elif x.dtype in _LOW_PRECISION or x.dtype.itemsize < 2:
            x = x.float()
        low, high = torch.aminmax(x)
        parts = torch.stack([x.sum(), torch.linalg.vector_norm(x), low, high,
                             torch.count_nonzero(x).to(x.dtype)])
        total, l2, min_, max_, nonzero = parts.to(torch.float64).tolist()
        mean = total / numel
        spread = l2 * l2 / numel - mean * mean
        if math.isfinite(spread) and spread >= 0.5 * l2 * l2 / numel:
            std = math.sqrt(spread)
        else:  # mean dominates (or overflow): E[x^2] - mean^2 would cancel; go again
            std = torch.linalg.vector_norm(x - mean).item() / math.sqrt(numel)
        nans = infs = 0
        if not (math.isfinite(total) and math.isfinite(l2)):
            nans = int(torch.isnan(x).sum().item())
            infs = int(torch.isinf(x).sum().item())
    return Stats(
        mean=mean,
        std=std,
        min=min_,
        max=max_,
        absmax=math.nan if nans else max(abs(min_), abs(max_)),
        l2=l2,
        frac_zero=(numel - nonzero) / numel,
        nan_count=nans,
        inf_count=infs,
    )


def _complex_stats(magnitude: torch.Tensor, numel: int) -> Stats:
    parts = [
        magnitude.max(),
        torch.linalg.vector_norm(magnitude),
        torch.count_nonzero(magnitude),
        torch.isnan(magnitude).sum(),
        torch.isinf(magnitude).sum(),
    ]
    absmax, l2, nonzero, nans, infs = torch.stack([p.to(torch.float64) for p in parts]).tolist()
    return Stats(
        mean=None,
        std=None,
        min=None,
        max=None,
        absmax=absmax,
        l2=l2,
        frac_zero=(numel - nonzero) / numel,
        nan_count=int(nans),
        inf_count=int(infs),
    )
