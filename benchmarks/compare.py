"""The cost of comparing runs, against the limits it is measured by, side by side in one run.

Run: ``python benchmarks/compare.py [--repeats 9] [--runs 1000] [--ops 200] [--dir DIR]
[--json PATH]``. Three measures (the comparison issue's targets):

* **Two stored GPT-2 runs, every tensor compared** (``GPT2Model``, 4 layers, d=256,
  batch 4 x 128, every op saved: ~160 MB a run): ``store.compare(a, b).df()`` against
  **the limit**, reading both runs' tensors once (``run[label].array[...]`` for every
  saved op of both runs, nothing computed). Target: compare <= 1.3x the limit. The
  files are in the OS's page cache for both (each is run once before timing); each
  sample runs in a new process (``--sample``), as a user's first comparison in a
  notebook would, so neither condition finds the other's decoded chunks or memory.
* **Statistics of 1,000 runs against a baseline** (``store.compare(base, others,
  tensors=False).df()``): runs of a chain of ``--ops`` small ops. Target <= 1 s, with
  the reader's catalog mirror loaded (a new reader loads it once; that cost is printed
  too).
* For comparison, the same statistics through a Python loop over the runs
  (``store.compare(base, run, tensors=False, select=tl.all())`` each), which loads
  every run op by op.

Method: ``torch.set_num_threads(1)``, wall time, conditions interleaved, medians over
``--repeats`` rounds (the GPT-2 pair's ratio is the median of per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from capture_overhead import build_model

import tracelake as tl
from tracelake.store.tensors import clear_chunk_cache


def _gpt2_store(root: Path) -> tl.Store:
    store = tl.open(root)
    if "a" in store and "b" in store:
        return store
    model, args = build_model("gpt2")
    with torch.no_grad():
        store.record(model, *args, name="a", overwrite=True)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        store.record(model, *args, name="b", overwrite=True)
    return store


def _read_both(store: tl.Store) -> int:
    clear_chunk_cache()
    total = 0
    for name in ("a", "b"):
        for op in store[name]:
            lazy = op.array
            if lazy is not None:
                total += lazy[...].numel()
    return total


def _compare_all(store: tl.Store) -> int:
    clear_chunk_cache()
    return len(store.compare("a", "b").df())


def _chain_store(root: Path, runs: int, ops: int) -> tl.Store:
    store = tl.open(root)
    have = len(store)
    if have >= runs + 1:
        return store

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for k in range(ops // 2):
                x = torch.sin(x) * (1 + k % 3)
            return x

    model = Chain()
    torch.manual_seed(0)
    with torch.no_grad():
        for k in range(have, runs + 1):
            store.record(model, torch.randn(8, 8), name=f"r{k:05d}", save=tl.none(), stats="all")
    return store


def _sample(where: Path, what: str) -> float:
    """One timed GPT-2 sample in a new process (its import and set-up untimed)."""
    out = subprocess.run(
        [sys.executable, __file__, "--sample", what, "--dir", str(where)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--loop-runs", type=int, default=50, help="runs in the Python loop")
    parser.add_argument("--dir", default=None, help="keep the stores here between runs")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--sample", choices=("read", "compare"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = Path(args.dir or tempfile.mkdtemp(prefix="tl-compare-"))
    where.mkdir(parents=True, exist_ok=True)
    if args.sample:  # one sample, in this new process
        store = tl.open(where / "gpt2.tl", create=False)
        fn = _read_both if args.sample == "read" else _compare_all
        print(_timed(lambda: fn(store)))
        return
    try:
        _measure(args, where)
    finally:
        if args.dir is None:  # (its own temporary directory: ~320 MB left in /tmp)
            shutil.rmtree(where, ignore_errors=True)


def _measure(args: argparse.Namespace, where: Path) -> None:
    gpt2 = _gpt2_store(where / "gpt2.tl")
    elements = _read_both(gpt2)  # warm the page cache and the readers
    _compare_all(gpt2)
    print(f"GPT-2 pair: {elements * 4 / 2**20:.0f} MiB of tensors in both runs")

    start = time.perf_counter()
    chains = _chain_store(where / "chains.tl", args.runs, args.ops)
    print(
        f"{args.runs + 1} chain runs of {args.ops} ops ready in {time.perf_counter() - start:.1f} s"
    )
    names = sorted(chains.runs()["name"])
    base, others = names[0], names[1 : args.runs + 1]
    fresh = tl.open(where / "chains.tl", create=False)
    cold = _timed(lambda: fresh.compare(base, others, tensors=False).df())

    results: dict[str, list[float]] = {
        "read": [],
        "compare": [],
        "ratio": [],
        "stats": [],
        "loop": [],
    }
    for k in range(args.repeats):
        order = ["read", "compare"] if k % 2 == 0 else ["compare", "read"]
        times = {name: _sample(where, name) for name in order}
        results["read"].append(times["read"])
        results["compare"].append(times["compare"])
        results["ratio"].append(times["compare"] / times["read"])
        results["stats"].append(_timed(lambda: chains.compare(base, others, tensors=False).df()))
        loop = others[: args.loop_runs]
        results["loop"].append(
            _timed(
                lambda loop=loop: [
                    chains.compare(base, o, tensors=False, select=tl.all()).df() for o in loop
                ]
            )
            * len(others)
            / len(loop)
        )
    med = {name: statistics.median(values) for name, values in results.items()}
    rows = [
        ("GPT-2 pair: read both runs' tensors once (the limit)", f"{med['read'] * 1e3:.0f} ms", ""),
        ("GPT-2 pair: store.compare(a, b).df()", f"{med['compare'] * 1e3:.0f} ms", ""),
        (
            "GPT-2 pair: compare / read (median of rounds)",
            f"{med['ratio']:.2f}x",
            "<= 1.3x: " + ("met" if med["ratio"] <= 1.3 else "MISSED"),
        ),
        (
            f"statistics of {len(others)} runs against one (mirror loaded)",
            f"{med['stats'] * 1e3:.0f} ms",
            "<= 1000 ms: " + ("met" if med["stats"] <= 1.0 else "MISSED"),
        ),
        ("the same, a new reader (loads the mirror once)", f"{cold * 1e3:.0f} ms", ""),
        (
            f"the same through a Python loop over runs (from {args.loop_runs}, scaled)",
            f"{med['loop'] * 1e3:.0f} ms",
            "",
        ),
    ]
    print("\n| measure | median | target |\n|---|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nper-round compare/read ratios: {', '.join(f'{r:.2f}' for r in results['ratio'])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "rounds": results, "cold": cold}))
    for store in (gpt2, chains, fresh):
        store.close()  # (their sealed runs folded now, not at exit into a removed directory)


if __name__ == "__main__":
    main()
