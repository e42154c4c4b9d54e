"""The ``tracelake`` command line. Terminal output lives here, never in the library."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

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


def ops_table(trace: Any, title: str) -> Table:
    """A rich table of a trace's ops: label, func, module, shape, dtype, stats, source."""
    table = Table(title=title, show_lines=False, header_style="bold")
    for name in ("label", "func", "module", "shape", "dtype", "mean", "std", "absmax", "source"):
        table.add_column(name, overflow="fold")
    for op in trace:
        stats = op.stats
        source = f"{os.path.basename(op.source.file)}:{op.source.line}" if op.source else ""
        table.add_row(
            op.label,
            op.func,
            op.module,
            "x".join(map(str, op.shape)) or "scalar",
            str(op.dtype).removeprefix("torch."),
            _fmt(stats and stats.mean),
            _fmt(stats and stats.std),
            _fmt(stats and stats.absmax),
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
    assert relu.out is not None and scaled.out is not None  # the demo saves everything
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
    if args.store:
        _demo_store(args.store, model, console)
    return 0


def result_table(result: Any, caption: str | None = None) -> Table:
    """A rich table of a query result, tensor cells summarised."""
    from tracelake.query.results import describe

    table = Table(header_style="bold", caption=caption)
    for name in result.columns:
        table.add_column(name, overflow="fold")
    for row in result:
        table.add_row(*[describe(row[c]) for c in result.columns])
    return table


DEMO_QUERIES = (
    "select run, label, module, out from ops where func = 'relu' order by run",
    "select run, label, absmax from ops where func = 'linear' and absmax > :limit "
    "order by absmax desc limit 5",
    "select run, out[0, -1, :4] as last_token from ops where label = 'relu_1_21' "
    "and meta.prompt like '%Paris%'",
    "select func, count(*) as n, avg(l2) as mean_l2 from ops group by func order by n desc limit 6",
    "select run, label, shape from ops where func = 'linear' and parent.func = 'layer_norm' "
    "and run = 'base' order by label",
)


def _demo_store(path: str, model: torch.nn.Module, console: Console) -> None:
    """Record the demo model into a store (three runs, three 'prompts') and query it."""
    store = tl.open(path)
    prompts = {
        "base": "Paris is the capital of",
        "other": "Rome is the capital of",
        "scaled": "Paris, again",
    }
    with torch.no_grad():
        for i, (name, prompt) in enumerate(prompts.items()):
            torch.manual_seed(i)
            ids = (demo_inputs() + 7 * i) % 50  # a different "prompt" per run
            store.record(model, ids, name=name, meta={"prompt": prompt}, overwrite=True)
    console.print(f"\nrecorded {len(prompts)} runs into {store.path}:", soft_wrap=True)
    console.print(
        store.runs()[["name", "status", "steps", "ops", "bytes"]].to_string(index=False),
        soft_wrap=True,
    )
    for text in DEMO_QUERIES:
        result = store.query(text, **({"limit": 1.0} if ":limit" in text else {}))
        console.print(f"\n[bold]>>> {text}[/bold]", soft_wrap=True)
        console.print(result_table(result))
    console.print(f"verify: {store.verify()}", soft_wrap=True)


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, default=str, indent=1)
    sys.stdout.write("\n")


def _runs(args: argparse.Namespace) -> int:
    df = tl.open(args.store, create=False).runs(all=args.all)
    if args.json:
        _print_json(df.to_dict(orient="records"))
        return 0
    table = Table(title=f"runs in {args.store}", header_style="bold")
    for name in ("name", "status", "created", "steps", "ops", "bytes", "model_class", "meta"):
        table.add_column(name, overflow="fold")
    for row in df.to_dict(orient="records"):
        table.add_row(
            *[
                _fmt(row[c])
                for c in ("name", "status", "created", "steps", "ops", "bytes", "model_class")
            ],
            json.dumps(row["meta"]) if row["meta"] is not None else "",
        )
    _console().print(table)
    return 0


def _show(args: argparse.Namespace) -> int:
    run = tl.open(args.store, create=False)[args.run]
    view = run.step(args.step if args.step is not None else 0)
    if args.json:
        _print_json(view.df().drop(columns=["parents"]).to_dict(orient="records"))
        return 0
    title = f"{run.name}: {run.model_class}" + (
        f", step {view.step} of {run.num_steps}" if run.num_steps > 1 else ""
    )
    _console().print(ops_table(view, f"{title}: {len(view)} ops"))
    return 0


def _rm(args: argparse.Namespace) -> int:
    store = tl.open(args.store, create=False)
    for name in args.run:
        store.delete(name)
    if args.json:
        _print_json({"deleted": args.run})
    else:
        _console().print(
            f"deleted {len(args.run)} run(s); `tracelake gc {args.store}` reclaims their space",
            soft_wrap=True,
        )
    return 0


def _gc(args: argparse.Namespace) -> int:
    freed = tl.open(args.store, create=False).gc()
    if args.json:
        _print_json(freed)
    else:
        _console().print(
            f"removed {freed['runs']} run(s) and {freed['orphans']} orphaned "
            f"director(ies), {freed['bytes'] / 2**20:.1f} MiB",
            soft_wrap=True,
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = tl.open(args.store, create=False).verify()
    if args.json:
        _print_json(report.as_dict())
    else:
        console = _console()
        for problem in report.problems:
            console.print(f"[red]damaged[/red] {problem}", soft_wrap=True, markup=True)
        verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
        console.print(
            f"{report.runs} run(s), {report.tensors} tensors, {report.chunks} "
            f"chunks checked: {verdict}",
            soft_wrap=True,
        )
    return 0 if report.ok else 1


def _param(text: str) -> tuple[str, Any]:
    """``k=v``: v as JSON when it parses (numbers, true/false/null, quoted strings,
    lists), else the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param takes name=value, not {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _query(args: argparse.Namespace) -> int:
    from tracelake.query.results import describe

    store = tl.open(args.store, create=False)
    try:
        result = store.query(args.text, **dict(args.param))
    except tl.QueryError as exc:
        print(exc, file=sys.stderr)
        return 2
    fmt = args.format
    if fmt == "parquet":
        import pyarrow.parquet as pq

        if not args.output:
            print("tracelake query: --format parquet needs -o FILE", file=sys.stderr)
            return 2
        pq.write_table(result.arrow(), args.output)
        return 0
    out = open(args.output, "w", newline="") if args.output else sys.stdout  # noqa: SIM115
    try:
        if fmt == "json":
            rows = [
                {
                    k: (v.tolist() if hasattr(v, "tolist") and not isinstance(v, float) else v)
                    for k, v in row.items()
                }
                for row in result
            ]
            json.dump(rows, out, default=str, indent=1)
            out.write("\n")
        elif fmt == "csv":
            import csv

            writer = csv.writer(out)
            writer.writerow(result.columns)
            for row in result:
                writer.writerow([describe(row[c]) for c in result.columns])
        else:
            table = result_table(result, caption=f"{len(result)} rows")
            Console(file=out, width=None if out.isatty() else 160).print(table)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


#: The columns ``tracelake diff`` shows in a terminal (every column goes to files).
_DIFF_SHOWN = (
    "key",
    "label_a",
    "label_b",
    "status",
    "max_abs_diff",
    "rel_l2",
    "cosine",
    "allclose",
)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such floats are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _diff(args: argparse.Namespace) -> int:
    store = tl.open(args.store, create=False)
    comparison = store.compare(
        args.a,
        args.b,
        on=args.on,
        where=args.where,
        atol=args.atol,
        rtol=args.rtol,
        steps=tuple(args.steps) if args.steps else None,
    )
    if args.first:
        found = comparison.first_divergence()
        rows = [found] if found is not None else []
    else:
        rows = comparison.rows()
    differs = any(r["status"] != "compared" or not r["allclose"] for r in rows)
    if args.format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not args.output:
            print("tracelake diff: --format parquet needs -o FILE", file=sys.stderr)
            return 2
        table = (
            comparison.arrow()
            if not args.first
            else pa.Table.from_pylist([{k: _finite(v) for k, v in r.items()} for r in rows])
        )
        pq.write_table(table, args.output)
        return 1 if args.exit_code and differs else 0
    out = open(args.output, "w", newline="") if args.output else sys.stdout  # noqa: SIM115
    try:
        if args.format == "json":
            json.dump([{k: _finite(v) for k, v in r.items()} for r in rows], out, indent=1)
            out.write("\n")
        elif args.format == "csv":
            import csv

            writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["key"])
            writer.writeheader()
            for r in rows:
                writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in r.items()})
        else:
            table = Table(title=f"{comparison!r}" if not args.first else "first divergence")
            for column in _DIFF_SHOWN:
                table.add_column(column, overflow="fold")
            for r in rows:
                table.add_row(*(_cell(r[c]) for c in _DIFF_SHOWN))
            if args.first and not rows:
                table.caption = "no divergence"
            Console(file=out, width=None if out.isatty() else 160).print(table)
    finally:
        if out is not sys.stdout:
            out.close()
    return 1 if args.exit_code and differs else 0


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _graph(args: argparse.Namespace) -> int:
    """Draw a run's op graph to a file (tracelake/graph.py; needs Graphviz's dot)."""
    store = tl.open(args.store, create=False)
    run = store[args.run]
    diff = store.compare(args.run, args.diff) if args.diff else None
    try:
        drawn = run.graph(
            step=args.step, depth=args.depth, color=args.color, diff=diff, collapse=args.collapse
        )
    except ValueError as exc:  # a statistic or metric that does not exist
        print(f"tracelake graph: {exc}", file=sys.stderr)
        return 2
    drawn.save(args.output)
    if args.json:
        _print_json({"output": args.output, "nodes": drawn.nodes, "ops": drawn.ops})
    else:
        _console().print(f"{args.output}: {drawn!r}", soft_wrap=True, markup=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracelake", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tracelake {tl.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="trace the built-in demo model, print its ops")
    demo.add_argument("--json", action="store_true", help="print the ops as JSON records")
    demo.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="also record the demo into the store at DIR and query it",
    )
    demo.set_defaults(handler=_demo)

    def command(name: str, help: str, fn: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        sub.add_argument("store", help="the store's directory")
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(handler=fn)
        return sub

    runs = command("runs", "list the runs of a store", _runs)
    runs.add_argument(
        "--all", action="store_true", help="also recording, interrupted, failed and deleted runs"
    )
    show = command("show", "print a run's ops: label, func, module, shape, dtype, stats", _show)
    show.add_argument("run", help="the run's name")
    show.add_argument("--step", type=int, default=None, help="which step (multi-step runs)")
    rm = command("rm", "delete runs (gc reclaims their space)", _rm)
    rm.add_argument("run", nargs="+", help="names of the runs to delete")
    command("gc", "reclaim the space of deleted, failed and interrupted runs", _gc)
    query = commands.add_parser("query", help="run a query over a store (docs/query.md)")
    query.add_argument("store", help="the store's directory")
    query.add_argument("text", help='the query, e.g. "select run, label from ops"')
    query.add_argument(
        "--param",
        action="append",
        type=_param,
        default=[],
        metavar="NAME=VALUE",
        help="bind :NAME (value parsed as JSON if it can)",
    )
    query.add_argument("--format", choices=("table", "csv", "json", "parquet"), default="table")
    query.add_argument("-o", "--output", help="write to FILE instead of the terminal")
    query.set_defaults(handler=_query)
    command("verify", "check every chunk's checksum and the catalog's agreement", _verify)
    diff = commands.add_parser("diff", help="compare two runs op by op (store.compare)")
    diff.add_argument("store", help="the store's directory")
    diff.add_argument("a", help="the reference run")
    diff.add_argument("b", help="the run compared with it")
    diff.add_argument("--on", choices=("key", "label", "module"), default="key")
    diff.add_argument(
        "--where", default=None, help="a query condition on ops, e.g. \"func = 'relu'\""
    )
    diff.add_argument("--atol", type=float, default=1e-8)
    diff.add_argument("--rtol", type=float, default=1e-5)
    diff.add_argument("--steps", type=int, nargs=2, metavar=("I", "J"), help="step I of a, J of b")
    diff.add_argument("--first", action="store_true", help="only the first divergence")
    diff.add_argument(
        "--exit-code", action="store_true", help="exit 1 when anything differs (as git diff)"
    )
    diff.add_argument("--format", choices=("table", "csv", "json", "parquet"), default="table")
    diff.add_argument("-o", "--output", help="write to FILE instead of the terminal")
    diff.set_defaults(handler=_diff)
    graph = command("graph", "draw a run's op graph with Graphviz (needs `dot`)", _graph)
    graph.add_argument("run", help="the run's name")
    graph.add_argument("-o", "--output", required=True, help="FILE.svg (.png, .pdf, .dot)")
    graph.add_argument("--step", type=int, default=None, help="which step (multi-step runs)")
    graph.add_argument("--depth", type=int, default=None, help="module depth drawn expanded")
    graph.add_argument("--color", default=None, help="colour by a statistic (absmax, ...)")
    graph.add_argument("--diff", default=None, metavar="RUN", help="colour by difference to RUN")
    graph.add_argument("--collapse", action="append", default=[], help="collapse a module")
    serve = commands.add_parser(
        "serve", help="browse a store in a web browser (read-only; needs the `web` extra)"
    )
    serve.add_argument("store", help="the store's directory")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: local)")
    serve.add_argument("--port", type=int, default=8765, help="the port (default 8765)")
    serve.set_defaults(handler=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from tracelake.explorer import serve  # Starlette and uvicorn load only for this command

    store = tl.open(args.store, create=False)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"tracelake explorer of {store.path}: http://{host}:{args.port}/", flush=True)
    serve(store, args.host, args.port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except tl.TraceLakeError as exc:  # every failure of the store or a query, DuckDB's too
        print(f"tracelake {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
