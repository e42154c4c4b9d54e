"""The ``tracelake`` command line. Terminal output lives here, never in the library."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

import tracelake as tl
from tracelake.demo import DemoNet, demo_inputs


def _fmt(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def ops_table(trace: tl.Trace, title: str) -> Table:
    """A rich table of a trace's ops: label, func, module, shape, dtype, stats, source."""
    table = Table(title=title, show_lines=False, header_style="bold")
    for name in ("label", "func", "module", "shape", "dtype", "mean", "std", "absmax", "source"):
        table.add_column(name, overflow="fold")
    for op in trace:
        stats = op.stats
        source = f"{os.path.basename(op.source.file)}:{op.source.line}" if op.source else ""
        table.add_row(
            op.label, op.func, op.module, "x".join(map(str, op.shape)) or "scalar",
            str(op.dtype).removeprefix("torch."),
            _fmt(stats and stats.mean), _fmt(stats and stats.std), _fmt(stats and stats.absmax),
            source,
        )
    return table


def _console() -> Console:
    # Tables need room: when printing to a pipe or a CI log, don't fold them to 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _demo(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = DemoNet().eval()
    ids = demo_inputs()
    with torch.no_grad():
        log = tl.trace(model, ids)
    if args.json:
        rows = log.df().drop(columns=["parents"]).to_dict(orient="records")
        json.dump(rows, sys.stdout, default=str, indent=1)
        sys.stdout.write("\n")
        return 0
    console = _console()
    console.print(ops_table(log, f"tl.trace(DemoNet(), ids): {len(log)} ops"))
    relu = log.find(func="relu")[0]
    scaled = log[relu.children[0]]
    untouched = torch.equal(relu.out * 0.5, scaled.out)
    console.print(
        f"\n{relu.label}: parents {list(relu.parents)}, source {relu.source}; its saved copy "
        f"times 0.5 equals {scaled.label} ({scaled.func}, in place on the same tensor): "
        f"{untouched}",
        soft_wrap=True,  # prose: never folded, whatever the width of the paths in it
    )
    console.print(
        f"encoder passes: {[m.label for m in log.modules if m.path == 'encoder']}", soft_wrap=True
    )
    log.cleanup()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracelake", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tracelake {tl.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="trace the built-in demo model, print its ops")
    demo.add_argument("--json", action="store_true", help="print the ops as JSON records")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
