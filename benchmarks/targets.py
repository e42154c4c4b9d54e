"""Every target of issue 16 ("Performance, round two"), from the benchmarks that measure
them, in one command: each benchmark runs in a process of its own, one after another
(never two at once: they would share the cores), with the arguments the README gives, and
the lines where it judges a target (``met`` / ``MISSED``) are gathered into one table.

Run: ``python benchmarks/targets.py [--only NAMES] [--out DIR] [--quick]``. ``--out``
keeps each benchmark's whole output (``NAME.txt``: its tables, in markdown where it has
them) beside the table, ``targets.md``; ``--quick`` runs each at its smallest (a check
that the chain of commands works; its figures mean nothing). About 15 minutes in full on
the 2-core development machine, half of it the 10,000-run build of ``growth``.

The verdicts are the benchmarks' own (each measures its condition side by side with its
peer or limit, interleaved, medians of at least 9 rounds); this script only runs them
and collects what they print. It exits non-zero only if a benchmark failed; a missed
target is a result, not an error.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent


class Step(NamedTuple):
    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    #: whether it takes ``--dir`` (where it builds its stores: under ``--out``'s scratch)
    takes_dir: bool = True
    #: a program it needs on the PATH (else the step is reported as not run)
    needs: str | None = None


STEPS = (
    # statistics for every op (GPT-2) and the metadata-only per-op cost in time
    Step(
        "capture",
        "capture_overhead.py",
        ("--models", "gpt2,chain", "--no-torchlens", "--repeats", "15", "--markdown"),
        ("--models", "mlp,chain", "--no-torchlens", "--repeats", "1"),
        takes_dir=False,
    ),
    # the per-op target, counted in instructions
    Step(
        "instructions",
        "instructions.py",
        ("--markdown",),
        ("--forwards", "1"),
        takes_dir=False,
        needs="valgrind",
    ),
    # mid-size tensors (GPT-2), large ones (wide), small ops end to end (chain)
    Step(
        "store",
        "store_write.py",
        ("--models", "gpt2,wide,chain", "--no-torchlens", "--repeats", "9", "--markdown"),
        ("--models", "chain", "--no-torchlens", "--repeats", "1"),
    ),
    # one tiny run; many in a row, batched
    Step(
        "tiny",
        "many_runs.py",
        ("--skip-growth", "--rounds", "9"),
        ("--skip-growth", "--rounds", "1"),
    ),
    # the catalog's growth: 10,000 runs built, then side by side with a new store
    Step(
        "growth",
        "many_runs.py",
        ("--skip-tiny", "--runs", "10000", "--no-tensors"),
        ("--skip-tiny", "--runs", "20", "--ops", "20", "--no-tensors"),
    ),
    # the queries' targets, on a store of 1,000 runs
    Step(
        "query",
        "query_latency.py",
        ("--markdown",),
        ("--runs", "3", "--ops", "40", "--repeats", "1"),
    ),
)
NAMES = tuple(step.name for step in STEPS)

#: A line where a benchmark judges a target, in the two forms they print: "... (target
#: <= 10 ms): met" and "...: MET (measured 1.08x)" (a table's verdict column is not one).
VERDICT = re.compile(r"\): (met|MISSED)\b|: (MET|MISSED) \(measured")


class Result(NamedTuple):
    step: Step
    command: str
    seconds: float
    output: str
    failed: str | None  # why it judged nothing, if it did not run or did not end well
    crashed: bool = False  # it ran and failed (not run for want of a program: False)


def run(step: Step, quick: bool, scratch: Path) -> Result:
    """Run ``step`` as a user would (this interpreter, the benchmark's directory on the
    path as its own), its stores under ``scratch``."""
    args = [*(step.quick if quick else step.full)]
    command = " ".join(["python", f"benchmarks/{step.script}", *args])
    if step.takes_dir:  # (shown as DIR: a temporary directory, removed)
        args += ["--dir", str(scratch / step.name)]
        command += " --dir DIR"
    if step.needs is not None and shutil.which(step.needs) is None:
        return Result(step, command, 0.0, "", f"not run: {step.needs} is not installed")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(HERE / step.script), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - start
    failed = None
    if proc.returncode != 0:
        failed = f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return Result(step, command, seconds, proc.stdout, failed, crashed=failed is not None)


def verdicts(output: str) -> list[tuple[str, str]]:
    """(the line, ``met`` or ``MISSED``) for each line of ``output`` that judges a target."""
    found = []
    for line in output.splitlines():
        match = VERDICT.search(line)
        if match:
            text = re.sub(r"\s{2,}", " ", line.strip().removeprefix("- ").replace("|", "\\|"))
            found.append((text, "MISSED" if "MISSED" in match.groups() else "met"))
    return found


def table(results: list[Result], header: str) -> str:
    """The markdown table of every verdict, by benchmark, under ``header``."""
    lines = [header, "", "| benchmark | what it printed | verdict |", "|---|---|---|"]
    judged: list[str] = []
    for result in results:
        where = f"`{result.command}` ({result.seconds / 60:.1f} min)"
        if result.failed is not None:
            lines.append(f"| {where} | {result.failed} | not run |")
            continue
        found = verdicts(result.output)
        judged += [verdict for _, verdict in found]
        if not found:
            lines.append(f"| {where} | (no target judged: see its output) | |")
        for text, verdict in found:
            lines.append(f"| {where} | {text} | {'**met**' if verdict == 'met' else 'MISSED'} |")
            where = '"'
    lines += ["", f"{judged.count('met')} of {len(judged)} lines judged met."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(NAMES), help=f"comma-separated subset of {','.join(NAMES)}"
    )
    parser.add_argument("--out", default=None, help="keep each benchmark's output here")
    parser.add_argument("--quick", action="store_true", help="each at its smallest")
    args = parser.parse_args(argv)
    chosen = args.only.split(",")
    unknown = sorted(set(chosen) - set(NAMES))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(NAMES)}")
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    began, load = datetime.datetime.now(), os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="tl-targets-") as scratch:
        for step in STEPS:
            if step.name not in chosen:
                continue
            print(f"{step.name}: running {step.script} ...", file=sys.stderr, flush=True)
            result = run(step, args.quick, Path(scratch))
            results.append(result)
            if out is not None:
                (out / f"{step.name}.txt").write_text(f"$ {result.command}\n\n{result.output}")
            shutil.rmtree(Path(scratch) / step.name, ignore_errors=True)
    header = (
        f"Issue 16's targets: `benchmarks/targets.py{' --quick' if args.quick else ''}`, "
        f"{began:%Y-%m-%d %H:%M}-{datetime.datetime.now():%H:%M}, commit {commit or '?'}, "
        f"{os.cpu_count()} cores, load {load:.2f} at the start and "
        f"{os.getloadavg()[0]:.2f} at the end"
    )
    text = table(results, header)
    print(text)
    if out is not None:
        (out / "targets.md").write_text(text + "\n")
    return 1 if any(r.crashed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
