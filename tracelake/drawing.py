"""Pictures drawn with numpy alone, for the web explorer: a heatmap as a PNG (zlib and
struct from the standard library), a histogram and an op graph as SVG. No plotting
library, no torch: the inputs are numpy arrays and plain lists. Every text that goes
into SVG is escaped here."""

from __future__ import annotations

import html
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Histogram", "graph_svg", "heatmap_png", "histogram", "histogram_svg", "layers"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def _palette(t: np.ndarray) -> np.ndarray:
    """Values in [0, 1] (NaN: grey) to RGB bytes on a blue-white-red scale."""
    t = np.clip(t, 0.0, 1.0)
    low = np.array([33, 102, 172], dtype=np.float64)
    mid = np.array([247, 247, 247], dtype=np.float64)
    high = np.array([178, 24, 43], dtype=np.float64)
    s = np.nan_to_num(t, nan=0.5)[..., None]
    lower = low + (mid - low) * np.clip(s * 2, 0, 1)
    upper = mid + (high - mid) * np.clip(s * 2 - 1, 0, 1)
    rgb = np.where(s < 0.5, lower, upper)
    rgb[np.isnan(t)] = (128, 128, 128)
    return rgb.round().astype(np.uint8)


def heatmap_png(values: np.ndarray, scale: int = 4) -> tuple[bytes, float, float]:
    """A 2-D array as a PNG, each value a ``scale`` x ``scale`` square on a diverging
    scale centred on 0 (blue negative, red positive, grey NaN or Inf); returns the PNG
    and the value range it shows (``-m, m``, ``m`` the largest finite absolute value)."""
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 2 or data.size == 0:
        raise ValueError(f"a heatmap takes a non-empty 2-D array, not shape {data.shape}")
    finite = np.isfinite(data)
    m = float(np.abs(data[finite]).max()) if finite.any() else 0.0
    t = np.where(finite, data / (2 * m) + 0.5 if m > 0 else 0.5, np.nan)
    rgb = _palette(t).repeat(scale, axis=0).repeat(scale, axis=1)
    height, width = rgb.shape[:2]
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )
    return png, -m, m


@dataclass
class Histogram:
    """Counts of the finite values in ``bins`` equal bins from ``edges[0]`` to
    ``edges[-1]``, and how many values were not finite."""

    counts: list[int]
    edges: list[float]
    nonfinite: int


def histogram(values: np.ndarray, bins: int = 40) -> Histogram:
    """The histogram of an array's finite values (numpy's ``histogram`` over their range;
    one bin where numpy cannot make ``bins`` finite ones)."""
    data = np.asarray(values).reshape(-1)
    if data.dtype == np.bool_:
        data = data.astype(np.int8)
    data = data.astype(np.float64)
    finite = data[np.isfinite(data)]
    if finite.size == 0:
        return Histogram([], [], int(data.size))
    try:
        with np.errstate(all="ignore"):
            counts, edges = np.histogram(finite, bins=bins)
        if not np.isfinite(edges).all():
            raise ValueError("the range overflows")
    except ValueError:  # a range too narrow (one large value) or too wide for the bins
        counts, edges = np.array([finite.size]), np.array([finite.min(), finite.max()])
    return Histogram(counts.tolist(), edges.tolist(), int(data.size - finite.size))


def histogram_svg(hist: Histogram, width: int = 480, height: int = 160) -> str:
    """An SVG bar chart of ``hist``; each bar carries its bin and count (``data-lo``,
    ``data-hi``, ``data-count`` and a tooltip)."""
    if not hist.counts:
        return '<p class="note">no finite values</p>'
    top = max(hist.counts) or 1
    n = len(hist.counts)
    bar = width / n
    parts = [
        f'<svg class="histogram" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height + 20}" viewBox="0 0 {width} {height + 20}">'
    ]
    for i, count in enumerate(hist.counts):
        lo, hi = hist.edges[i], hist.edges[i + 1]
        h = height * count / top
        parts.append(
            f'<rect class="bin" x="{i * bar:.2f}" y="{height - h:.2f}" width="{bar * 0.9:.2f}" '
            f'height="{h:.2f}" data-lo="{lo!r}" data-hi="{hi!r}" data-count="{count}">'
            f"<title>[{lo:.4g}, {hi:.4g}): {count}</title></rect>"
        )
    parts.append(
        f'<text x="0" y="{height + 15}" font-size="11">{hist.edges[0]:.4g}</text>'
        f'<text x="{width}" y="{height + 15}" font-size="11" text-anchor="end">'
        f"{hist.edges[-1]:.4g}</text></svg>"
    )
    return "".join(parts)


def layers(count: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Each node's depth (0 for a node without parents, else one more than its deepest
    parent); nodes are 0..count-1 in execution order, so parents come first. An edge
    naming a node out of range, or pointing backwards, is ignored."""
    depth = [0] * count
    for parent, child in sorted(edges, key=lambda e: e[1]):
        if 0 <= parent < child < count:
            depth[child] = max(depth[child], depth[parent] + 1)
    return depth


_KIND_FILL = {"input": "#d9f0d3", "output": "#fde0c5"}


def graph_svg(
    nodes: Sequence[tuple[str, str, str]],
    edges: Sequence[tuple[int, int]],
    href: Sequence[str],
) -> str:
    """The op graph as SVG, one row per depth: ``nodes[i]`` is (label, func, kind) of
    node ``i``, ``edges`` are (parent, child) indices into ``nodes``, ``href[i]`` the
    link of node ``i``. Each node is an ``<a>`` around a box with its label."""
    depth = layers(len(nodes), edges)
    column: list[int] = []
    per_row: dict[int, int] = {}
    for d in depth:
        column.append(per_row.get(d, 0))
        per_row[d] = column[-1] + 1
    box_w, box_h, gap_x, gap_y = 150, 30, 20, 26
    x = [16 + c * (box_w + gap_x) for c in column]
    y = [16 + d * (box_h + gap_y) for d in depth]
    width = 32 + max(per_row.values(), default=1) * (box_w + gap_x)
    height = 32 + (max(depth, default=0) + 1) * (box_h + gap_y)
    parts = [
        f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="monospace" '
        'font-size="11">'
    ]
    for parent, child in edges:
        if not 0 <= parent < child < len(nodes):
            continue
        x1, y1, x2, y2 = x[parent] + box_w / 2, y[parent] + box_h, x[child] + box_w / 2, y[child]
        if depth[child] - depth[parent] > 1:  # a skip: bow out to the right of the boxes
            bow = box_w / 2 + 12 + 6 * min(depth[child] - depth[parent], 10)
            parts.append(
                f'<path class="edge" d="M{x1},{y1} C{x1 + bow},{y1 + gap_y} '
                f'{x2 + bow},{y2 - gap_y} {x2},{y2}" fill="none" stroke="#b07"/>'
            )
        else:
            parts.append(
                f'<line class="edge" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#888"/>'
            )
    for i, (label, func, kind) in enumerate(nodes):
        fill = _KIND_FILL.get(kind, "#dbe9f6")
        text = label if len(label) <= 22 else label[:21] + "…"
        parts.append(
            f'<a class="node" href="{html.escape(href[i])}" data-label="{html.escape(label)}">'
            f"<title>{html.escape(label)} ({html.escape(func)})</title>"
            f'<rect x="{x[i]}" y="{y[i]}" width="{box_w}" height="{box_h}" rx="4" '
            f'fill="{fill}" stroke="#456"/>'
            f'<text x="{x[i] + box_w / 2}" y="{y[i] + 19}" text-anchor="middle">'
            f"{html.escape(text)}</text></a>"
        )
    parts.append("</svg>")
    return "".join(parts)
