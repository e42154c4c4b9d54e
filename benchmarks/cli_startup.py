"""How long the command line's catalog-only commands take, against importing DuckDB.

Run: ``python benchmarks/cli_startup.py [--store DIR] [--rounds 9] [--markdown]``. The
store (default ``/tmp/tl-cli-bench/demo.tl``) is the demo store, made once with
``tracelake demo --store``. Each round runs, in a new process each and in a shuffled
order, ``python -c "import duckdb"`` (the floor: the catalog is a DuckDB file),
``tracelake runs STORE``, ``tracelake runs STORE --json``, ``tracelake --version``,
``tracelake --help`` and ``tracelake verify STORE --catalog``; wall time per command,
median over the rounds, and its ratio to the floor of the same rounds; ``python -c
pass`` (the interpreter alone) is shown too. None of them imports torch, pandas,
pyarrow, numpy or zarr (``tests/test_cli.py`` checks that); the target for ``tracelake
runs`` is 0.3 s.

Every process runs with compiled bytecode cached, as an installed package has it (in a
``PYTHONPYCACHEPREFIX`` under the temporary directory, so the checkout is left as it
is): where ``PYTHONDONTWRITEBYTECODE`` is set, every start would compile each module
again, about 30 ms of ``tracelake runs`` that no installed copy pays. ``--no-cache``
measures that case instead.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def _wall(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="/tmp/tl-cli-bench/demo.tl")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--no-cache", action="store_true", help="no bytecode cache")
    args = parser.parse_args()
    env = dict(os.environ)
    if not args.no_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "tl-cli-bench-pyc")
    tracelake = str(BIN / "tracelake")
    if not os.path.isdir(args.store):
        Path(args.store).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([tracelake, "demo", "--store", args.store], check=True, capture_output=True)
    commands = {
        'python -c "pass"': [sys.executable, "-c", "pass"],
        'python -c "import duckdb"': [sys.executable, "-c", "import duckdb"],
        "tracelake runs STORE": [tracelake, "runs", args.store],
        "tracelake runs STORE --json": [tracelake, "runs", args.store, "--json"],
        "tracelake --version": [tracelake, "--version"],
        "tracelake --help": [tracelake, "--help"],
        "tracelake verify STORE --catalog": [tracelake, "verify", args.store, "--catalog"],
    }
    for argv in commands.values():  # warm the page cache (and the bytecode cache)
        _wall(argv, env)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        order = list(commands)
        random.shuffle(order)
        for name in order:
            times[name].append(_wall(commands[name], env))
    floor = statistics.median(times['python -c "import duckdb"'])
    rows = [(name, statistics.median(t), statistics.median(t) / floor) for name, t in times.items()]
    if args.markdown:
        print("| command | median wall (s) | x import duckdb |")
        print("| --- | ---: | ---: |")
        for name, median, ratio in rows:
            print(f"| `{name}` | {median:.3f} | {ratio:.2f} |")
    else:
        for name, median, ratio in rows:
            print(f"{name:40s} {median:7.3f} s  {ratio:5.2f}x")
    cache = "no bytecode cache" if args.no_cache else "bytecode cached"
    print(
        f"({args.rounds} rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
        f"{cache}; target for tracelake runs: 0.3 s)"
    )


if __name__ == "__main__":
    main()
