"""A/B benchmarks: the same benchmark scripts run on the code of a base revision
("before") and on the working tree ("after"), interleaved, printed side by side.

Run (from the repository, with the project's venv)::

    .venv/bin/python benchmarks/ab.py [--base e3cf426] [--after tree|installed|REV]
        [--bench capture,store,query] [--rounds 3] [--workdir DIR] [--keep]
        [--capture-args ARGS] [--store-args ARGS] [--query-args ARGS]

Sides. ``--base REV`` is taken with ``git archive`` into a temporary directory and
installed there with ``pip install --no-deps --target`` (so its C extension,
``recorder/_hot.c``, is built as a user's install builds it). ``--after tree`` (the
default) does the same with the working tree's files (tracked and untracked, not ignored),
so both sides are built the same way and a stale editable build cannot stand in for the
tree; ``--after installed`` uses the ``tracelake`` the venv has installed; any other value
is a revision, built like the base. Each side runs with its directory first on
``PYTHONPATH``: a package found there wins over the editable install's finder, which
sits at the end of ``sys.meta_path``. Subprocesses start in the work directory, so the
repository's own folders never shadow it. Each side's first line says which
``tracelake`` its benchmark imported and whether its compiled hot path is in use.

The benchmark scripts are the working tree's for both sides (one script, two codes);
each writes its results with ``--json`` (``write_results`` below, the one owner of that
format). Every round runs each benchmark once per side, the side that goes first
alternating between rounds; one torch thread. The tables give each measure's median over
rounds per side, their ratio, and the range of the per-round (paired) ratios; ``worse?``
marks a measure whose every "after" value is worse than every "before" value (three rounds
or more). That is a pointer, not a verdict: with three rounds and nothing changed it
happens to one measure in twenty, so rerun such a benchmark alone with more rounds.

Default settings are small so that two sides x three rounds fit in about ten minutes on a
busy two-core machine: capture ``--models gpt2,chain --no-torchlens --repeats 5``; store
``--models gpt2,wide,chain --repeats 2 --no-torchlens``; query ``--runs 100 --ops 200
--repeats 20`` (each side builds its own store once, with its own writer, in the work
directory; building is not timed). Override with ``--capture-args`` etc. (one string).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_BASE = "e3cf426"  # the commit before the architecture work (issue 10)

BENCHES: dict[str, tuple[str, str]] = {
    "capture": ("capture_overhead.py", "--models gpt2,chain --no-torchlens --repeats 5"),
    "store": ("store_write.py", "--models gpt2,wide,chain --repeats 2 --no-torchlens"),
    "query": ("query_latency.py", "--runs 100 --ops 200 --repeats 20"),
}

BETTER: dict[str, str] = {}  # measure -> "lower" | "higher": as the benchmarks declare


def write_results(path: str, measures: Iterable[tuple[str, float | None, str]]) -> None:
    """Write a benchmark's results for ab.py: (name, value, "lower" | "higher" is better),
    with the ``tracelake`` that produced them."""
    import tracelake

    doc = {
        "tracelake": tracelake.__file__,
        "compiled": _compiled(),
        "measures": [
            {"name": name, "value": value, "better": better}
            for name, value, better in measures
            if value is not None
        ],
    }
    Path(path).write_text(json.dumps(doc, indent=1))


def _compiled() -> bool | None:
    """Whether the recorder's compiled hot path is in use (None: this code cannot say)."""
    try:
        from tracelake.recorder import compiled
    except ImportError:
        return None
    return bool(getattr(compiled, "ENABLED", None))


@dataclass
class Side:
    name: str  # "before" / "after"
    label: str  # the revision or "working tree"
    site: Path | None  # prepended to PYTHONPATH; None: the installed tracelake
    # bench -> measure -> round -> value
    values: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if self.site is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(self.site), env.get("PYTHONPATH", "")) if p
            )
        return env


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, capture_output=True, check=False, **kw)


def _install(src: Path, site: Path) -> None:
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    proc = _run([*pip, "--target", str(site), str(src)])
    if proc.returncode:
        sys.exit(f"pip install of {src} failed:\n{proc.stdout}{proc.stderr}")


def prepare_rev(rev: str, where: Path) -> Path:
    src, site = where / "src", where / "site"
    src.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev], capture_output=True, check=False
    )
    if archive.returncode:
        sys.exit(f"git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    _install(src, site)
    return site


def prepare_tree(where: Path) -> Path:
    src, site = where / "src", where / "site"
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, files.split("\0")):
        path = REPO / rel
        if path.is_file():  # a tracked file deleted in the tree is left out
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel)
    _install(src, site)
    return site


def describe(side: Side, cwd: Path) -> tuple[str, bool | None]:
    """Which tracelake this side imports: checked before anything is timed."""
    code = "import ab, json, tracelake; print(json.dumps([tracelake.__file__, ab._compiled()]))"
    env = side.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(HERE)) if p)
    proc = _run([sys.executable, "-c", code], env=env, cwd=cwd)
    if proc.returncode:
        sys.exit(f"{side.name}: import tracelake failed:\n{proc.stderr}")
    path, hot = json.loads(proc.stdout)
    if side.site is not None and not Path(path).is_relative_to(side.site):
        sys.exit(f"{side.name}: imports {path}, not its own code under {side.site}")
    hot_path = {True: "compiled", False: "pure Python", None: "hot path unknown"}[hot]
    return f"{side.name} ({side.label}): {path} ({hot_path})", hot


def run_bench(side: Side, bench: str, args: list[str], work: Path, rnd: int) -> str | None:
    """One run of one benchmark on one side; its measures join the side's values.
    Returns an error text instead when the benchmark failed."""
    script, _ = BENCHES[bench]
    out = work / f"{bench}-{side.name}-{rnd}.json"
    if bench == "query":  # each side reads a store its own code wrote
        args = [*args, "--dir", str(work / f"query-store-{side.name}")]
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    proc = _run(cmd, env=side.env(), cwd=work)
    if proc.returncode or not out.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        return f"{bench} ({side.name}, round {rnd + 1}) failed, exit {proc.returncode}:\n" + (
            "\n".join("    " + line for line in tail)
        )
    doc = json.loads(out.read_text())
    if side.site is not None and not Path(doc["tracelake"]).is_relative_to(side.site):
        return f"{bench} ({side.name}) imported {doc['tracelake']}, not its own code"
    per = side.values.setdefault(bench, {})
    for m in doc["measures"]:
        per.setdefault(m["name"], {})[rnd] = float(m["value"])
        BETTER[m["name"]] = m["better"]
    return None


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def _row(name: str, by_round_b: dict[int, float], by_round_a: dict[int, float]) -> list[str]:
    before, after = list(by_round_b.values()), list(by_round_a.values())
    b, a = statistics.median(before), statistics.median(after)
    if b <= 0 or a <= 0:
        return [name, _fmt(b), _fmt(a), "-", "-", ""]
    paired = [by_round_a[r] / x for r, x in by_round_b.items() if r in by_round_a and x > 0]
    paired = [r for r in paired if r > 0]
    lower = BETTER.get(name) == "lower"
    apart = min(after) > max(before) if lower else max(after) < min(before)
    flag = "worse?" if apart and min(len(before), len(after)) >= 3 else ""
    spread = f"{min(paired):.2f}-{max(paired):.2f}" if paired else "-"
    return [name, _fmt(b), _fmt(a), f"{a / b:.2f}", spread, flag]


def render(bench: str, args: list[str], before: Side, after: Side, rounds: int) -> str:
    script, _ = BENCHES[bench]
    head = f"### {bench}: benchmarks/{script} {shlex.join(args)} ({rounds} rounds)\n\n"
    lines = [
        "| measure | before median | after median | after/before | per-round ratios | |",
        "|---|---:|---:|---:|---:|---|",
    ]
    b_vals, a_vals = before.values.get(bench, {}), after.values.get(bench, {})
    for name, vals in b_vals.items():
        if name in a_vals:
            lines.append("| " + " | ".join(_row(name, vals, a_vals[name])) + " |")
    missing = sorted(set(b_vals) ^ set(a_vals))
    if missing:
        lines.append(f"\n(measured on one side only: {', '.join(missing)})")
    lines.append(
        "\nper-round ratios: after/before within one round (the range over rounds); worse?: "
        "every after value worse than every before value (a pointer: see the docstring)"
    )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help="revision for 'before'")
    parser.add_argument("--after", default="tree", help="tree | installed | a revision")
    parser.add_argument("--bench", default="capture,store,query")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", help="default: a new temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    for bench, (_, default) in BENCHES.items():
        parser.add_argument(f"--{bench}-args", default=default, help=f"default: {default}")
    ns = parser.parse_args(argv)
    benches = [b.strip() for b in ns.bench.split(",") if b.strip()]
    if unknown := sorted(set(benches) - set(BENCHES)):
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    work = Path(ns.workdir or tempfile.mkdtemp(prefix="tl-ab-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        compare(ns, benches, work)
    finally:
        if not ns.keep and ns.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def compare(ns: argparse.Namespace, benches: list[str], work: Path) -> None:
    before = Side("before", ns.base, prepare_rev(ns.base, work / "before"))
    if ns.after == "tree":
        after = Side("after", "working tree", prepare_tree(work / "after"))
    elif ns.after == "installed":
        after = Side("after", "installed", None)
    else:
        after = Side("after", ns.after, prepare_rev(ns.after, work / "after"))
    hot = set()
    for side in (before, after):
        text, side_hot = describe(side, work)
        print(text, flush=True)
        hot.add(side_hot)
    if len(hot) > 1:  # e.g. one side's _hot.c failed to compile: the sides differ in kind
        print("WARNING: the two sides do not run the same recorder hot path", flush=True)
    load = os.getloadavg()[0]
    args = {b: shlex.split(getattr(ns, f"{b}_args")) for b in benches}
    errors = []
    for rnd in range(ns.rounds):
        order = (before, after) if rnd % 2 == 0 else (after, before)
        for bench in benches:
            for side in order:
                print(f"round {rnd + 1}/{ns.rounds}: {bench} {side.name}", flush=True)
                if (err := run_bench(side, bench, args[bench], work, rnd)) is not None:
                    print(err, flush=True)
                    errors.append(err)
    print(f"\nload average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n")
    for bench in benches:
        print(render(bench, args[bench], before, after, ns.rounds) + "\n")
    if errors:
        sys.exit(f"{len(errors)} benchmark run(s) failed (above)")


if __name__ == "__main__":
    main()
