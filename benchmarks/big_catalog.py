"""A new reader's first predicate query on catalogs of millions of ops (issue 15).

Run: ``python benchmarks/big_catalog.py [--ops 500000,1000000,3000000,10000000] [--dir DIR]
[--repeats 3]``. One store (``--dir``, default ``/tmp/tl-big-catalog``) is grown to each
size in turn and measured there; a store already that large is reused.

**Building** (cheap, but every row real): one run of the query benchmark's chain (1,000
ops, ``benchmarks/query_latency.py``'s ``Chain``) is recorded by the real writer with
statistics of every op and no tensor (``save=tl.none(), stats="all"``); its catalog rows
(every run table) are read back and committed again as further runs through the store's
own batch commit (``CatalogWriter.commit_batch``: each copy gets its own run id, a copy
of the template's run directory renamed into place, its ``runs`` row and ``run.json``
marker), 1,000 runs a transaction. So the catalog holds exactly the rows a writer makes,
``verify`` accepts the store, and a 10-million-op catalog takes minutes, not hours.

**Measured**, in ``--repeats`` fresh processes at each size (median), and first on a
store of the template run alone (the fixed costs: imports, the query parser's tables,
DuckDB's start): ``tl.open``, then the first ``store.query`` (wall and process CPU
time) of ``select run, label, absmax from ops where func = 'relu' and absmax > 2.5
order by absmax desc limit 10`` (the query benchmark's catalog predicate), the
process's peak resident memory (``VmHWM``) and how much of it the query added over the
process after ``import tracelake, torch`` and ``tl.open``; then the same query three
times more in that process (hot: the fastest). Up to ``MIRROR_OPS`` (a million) ops
the reader copies every run's rows into its mirror for such a query; past it, the
query reads the catalog file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PREDICATE = (
    "select run, label, absmax from ops where func = 'relu' and absmax > 2.5 "
    "order by absmax desc limit 10"
)
BATCH = 1000  # runs a transaction

#: What a fresh process runs: open, the first query, the hot one, its peak resident
#: memory (VmHWM: ru_maxrss would carry the parent's over ``exec``), in KiB.
PROBE = """
import json, sys, time
def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
start = time.perf_counter()
import torch, tracelake as tl
torch.set_num_threads(1)
imported = time.perf_counter()
store = tl.open(sys.argv[1], create=False)
base = hwm()
t0, cpu = time.perf_counter(), time.process_time()
first = store.query(sys.argv[2])
t1, cpu = time.perf_counter(), time.process_time() - cpu
hot = []
for _ in range(3):
    t2 = time.perf_counter()
    store.query(sys.argv[2])
    hot.append(time.perf_counter() - t2)
print(json.dumps({"import_s": imported - start, "open_s": t0 - imported,
    "first_s": t1 - t0, "first_cpu_s": cpu, "hot_s": min(hot), "rows": len(first),
    "base_kib": base, "peak_kib": hwm()}))
"""


def _complete(root: Path) -> list[dict[str, Any]]:
    """The ``runs`` rows of the store's complete runs."""
    from tracelake.store.catalog import read_runs
    from tracelake.store.layout import StorePaths

    if not (root / "catalog.duckdb").exists():
        return []
    return read_runs(StorePaths(root), "status = 'complete'", [])


def _ops_in(root: Path) -> int:
    return sum(int(info["op_count"] or 0) for info in _complete(root))


def _template(root: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The template run (recorded once): its directory, catalog tables and summary."""
    import torch

    import tracelake as tl
    from tracelake.store.catalog import read_source
    from tracelake.store.layout import StorePaths, locked
    from tracelake.store.schema import RUN_TABLES, TABLES, select_list

    sys.path.insert(0, str(Path(__file__).parent))
    from query_latency import Chain

    store = tl.open(root)
    if "template" not in store:
        torch.manual_seed(0)
        with torch.no_grad():
            store.record(
                Chain(1000), torch.randn(32, 32), name="template", save=tl.none(), stats="all"
            )
    info = next(r for r in _complete(root) if r["name"] == "template")
    paths = StorePaths(root)
    tables = {}
    with locked(paths.lock, exclusive=False), read_source(paths) as (src, present):
        for table in RUN_TABLES:
            if table in present:
                tables[table] = src.sql(
                    f"SELECT {select_list(TABLES[table], present[table])} FROM {table} "
                    "WHERE run_id = ?",
                    params=[info["id"]],
                ).to_arrow_table()
    summary = {k: info.get(k) for k in ("steps", "op_count", "bytes", "device")}
    summary.update(param_fingerprint=info.get("param_fingerprint"))
    summary.update(input_fingerprint=info.get("input_fingerprint"))
    return paths.run_dir(int(info["id"])), tables, {"summary": summary, "info": info}


def grow(root: Path, target_ops: int) -> int:
    """Add copies of the template run until the store holds ``target_ops`` ops; return
    how many it holds."""
    from tracelake.store.catalog import CatalogWriter, StagedRun
    from tracelake.store.layout import STAGING, StorePaths

    have = _ops_in(root)
    if have >= target_ops:
        return have
    template_dir, tables, extra = _template(root)
    paths = StorePaths(root)
    writer = CatalogWriter(paths)
    per_run = int(extra["summary"]["op_count"])
    info = {k: extra["info"].get(k) for k in ("model_class", "torch_version", "device")}
    have = _ops_in(root)
    made = 0
    while have < target_ops:
        count = min(BATCH, -(-(target_ops - have) // per_run))
        staged = []
        for _ in range(count):
            made += 1
            where = paths.runs / f"{STAGING}big-{os.getpid()}-{made}-{os.urandom(4).hex()}"
            shutil.copytree(
                template_dir,
                where,
                ignore=shutil.ignore_patterns("run.json", "writing.lock"),
            )
            staged.append(
                StagedRun(
                    staged=where,
                    name=f"copy-{have // per_run + len(staged):08d}-{os.urandom(3).hex()}",
                    overwrite=False,
                    created=datetime.now(UTC).replace(tzinfo=None),
                    info={**info, "meta": {"copy": have // per_run + len(staged)}},
                    tables=tables,
                    summary=extra["summary"],
                )
            )
        start = time.perf_counter()
        writer.commit_batch(staged)
        have += count * per_run
        print(
            f"  {have:>11,} ops ({count} runs committed in {time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    return have


def probe(root: Path, repeats: int) -> dict[str, float]:
    found = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(root), PREDICATE],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        found.append(json.loads(out.strip().splitlines()[-1]))
    return {k: statistics.median(f[k] for f in found) for k in found[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="500000,1000000,3000000,10000000")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "tl-big-catalog"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(args.dir)
    sizes = [int(s) for s in args.ops.split(",")]
    print(f"load {os.getloadavg()[0]:.2f} at the start; store at {root}")
    rows = []
    one = root.with_name(root.name + "-one")  # the template run alone: the fixed costs
    grow(one, 1)
    rows.append((_ops_in(one), probe(one, args.repeats)))
    for size in sizes:
        print(f"growing to {size:,} ops:", flush=True)
        have = grow(root, size)
        m = probe(root, args.repeats)
        rows.append((have, m))
        mib = 1024
        print(
            f"  {have:>11,} ops: first query {m['first_s']:6.2f} s "
            f"(CPU {m['first_cpu_s']:5.2f} s; open {m['open_s']:.2f} s), "
            f"hot {m['hot_s'] * 1e3:7.1f} ms, peak RSS {m['peak_kib'] / mib:7.0f} MiB "
            f"(+{(m['peak_kib'] - m['base_kib']) / mib:.0f} MiB over the opened store), "
            f"catalog file {(root / 'catalog.duckdb').stat().st_size / 2**20:.0f} MiB",
            flush=True,
        )
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    print(
        "\n| ops in the catalog | first predicate query | its CPU | hot | peak RSS "
        "| added by the query |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for have, m in rows:
        print(
            f"| {have:,} | {m['first_s']:.2f} s | {m['first_cpu_s']:.2f} s | "
            f"{m['hot_s'] * 1e3:.0f} ms | "
            f"{m['peak_kib'] / 1024:.0f} MiB | {(m['peak_kib'] - m['base_kib']) / 1024:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
