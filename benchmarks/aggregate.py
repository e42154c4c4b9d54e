"""Aggregations over stored activations (issue 15, item 4): Dask (``store.dask_array``,
unread until computed) against single-process numpy (``stack()`` then numpy) and DuckDB
over the recorded statistics alone (no tensor read), in one run, interleaved rounds,
medians. Each engine computes what it can of: the global mean and variance of every
element, the per-feature mean, the covariance and its top principal components.

    nice -n 5 .venv/bin/python benchmarks/aggregate.py [--runs 8] [--ops 100] [--batch 64]

``--batch 4096`` makes every activation 4 MiB (each in its own Zarr array, read by
``from_zarr``) instead of 64 KiB (packed, read by delayed readers). Needs the ``scale``
extra (Dask). The load average is printed before and after: the figures are only
comparable within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import tracelake as tl
from tracelake.store.tensors import clear_chunk_cache

FEATURES = 256
QUERY = "select out from ops where func = 'tanh' order by run, step, idx"


class Stack(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _pca(mean: np.ndarray, second: np.ndarray, n: int, k: int = 8) -> np.ndarray:
    """Top ``k`` principal variances from the per-feature mean and E[x xᵀ]."""
    cov = (second - np.outer(mean, mean)) * (n / (n - 1))
    return np.linalg.eigvalsh(cov)[::-1][:k]


def with_numpy(store: tl.Store) -> dict[str, Any]:
    x = store.query(QUERY).stack().numpy().reshape(-1, FEATURES).astype(np.float64)
    mean = x.mean(axis=0)
    return {
        "mean": float(x.mean()),
        "var": float(x.var()),
        "pca": _pca(mean, x.T @ x / len(x), len(x)),
    }


def with_dask(store: tl.Store) -> dict[str, Any]:
    import dask

    x = store.dask_array(QUERY).reshape(-1, FEATURES).astype(np.float64)
    mean, second, total, squares = dask.compute(
        x.mean(axis=0), x.T @ x / x.shape[0], x.mean(), (x**2).mean()
    )
    return {
        "mean": float(total),
        "var": float(squares - total**2),
        "pca": _pca(mean, second, x.shape[0]),
    }


def with_duckdb(store: tl.Store) -> dict[str, Any]:
    """From the statistics recorded with each tensor: every tensor has as many elements,
    so the global mean is the mean of means and E[x²] the mean of std² + mean²."""
    frame = store.sql(
        "select avg(mean) as m, avg(std * std + mean * mean) as sq from ops where func = 'tanh'"
    )
    mean, square = float(frame["m"][0]), float(frame["sq"][0])
    return {"mean": mean, "var": square - mean * mean, "pca": None}


ENGINES: dict[str, Callable[[tl.Store], dict[str, Any]]] = {
    "numpy (stack)": with_numpy,
    "dask": with_dask,
    "duckdb (stats only)": with_duckdb,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--ops", type=int, default=100, help="tanh activations per run")
    parser.add_argument("--batch", type=int, default=64, help="rows of each activation")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tl-aggregate-") as root:
        warnings.simplefilter("ignore", tl.TraceLakeWarning)  # "created a new, empty store"
        store = tl.open(root)
        torch.manual_seed(0)
        model = Stack(args.ops)
        for run in range(args.runs):
            with torch.no_grad():
                store.record(model, torch.randn(args.batch, FEATURES), name=f"r{run}")
        rows = args.runs * args.ops * args.batch
        nbytes = rows * FEATURES * 4
        print(
            f"{args.runs} runs x {args.ops} activations of {args.batch} x {FEATURES} float32: "
            f"{rows:,} rows, {nbytes / 2**20:.0f} MiB; {os.cpu_count()} cores; "
            f"load {os.getloadavg()[0]:.2f} before"
        )
        times: dict[str, list[float]] = {name: [] for name in ENGINES}
        answers: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):  # interleaved: every engine sees the same load
            for name, engine in ENGINES.items():
                reader = tl.open(root, create=False)  # a new reader each time, chunk cache empty
                clear_chunk_cache()
                start = time.perf_counter()
                answers[name] = engine(reader)
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["numpy (stack)"])
        want = answers["numpy (stack)"]
        print(f"{'engine':<22}{'median s':>10}{'vs numpy':>10}  mean err   var err    pca err")
        for name, measured in times.items():
            got = answers[name]
            pca = "n/a" if got["pca"] is None else f"{np.abs(got['pca'] - want['pca']).max():.1e}"
            print(
                f"{name:<22}{statistics.median(measured):>10.3f}"
                f"{statistics.median(measured) / base:>9.2f}x"
                f"  {abs(got['mean'] - want['mean']):.1e}  {abs(got['var'] - want['var']):.1e}"
                f"    {pca}"
            )
        print(f"load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
