"""What the recording's progress bar costs the forward pass: ``store.record`` with
``progress=False`` against ``progress=True`` (the bar shown, drawn to a throwaway
terminal), side by side in one process.

Run: ``python benchmarks/progress_overhead.py [--rounds 9] [--ops 10000]``. The model is
a chain of ``--ops`` small elementwise ops on a (64, 64) tensor, every op saved (the
recorder's hot path at its busiest per op); each round records it once per condition, in
alternating order; the report is each condition's median wall time and their ratio. The
bar's counting never runs on the forward thread (a thread of its own reads the writer's
byte count every quarter second), so the ratio should be 1 within noise. The bar is
drawn as to a terminal (``TRACELAKE_PROGRESS=1``; stderr is a throwaway buffer) and
from the start (``progress.DELAY`` 0); a recording must last several of the bar's
quarter seconds for it to be drawn at all, which the benchmark checks (it stops, saying
so, where the bar drew nothing: a faster machine needs more ``--ops``).
"""

from __future__ import annotations

import argparse
import io
import os
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
    parser.add_argument("--ops", type=int, default=10000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    progress.DELAY = 0.0  # the bar from the start: the whole recording pays for it
    os.environ["TRACELAKE_PROGRESS"] = "1"  # drawn as to a terminal, into the buffer
    model, x = Chain(args.ops).eval(), torch.randn(64, 64)
    times: dict[bool, list[float]] = {False: [], True: []}
    drawn: dict[bool, list[int]] = {False: [], True: []}  # characters written to stderr
    with tempfile.TemporaryDirectory() as tmp:
        with redirect_stderr(io.StringIO()):
            store = tl.open(f"{tmp}/s.tl")
        with torch.no_grad():
            store.record(model, x, name="warm", progress=False)
            for r in range(args.rounds):
                for shown in (False, True) if r % 2 == 0 else (True, False):
                    with redirect_stderr(io.StringIO()) as err:
                        start = time.perf_counter()
                        store.record(model, x, name=f"r{r}-{shown}", progress=shown)
                        times[shown].append(time.perf_counter() - start)
                    drawn[shown].append(len(err.getvalue()))
    if min(drawn[True]) == 0:
        raise SystemExit(
            f"the bar drew nothing in {drawn[True].count(0)} of {args.rounds} recordings "
            f"({statistics.median(times[True]) * 1e3:.0f} ms each): too short for its "
            f"{progress._POLL} s poll; pass more --ops"
        )
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"progress=False {off * 1e3:8.1f} ms (median of {args.rounds})")
    print(f"progress=True  {on * 1e3:8.1f} ms")
    print(f"ratio on/off   {on / off:8.3f}  ({args.ops} ops saved per recording)")
    print(
        f"drawn: {statistics.median(drawn[True]):.0f} characters a recording with the bar, "
        f"{max(drawn[False])} without"
    )


if __name__ == "__main__":
    main()
