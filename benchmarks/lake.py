"""The shared-catalog deployment (DuckLake on PostgreSQL, arrays and Parquet on an
S3-compatible server) against the real servers: moto_server and a throwaway PostgreSQL
on free ports (tests/servers.py), on this machine.

Run in the ducklake venv (DuckDB 1.5.5 and the extension wheels; .ci/run makes one):
``.venv-ducklake/bin/python benchmarks/lake.py [writers] [throughput] [queries]
[--writers 8] [--runs 25] [--readers 2] [--lease 20] [--query-runs 10]
[--query-ops 100000]``.

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
* ``queries``: ``--query-runs`` runs of ``--query-ops`` ops each (statistics only:
  ``stats="all", save=tl.none()``) in the lake; a new reader's first query (its
  mirror copies the rows), then warm: a point lookup (``run = :r and label = :l``) and
  a predicate over every op (targets: 30 ms and 100 ms).
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


def queries(dsn: str, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from query_latency import Chain

    torch.set_num_threads(1)
    options, url, catalog = s3_options(endpoint), f"s3://{BUCKET}/q", new_database(dsn, "q")
    store = tl.open(url, catalog=catalog, storage_options=options)
    model = Chain(args.query_ops)
    began = time.perf_counter()
    with torch.no_grad():
        for k in range(args.query_runs):
            store.record(model, torch.randn(32, 32), name=f"q{k}", stats="all", save=tl.none())
    built = time.perf_counter() - began
    reader = tl.open(url, catalog=catalog, storage_options=options, create=False)
    predicate = (
        "select run, label, absmax from ops where func = 'relu' and absmax > 2.5 "
        "order by absmax desc limit 10"
    )
    began = time.perf_counter()
    total = reader.query("select count(*) as n from ops").df()["n"][0]
    first = time.perf_counter() - began
    labels = reader.query("select label from ops where run = 'q0'").df()["label"].tolist()

    def timed(fn: Any, repeats: int = 30) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
        return statistics.median(samples) * 1e3

    import random

    rng = random.Random(0)
    point = timed(
        lambda: reader.query(
            "select absmax from ops where run = :r and label = :l",
            r=f"q{rng.randrange(args.query_runs)}",
            l=rng.choice(labels),
        ).df()
    )
    pred = timed(lambda: reader.query(predicate).df())
    return {
        "ops": int(total),
        "build s": round(built, 1),
        "new reader's first query s": round(first, 2),
        "point lookup ms (warm, median)": round(point, 2),
        "predicate over all ops ms (warm, median)": round(pred, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", default=["writers", "throughput", "queries"])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--lease", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=256, help="the writers' Linear width")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--query-runs", type=int, default=10)
    parser.add_argument("--query-ops", type=int, default=100_000)
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
