"""Memory of a large export: ``tracelake query ... --format parquet|json`` streams.

Run: ``python benchmarks/export_memory.py [--gib 1] [--dir DIR] [--formats parquet json]``.
Records (once, in ``--dir``, default ``/tmp/tl-export-bench``) one run of a chain of
elementwise ops on a (4096, 4096) float32 tensor, 64 MiB each, ``--gib`` GiB saved in
all; then, in a new process per format, runs the query ``select label, out from ops``
lazily (the catalog's rows only), notes the resident memory (the baseline), exports it
and reports the peak resident memory over that baseline and the time. The peak is the
kernel's high-water mark (``VmHWM``), reset at the baseline (``/proc/self/clear_refs``):
not ``ru_maxrss``, which a child keeps from its parent across ``fork`` and ``exec`` (a
parent that had just recorded the store passed its own peak on to every export).
``--limit N`` exports the first N rows only (memory is per batch, so a few rows show
it; a 1 GiB JSON export takes minutes). Target (issue 14): a 1 GiB export within
300 MiB over the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_CHILD = r"""
import json, sys, time
import tracelake as tl
from tracelake.query.export import export
from tracelake.query.results import run_query

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

store = tl.open(sys.argv[1], create=False)
limit = f" limit {sys.argv[4]}" if sys.argv[4] != "0" else ""
result = run_query(store, "select label, out from ops where run = 'big'" + limit, lazy=True)
import torch, pyarrow, pyarrow.parquet  # (loaded before the baseline: not the export's)

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from here
base = rss()
start = time.perf_counter()
export(result, sys.argv[2], sys.argv[3], progress=False)
took = time.perf_counter() - start
print(json.dumps({"base": base, "peak": hwm(), "seconds": took, "rows": len(result)}))
"""


def _record(root: Path, gib: float) -> None:
    import torch

    import tracelake as tl

    class Chain(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.n = n

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.n):
                x = x * 1.0001
            return x

    n = max(1, round(gib * 1024 / 64)) - 1  # the input is saved too
    store = tl.open(root)
    with torch.no_grad():
        store.record(Chain(n), torch.randn(4096, 4096), name="big", progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default="/tmp/tl-export-bench")
    parser.add_argument("--formats", nargs="+", default=["parquet", "arrow", "json"])
    parser.add_argument("--limit", type=int, default=0, help="export only the first N rows")
    args = parser.parse_args()
    root = Path(args.dir) / f"store-{args.gib:g}gib.tl"
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        _record(root, args.gib)
    for fmt in args.formats:
        out = Path(args.dir) / f"export.{fmt}"
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(root), fmt, str(out), str(args.limit)],
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        over = (got["peak"] - got["base"]) / 2**20
        size = out.stat().st_size / 2**30
        print(
            f"{fmt:8s} {got['rows']:3d} rows, {size:5.2f} GiB written in {got['seconds']:6.1f} s; "
            "peak RSS "
            f"{over:6.0f} MiB over the baseline ({got['base'] / 2**20:.0f} MiB)"
        )
        os.remove(out)
    print(f"(store: {args.gib:g} GiB of float32 tensors, 64 MiB each; {time.ctime()})")


if __name__ == "__main__":
    main()
