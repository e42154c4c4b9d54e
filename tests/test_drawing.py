"""The explorer's pictures (``tracelake/drawing.py``) on the values the browser tests do
not reach: NaN and Inf, all zeros, one row, integers and booleans, an edge that points
nowhere. Hypothesis draws the arrays; the PNG is decoded independently (tests/png.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from png import png_pixels

from tracelake.drawing import graph_svg, heatmap_png, histogram, histogram_svg, layers

GREY = (128, 128, 128)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=2, max_dims=2, max_side=12),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=32),
    ),
    st.integers(1, 4),
)
def test_heatmap_shows_each_value_by_sign(values: np.ndarray, scale: int) -> None:
    png, lo, hi = heatmap_png(values, scale)
    pixels = png_pixels(png)
    assert pixels.shape == (values.shape[0] * scale, values.shape[1] * scale, 3)
    cells = pixels[::scale, ::scale].astype(int)
    finite = np.isfinite(values)
    m = np.abs(values[finite]).max() if finite.any() else 0.0
    assert (lo, hi) == (-m, m)
    assert all(tuple(c) == GREY for c in cells[~finite])
    red, blue = cells[..., 0], cells[..., 2]
    assert (red[finite & (values > 0)] >= blue[finite & (values > 0)]).all()
    assert (red[finite & (values < 0)] <= blue[finite & (values < 0)]).all()
    if m > 0:  # the extremes are the scale's ends
        assert (
            tuple(cells[finite & (values == m)][0]) == (178, 24, 43)
            if (values == m).any()
            else True
        )
    assert all(tuple(c) == (247, 247, 247) for c in cells[finite & (values == 0)])


def test_heatmap_refuses_what_is_not_a_matrix() -> None:
    for bad in (np.zeros(3), np.zeros((0, 4)), np.zeros((2, 2, 2))):
        with pytest.raises(ValueError, match="2-D"):
            heatmap_png(bad)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.float64, np.int64, np.bool_]),
        hnp.array_shapes(max_dims=3, max_side=20),
    )
)
def test_histogram_counts_every_finite_value(values: np.ndarray) -> None:
    hist = histogram(values, bins=10)
    as_float = values.astype(np.float64).reshape(-1)
    finite = as_float[np.isfinite(as_float)]
    assert hist.nonfinite == as_float.size - finite.size
    if finite.size == 0:
        assert hist.counts == [] and "no finite values" in histogram_svg(hist)
        return
    try:
        with np.errstate(all="ignore"):
            counts, edges = np.histogram(finite, bins=10)
        assert np.isfinite(edges).all()
    except (ValueError, AssertionError):  # numpy cannot: one bin, from min to max
        counts, edges = np.array([finite.size]), np.array([finite.min(), finite.max()])
    assert hist.counts == counts.tolist() and hist.edges == edges.tolist()
    svg = histogram_svg(hist)
    assert svg.count('class="bin"') == len(counts)
    assert sum(int(part.split('"')[0]) for part in svg.split('data-count="')[1:]) == finite.size


def test_layers_and_graph() -> None:
    # 0 -> 1 -> 2, 0 -> 2 (a skip), and edges that point nowhere or backwards: ignored
    edges = [(0, 1), (1, 2), (0, 2), (5, 1), (2, 0), (-1, 2)]
    assert layers(3, edges) == [0, 1, 2]
    assert layers(4, [(0, 2), (1, 3), (2, 3)]) == [0, 0, 1, 2]
    svg = graph_svg(
        [("in<1>", "input", "input"), ("a&b", "relu", "op"), ('"q"', "add", "op")],
        edges,
        ["/op?label=in%3C1%3E", "/op?label=a%26b&x=1", "/op?label=%22q%22"],
    )
    assert svg.count('class="node"') == 3
    assert svg.count('class="edge"') == 3  # the three edges that exist
    assert "<path" in svg  # the skip bows around the middle box
    assert "in&lt;1&gt;" in svg and "a&amp;b" in svg and "&quot;q&quot;" in svg
    assert "<1>" not in svg and 'href="/op?label=a%26b&amp;x=1"' in svg
