"""Server time of the web explorer's pages on the 1,000-run benchmark store.

Run: ``python benchmarks/explorer_latency.py [--runs 1000] [--ops 1000] [--dir DIR]
[--repeats 20] [--markdown]``. The store is the one ``benchmarks/query_latency.py``
builds (1,000 runs of a 1,000-op chain, every op saved; built once in ``--dir``, default
``/tmp/tl-query-bench``, and reused). The explorer is served from a thread
(``tracelake.explorer.running``) and each page is fetched over HTTP; what is measured is
the server's own time for the page (its ``Server-Timing`` header: the views' queries
plus rendering; and the server process's CPU time meanwhile, which a busy machine
stretches less than the wall time), median and 90th percentile over ``--repeats``
rounds, pages interleaved within each round, after two warm-up rounds; and the first
request of each page, from a new ``Store``, and how long the server took to start: it
answers each kind of page once on the most recent run before it listens
(``Explorer.warm``: torch and the query room imported, the catalog mirror loaded,
templates compiled), so a first request pays only for what is new to it (a run not read
before: its rows copied into the mirror, or read op by op for a comparison). The target
is <= 300 ms a page.

Pages: the runs list (first 200 of 1,000 runs, with meta and provenance), the runs
list filtered on meta, a run's op table (first 200 of its 1,000 ops), the same
filtered (``func = 'relu' and absmax > 1``), its op graph (1,000 nodes), an op with its
tensor (heatmap, histogram), and two runs compared op by op with their first divergence;
and, in every round (warm-up rounds included: each is a first request), two runs no page
showed before compared, a new pair each round, at a random place in the round.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from query_latency import build

import tracelake as tl
from tracelake.explorer import running


def server_ms(url: str) -> tuple[float, float]:
    """The server's time for the page and its process's CPU time meanwhile (ms)."""
    with urllib.request.urlopen(url) as response:
        response.read()
        timing = response.headers["Server-Timing"]  # app;dur=12.34, cpu;dur=5.67
    metrics = dict(part.strip().split(";dur=") for part in timing.split(","))
    return float(metrics["app"]), float(metrics["cpu"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--dir", default="/tmp/tl-query-bench")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = build(Path(args.dir), args.runs, args.ops)
    names = store.runs()["name"].tolist()
    rng = random.Random(0)
    a, b = rng.sample(names, 2)
    label = store.query("select label from ops where run = :r and func = 'relu' limit 1", r=a)
    op = next(iter(label))["label"]

    def q(path: str, **params: object) -> str:
        return f"{path}?{urllib.parse.urlencode(params)}"

    pages = {
        f"runs list (200 of {len(names):,} runs)": "/",
        "runs list, where meta.prompt = 'Paris'": q("/", where="meta.prompt = 'Paris'"),
        f"run's op table (200 of {args.ops:,} ops)": q("/run", run=a),
        "run's op table, where func = 'relu' and absmax > 1": q(
            "/run", run=a, where="func = 'relu' and absmax > 1"
        ),
        f"op graph ({args.ops:,} nodes)": q("/graph", run=a),
        "op detail with tensor (heatmap, histogram)": q("/op", run=a, label=op),
        f"compare two {args.ops:,}-op runs, first divergence": q("/compare", a=a, b=b),
    }
    # Each round also compares two runs that no page has shown before (a pair of its
    # own, from runs kept out of the pages above): what a user's first comparison costs.
    fresh_name = f"compare two {args.ops:,}-op runs not viewed before (each round)"
    unseen = [n for n in names if n not in (a, b)]
    rng.shuffle(unseen)
    samples: dict[str, list[float]] = {name: [] for name in [*pages, fresh_name]}
    cpu: dict[str, list[float]] = {name: [] for name in samples}
    first: dict[str, float] = {}
    started = time.perf_counter()
    with running(tl.open(args.dir, create=False)) as base:  # a new Store: nothing cached
        start_s = time.perf_counter() - started
        for round_ in range(args.repeats + 2):
            order = list(pages.items())
            fresh = q("/compare", a=unseen[2 * round_], b=unseen[2 * round_ + 1])
            order.insert(rng.randrange(len(order) + 1), (fresh_name, fresh))
            for name, path in order:
                ms, cpu_ms = server_ms(base + path)
                if round_ == 0:
                    first[name] = ms
                elif round_ >= 2 or name == fresh_name:
                    samples[name].append(ms)
                    cpu[name].append(cpu_ms)
    print(
        f"store: {len(names)} runs x {args.ops} ops, load {os.getloadavg()[0]:.2f}; "
        f"server started (and warmed) in {start_s:.2f} s"
    )
    rows = []
    for name, values in samples.items():
        values.sort()
        median = statistics.median(values)
        p90 = values[int(0.9 * (len(values) - 1))]
        rows.append((name, first[name], median, p90, statistics.median(cpu[name])))
    worst = max(row[3] for row in rows)
    if args.markdown:
        print(
            "| page | first request | median | p90 | median CPU |\n"
            "| --- | ---: | ---: | ---: | ---: |"
        )
        for name, once, median, p90, cpu_ms in rows:
            print(f"| {name} | {once:.1f} ms | {median:.1f} ms | {p90:.1f} ms | {cpu_ms:.1f} ms |")
    else:
        for name, once, median, p90, cpu_ms in rows:
            print(
                f"{name:52s} first {once:7.1f} ms  median {median:7.1f} ms  "
                f"p90 {p90:7.1f} ms  CPU {cpu_ms:7.1f} ms"
            )
    print(f"slowest p90: {worst:.1f} ms (target <= 300 ms)")


if __name__ == "__main__":
    main()
