"""Direct against buffered writes of a store's large files, paired in one process.

Run: ``python benchmarks/direct_writes.py [--model gpt2|wide] [--pairs 40]``.

``store.record`` of ``store_write.py``'s model (every op saved) into one existing
store, run after run, with ``local.DIRECT`` switched on and off between runs in ABBA
order (so neither side always follows the other), each run's files made clean first
(``os.sync``) and deleted and collected afterwards, untimed. One process, one store,
one warm model: what differs between the two sides is only how the files of 1 MiB or
more are written (``O_DIRECT`` through a staging buffer, or the page cache with its
writeback), which the noise of separate processes on a loaded machine can hide.
``TRACELAKE_BUFFERED_WRITES=1`` does the same across processes (``store_write.py``).

Printed for each side: the median wall time of a run, its process CPU (``getrusage``:
every thread's, the writer's included) and the machine's busy CPU (``/proc/stat``: the
kernel's worker threads too, which do part of the writeback and of ``O_DIRECT``'s
completions, and the machine's other work); then the median of the paired differences
(direct - buffered) and in how many pairs the direct run was faster. Linux only.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings

import torch
from store_write import _model

import tracelake as tl
from tracelake.store import local


def _busy() -> float:
    """CPU seconds every core of the machine has been busy (not idle, not waiting on
    I/O) so far."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "wide"])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    opts = parser.parse_args(argv)
    if not hasattr(os, "O_DIRECT"):
        raise SystemExit("O_DIRECT is Linux's: nothing to compare here")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, args = _model(opts.model)
    if opts.dir is not None:
        os.makedirs(opts.dir, exist_ok=True)
    root = tempfile.mkdtemp(dir=opts.dir, prefix="tl-direct-")
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    try:
        store = tl.open(os.path.join(root, "store"), create=True)
        with torch.no_grad():
            store.record(model, *args, name="first")
            for i in range(2 * opts.pairs + 2):  # the first two: warm-up
                direct = bool((i + i // 2) % 2)  # ABBA: 0 1 1 0 0 1 1 0 ...
                local.DIRECT = direct
                os.sync()
                busy, cpu, start = _busy(), _cpu(), time.perf_counter()
                store.record(model, *args, name="bench")
                wall = time.perf_counter() - start
                if i >= 2:
                    results[direct].append((wall, _cpu() - cpu, _busy() - busy))
                store.delete("bench")
                store.gc(progress=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{opts.model}: {opts.pairs} pairs, load {os.getloadavg()[0]:.2f}")
    for direct in (False, True):
        rows = results[direct]
        wall, cpu, busy = (statistics.median(r[k] for r in rows) * 1e3 for k in range(3))
        name = "O_DIRECT" if direct else "buffered"
        print(f"  {name}: wall {wall:.1f} ms, process CPU {cpu:.1f} ms, machine busy {busy:.0f} ms")
    pairs = list(zip(results[True], results[False], strict=True))
    for k, what in enumerate(("wall", "process CPU", "machine busy")):
        diffs = [(a[k] - b[k]) * 1e3 for a, b in pairs]
        faster = sum(d < 0 for d in diffs)
        print(
            f"  {what}, direct - buffered, paired median: {statistics.median(diffs):+.1f} ms "
            f"(direct lower in {faster} of {len(diffs)})"
        )


if __name__ == "__main__":
    main()
