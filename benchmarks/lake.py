"""The shared-catalog deployment (DuckLake on PostgreSQL, arrays and Parquet on an
S3-compatible server) against the real servers: moto_server and a throwaway PostgreSQL
on free ports (tests/servers.py), on this machine.

Run in the ducklake venv (DuckDB 1.5.5 and the extension wheels; .ci/run makes one):
``.venv-ducklake/bin/python benchmarks/lake.py [writers] [throughput] [queries]
[--writers 8] [--runs 25] [--readers 2] [--lease 20] [--query-runs 2]
[--query-ops 50000] [--query-sizes 4,25]``.

* ``writers``: ``--writers`` processes each record ``--runs`` runs (Linear(64, ``--width``
  256) + Tanh on a 520 x 64 input: two 0.5 MB activations a run) into one store, while
  ``--readers`` processes query throughout (every run's op count, one run's tensors),
  and the last writer is SIGKILLed in the middle of one more run. Reports errors seen
  by writers and readers, runs committed, every run compared bitwise with a plain
  forward, the killed run invisible, and its objects collected by ``gc()`` once its
  lease (``--lease`` s) expired.
* ``throughput``: the same runs recorded by one process into a local store (fsync'd)
  and into the lake, interleaved rounds: MB/s each and the ratio (the issue's bar: the
  lake at least 0.4x the local store).
* ``queries``: ``--query-runs`` runs of the query benchmark's chain (``--query-ops``
  50,000: 43,752 ops each, statistics only: ``stats="all", save=tl.none()``) recorded
  into the lake, which then grows to each of ``--query-sizes`` runs by copies of their
  rows committed as new runs (:func:`copy_runs`: the writer's own catalog
  transactions, no recording, so a million ops take seconds). At each size a new
  reader in a process of its own: its first query (open, then the predicate over every
  op), its RSS, then warm medians: a point lookup (``run = :r and label = :l``) and the
  predicate (targets: 30 ms and 100 ms over 1M ops). Past ``MIRROR_OPS`` ops the reader
  copies no rows: queries over every run read the lake's Parquet files.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import make_bucket, moto_server, new_database, postgres_server, s3_options
from test_ducklake import READER, WRITER, check_writers

import tracelake as tl

BUCKET = "tracelake-bench"


def _objects(options: dict[str, Any], prefix: str) -> set[str]:
    import obstore

    from tracelake.store.objstore import open_object_store

    whole = open_object_store(f"s3://{BUCKET}", options)
    keys = [m["path"] for batch in obstore.list(whole, f"{prefix}/runs/") for m in batch]
    return {key.split("/")[2] for key in keys}


def writers(dsn: str, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    url, catalog = f"s3://{BUCKET}/writers", new_database(dsn, "writers")
    options = s3_options(endpoint)
    tl.open(url, catalog=catalog, storage_options=options).runs()  # (the lake's tables)
    env = dict(os.environ, TRACELAKE_LEASE_SECONDS=str(args.lease))
    text = json.dumps(options)
    stop = Path(tempfile.mkdtemp()) / "stop"

    def start(*argv: str, out: bool = False) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", *argv],
            stdout=subprocess.PIPE if out else None,
            text=True,
            env=env,
        )

    began = time.perf_counter()
    readers = [start(READER, url, catalog, text, str(stop), out=True) for _ in range(args.readers)]
    procs = [
        start(WRITER, url, catalog, text, f"w{i}", str(args.runs), "0", str(args.width))
        for i in range(args.writers - 1)
    ]
    last = f"w{args.writers - 1}"
    victim = start(WRITER, url, catalog, text, last, str(args.runs), "1", str(args.width), out=True)
    assert victim.stdout is not None
    killed = victim.stdout.readline().strip() == "ready"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    failed_writers = sum(proc.wait() != 0 for proc in procs)
    elapsed = time.perf_counter() - began
    stop.touch()
    reader_lines = [r.communicate(timeout=300)[0].strip().splitlines() for r in readers]
    queries = sum(int(lines[-1].split()[1]) for lines in reader_lines)
    reader_errors = sum(int(lines[-1].split()[2]) for lines in reader_lines)
    names = [f"w{i}-{k}" for i in range(args.writers) for k in range(args.runs)]
    check_writers(url, catalog, options, names, args.width)  # every run there, bitwise (or raises)
    store = tl.open(url, catalog=catalog, storage_options=options)
    invisible = f"w{args.writers - 1}-killed" not in store
    before = len(_objects(options, "writers"))
    time.sleep(args.lease + 1)
    collected = store.gc()["runs"]
    after = len(_objects(options, "writers"))
    return {
        "writers": args.writers,
        "runs each": args.runs,
        "seconds": round(elapsed, 1),
        "runs/s": round(len(names) / elapsed, 2),
        "writer processes failed": failed_writers,
        "reader queries": queries,
        "reader errors": reader_errors,
        "runs committed, bitwise intact": len(names),
        "killed mid-run": killed,
        "killed run invisible": invisible,
        "run prefixes before gc / after": f"{before} / {after}",
        "collected after the lease": collected,
        "verify ok": store.verify().ok,
    }


def throughput(dsn: str, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    options = s3_options(endpoint)
    lake = tl.open(f"s3://{BUCKET}/tp", catalog=new_database(dsn, "tp"), storage_options=options)
    local = tl.open(Path(tempfile.mkdtemp()) / "local.tl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2100), torch.nn.Tanh())
    x = torch.randn(520, 64)
    times: dict[str, list[float]] = {"local": [], "lake": []}
    nbytes = 0
    with torch.no_grad():
        for k in range(args.rounds * 2 + 2):
            for label, store in (("local", local), ("lake", lake)):
                began = time.perf_counter()
                run = store.record(model, x, name=f"{label}-{k}")
                if k >= 2:  # (the first two: warm-up)
                    times[label].append(time.perf_counter() - began)
                nbytes = int(run.info["bytes"])
    local_s, lake_s = statistics.median(times["local"]), statistics.median(times["lake"])
    return {
        "bytes a run": nbytes,
        "local MB/s": round(nbytes / local_s / 1e6, 1),
        "lake MB/s": round(nbytes / lake_s / 1e6, 1),
        "local ms a run": round(local_s * 1e3, 1),
        "lake ms a run": round(lake_s * 1e3, 1),
        "lake / local": round(local_s / lake_s, 2),
    }


def copy_runs(store: Any, sources: list[str], copies: int, first: int = 0) -> None:
    """The bulk path to a large lake: ``copies`` more runs, each one a copy of a recorded
    run's rows (round robin over ``sources``) committed under a new name (numbered from
    ``first``) by the writer's own two catalog transactions (register with a lease,
    commit), without recording."""
    from tracelake.store.catalog import _with_run_id
    from tracelake.store.schema import RUN_TABLES, present_columns

    lake = store._catalog
    infos = {row["name"]: row for row in lake.rows("status = 'complete'", [])}
    with lake.transaction() as con:
        present = present_columns(con)
        rows = {
            name: {
                table: con.sql(
                    f"SELECT * FROM {table} WHERE run_id = {int(infos[name]['id'])}"
                ).to_arrow_table()
                for table in RUN_TABLES
                if table in present
            }
            for name in sources
        }
    for k in range(copies):
        source = sources[k % len(sources)]
        info, name = infos[source], f"{source}-copy{first + k}"
        run_id, lease = lake.reserve(name, False, {"model_class": info["model_class"]})
        try:
            tables = {t: _with_run_id(data, run_id) for t, data in rows[source].items()}
            lake.commit(run_id, name, False, tables, dict(info))
        finally:
            lease.close()


#: A new reader, in a process of its own: its first query over every op (the predicate),
#: then warm medians of a point lookup and of the predicate, and its peak RSS.
NEW_READER = """
import json, random, sys, time
import tracelake as tl
url, catalog, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
PREDICATE = (
    "select run, label, absmax from ops where func = 'relu' and absmax > 2.5 "
    "order by absmax desc limit 10"
)
began = time.perf_counter()
reader = tl.open(url, catalog=catalog, storage_options=options, create=False)
reader.query(PREDICATE).df()
first = time.perf_counter() - began
def peak_mib():  # (this process's own: ru_maxrss would count the parent's at fork)
    status = open("/proc/self/status").read().split("VmHWM:")[1]
    return int(status.split()[0]) / 1024

rss_first = peak_mib()
direct = reader.catalog._direct
total = int(reader.query("select count(*) as n from ops").df()["n"][0])
labels = reader.query("select label from ops where run = 'q0'").df()["label"].tolist()
rng = random.Random(0)
names = list(reader)
recorded = [name for name in names if "-copy" not in name]  # (warm: their rows are read)

sys.path.insert(0, sys.argv[4])
from query_latency import timed  # (median and 90th percentile, seconds)

point = timed(lambda: reader.query(
    "select absmax from ops where run = :r and label = :l", r=rng.choice(recorded),
    l=rng.choice(labels)).df(), 30)[0] * 1e3
predicate = timed(lambda: reader.query(PREDICATE).df(), 30)[0] * 1e3
print(json.dumps({
    "runs": len(names), "ops": total, "reads the lake itself": direct,
    "new reader's first query s (open + predicate)": round(first, 2),
    "new reader's RSS after it MiB": round(rss_first),
    "point lookup ms (warm, median)": round(point, 2),
    "predicate over all ops ms (warm, median)": round(predicate, 2),
    "peak RSS MiB": round(peak_mib()),
}))
"""


def queries(dsn: str, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    """The lake grown to each of ``--query-sizes`` runs (``--query-runs`` recorded, the
    rest copies of them: :func:`copy_runs`), a new reader measured at each size."""
    import torch

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    from query_latency import Chain

    torch.set_num_threads(1)
    options, url, catalog = s3_options(endpoint), f"s3://{BUCKET}/q", new_database(dsn, "q")
    store = tl.open(url, catalog=catalog, storage_options=options)
    model = Chain(args.query_ops)
    began = time.perf_counter()
    recorded = [f"q{k}" for k in range(args.query_runs)]
    with torch.no_grad():
        for name in recorded:
            store.record(model, torch.randn(32, 32), name=name, stats="all", save=tl.none())
    built, have = time.perf_counter() - began, len(recorded)
    curve = []
    for size in sorted(args.query_sizes or [have]):
        began = time.perf_counter()
        copy_runs(store, recorded, max(0, size - have), first=have)
        built, have = built + time.perf_counter() - began, max(size, have)
        reader = subprocess.run(
            [sys.executable, "-c", NEW_READER, url, catalog, json.dumps(options), here],
            capture_output=True,
            text=True,
            check=True,
        )
        point = json.loads(reader.stdout.strip().splitlines()[-1])
        point["build s (cumulative)"] = round(built, 1)
        print(json.dumps({"queries, a new reader": point}), flush=True)
        curve.append(point)
    return {"sizes": len(curve)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", default=["writers", "throughput", "queries"])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--lease", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=256, help="the writers' Linear width")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--query-runs", type=int, default=2, help="runs recorded")
    parser.add_argument("--query-ops", type=int, default=50_000, help="a recorded run's ops")
    parser.add_argument(
        "--query-sizes",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[4, 25],
        help="runs in the lake at each measurement (comma-separated; beyond the recorded "
        "runs, copies of them)",
    )
    args = parser.parse_args()
    os.environ["TRACELAKE_LEASE_SECONDS"] = str(args.lease)
    with postgres_server() as dsn, moto_server() as endpoint:
        make_bucket(endpoint, BUCKET)
        for what in args.what:
            result = {"writers": writers, "throughput": throughput, "queries": queries}[what](
                dsn, endpoint, args
            )
            print(json.dumps({what: result}, default=str), flush=True)


if __name__ == "__main__":
    main()
