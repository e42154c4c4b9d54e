"""Summary statistics of a tensor, computed while it exists.

Many questions ("which layer blew up?", "where did the first NaN appear?") are answered
from these numbers alone, so the catalog keeps them for every saved op and, on request,
for every op. They are taken over all elements; ``std`` is the population standard
deviation (``correction=0``), defined for a single element too. NaNs propagate into mean,
std, min, max, absmax and l2, and are counted in ``nan_count``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from typing import Any

import numpy as np
import torch

from . import compiled
from .record import F64, OPS, STAT_FIELDS, Stats

__all__ = [
    "EXACT_SQUARES",
    "GATHER_MAX",
    "MOMENTS",
    "UNSIGNED",
    "Stats",
    "StatsGatherer",
    "combine_stats",
    "compute_stats",
    "fused_layout",
    "fused_stats",
    "gatherable",
    "gathered_values",
    "partial_stats",
    "segment_moments",
    "segment_stats",
]


_EMPTY = Stats(None, None, None, None, None, None, None, 0, 0)
# Up to this many elements, plain Python beats torch's per-kernel dispatch.
_SMALL = 64
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SLICE = 1 << 20  # elements per slice of the careful std pass
#: Tensors up to this many bytes get their statistics gathered (a copy of their bytes and
#: a share of a few segmented numpy reductions): cheaper than reducing each on its own.
GATHER_MAX = 16 << 10
#: Unsigned integers of each element width: how gathered bytes are viewed.
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: dtypes numpy converts to float64 itself (the rest go through torch).
_NATIVE = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}
_memmove = ctypes.memmove
#: How much of the second moment the spread must be for std from float64 sums of exact
#: squares (``_hot.moments_f32``; a float32 norm needs half): the sums' relative error
#: (~n * 2**-53 at worst, ~1e-11 for a million elements) then costs the std at most
#: ~1e-8 relatively; below, the shifted second pass (:func:`_std`).
EXACT_SQUARES = 1e-3


def compute_stats(tensor: torch.Tensor) -> Stats:
    """Compute :class:`Stats` of ``tensor`` (any dtype, any device) with one host sync.

    Cheap reductions only (sum, norm, min/max, nonzeros); ``std`` comes from the first
    two moments when that is well conditioned, else from a shifted second pass; NaN and
    Inf are counted only when min or max shows there are any.
    """
    if tensor.dtype is torch.float32:  # the common case: one compiled pass, no torch calls
        layout = fused_layout(tensor)
        fused = None if layout is None else _fused_partial(tensor, layout)
        if fused is not None:
            total, l2, low, high, nonzero, m2, numel = fused
            return _finish(tensor, numel, total, l2, low, high, nonzero, m2)
    x = tensor.detach()  # (reductions of it record no graph: no torch.no_grad(), whose
    numel = x.numel()  # __enter__ a Ctrl-C can leave half done; emit.copy_tensor)
    if numel == 0 or x.device.type == "meta":
        return _EMPTY
    if x.is_complex():
        return _complex_stats(x.abs(), numel)
    x = _real(x)
    if numel <= _SMALL and x.device.type == "cpu" and type(x) is torch.Tensor:
        return _small_stats(x.reshape(-1).tolist())
    total, l2, low, high, nonzero, m2, _ = partial_stats(x)
    return _finish(x, numel, total, l2, low, high, nonzero, m2)


def combine_stats(tensor: torch.Tensor, partials: list[tuple[float, ...]]) -> Stats:
    """:func:`compute_stats` of ``tensor`` from the :func:`partial_stats` of parts that
    partition its elements: how a store's worker gets the statistics of a large tensor
    from the chunks it writes, each reduced while it is in cache (one pass over memory
    instead of five; a part's spread about its own mean too, so that ``std`` needs no
    second pass over the tensor however its mean dwarfs its spread). Complex and empty
    tensors: compute_stats itself."""
    x = tensor.detach()
    numel = x.numel()
    if numel <= _SMALL or x.is_complex() or not partials:
        return compute_stats(x)
    totals, norms, lows, highs, nonzeros, spreads, counts = zip(*partials, strict=True)
    total = math.fsum(totals)
    mean = total / numel
    # Chan et al.'s pairwise update: the parts' squared deviations about their own
    # means, plus what their means' distances from the whole's add.
    m2 = math.fsum(spreads) + math.fsum(
        n * (t / n - mean) ** 2 for t, n in zip(totals, counts, strict=True)
    )
    l2 = math.sqrt(math.fsum(n * n for n in norms))
    return _finish(x, numel, total, l2, _nan_or(min, lows), _nan_or(max, highs), sum(nonzeros), m2)


def _nan_or(pick: Any, values: tuple[float, ...]) -> float:
    """``pick(values)``, NaN if one of them is (Python's min and max keep a NaN only
    when it comes first)."""
    return math.nan if any(v != v for v in values) else pick(values)


def partial_stats(x: torch.Tensor) -> tuple[float, float, float, float, float, float, int]:
    """(sum, l2 norm, min, max, nonzeros, squared deviations from its mean, elements) of
    a real tensor, with one host sync (and a second pass over ``x`` while it is in cache
    when its mean dwarfs its spread): the sum accumulated in float64, min and max NaN
    when there is one (the deviations then NaN too)."""
    x = _real(x.detach())
    numel = x.numel()
    layout = fused_layout(x)
    fused = None if layout is None else _fused_partial(x, layout)
    if fused is not None:
        return fused
    low, high = torch.aminmax(x)
    f64 = torch.float64
    parts = [torch.linalg.vector_norm(x).to(f64), low.to(f64), high.to(f64)]
    total, nonzero = _numpy_sum64(x), _numpy_nonzero(x)
    if nonzero is None:
        parts.append(torch.count_nonzero(x).to(f64))
    if total is None:
        parts.append(x.sum(dtype=f64))
    l2, min_, max_, *rest = torch.stack(parts).tolist()
    if nonzero is None:
        nonzero = rest.pop(0)
    if total is None:
        total = rest[0]
    m2 = math.nan
    if math.isfinite(min_) and math.isfinite(max_):
        if not math.isfinite(l2):  # squares overflowed a float dtype
            l2 = torch.linalg.vector_norm(x, dtype=f64).item()
        if not math.isfinite(total):
            total = x.sum(dtype=f64).item()
        m2 = _std(x, numel, total / numel, l2) ** 2 * numel
    return total, l2, min_, max_, nonzero, m2, numel


def fused_layout(tensor: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(address, run, count, step) of the memory :func:`compute_stats` reduces in one
    compiled pass as it lies (``_hot.moments_f32``; :func:`_runs`: no copy of a sliced or
    permuted view), for a float32 CPU tensor of more than a handful of elements; two
    views of one layout hold the same elements, so get the same statistics, to the bit.
    ``None`` for the rest, and without the extension (or with one built before it had
    this pass)."""
    numel = tensor.numel()
    if (
        numel <= _SMALL
        or tensor.dtype is not torch.float32
        or type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout is not torch.strided
        or tensor.is_neg()
        or not hasattr(compiled.hot(), "moments_f32")
    ):
        return None
    runs = _runs(tensor, numel)
    return None if runs is None else (tensor.data_ptr(), *runs)


def fused_stats(
    tensor: torch.Tensor,
    layout: tuple[int, int, int, int] | None,
    moments: tuple[float, float, float, float, float] | None = None,
) -> Stats:
    """:func:`compute_stats` of ``tensor``, whose :func:`fused_layout` is ``layout``;
    ``moments``: what the compiled pass over that layout gave, if it ran already (a
    store's worker runs it with the checksums of the bytes it writes,
    ``_hot.crc_moments_f32``)."""
    fused = None if layout is None else _fused_partial(tensor, layout, moments)
    if fused is None:
        return compute_stats(tensor)
    total, l2, low, high, nonzero, m2, numel = fused
    return _finish(tensor, numel, total, l2, low, high, nonzero, m2)


def _fused_partial(
    x: torch.Tensor,
    layout: tuple[int, int, int, int],
    moments: tuple[float, float, float, float, float] | None = None,
) -> tuple[float, float, float, float, float, float, int] | None:
    """:func:`partial_stats` of ``x`` from the compiled pass over its ``layout``
    (:func:`fused_layout`: the sum and the sum of squares in float64, min, max, zeros;
    ``moments`` if it ran already), and a second pass only when its mean dwarfs its
    spread (:func:`_std`); ``None`` when it meets a NaN or an Inf (the sums then say
    so): the caller's careful path counts them."""
    if moments is None:
        moments = compiled.hot().moments_f32(*layout)
    total, squares, min_, max_, zeros = moments
    if not (math.isfinite(total) and math.isfinite(squares)):
        return None
    numel = layout[1] * layout[2]
    l2, mean = math.sqrt(squares), total / numel
    spread = squares / numel - mean * mean
    if spread >= EXACT_SQUARES * squares / numel:
        m2 = spread * numel
    else:
        m2 = _std(x.detach(), numel, mean, l2) ** 2 * numel
    return total, l2, min_, max_, numel - zeros, m2, numel


def _runs(x: torch.Tensor, numel: int) -> tuple[int, int, int] | None:
    """(run, count, step): ``x``'s elements as ``count`` runs of ``run`` contiguous
    elements ``step`` apart (``step`` = ``run`` for one run), in some order (statistics
    do not care which), or ``None`` when its dimensions do not fold into two that way
    (broadcast strides, say)."""
    if x.is_contiguous():
        return numel, 1, numel
    sizes = zip(x.shape, x.stride(), strict=True)
    dims = sorted((stride, size) for size, stride in sizes if size > 1)
    run, count, step = 1, 1, 0
    for stride, size in dims:
        if stride == 0:  # broadcast: elements repeat
            return None
        if count == 1 and stride == run:  # still the innermost contiguous block
            run *= size
        elif count == 1 and stride > run:  # the first gap: the rows begin
            count, step = size, stride
        elif stride == step * count:  # rows that continue the rows before them
            count *= size
        else:
            return None
    return run, count, step if count > 1 else run


def _real(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype whose reductions are exact enough: integers in float64 (exact up
    to 2**53; bools become 0/1), half and 8-bit floats in float32."""
    if not x.is_floating_point():
        return x.to(torch.float64)
    if x.dtype in _LOW_PRECISION or x.dtype.itemsize < 2:
        return x.float()
    return x


def _finish(
    x: torch.Tensor,
    numel: int,
    total: float,
    l2: float,
    min_: float,
    max_: float,
    nonzero: float,
    m2: float,
) -> Stats:
    """Stats from the reductions of (all of) ``x`` (``m2``: the squared deviations from
    its mean); ``x`` itself only to count NaN and Inf, when min or max shows some."""
    nans = infs = 0
    if not (math.isfinite(min_) and math.isfinite(max_)):  # min/max propagate NaN
        nans = int(torch.isnan(x).sum().item())
        infs = int(torch.isinf(x).sum().item())
    mean = total / numel
    std = math.sqrt(max(m2, 0.0) / numel) if not (nans or infs) else math.nan
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


def _numpy_sum64(x: torch.Tensor) -> float | None:
    """The sum of a float32 CPU tensor, accumulated in float64 (a float32 sum drifts on
    large, near-constant tensors, and the mean, hence std's shift, with it), through
    numpy, which converts in cache-sized blocks (torch's float64-accumulating sum of
    float32 is several times slower; see docs/architecture.md), and a store's workers
    compute it for every large tensor. ``None`` elsewhere: torch's sum, with the other
    reductions."""
    if x.dtype is torch.float32 and x.device.type == "cpu" and type(x) is torch.Tensor:
        try:
            with np.errstate(all="ignore"):  # inf - inf: NaN, as torch gives, silently
                return float(np.add.reduce(x.reshape(-1).numpy(), dtype=np.float64))
        except (RuntimeError, TypeError):  # e.g. a tensor with the negative bit set
            return None
    return None


def _numpy_nonzero(x: torch.Tensor) -> float | None:
    """How many elements of a CPU tensor are not zero, counted by numpy, which is several
    times faster than torch's count_nonzero on unordered zeros such as a ReLU's output
    (a store's workers count every chunk they write). ``None``
    where numpy cannot see the tensor: torch's count, with the other reductions."""
    if x.device.type == "cpu" and type(x) is torch.Tensor:
        try:
            return float(np.count_nonzero(x.numpy()))
        except (RuntimeError, TypeError):  # e.g. a tensor with the negative bit set
            return None
    return None


def _small_stats(values: list[float]) -> Stats:
    """Stats of a tiny tensor's values in plain Python floats: exact two-pass std."""
    numel = len(values)
    nans = sum(1 for v in values if v != v)
    infs = sum(1 for v in values if v in (math.inf, -math.inf))
    low, high = min(values), max(values)
    bad = nans or infs
    mean = (sum(values) if bad else math.fsum(values)) / numel  # fsum refuses inf - inf
    return Stats(
        mean=mean,
        std=math.nan if bad else math.sqrt(math.fsum((v - mean) ** 2 for v in values) / numel),
        min=math.nan if nans else low,
        max=math.nan if nans else high,
        absmax=math.nan if nans else max(abs(low), abs(high)),
        l2=math.nan if nans else math.sqrt(math.fsum(v * v for v in values)),
        frac_zero=sum(1 for v in values if v == 0) / numel,
        nan_count=nans,
        inf_count=infs,
    )


def _std(x: torch.Tensor, numel: int, mean: float, l2: float) -> float:
    second = l2 * l2 / numel
    spread = second - mean * mean
    if spread >= 0.5 * second:
        return math.sqrt(spread)
    # The mean dominates: E[x^2] - mean^2 would cancel. Shift by the mean rounded to the
    # tensor's dtype (the subtraction is then exact) and correct for the rounding.
    # In slices, so that the temporaries stay a few MiB however large the tensor (a
    # store computes this on its workers, beside its bounded in-flight buffers).
    flat = x.reshape(-1)
    shift = torch.tensor(mean, dtype=_real(flat[:1]).dtype).item()
    squares = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, numel, _SLICE):
        real = _real(flat[start : start + _SLICE])
        if (
            real.dtype is torch.float32
            and real.device.type == "cpu"
            and type(real) is torch.Tensor
            and not real.is_neg()
        ):
            # shifted and squared in float32 in a scratch buffer of this thread's (fresh
            # memory for each temporary cost a store's worker more than the arithmetic),
            # summed in float64 by numpy: where torch's float64 norm converts element by
            # element
            part = _scratch(real.numel())
            with np.errstate(over="ignore"):
                np.subtract(real.numpy(), np.float32(shift), out=part)
                total = float(np.add.reduce(np.square(part, out=part), dtype=np.float64))
            if math.isfinite(total):  # else a square overflowed float32: float64 below
                squares += total
                continue
        squares += torch.linalg.vector_norm(real - shift, dtype=torch.float64) ** 2
    variance = squares.item() / numel - (mean - shift) ** 2
    return math.sqrt(max(variance, 0.0))


_SCRATCH = threading.local()


def _scratch(n: int) -> np.ndarray:
    """``n`` float32s of this thread's scratch memory (up to ``_SLICE``, kept)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or len(buffer) < n:
        buffer = _SCRATCH.buffer = np.empty(max(n, 1 << 16), dtype=np.float32)
    return buffer[:n]


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


#: The floating-point statistics, in :class:`Stats` order: what segment_moments gives
#: (the counts, NaN and Inf, follow them in Stats and are 0 where it applies).
MOMENTS = tuple(name for name in STAT_FIELDS if OPS.field(name).type is F64)
assert STAT_FIELDS[: len(MOMENTS)] == MOMENTS
_NO_COUNTS = (0,) * (len(STAT_FIELDS) - len(MOMENTS))
_MEAN, _STD, _MIN, _MAX, _ABSMAX, _L2, _FRAC_ZERO = map(
    MOMENTS.index, ("mean", "std", "min", "max", "absmax", "l2", "frac_zero")
)


def segment_moments(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Statistics of consecutive segments of ``values`` (float64; segment k has
    ``counts[k]`` elements, all > 0) from a handful of segmented numpy reductions: how a
    store gets the statistics of the thousands of small tensors in one 4 MiB chunk
    without several torch calls per tensor. Returns a (segments, len(MOMENTS)) float64
    array of the floating-point statistics (:data:`MOMENTS`: the :class:`Stats` fields
    before the NaN and Inf counts, both 0 here), and a mask, False where these would not
    give what :func:`compute_stats` gives (NaN or Inf, or a mean that dwarfs the
    spread): the caller computes those one by one."""
    out = np.empty((len(counts), len(MOMENTS)))
    if counts.min() == counts.max():  # segments of one size (common: a layer's rows):
        values = values.reshape(len(counts), -1)  # row reductions beat reduceat
        shift = values[:, 0]
        with np.errstate(invalid="ignore", over="ignore"):
            centred = values - shift[:, None]
            first, second = centred.sum(1), (centred * centred).sum(1)
            squares = (values * values).sum(1)
        low = out[:, _MIN] = values.min(1)
        high = out[:, _MAX] = values.max(1)
        zeros = (values == 0).sum(1)
    else:
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        # Moments about each segment's first element: near-constant tensors (common: a
        # saturated activation) then lose no digits to E[x^2] - mean^2 cancellation.
        shift = values[starts]
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf: judged below
            centred = values - np.repeat(shift, counts)
            first = np.add.reduceat(centred, starts)
            second = np.add.reduceat(centred * centred, starts)
            squares = np.add.reduceat(values * values, starts)
        low = out[:, _MIN] = np.minimum.reduceat(values, starts)
        high = out[:, _MAX] = np.maximum.reduceat(values, starts)
        zeros = np.add.reduceat((values == 0).astype(np.int64), starts)
    with np.errstate(invalid="ignore", over="ignore"):
        offset = first / counts
        moment = second / counts
        spread = moment - offset * offset
        out[:, _MEAN] = shift + offset
        # Cancellation is bounded by how far the first element lies from the mean
        # (at most a factor n); past a millionth, the careful path.
        good = (
            np.isfinite(low) & np.isfinite(high) & np.isfinite(squares) & (spread >= 1e-6 * moment)
        )
        out[:, _STD] = np.sqrt(np.where(good, spread, 0.0))
    out[:, _ABSMAX] = np.maximum(np.abs(low), np.abs(high))
    out[:, _L2] = np.sqrt(squares)
    out[:, _FRAC_ZERO] = zeros / counts
    return out, good


def segment_stats(values: np.ndarray, counts: np.ndarray) -> list[Stats | None]:
    """:func:`segment_moments` as :class:`Stats` objects, ``None`` where not good."""
    moments, good = segment_moments(values, counts)
    return [
        Stats(*row, *_NO_COUNTS) if g else None
        for row, g in zip(moments.tolist(), good.tolist(), strict=True)
    ]


def gathered_values(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The values of elements of the real ``dtype`` given by their bits (unsigned
    integers of its width), as float64: as :func:`compute_stats` reduces them."""
    native = _NATIVE.get(dtype)
    if native is not None:
        return bits.view(native).astype(np.float64)
    return torch.from_numpy(bits).view(dtype).to(torch.float64).numpy()  # bf16, fp8, bool


@functools.cache
def gatherable(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can have their statistics gathered (real dtypes whose
    elements numpy can view as unsigned integers of their width)."""
    return not dtype.is_complex and dtype.itemsize in UNSIGNED


class _Stage:
    """One dtype's gathered bytes, tensor after tensor."""

    __slots__ = ("address", "buffer", "keys", "sizes", "used")

    def __init__(self, capacity: int):
        self.buffer = np.empty(capacity, dtype=np.uint8)
        self.address = self.buffer.ctypes.data
        self.used = 0
        self.keys: list[int] = []
        self.sizes: list[int] = []  # bytes


class StatsGatherer:
    """Statistics of many small tensors for about the price of a copy each (what
    ``stats="all"`` asks of every op): :meth:`add` copies a tensor's bytes into a buffer
    of its dtype (one ``memmove``); when a buffer is full, and at :meth:`finish`, its
    tensors are reduced together (:func:`segment_moments`), the odd ones (NaN, Inf, a mean
    that dwarfs the spread) one by one from their copies. Reducing a tiny tensor on its
    own costs several torch calls, far more than copying its bytes."""

    def __init__(self, capacity: int = 1 << 20):
        self._capacity = max(capacity, GATHER_MAX)
        self._stages: dict[torch.dtype, _Stage] = {}
        self._done: dict[int, Stats] = {}

    def add(self, key: int, tensor: torch.Tensor) -> bool:
        """Take ``tensor``'s statistics under ``key``; False (nothing taken) for what is
        not a small, contiguous, real CPU tensor: compute those with compute_stats."""
        nbytes = tensor.nbytes
        if not (
            0 < nbytes <= GATHER_MAX
            and type(tensor) is torch.Tensor
            and tensor.is_cpu
            and tensor.layout is torch.strided
            and tensor.is_contiguous()
            and not tensor.is_neg()
        ):
            return False
        dtype = tensor.dtype
        stage = self._stages.get(dtype)
        if stage is None:
            if not gatherable(dtype):
                return False
            stage = self._stages[dtype] = _Stage(self._capacity)
        if stage.used + nbytes > self._capacity:
            self._reduce(dtype, stage)
        _memmove(stage.address + stage.used, tensor.data_ptr(), nbytes)
        stage.used += nbytes
        stage.keys.append(key)
        stage.sizes.append(nbytes)
        return True

    def finish(self) -> dict[int, Stats]:
        """The statistics of every tensor added, by key."""
        for dtype, stage in self._stages.items():
            self._reduce(dtype, stage)
        return self._done

    def _reduce(self, dtype: torch.dtype, stage: _Stage) -> None:
        if not stage.keys:
            return
        item = dtype.itemsize
        counts = np.array(stage.sizes, dtype=np.int64) // item
        bits = stage.buffer[: stage.used].view(UNSIGNED[item])
        moments, good = segment_moments(gathered_values(bits, dtype), counts)
        starts = (np.cumsum(counts) - counts).tolist()
        done = self._done
        for key, row, ok, start, count in zip(
            stage.keys, moments.tolist(), good.tolist(), starts, counts.tolist(), strict=True
        ):
            if ok:
                done[key] = Stats(*row, 0, 0)  # type: ignore[call-arg]
            else:
                part = torch.from_numpy(bits[start : start + count].copy()).view(dtype)
                done[key] = compute_stats(part)
        stage.used = 0
        stage.keys = []
        stage.sizes = []
