"""Per-op cost of metadata-only recording against the bare TorchFunctionMode, counted in
instructions (callgrind), so that the figure does not move with this shared machine's load.

Run: ``python benchmarks/instructions.py [--forwards 5] [--markdown]`` (needs
``valgrind``). The script runs itself once under ``valgrind --tool=callgrind
--instr-atstart=no``; inside, instrumentation is switched on (``callgrind_control -i on``)
only around the measured forwards of each condition, one after another on the chain of
``capture_overhead.py`` (1,000 small elementwise ops on (4, 4)), each condition warmed up
first:

* ``plain``: ``model(x)``;
* ``bare mode``: the same inside capture_overhead's bare TorchFunctionMode;
* ``tracelake none``: ``tl.trace(model, x, save=tl.none()).cleanup()`` (the cleanup is
  counted too: it is small beside 1,000 ops).

Each condition is counted over N and then 2N forwards (``--forwards`` N): the difference
divided by N is one forward with the counting's own costs (the ``callgrind_control``
calls) taken out. "per op" is (condition - plain) / 1,000; the target (issue 16): the
per-op cost of tracelake none <= 1.5x the bare mode's.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

CONDITIONS = ("plain", "bare mode", "tracelake none")
OPS = 1000  # the chain's ops (its input and output entries are not torch calls)
TARGET = 1.5


def child(forwards: int) -> None:
    """Inside callgrind: count each condition over ``forwards`` and 2x that many."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from capture_overhead import _BareMode, build_model

    import tracelake as tl

    torch.set_num_threads(1)
    model, args = build_model("chain")
    pid = str(os.getpid())

    def control(*options: str) -> None:
        subprocess.run(["callgrind_control", *options, pid], check=True, stdout=subprocess.DEVNULL)

    def bare() -> None:
        with _BareMode():
            model(*args)

    runs = {
        "plain": lambda: model(*args),
        "bare mode": bare,
        "tracelake none": lambda: tl.trace(model, *args, save=tl.none()).cleanup(),
    }
    with torch.no_grad():
        for k, name in enumerate(CONDITIONS):
            for _ in range(3):
                runs[name]()
            for n in (forwards, 2 * forwards):
                control("-i", "on")
                control("-z")
                for _ in range(n):
                    runs[name]()
                control("-d", f"c{k}-{n}")
                control("-i", "off")


def parse(where: str, forwards: int) -> dict[str, float]:
    """Instructions of one forward of each condition, from the dumps in ``where``."""
    totals: dict[tuple[int, int], int] = {}
    for path in glob.glob(os.path.join(where, "cg.out.*")):
        with open(path) as f:
            head = f.read(4096)
        trigger = re.search(r"dump c(\d+)-(\d+)", head)
        summary = re.search(r"^summary: (\d+)", head, re.M)
        if trigger and summary:
            totals[(int(trigger[1]), int(trigger[2]))] = int(summary[1])
    return {
        name: (totals[(k, 2 * forwards)] - totals[(k, forwards)]) / forwards
        for k, name in enumerate(CONDITIONS)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forwards", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.forwards)
        return
    if shutil.which("valgrind") is None:
        sys.exit("needs valgrind (apt-get install valgrind)")
    where = tempfile.mkdtemp(prefix="tl-instr-")
    try:
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={where}/cg.out",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                f"--forwards={args.forwards}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        per_forward = parse(where, args.forwards)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    plain = per_forward["plain"]
    rows = [
        (
            name,
            per_forward[name],
            (per_forward[name] - plain) / OPS if name != "plain" else None,
        )
        for name in CONDITIONS
    ]
    bare = rows[1][2]
    header = ("condition", "instructions / forward", "per op over plain", "x bare mode")
    lines = [
        (
            name,
            f"{total:,.0f}",
            "" if op is None else f"{op:,.0f}",
            "" if op is None or not bare else f"{op / bare:.2f}x",
        )
        for name, total, op in rows
    ]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|---|---:|---:|---:|")
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for line in lines:
            print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))
    ratio = rows[2][2] / bare if rows[2][2] is not None and bare else float("inf")
    print(
        f"metadata-only per op <= {TARGET}x the bare mode's, chain, in instructions: "
        f"{'MET' if ratio <= TARGET else 'MISSED'} (measured {ratio:.2f}x)"
    )


if __name__ == "__main__":
    main()
