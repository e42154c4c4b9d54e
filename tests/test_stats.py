"""Summary statistics agree with a float64 reference, for every dtype the recorder meets."""

from __future__ import annotations

import itertools
import math
import platform

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tracelake.recorder.stats import Stats, compute_stats

finite32 = st.floats(-1e6, 1e6, allow_nan=False, width=32)
special = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e30, -3.5])


def reference(values: np.ndarray) -> dict:
    x = values.astype(np.float64).ravel()
    finite = np.isfinite(x).all()
    with np.errstate(all="ignore"):
        return {
            "mean": x.mean(),
            "std": x.std(),
            "min": x.min(),
            "max": x.max(),
            "l2": np.sqrt((x * x).sum()) if finite else math.nan,
            "frac_zero": float((x == 0).mean()),
            "nan_count": int(np.isnan(x).sum()),
            "inf_count": int(np.isinf(x).sum()),
        }


def close(got: float | None, want: float, rel: float, scale: float) -> bool:
    """Within ``rel`` of the reference, or of the data's magnitude ``scale`` (float32
    accumulation errors grow with the values summed, not with the result)."""
    assert got is not None
    return got == pytest.approx(want, rel=rel, abs=rel * scale + 1e-12)


@settings(max_examples=150, deadline=None)
@given(values=arrays(np.float32, st.integers(1, 300), elements=st.one_of(finite32, special)))
def test_float32_stats_match_float64_reference(values: np.ndarray) -> None:
    stats = compute_stats(torch.from_numpy(values))
    want = reference(values)
    assert stats.nan_count == want["nan_count"]
    assert stats.inf_count == want["inf_count"]
    assert stats.frac_zero == want["frac_zero"]
    if want["nan_count"] or want["inf_count"]:
        return  # moments are NaN/Inf by definition; the counts above are what matters
    assert stats.min == want["min"] and stats.max == want["max"]
    assert stats.absmax == max(abs(want["min"]), abs(want["max"]))
    scale = max(abs(want["min"]), abs(want["max"]))
    assert close(stats.mean, want["mean"], 1e-5, scale)
    assert close(stats.l2, want["l2"], 1e-5, scale)
    assert close(stats.std, want["std"], 1e-4, scale)


@settings(max_examples=60, deadline=None)
@given(offset=st.floats(-1e4, 1e4), scale=st.floats(1e-3, 10), n=st.integers(2, 2000))
def test_std_is_accurate_when_the_mean_dominates(offset: float, scale: float, n: int) -> None:
    values = (np.random.default_rng(n).standard_normal(n) * scale + offset).astype(np.float32)
    stats = compute_stats(torch.from_numpy(values))
    want = values.astype(np.float64).std()
    # float32 data carry |offset| * 2**-24 of rounding each; the std is good to that.
    assert stats.std == pytest.approx(want, rel=1e-3, abs=abs(offset) * 2**-22)


@pytest.mark.parametrize(
    ("tensor", "mean", "min_", "max_", "frac_zero"),
    [
        (torch.tensor([1, 2, 3, 0], dtype=torch.int64), 1.5, 0.0, 3.0, 0.25),
        (torch.tensor([True, False, False, False]), 0.25, 0.0, 1.0, 0.75),
        (torch.tensor([-2, 4], dtype=torch.int8), 1.0, -2.0, 4.0, 0.0),
        (torch.tensor([0.5, -1.5], dtype=torch.bfloat16), -0.5, -1.5, 0.5, 0.0),
        (torch.tensor([0.5, -1.5], dtype=torch.float16), -0.5, -1.5, 0.5, 0.0),
        (torch.tensor([2**53, 0], dtype=torch.int64), 2.0**52, 0.0, 2.0**53, 0.5),
    ],
)
def test_non_float32_dtypes(
    tensor: torch.Tensor, mean: float, min_: float, max_: float, frac_zero: float
) -> None:
    stats = compute_stats(tensor)
    assert stats.mean == mean and stats.min == min_ and stats.max == max_
    assert stats.frac_zero == frac_zero


def test_empty_complex_and_meta_tensors() -> None:
    assert compute_stats(torch.empty(0, 3)) == Stats(None, None, None, None, None, None, None, 0, 0)
    assert compute_stats(torch.empty(3, device="meta")).mean is None
    z = compute_stats(torch.tensor([3 + 4j, 0j]))
    assert z.mean is None and z.absmax == 5.0 and z.frac_zero == 0.5 and z.l2 == 5.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            arrays(np.float32, st.integers(1, 70), elements=finite32),
            st.tuples(finite32, st.integers(1, 40), st.floats(0, 1e-3)).map(
                lambda t: (t[0] + t[2] * np.arange(t[1])).astype(np.float32)
            ),  # near-constant
            arrays(np.float32, st.integers(1, 8), elements=special),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_segment_stats_match_compute_stats(parts: list[np.ndarray]) -> None:
    """The store's batched statistics of a chunk's small tensors are compute_stats'
    numbers, or None (then the store falls back to compute_stats itself)."""
    from tracelake.recorder.stats import segment_stats

    values = np.concatenate(parts).astype(np.float64)
    counts = np.array([p.size for p in parts], dtype=np.int64)
    for part, got in zip(parts, segment_stats(values, counts), strict=True):
        if got is None:
            continue
        want = compute_stats(torch.from_numpy(part))
        assert np.isfinite(part).all()
        scale = float(np.abs(part.astype(np.float64)).max())
        for name in ("mean", "min", "max", "absmax", "l2", "frac_zero"):
            assert close(getattr(got, name), getattr(want, name), 1e-6, scale), name
        assert close(got.std, want.std, 1e-5, scale * 1e-3), "std"
        assert (got.nan_count, got.inf_count) == (0, 0)


GATHER_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(GATHER_DTYPES),
            st.one_of(
                arrays(np.float32, st.integers(1, 300), elements=finite32),
                arrays(np.float32, st.integers(1, 6), elements=special),
            ),
        ),
        min_size=1,
        max_size=40,
    ),
    st.integers(16 << 10, 64 << 10),
)
def test_gathered_stats_are_compute_stats_numbers(
    parts: list[tuple[torch.dtype, np.ndarray]], capacity: int
) -> None:
    """stats="all" gathers small tensors (a small capacity makes buffers fill and flush
    mid-way): every tensor's statistics match compute_stats of the tensor, NaN and Inf
    counted, whatever the dtype; larger and complex tensors are refused."""
    from tracelake.recorder.stats import StatsGatherer

    gatherer = StatsGatherer(capacity)
    tensors = {}
    for key, (dtype, values) in enumerate(parts):
        tensor = torch.from_numpy(values).to(dtype)
        tensors[key] = tensor.clone()
        assert gatherer.add(key, tensor)
        tensor.fill_(7)  # the gatherer took a copy: later writes change nothing
    assert not gatherer.add(-1, torch.zeros(5000))  # 20 KB: more than gathering pays for
    assert not gatherer.add(-2, torch.zeros(3, dtype=torch.complex64))
    assert not gatherer.add(-3, torch.zeros(4, 4).t())  # not contiguous
    got = gatherer.finish()
    assert sorted(got) == sorted(tensors)
    for key, tensor in tensors.items():
        want = compute_stats(tensor)
        have = got[key]
        assert (have.nan_count, have.inf_count) == (want.nan_count, want.inf_count)
        assert have.frac_zero == want.frac_zero
        if want.nan_count or want.inf_count:
            continue
        scale = max(abs(want.min), abs(want.max)) if want.min is not None else 0.0
        for name in ("mean", "min", "max", "absmax", "l2"):
            assert close(getattr(have, name), getattr(want, name), 1e-5, scale), name
        assert close(have.std, want.std, 1e-4, scale), "std"


@settings(max_examples=60, deadline=None)
@given(
    offset=st.sampled_from([0.0, 1.0, 1e3, -1e4]),
    scale=st.floats(1e-3, 10),
    n=st.integers(70, 3000),
    parts=st.integers(1, 7),
    bad=st.sampled_from([None, math.nan, math.inf]),
    where=st.floats(0, 0.999),
)
def test_stats_combined_from_parts_match_the_whole(
    offset: float, scale: float, n: int, parts: int, bad: float | None, where: float
) -> None:
    """A store's workers reduce each chunk of a large tensor as they write it and combine
    the parts' moments (std included, with no second pass even when the mean dwarfs the
    spread); a NaN or Inf in any part, not only the first, is counted."""
    from tracelake.recorder.stats import combine_stats, partial_stats

    rng = np.random.default_rng(n)
    values = (offset + scale * rng.standard_normal(n)).astype(np.float32)
    if bad is not None:
        values[int(where * n)] = bad
    x = torch.from_numpy(values)
    cuts = sorted({0, n, *rng.integers(1, n, parts - 1).tolist()})
    got = combine_stats(x, [partial_stats(x[a:b]) for a, b in itertools.pairwise(cuts)])
    want = reference(values)
    assert (got.nan_count, got.inf_count) == (want["nan_count"], want["inf_count"])
    if bad is not None:
        assert math.isnan(got.std)
        return
    assert got.min == want["min"] and got.max == want["max"]
    assert got.mean == pytest.approx(want["mean"], rel=1e-12, abs=1e-12)
    assert got.std == pytest.approx(want["std"], rel=1e-5)
    assert got == compute_stats(x) or all(
        getattr(got, f) == pytest.approx(getattr(compute_stats(x), f), rel=1e-5)
        for f in ("mean", "std", "l2")
    )


LAYOUTS = [
    lambda t: t,
    lambda t: t[..., 1:],  # rows with gaps
    lambda t: t.transpose(0, 2),  # permuted: the memory is whole
    lambda t: t[:, ::2],  # a stride between rows
    lambda t: t[1:].permute(2, 0, 1),
    lambda t: t[:1].expand(3, -1, -1),  # broadcast: the careful path
]


@settings(max_examples=60, deadline=None)
@given(
    values=arrays(
        np.float32,
        st.tuples(st.integers(2, 9), st.integers(2, 9), st.integers(2, 40)),
        elements=st.one_of(finite32, finite32.map(lambda v: v / 1e6 + 1e3), special),
    ),
    layout=st.sampled_from(range(len(LAYOUTS))),
)
def test_float32_views_reduced_where_they_lie(values: np.ndarray, layout: int) -> None:
    """stats="all" reduces a float32 tensor in one compiled pass over its memory as it
    lies (a transposed or sliced view is not copied), sums and squares in float64: the
    numbers are the float64 reference's to ~1e-12 (NaN and Inf counted by the careful
    path), the same with the compiled recorder switched off to float32 reductions' 1e-5,
    and a view's statistics do not depend on its layout beyond rounding."""
    from tracelake.recorder import compiled

    view = LAYOUTS[layout](torch.from_numpy(values))
    got = compute_stats(view)
    want = reference(view.numpy())
    assert (got.nan_count, got.inf_count) == (want["nan_count"], want["inf_count"])
    assert got.frac_zero == want["frac_zero"]
    was, compiled.ENABLED = compiled.ENABLED, False
    try:
        python = compute_stats(view)
    finally:
        compiled.ENABLED = was
    assert (python.nan_count, python.inf_count) == (got.nan_count, got.inf_count)
    if want["nan_count"] or want["inf_count"]:
        return
    scale = max(abs(want["min"]), abs(want["max"]))
    assert got.min == want["min"] and got.max == want["max"]
    exact = 1e-12 if view.numel() > 64 else 1e-5  # tiny tensors: plain Python floats
    for name in ("mean", "l2", "std"):
        assert close(getattr(got, name), want[name], exact if name != "std" else 1e-4, scale)
        assert close(getattr(python, name), getattr(got, name), 1e-4, scale), name
    contiguous = compute_stats(view.contiguous())
    assert close(contiguous.mean, got.mean, 1e-12, scale)
    assert close(contiguous.l2, got.l2, 1e-12, scale)


@settings(max_examples=80, deadline=None)
@given(
    values=arrays(
        np.float32,
        st.integers(1, 700),
        elements=st.one_of(finite32, st.sampled_from([0.0, -0.0, 1e-40, -1e-40, 3e38])),
    ),
    run=st.integers(1, 90),
    gap=st.integers(0, 13),
)
def test_every_implementation_of_the_pass_gives_the_same_bits(
    values: np.ndarray, run: int, gap: int
) -> None:
    """The compiled pass has an implementation per instruction set (AVX-512 and AVX2
    where the processor has them, SSE2, plain C): over any layout (rows of ``run``
    elements ``gap`` apart, so every lane phase and tail) they give the same sums,
    extremes and zero count, to the bit, so statistics do not depend on the machine that
    computed them."""
    from tracelake.recorder import compiled

    hot = compiled.hot()
    assert hot is not None, "the extension is missing"
    run = min(run, len(values))
    step = run + gap
    count = max(1, (len(values) - run) // step + 1)
    layout = (values.ctypes.data, run, count, step)
    best = hot.moments_f32(*layout)
    each = {name: hot.moments_f32(*layout, which) for name, which in hot.moment_passes().items()}
    bits = {name: np.array(got, dtype=np.float64).tobytes() for name, got in each.items()}
    if platform.machine() in ("x86_64", "AMD64"):  # every x86-64 has SSE2
        assert {"c", "sse2"} <= set(each), each
    assert set(bits.values()) == {np.array(best, dtype=np.float64).tobytes()}, (best, each)
    rows = [values[k * step : k * step + run].astype(np.float64) for k in range(count)]
    total = np.concatenate(rows)
    assert best[2:] == (total.min(), total.max(), float((total == 0).sum()))


def test_a_pass_the_processor_lacks_is_refused_by_name() -> None:
    """Asking the compiled pass for an implementation this processor does not run (or one
    that does not exist) is an error that says where the ones it runs are listed, not a
    crash on an illegal instruction."""
    from tracelake.recorder import compiled

    hot = compiled.hot()
    assert hot is not None, "the extension is missing"
    values = np.arange(100, dtype=np.float32)
    for which in (-1, 99, *({1, 2, 3, 4} - set(hot.moment_passes().values()))):
        with pytest.raises(ValueError, match=r"moment_passes\(\)"):
            hot.moments_f32(values.ctypes.data, 100, 1, 100, which)


def test_views_of_one_memory_share_statistics_until_written() -> None:
    """Under stats="all", a view that only reshapes or permutes an op's output reuses
    that output's statistics; an in-place write in between (seen by the version counter)
    makes the next view's statistics its own again, as a plain forward shows."""
    from torch import nn

    import tracelake as tl

    class Views(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 3  # (8, 16, 32): 4096 elements, reduced where they lie
            a = y.view(8, 512).t()  # the same elements: the same statistics
            y.add_(1)  # a write: what comes after sees new values
            b = y.permute(2, 0, 1)
            c = b[:, :, 1:]  # a slice: other elements
            return a.sum() + b.sum() + c.sum()

    x = torch.randn(8, 16, 32)
    trace = tl.trace(Views(), x, save=tl.none(), stats="all")
    y = x * 3
    expected = {"mul_1_1": y, "view_1_2": y, "t_1_3": y, "add_1_4": y + 1, "permute_1_5": y + 1}
    expected["getitem_1_6"] = (y + 1).permute(2, 0, 1)[:, :, 1:]
    for label, value in expected.items():
        stats = trace[label].stats
        assert stats is not None, label
        want = value.double()
        assert stats.mean == pytest.approx(want.mean().item(), rel=1e-12), label
        assert stats.l2 == pytest.approx(want.norm().item(), rel=1e-12), label
        assert stats.std == pytest.approx(want.std(correction=0).item(), rel=1e-9), label
        assert stats.min == want.min().item() and stats.max == want.max().item(), label
