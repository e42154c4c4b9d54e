"""Many runs into one store: a tiny run's fixed cost, batches, and commits as the store grows.

Run: ``python benchmarks/many_runs.py [--runs 1000] [--ops 1000] [--rounds 15]
[--batch 50] [--dir DIR] [--skip-tiny] [--skip-growth]`` (``--runs 10000 --skip-tiny``
for the issue's figure; the default is smaller, for a quick look).

* **Tiny runs** (``nn.Linear(8, 8)`` on a (2, 8) input, every tensor saved), on a warm
  store, in ``--rounds`` interleaved rounds: each round times three plain
  ``store.record`` calls and one ``with store.batch():`` block of ``--batch`` records.
  Printed: ``record()`` median and 90th percentile, and the batched cost per run
  (block wall time / runs, median and 90th percentile over rounds; it includes the
  batch's one ``syncfs`` and one catalog transaction), and the process's CPU time per
  run (all its threads; what a loaded machine inflates least).
* **Growth**: ``--runs`` runs of the query benchmark's chain (``--ops`` elementwise ops
  on a (32, 32) tensor, all saved: ``benchmarks/query_latency.py``'s store), recorded
  one by one. Printed: for the first and the last hundred runs, the median wall time of
  ``store.record`` and of its catalog commit (``CatalogWriter.commit``: the one
  transaction that inserts the run's rows) with the share of it that the ``DETACH``
  ending it takes (meant as DuckDB's checkpoint; measured ~1 ms, so the writing happens
  at ``COMMIT``), and runs/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tracelake as tl
from tracelake.store import catalog

sys.path.insert(0, str(Path(__file__).parent))
from query_latency import Chain  # (the query benchmark's model)


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def tiny(root: Path, rounds: int, batch: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    store = tl.open(root)
    for _ in range(5):  # warm: the catalog exists, DuckDB started, caches made
        store.record(model, x)
    with store.batch():
        store.record(model, x)
    single: list[float] = []
    batched: list[float] = []
    single_cpu: list[float] = []  # CPU time of the process (all its threads)
    batched_cpu: list[float] = []
    for _ in range(rounds):
        for _ in range(3):
            start, cpu = time.perf_counter(), time.process_time()
            store.record(model, x)
            single.append(time.perf_counter() - start)
            single_cpu.append(time.process_time() - cpu)
        start, cpu = time.perf_counter(), time.process_time()
        with store.batch():
            for _ in range(batch):
                store.record(model, x)
        batched.append((time.perf_counter() - start) / batch)
        batched_cpu.append((time.process_time() - cpu) / batch)
    ms = 1e3
    return {
        "record_median_ms": statistics.median(single) * ms,
        "record_p90_ms": _p90(single) * ms,
        "batched_median_ms": statistics.median(batched) * ms,
        "batched_p90_ms": _p90(batched) * ms,
        "record_cpu_ms": statistics.median(single_cpu) * ms,
        "batched_cpu_ms": statistics.median(batched_cpu) * ms,
    }


def growth(root: Path, runs: int, ops: int, tensors: bool = True) -> dict[str, float]:
    commits: list[float] = []
    detaches: list[float] = []  # each transaction's DETACH
    commit, detach = catalog.CatalogWriter.commit, catalog._detach

    def timed_commit(self: catalog.CatalogWriter, *args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return commit(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            commits.append(time.perf_counter() - start)

    def timed_detach(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            detach(*args, **kwargs)
        finally:
            detaches.append(time.perf_counter() - start)

    catalog.CatalogWriter.commit = timed_commit  # type: ignore[method-assign]
    catalog._detach = timed_detach
    store = tl.open(root)
    model = Chain(ops)
    options: dict[str, Any] = {} if tensors else {"save": tl.none(), "stats": "all"}
    walls: list[float] = []
    try:
        with torch.no_grad():
            for i in range(runs):
                torch.manual_seed(i)
                x = torch.randn(32, 32)
                start = time.perf_counter()
                store.record(model, x, name=f"run{i:05d}", meta={"i": i}, **options)
                walls.append(time.perf_counter() - start)
                if (i + 1) % 1000 == 0:
                    print(
                        f"  {i + 1} runs: the last hundred's commit median "
                        f"{statistics.median(commits[-100:]) * 1e3:.2f} ms, record median "
                        f"{statistics.median(walls[-100:]) * 1e3:.2f} ms",
                        flush=True,
                    )
    finally:
        catalog.CatalogWriter.commit = commit  # type: ignore[method-assign]
        catalog._detach = detach
    n = min(100, runs)
    ms = 1e3
    checkpoints = detaches[1::2]  # (reserve, commit) per run: the commit's DETACH
    return {
        "first_checkpoint_ms": statistics.median(checkpoints[:n]) * ms,
        "last_checkpoint_ms": statistics.median(checkpoints[-n:]) * ms,
        "first_record_ms": statistics.median(walls[:n]) * ms,
        "last_record_ms": statistics.median(walls[-n:]) * ms,
        "first_commit_ms": statistics.median(commits[:n]) * ms,
        "last_commit_ms": statistics.median(commits[-n:]) * ms,
        "first_runs_per_s": n / sum(walls[:n]),
        "last_runs_per_s": n / sum(walls[-n:]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--dir", default=None, help="where to build the stores (a temp dir)")
    parser.add_argument("--skip-growth", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true", help="only the growth part")
    parser.add_argument(
        "--no-tensors",
        action="store_true",
        help="growth runs keep statistics of every op but no tensor (save=tl.none(), "
        'stats="all"): the same catalog rows without 3.5 MB of chunks a run',
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = Path(args.dir or tempfile.mkdtemp(prefix="tl-many-"))
    print(f"load {os.getloadavg()[0]:.2f} at the start")
    if not args.skip_tiny:
        t = tiny(base / "tiny", args.rounds, args.batch)
        print(f"tiny run (nn.Linear(8, 8)), {args.rounds} interleaved rounds:")
        print(
            f"  store.record       median {t['record_median_ms']:7.2f} ms   "
            f"p90 {t['record_p90_ms']:7.2f} ms   CPU {t['record_cpu_ms']:6.2f} ms"
        )
        print(
            f"  batched ({args.batch}/batch)  median {t['batched_median_ms']:7.2f} ms   "
            f"p90 {t['batched_p90_ms']:7.2f} ms   CPU {t['batched_cpu_ms']:6.2f} ms   "
            "per run, amortised"
        )
    if args.skip_growth:
        return
    g = growth(base / "growth", args.runs, args.ops, not args.no_tensors)
    kept = "statistics only" if args.no_tensors else "every op saved"
    print(f"growth: {args.runs} runs of {args.ops} ops ({kept}), recorded one by one:")
    for which in ("first", "last"):
        print(
            f"  {which} 100:{' ' * (6 - len(which))}record {g[f'{which}_record_ms']:7.2f} ms, "
            f"commit {g[f'{which}_commit_ms']:6.2f} ms "
            f"(its DETACH {g[f'{which}_checkpoint_ms']:6.2f} ms) "
            f"(medians), {g[f'{which}_runs_per_s']:6.1f} runs/s"
        )
    print(f"  last/first commit: {g['last_commit_ms'] / g['first_commit_ms']:.2f}x")


if __name__ == "__main__":
    main()
