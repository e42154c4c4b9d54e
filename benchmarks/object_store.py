"""A store on the local disk against one whose arrays are on object storage (a local
S3-compatible server, moto_server, started here on a free port), side by side in one
run (issue 15): write throughput of ``store.record`` (fsync'd on disk; PUTs on the
server), reading every tensor back (``stack()``, a new reader), and a warm point lookup.

    nice -n 5 .venv/bin/python benchmarks/object_store.py [--rounds 5] [--mib 64]

Interleaved rounds, medians; the load average before and after. Needs the ``scale``
extra and moto[server] (the dev extra has both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import tracelake as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import make_bucket, moto_server, s3_options

BUCKET = "bench"


class Wide(nn.Module):
    """Elementwise ops on a (rows, 1024) float32 input: 4 MiB per op for 1,024 rows."""

    def __init__(self, ops: int):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in range(self.ops):
            x = torch.sin(x) if k % 2 else x * 1.0001
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64, help="MiB each run writes")
    parser.add_argument("--lookups", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", tl.TraceLakeWarning)
    ops = 8
    x = torch.randn(args.mib * 1024 // ops // 4, 1024)  # ops x (rows x 1024 x 4 bytes)
    model = Wide(ops)
    nbytes = x.numel() * 4 * (ops + 1) / 2**20
    with moto_server() as endpoint, tempfile.TemporaryDirectory() as tmp:
        make_bucket(endpoint, BUCKET)
        options = s3_options(endpoint)
        where = {
            "local disk": lambda k: tl.open(Path(tmp) / f"local{k}"),
            "object store": lambda k: tl.open(
                f"s3://{BUCKET}/s{k}", catalog=Path(tmp) / f"remote{k}", storage_options=options
            ),
        }
        reopen = {
            "local disk": lambda k: tl.open(Path(tmp) / f"local{k}", create=False),
            "object store": lambda k: tl.open(
                Path(tmp) / f"remote{k}", create=False, storage_options=options
            ),
        }
        print(
            f"{ops} ops x {x.numel() * 4 / 2**20:.0f} MiB a run ({nbytes:.0f} MiB with the "
            f"input); moto_server at {endpoint}; load {os.getloadavg()[0]:.2f} before"
        )
        write: dict[str, list[float]] = {name: [] for name in where}
        read: dict[str, list[float]] = {name: [] for name in where}
        point: dict[str, list[float]] = {name: [] for name in where}
        for k in range(args.rounds):  # interleaved: both see the same load
            for name, make in where.items():
                store = make(k)
                start = time.perf_counter()
                with torch.no_grad():
                    store.record(model, x, name="r")
                write[name].append(time.perf_counter() - start)
                reader = reopen[name](k)
                start = time.perf_counter()
                reader.query("select out from ops where func = 'sin'").stack()
                read[name].append(time.perf_counter() - start)
                text = "select out from ops where run = :run and label = :label"
                label = reader.query("select label from ops where func = 'sin'").df()["label"][0]
                for _ in range(3):  # warm: the op index is built on the second run
                    reader.query(text, run="r", label=label)
                times = []
                for _ in range(args.lookups):
                    start = time.perf_counter()
                    reader.query(text, run="r", label=label)
                    times.append(time.perf_counter() - start)
                point[name].append(statistics.median(times))
        print(f"{'':<14}{'write MiB/s':>12}{'read MiB/s':>12}{'point lookup ms':>17}")
        for name in where:
            print(
                f"{name:<14}{nbytes / statistics.median(write[name]):>12.0f}"
                f"{x.numel() * 4 * ops / 2**20 / 2 / statistics.median(read[name]):>12.0f}"
                f"{statistics.median(point[name]) * 1e3:>17.2f}"
            )
        ratio_w = statistics.median(write["local disk"]) / statistics.median(write["object store"])
        ratio_r = statistics.median(read["local disk"]) / statistics.median(read["object store"])
        print(
            f"object store / local disk: write {ratio_w:.2f}x, read {ratio_r:.2f}x "
            "(target: write >= 0.4x)"
        )
    print(f"load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
