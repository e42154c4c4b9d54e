"""How a query's cost grows with its text (issue 17, item 14): an `in` list of n values,
and n conditions joined by `and` / `or`, at n and 4n. Linear cost shows as a ratio
near 4 between the two sizes (quadratic: 16).

    .venv/bin/python benchmarks/query_scaling.py [--n 10000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import tracelake as tl


def _texts(kind: str, n: int) -> str:
    if kind == "in":
        values = ", ".join(f"'l{i}'" for i in range(n))
        return f"select label from ops where label in ({values})"
    op = " and " if kind == "and" else " or "
    test = "!=" if kind == "and" else "="
    return "select label from ops where " + op.join(f"idx {test} {i}" for i in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = tl.open(tempfile.mkdtemp())
    store.record(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4), name="a")
    store.query("select label from ops").df()
    for kind in ("in", "and", "or"):
        times: dict[int, list[float]] = {args.n: [], 4 * args.n: []}
        for _ in range(args.rounds):  # interleaved rounds: both sizes see the same load
            for n in times:
                text = _texts(kind, n)
                start = time.perf_counter()
                store.query(text).df()
                times[n].append(time.perf_counter() - start)
        small, large = (statistics.median(t) for t in times.values())
        print(
            f"{kind:>3}: n={args.n} {small:.2f} s, n={4 * args.n} {large:.2f} s "
            f"(ratio {large / small:.1f}; linear 4, quadratic 16)"
        )


if __name__ == "__main__":
    main()
