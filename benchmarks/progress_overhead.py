"""What the recording's progress bar costs the forward pass: ``store.record`` with
``progress=False`` against ``progress=True`` (the bar shown, drawn to a throwaway
terminal), side by side in one process.

Run: ``python benchmarks/progress_overhead.py [--rounds 9] [--ops 2000]``. The model is
a chain of ``--ops`` small elementwise ops on a (64, 64) tensor, every op saved (the
recorder's hot path at its busiest per op); each round records it once per condition, in
alternating order; the report is each condition's median wall time and their ratio. The
bar's counting never runs on the forward thread (a thread of its own reads the writer's
byte count every quarter second), so the ratio should be 1 within noise.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from contextlib import redirect_stderr

import torch

import tracelake as tl
from tracelake import progress


class Chain(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * 1.0001
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--ops", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    progress.DELAY = 0.0  # the bar from the start: the whole recording pays for it
    model, x = Chain(args.ops).eval(), torch.randn(64, 64)
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp, redirect_stderr(io.StringIO()):
        store = tl.open(f"{tmp}/s.tl")
        with torch.no_grad():
            store.record(model, x, name="warm", progress=False)
            for r in range(args.rounds):
                for shown in (False, True) if r % 2 == 0 else (True, False):
                    start = time.perf_counter()
                    store.record(model, x, name=f"r{r}-{shown}", progress=shown)
                    times[shown].append(time.perf_counter() - start)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"progress=False {off * 1e3:8.1f} ms (median of {args.rounds})")
    print(f"progress=True  {on * 1e3:8.1f} ms")
    print(f"ratio on/off   {on / off:8.3f}  ({args.ops} ops saved per recording)")


if __name__ == "__main__":
    main()
