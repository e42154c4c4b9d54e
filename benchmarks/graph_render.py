"""How long drawing a large model's op graph takes (issue 14: "a 10,000-op model still
renders in seconds").

Run: ``python benchmarks/graph_render.py [--repeats 5] [--blocks 67]``. The model: a
``Sequential`` of ``--blocks`` blocks, each a ``Sequential`` of ten modules of fifteen
ops (10,050 ops with 67 blocks), traced in memory. Measured, each a median over
``--repeats`` rounds, wall time, ``torch.set_num_threads(1)``:

* ``trace.graph()``: the graph built (module depth chosen automatically: the deepest
  whose graph has at most ``MAX_NODES`` nodes), without drawing;
* ``.svg()``: Graphviz's ``dot`` laying it out and drawing it;
* the same at ``depth=1`` (every block expanded: about 700 nodes), for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import tracelake as tl


class Leaf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = torch.relu(x * 1.5 + 0.1)
        return x


def _timed(fn: object) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()  # type: ignore[operator]
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=67)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = nn.Sequential(
        *[nn.Sequential(*[Leaf() for _ in range(10)]) for _ in range(args.blocks)]
    )
    trace = tl.trace(model, torch.randn(2, 4))
    times: dict[str, list[float]] = {"build": [], "svg": [], "build+svg depth=1": []}
    nodes = {}
    for _ in range(args.repeats):
        took, drawn = _timed(trace.graph)
        times["build"].append(took)
        took, _svg = _timed(drawn.svg)  # type: ignore[attr-defined]
        times["svg"].append(took)
        nodes["auto"] = drawn
        took, _deep = _timed(lambda: trace.graph(depth=1).svg())
        times["build+svg depth=1"].append(took)
    print(f"{len(trace)} ops; auto depth: {nodes['auto']!r}")
    for name, values in times.items():
        print(f"{name:>20}: median {statistics.median(values):.3f} s over {len(values)} rounds")
    total = statistics.median(a + b for a, b in zip(times["build"], times["svg"], strict=True))
    print(f"{'graph() + svg()':>20}: median {total:.3f} s")


if __name__ == "__main__":
    main()
