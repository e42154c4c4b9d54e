"""How two tensors differ: the metrics ``store.compare`` and the query language's
tensor-pair functions report (:class:`PairMetrics`), computed a slice at a time.

Both sides of one floating dtype are subtracted in that dtype (exactly rounded, and
exactly zero where they are equal); other pairs (fp32 vs bf16, integers, complex) in
float64. Memory stays bounded: large tensors are reduced a slice of leading rows at a
time (stored ones read only the chunks of each slice).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SLICE_ELEMENTS",
    "PairMetrics",
    "Sums",
    "row_slices",
    "sliced_metrics",
    "tensor_metrics",
]

#: Elements of each side reduced at a time: a pair never holds more than a few slices.
SLICE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class PairMetrics:
    """How two tensors of one shape differ, both taken in float64. ``rel_l2`` is
    ``|a - b| / |a|`` (a is the reference; ``inf`` when only ``a`` is zero); ``cosine``
    is None when either side is all zeros; ``allclose`` is torch's
    ``|a - b| <= atol + rtol * |a|`` everywhere, NaNs equal where both are NaN. Empty
    tensors differ by nothing."""

    max_abs_diff: float
    mean_abs_diff: float
    rel_l2: float
    cosine: float | None
    allclose: bool


class Sums:
    """Running sums over slices of a pair of tensors, reported in float64.

    Both sides of one floating dtype are subtracted in that dtype (exactly rounded, and
    exactly zero where they are equal); other pairs (fp32 vs bf16, integers, complex)
    are taken in float64 first. The differences' reductions (largest, sum of absolute
    values, sum of squares) are one pass each. The sides' own norms, and from them the
    cosine, come from their recorded statistics (``norms``, float64 at record time)
    where given, else from the slices; ``allclose`` is settled from the largest
    difference alone unless it is borderline. NaNs where both sides have one count as
    equal."""

    def __init__(
        self,
        atol: float,
        rtol: float,
        absmax_a: float | None = None,
        scratch: dict[torch.dtype, torch.Tensor] | None = None,
    ) -> None:
        self.atol, self.rtol = atol, rtol
        # Reused memory for the differences: a fresh buffer per pair would be fresh
        # pages for the kernel to fault in, every time
        self.scratch = scratch if scratch is not None else {}
        self.absmax_a = absmax_a
        self.n = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.sum_sq_diff = 0.0
        self.sum_sq_a = 0.0
        self.sum_sq_b = 0.0
        self.close = True

    def add(self, a: torch.Tensor, b: torch.Tensor, own_norms: bool = True) -> None:
        a, b = _comparable(a, b)
        if not a.numel():
            return
        self.n += a.numel()
        d = torch.sub(a, b, out=self._buffer(a.dtype, a.numel()))
        low, high = torch.aminmax(d)
        biggest = max(-float(low), float(high))
        if math.isnan(biggest):  # NaN or inf among them: the careful way
            self._add_nonfinite(a.double(), b.double(), own_norms)
            return
        self.max_abs = max(self.max_abs, biggest)
        self.sum_abs += float(torch.linalg.vector_norm(d, 1))
        self.sum_sq_diff += float(torch.linalg.vector_norm(d, 2)) ** 2
        if own_norms:  # in float64: a cosine near 1 needs more than float32's digits
            a64, b64 = a.double(), b.double()
            self.sum_sq_a += float(torch.dot(a64, a64))
            self.sum_sq_b += float(torch.dot(b64, b64))
        if self.close and biggest > self.atol:
            bound = self.absmax_a
            if bound is not None and biggest > self.atol + self.rtol * bound:
                self.close = False
            else:
                self.close = bool((d.abs() <= self.atol + self.rtol * a.abs()).all())

    def _buffer(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        buffer = self.scratch.get(dtype)
        if buffer is None or buffer.numel() < n:
            buffer = self.scratch[dtype] = torch.empty(max(n, SLICE_ELEMENTS), dtype=dtype)
        return buffer[:n]

    def _add_nonfinite(self, a: torch.Tensor, b: torch.Tensor, own_norms: bool) -> None:
        both_nan = a.isnan() & b.isnan()
        diff = (a - b).abs().masked_fill(both_nan, 0.0)
        a0, b0 = a.masked_fill(both_nan, 0.0), b.masked_fill(both_nan, 0.0)
        self.max_abs = max(self.max_abs, float(diff.max()))
        if diff.isnan().any():
            self.max_abs = math.nan
        self.sum_abs += float(diff.sum())
        self.sum_sq_diff += float((diff * diff).sum())
        if own_norms:
            self.sum_sq_a += float((a0 * a0).sum())
            self.sum_sq_b += float((b0 * b0).sum())
        if self.close:
            self.close = bool((diff <= self.atol + self.rtol * a0.abs()).all())

    def metrics(self, norms: tuple[float, float] | None = None) -> PairMetrics:
        """The metrics; ``norms``: both sides' L2 norms when known (then the slices'
        own were not summed)."""
        if not self.n:
            return PairMetrics(0.0, 0.0, 0.0, None, True)
        dist = math.sqrt(self.sum_sq_diff)
        if norms is None:
            sq_a, sq_b = self.sum_sq_a, self.sum_sq_b
        else:
            sq_a, sq_b = norms[0] * norms[0], norms[1] * norms[1]
        norm_a = math.sqrt(sq_a)
        rel = dist / norm_a if norm_a else (0.0 if dist == 0 else math.inf)
        # a.b = (|a|^2 + |b|^2 - |a - b|^2) / 2, the norms exact to float64: equal
        # tensors give exactly 1 whichever way the norms were had
        cosine = None
        if sq_a and sq_b:
            cosine = (sq_a + sq_b - self.sum_sq_diff) / (2 * math.sqrt(sq_a * sq_b))
            if not math.isnan(cosine):
                cosine = min(1.0, max(-1.0, cosine))
        return PairMetrics(self.max_abs, self.sum_abs / self.n, rel, cosine, self.close)


def _comparable(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides flat, on the CPU, of one dtype their difference is exact enough in."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.device.type != "cpu" or b.device.type != "cpu":
        a, b = a.cpu(), b.cpu()
    same = a.dtype == b.dtype and a.dtype in (torch.float32, torch.float64)
    if same:
        return a, b
    return _real64(a), _real64(b)


def _real64(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.to(dtype=torch.float64).reshape(-1)


def row_slices(source: Any, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """``source[...]`` whole when small, else a slice of leading rows at a time."""
    if not shape or math.prod(shape) <= SLICE_ELEMENTS:
        yield source[...]
        return
    step = max(1, SLICE_ELEMENTS // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], step):
        yield source[start : start + step]


def tensor_metrics(
    a: torch.Tensor, b: torch.Tensor, atol: float = 1e-8, rtol: float = 1e-5
) -> PairMetrics:
    """:class:`PairMetrics` of two tensors of one shape (any dtypes)."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    sums = Sums(atol, rtol)
    sums.add(a, b)
    return sums.metrics()


def sliced_metrics(a: Any, b: Any, atol: float = 1e-8, rtol: float = 1e-5) -> PairMetrics | None:
    """:class:`PairMetrics` of two tensors given as anything with a ``shape`` that
    indexes like a tensor (a ``torch.Tensor``, a stored
    :class:`~tracelake.store.run.LazyTensor`, which reads only the chunks of each
    slice), reduced a slice of leading rows at a time: memory stays bounded whatever
    their size. None when the shapes differ (the query language's null)."""
    shape = tuple(a.shape)
    if shape != tuple(b.shape):
        return None
    sums = Sums(atol, rtol)
    for x, y in zip(row_slices(a, shape), row_slices(b, shape), strict=True):
        sums.add(x, y)
    return sums.metrics()
