"""The ``tracelake`` command line. Terminal output lives here, never in the library.

Commands register themselves with :func:`command`: one decorated function each, which
imports what it needs when it runs (``tracelake runs`` and ``--help`` must start without
torch; ``tests/test_cli.py`` checks). To add one::

    @command(
        "serve",
        "browse a store in the web browser",
        arg("--port", type=int, default=8000, help="the port to listen on"),
    )
    def _serve(args: argparse.Namespace) -> int:
        from tracelake.web import serve  # imported only when this command runs

        return serve(open_store(args), port=args.port)

``store=True`` (the default) gives the command a first positional ``STORE``, which may be
left out when ``TRACELAKE_STORE`` names one; :func:`open_store` opens it without creating
anything. A handler returns the exit status; a :class:`~tracelake.TraceLakeError` it
raises is printed (no traceback) with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TextIO

from tracelake import __version__
from tracelake.errors import QueryError, TraceLakeError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from tracelake.store.store import Store

__all__ = ["COMMANDS", "arg", "build_parser", "command", "main", "open_store"]

#: What ``tracelake --help`` says first (a user's text, not this module's docstring).
DESCRIPTION = """\
Record PyTorch forward passes into a store (in Python: tl.open(path).record(model, x)),
then list, inspect, query and compare the stored runs from the shell.

STORE is a store's directory; it may be left out when the environment variable
TRACELAKE_STORE names one. Exit status: 0 on success, 1 on an error or a problem found,
2 on a usage error (a diff with --exit-code: 1 when the runs differ)."""

EPILOG = """\
examples:
  tracelake runs runs.tl                          list the runs (--all: failed ones too)
  tracelake show runs.tl baseline                 a run's ops with their statistics
  tracelake query runs.tl "select run, label, absmax from ops where func = 'relu'"
  tracelake query runs.tl -f query.sql --format parquet -o out.parquet
  echo "select func, count(*) from ops group by func" | tracelake query runs.tl -
  tracelake diff runs.tl base finetuned --first   where two runs first differ
  tracelake demo --store demo.tl                  record a small model and query it

The query language: docs/query.md. `tracelake COMMAND --help` for a command's options."""

#: The environment variable naming the default store.
STORE_ENV = "TRACELAKE_STORE"

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, one-line help, handler, arguments and whether it takes a
    ``STORE`` first."""

    name: str
    help: str
    handler: Handler
    arguments: tuple[tuple[tuple[str, ...], dict[str, Any]], ...]
    store: bool


#: Every subcommand, by name, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {}


def arg(*flags: str, **options: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One argument of a command, as ``argparse.ArgumentParser.add_argument`` takes it."""
    return flags, options


def command(
    name: str,
    help: str,
    *arguments: tuple[tuple[str, ...], dict[str, Any]],
    store: bool = True,
) -> Callable[[Handler], Handler]:
    """Register the decorated function as the subcommand ``name`` (see the module's
    docstring)."""

    def register(handler: Handler) -> Handler:
        COMMANDS[name] = Command(name, help, handler, arguments, store)
        return handler

    return register


def open_store(args: argparse.Namespace) -> Store:
    """The store ``args.store`` names, opened without creating one (a mistyped path is
    an error, not a new empty store)."""
    if not args.store:
        raise TraceLakeError(f"name a store (STORE), or set {STORE_ENV} to one")
    import tracelake as tl

    return tl.open(args.store, create=False)


# -- output ----------------------------------------------------------------------------------


def console(file: TextIO | None = None) -> Console:
    """A rich console on ``file`` (default stdout). Tables need room: printing to a pipe
    or a CI log, they are not folded to 80 columns."""
    from rich.console import Console

    out = file if file is not None else sys.stdout
    return Console(file=out, width=None if out.isatty() else 160)


def human_size(nbytes: int | float | None) -> str:
    """``1536`` -> ``1.5 KiB``."""
    if nbytes is None or (isinstance(nbytes, float) and math.isnan(nbytes)):
        return ""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def cell(value: Any) -> str:
    """A short text for a table cell (tensors summarised; floats to 4 digits)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, (dict, list)) and not value:
        return ""
    if isinstance(value, dict):
        return json.dumps(value)
    torch = sys.modules.get("torch")  # (only a query that read tensors loaded it)
    if torch is not None and isinstance(value, torch.Tensor):
        from tracelake.query.results import describe

        return describe(value)
    return str(value)


#: A column of a terminal table is never narrower than this (or its header), nor wider
#: than ``_WIDEST``: columns that do not fit are left out, and the caption names them.
_NARROWEST = 6
_WIDEST = 48


def render_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    title: str | None = None,
    caption: str | None = None,
    width: int = 160,
    wrap: Sequence[str] = (),
) -> Table:
    """A rich table of text cells, one line per row: cells longer than ``_WIDEST`` are
    cut with an ellipsis (those of the columns ``wrap`` names are folded onto more lines
    instead), and the columns that do not fit into ``width`` are left out (the caption
    lists them) rather than squeezed to unreadable slivers."""
    from rich.table import Table

    shown: list[int] = []
    used = 0
    for i, name in enumerate(columns):
        need = max(min(len(name), _WIDEST), _NARROWEST) + 3
        if shown and used + need > width:
            break
        shown.append(i)
        used += need
    hidden = list(columns[len(shown) :])
    if hidden:
        listed = ", ".join(hidden[:8]) + (", ..." if len(hidden) > 8 else "")
        note = (
            f"{len(hidden)} more column(s) not shown: {listed} "
            "(select fewer, or --format csv / json for all)"
        )
        caption = f"{caption}; {note}" if caption else note
    table = Table(title=title, caption=caption, header_style="bold")
    for i in shown:
        folded = columns[i] in wrap
        table.add_column(
            columns[i],
            overflow="fold" if folded else "ellipsis",
            no_wrap=not folded,
            min_width=min(max(len(columns[i]), _NARROWEST), _WIDEST),
            max_width=_WIDEST,
        )
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


def print_json(data: Any, file: TextIO | None = None) -> None:
    """``data`` as JSON: NaN and infinities (which JSON lacks) as null."""
    out = file if file is not None else sys.stdout
    json.dump(finite(data), out, default=str, indent=1, allow_nan=False)
    out.write("\n")


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (JSON has none) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return value


def _output(path: str | None) -> TextIO:
    return open(path, "w", newline="") if path else sys.stdout


# -- commands --------------------------------------------------------------------------------

_JSON = arg("--json", action="store_true", help="machine-readable output (JSON)")
_NO_PROGRESS = arg(
    "--no-progress",
    dest="progress",
    action="store_false",
    help="no progress bar (shown only in a terminal, for work over a second)",
)


@command(
    "runs",
    "list the runs of a store",
    arg(
        "--all",
        action="store_true",
        help="also recording, interrupted, failed (with their error) and deleted runs",
    ),
    _JSON,
)
def _runs(args: argparse.Namespace) -> int:
    rows = open_store(args).run_rows(all=args.all)
    if args.json:
        print_json(rows)
        return 0
    columns = ["name", "status", "created", "steps", "ops", "size", "model_class", "meta"]
    if args.all:
        columns.append("error")
    texts = [
        [
            *(cell(row[c]) for c in ("name", "status", "created", "steps", "ops")),
            human_size(row["bytes"]),
            cell(row["model_class"]),
            json.dumps(row["meta"]) if row["meta"] is not None else "",
            *([cell(row["error"])] if args.all else []),
        ]
        for row in rows
    ]
    out = console()
    caption = f"{len(rows)} run(s)" if rows else "no runs yet"
    table = render_table(
        columns, texts, f"runs in {args.store}", caption, out.width, wrap=("meta", "error")
    )
    out.print(table)
    return 0


_SHOWN = ("label", "func", "module", "shape", "dtype", "mean", "std", "absmax", "source")


@command(
    "show",
    "print a run's ops: label, func, module, shape, dtype, statistics, source line",
    arg("run", help="the run's name"),
    arg("--step", type=int, default=0, help="which step of a multi-step run (default 0)"),
    _JSON,
)
def _show(args: argparse.Namespace) -> int:
    from tracelake.errors import RecorderError, RunNotFoundError

    store = open_store(args)
    runs = {row["name"]: row for row in store.run_rows()}
    info = runs.get(args.run)
    if info is None:
        raise RunNotFoundError(args.run, runs)
    if not 0 <= args.step < info["steps"]:
        raise RecorderError(
            f"run {args.run!r} has steps 0..{info['steps'] - 1}; step {args.step} does not exist"
        )
    # The catalog has all a listing needs: no tensor is read (and torch is not imported).
    where = "from ops where run = :run and step = :step order by idx"
    if args.json:
        result = store.query(f"select * {where}", run=args.run, step=args.step)
        print_json(list(result))
        return 0
    result = store.query(
        "select label, func, module, shape, dtype, mean, std, absmax, source_file, "
        f"source_line {where}",
        run=args.run,
        step=args.step,
    )
    texts = [
        [
            row["label"],
            row["func"],
            row["module"],
            "x".join(map(str, row["shape"])) or "scalar",
            row["dtype"],
            cell(row["mean"]),
            cell(row["std"]),
            cell(row["absmax"]),
            f"{os.path.basename(row['source_file'])}:{row['source_line']}"
            if row["source_file"]
            else "",
        ]
        for row in result
    ]
    title = f"{args.run}: {info['model_class']}" + (
        f", step {args.step} of {info['steps']}" if info["steps"] > 1 else ""
    )
    out = console()
    out.print(render_table(_SHOWN, texts, f"{title}: {len(texts)} ops", None, out.width))
    return 0


@command(
    "rm",
    "delete runs (gc reclaims their space)",
    arg("run", nargs="+", help="the names of the runs to delete"),
    _JSON,
)
def _rm(args: argparse.Namespace) -> int:
    store = open_store(args)
    for name in args.run:
        store.delete(name)
    if args.json:
        print_json({"deleted": args.run})
    else:
        console().print(
            f"deleted {len(args.run)} run(s); `tracelake gc {args.store}` reclaims their space",
            soft_wrap=True,
        )
    return 0


@command("gc", "reclaim the space of deleted, failed and interrupted runs", _NO_PROGRESS, _JSON)
def _gc(args: argparse.Namespace) -> int:
    freed = open_store(args).gc(progress=None if args.progress else False)
    if args.json:
        print_json(freed)
    else:
        console().print(
            f"removed {freed['runs']} run(s) and {freed['orphans']} orphaned "
            f"director(ies): {human_size(freed['bytes'])} freed",
            soft_wrap=True,
        )
    return 0


@command(
    "verify",
    "check every chunk's checksum and that catalog and arrays agree",
    arg(
        "--catalog",
        action="store_true",
        help="only the catalog's half: the store's files and each run's directory (no "
        "chunk is read; quick)",
    ),
    _NO_PROGRESS,
    _JSON,
)
def _verify(args: argparse.Namespace) -> int:
    report = open_store(args).verify(
        tensors=not args.catalog, progress=None if args.progress else False
    )
    if args.json:
        print_json(report.as_dict())
    else:
        out = console()
        for problem in report.problems:
            out.print(f"[red]damaged[/red] {problem}", soft_wrap=True, markup=True)
        verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
        checked = (
            f"{report.runs} run(s) checked against the catalog"
            if args.catalog
            else f"{report.runs} run(s), {report.tensors} tensors, {report.chunks} chunks checked"
        )
        out.print(f"{checked}: {verdict}", soft_wrap=True)
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


_FORMATS = ("table", "csv", "json", "parquet", "arrow")


def _query_text(args: argparse.Namespace) -> str:
    if args.file is not None:
        if args.text is not None:
            raise QueryError("give the query as TEXT or with -f FILE, not both")
        with open(args.file) as f:
            return f.read()
    if args.text is None:
        raise QueryError('no query: give it as TEXT, as "-" (read from stdin) or -f FILE')
    return sys.stdin.read() if args.text == "-" else str(args.text)


@command(
    "query",
    "run a query over a store (the language: docs/query.md)",
    arg("text", nargs="?", help='the query, e.g. "select run, label from ops"; "-": stdin'),
    arg("-f", "--file", help="read the query from FILE"),
    arg(
        "--param",
        action="append",
        type=_param,
        default=[],
        metavar="NAME=VALUE",
        help="bind :NAME (the value parsed as JSON if it can be)",
    ),
    arg(
        "--format",
        choices=_FORMATS,
        default="table",
        help="table (a terminal's summary); csv, json, parquet, arrow: every value, exactly "
        "(tensors with their dtype and shape)",
    ),
    arg("-o", "--output", help="write to FILE instead of the terminal"),
    _NO_PROGRESS,
)
def _query(args: argparse.Namespace) -> int:
    store = open_store(args)
    text = _query_text(args)
    fmt = args.format
    if fmt in ("parquet", "arrow") and not args.output:
        print(f"tracelake query: --format {fmt} needs -o FILE", file=sys.stderr)
        return 2
    try:
        # Exports read each row's tensors as they write it: memory stays bounded.
        from tracelake.query.results import run_query

        result = run_query(store, text, dict(args.param), lazy=True)
    except QueryError as exc:
        print(exc, file=sys.stderr)
        # A run that is not there is an error in the store's state, not in the query's text.
        from tracelake.errors import RunNotFoundError

        return 1 if isinstance(exc, RunNotFoundError) else 2
    if fmt != "table":
        from tracelake.query.export import export

        export(result, fmt, args.output or sys.stdout, None if args.progress else False)
        return 0
    out = _output(args.output)
    try:
        texts = [[cell(row[c]) for c in result.columns] for row in result]
        shown = console(out)
        table = render_table(result.columns, texts, None, f"{len(texts)} rows", shown.width)
        shown.print(table)
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


@command(
    "diff",
    "compare two runs op by op (store.compare)",
    arg("a", help="the reference run"),
    arg("b", help="the run compared with it"),
    arg(
        "--on",
        choices=("key", "label", "module"),
        default="key",
        help="align ops by stable key (default), label, or module call",
    ),
    arg("--where", default=None, help="a query condition on ops, e.g. \"func = 'relu'\""),
    arg("--atol", type=float, default=1e-8, help="absolute tolerance of allclose (1e-8)"),
    arg("--rtol", type=float, default=1e-5, help="relative tolerance of allclose (1e-5)"),
    arg("--steps", type=int, nargs=2, metavar=("I", "J"), help="step I of a, J of b"),
    arg("--first", action="store_true", help="only the first divergence"),
    arg("--exit-code", action="store_true", help="exit 1 when anything differs (as git diff)"),
    arg(
        "--format",
        choices=("table", "csv", "json", "parquet"),
        default="table",
        help="table (a terminal's summary); csv, json, parquet: every row and column",
    ),
    arg("-o", "--output", help="write to FILE instead of the terminal"),
)
def _diff(args: argparse.Namespace) -> int:
    store = open_store(args)
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
    status = 1 if args.exit_code and differs else 0
    if args.format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not args.output:
            print("tracelake diff: --format parquet needs -o FILE", file=sys.stderr)
            return 2
        table = comparison.arrow() if not args.first else pa.Table.from_pylist(finite(rows))
        pq.write_table(table, args.output)
        return status
    out = _output(args.output)
    try:
        if args.format == "json":
            print_json(rows, out)
        elif args.format == "csv":
            import csv

            from tracelake.query.export import csv_text

            writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["key"])
            writer.writeheader()
            for r in rows:
                writer.writerow({k: csv_text(v) for k, v in r.items()})
        else:
            shown = console(out)
            title = f"{comparison!r}" if not args.first else "first divergence"
            caption = "no divergence" if args.first and not rows else None
            texts = [[cell(r[c]) for c in _DIFF_SHOWN] for r in rows]
            shown.print(render_table(_DIFF_SHOWN, texts, title, caption, shown.width))
    finally:
        if out is not sys.stdout:
            out.close()
    return status


@command(
    "graph",
    "draw a run's op graph with Graphviz (needs `dot`)",
    arg("run", help="the run's name"),
    arg("-o", "--output", required=True, help="FILE.svg (.png, .pdf, .dot)"),
    arg("--step", type=int, default=None, help="which step (multi-step runs)"),
    arg("--depth", type=int, default=None, help="module depth drawn expanded"),
    arg("--color", default=None, help="colour by a statistic (absmax, ...)"),
    arg("--diff", default=None, metavar="RUN", help="colour by difference to RUN"),
    arg("--collapse", action="append", default=[], help="collapse a module"),
    _JSON,
)
def _graph(args: argparse.Namespace) -> int:
    """Draw a run's op graph to a file (tracelake/graph.py; needs Graphviz's dot)."""
    store = open_store(args)
    run = store[args.run]
    diff = store.compare(args.run, args.diff) if args.diff else None
    try:
        drawn = run.graph(  # type: ignore[attr-defined]  # (the pictures branch's)
            step=args.step, depth=args.depth, color=args.color, diff=diff, collapse=args.collapse
        )
        drawn.save(args.output)
    except ValueError as exc:  # a statistic, metric, module or file type that does not exist
        print(f"tracelake graph: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json({"output": args.output, "nodes": drawn.nodes, "ops": drawn.ops})
    else:
        console().print(f"{args.output}: {drawn!r}", soft_wrap=True, markup=False)
    return 0


@command(
    "serve",
    "browse a store in a web browser (read-only; needs the `web` extra)",
    arg("--host", default="127.0.0.1", help="the address to bind (default: local)"),
    arg("--port", type=int, default=8765, help="the port (default 8765)"),
)
def _serve(args: argparse.Namespace) -> int:
    from tracelake.explorer import serve  # Starlette and uvicorn load only for this command

    store = open_store(args)
    serve(
        store,
        args.host,
        args.port,
        lambda url: print(f"tracelake explorer of {store.path}: {url}", flush=True),
    )
    return 0


@command(
    "demo",
    "trace the built-in demo model and print its ops (--store: record and query it too)",
    arg("--json", action="store_true", help="print the ops as JSON records"),
    arg("--store", default=None, metavar="DIR", help="also record the demo into DIR, query it"),
    store=False,
)
def _demo(args: argparse.Namespace) -> int:
    import torch

    import tracelake as tl
    from tracelake.demo import DemoNet, demo_inputs

    torch.manual_seed(0)
    model = DemoNet().eval()
    ids = demo_inputs()
    with torch.no_grad():
        log = tl.trace(model, ids)
    if args.json:
        print_json(log.df().drop(columns=["parents"]).to_dict(orient="records"))
        return 0
    out = console()
    texts = [_op_texts(op) for op in log]
    title = f"tl.trace(DemoNet(), ids): {len(log)} ops"
    out.print(render_table(_SHOWN, texts, title, None, out.width))
    relu = log.find(func="relu")[0]
    scaled = log[relu.children[0]]
    assert relu.out is not None and scaled.out is not None  # the demo saves everything
    untouched = torch.equal(relu.out * 0.5, scaled.out)
    out.print(
        f"\n{relu.label}: parents {list(relu.parents)}, source {relu.source}; its saved copy "
        f"times 0.5 equals {scaled.label} ({scaled.func}, in place on the same tensor): "
        f"{untouched}",
        soft_wrap=True,  # prose: never folded, whatever the width of the paths in it
    )
    passes = ", ".join(m.label for m in log.modules if m.path == "encoder")
    out.print(f"encoder passes: {passes}", soft_wrap=True)
    log.cleanup()
    if args.store:
        _demo_store(args.store, model, out)
    return 0


def _op_texts(op: Any) -> list[str]:
    """A trace's op as the cells of ``_SHOWN``."""
    stats = op.stats
    source = f"{os.path.basename(op.source.file)}:{op.source.line}" if op.source else ""
    return [
        op.label,
        op.func,
        op.module,
        "x".join(map(str, op.shape)) or "scalar",
        str(op.dtype).removeprefix("torch."),
        cell(stats and stats.mean),
        cell(stats and stats.std),
        cell(stats and stats.absmax),
        source,
    ]


DEMO_QUERIES = (
    "select run, label, module, out from ops where func = 'relu' order by run",
    "select run, label, absmax from ops where func = 'linear' and absmax > :limit "
    "order by absmax desc limit 5",
    "select run, label, out[0, -1, :4] as last_token from ops where func = 'relu' "
    "and meta.prompt like '%Paris%'",
    "select func, count(*) as n, avg(l2) as mean_l2 from ops group by func order by n desc limit 6",
    "select run, label, shape from ops where func = 'linear' and parent.func = 'layer_norm' "
    "and run = 'base' order by label",
)


def _demo_store(path: str, model: Any, out: Console) -> None:
    """Record the demo model into a store (three runs, three 'prompts') and query it."""
    import warnings

    import torch

    import tracelake as tl
    from tracelake.demo import demo_inputs

    with warnings.catch_warnings():  # (a new store is what the demo asked for)
        warnings.filterwarnings("ignore", "created a new", tl.TraceLakeWarning)
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
    out.print(f"\nrecorded {len(prompts)} runs into {store.path}:", soft_wrap=True)
    columns = ["name", "status", "steps", "ops", "size"]
    texts = [
        [r["name"], r["status"], cell(r["steps"]), cell(r["ops"]), human_size(r["bytes"])]
        for r in store.run_rows()
    ]
    out.print(render_table(columns, texts, None, None, out.width))
    for text in DEMO_QUERIES:
        bound: dict[str, Any] = {"limit": 1.0} if ":limit" in text else {}
        result = store.query(text, **bound)
        out.print(f"\n[bold]>>> {text}[/bold]", soft_wrap=True)
        texts = [[cell(row[c]) for c in result.columns] for row in result]
        out.print(render_table(result.columns, texts, None, f"{len(texts)} rows", out.width))
    report = store.verify()
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    out.print(
        f"\nverify: {verdict} ({report.runs} runs, {report.tensors} tensors, "
        f"{report.chunks} chunks checked)",
        soft_wrap=True,
    )
    out.print(
        f"next: tracelake runs {store.path}; tracelake show {store.path} base; "
        f'tracelake query {store.path} "select ..."',
        soft_wrap=True,
    )


# -- the parser and main ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``tracelake`` argument parser, one subparser per registered command."""
    parser = argparse.ArgumentParser(
        prog="tracelake",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tracelake {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        sub = commands.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.store:
            sub.add_argument(
                "store",
                metavar="STORE",
                help=f"the store's directory (default: ${STORE_ENV})",
            )
        for flags, options in cmd.arguments:
            sub.add_argument(*flags, **options)
        sub.set_defaults(handler=cmd.handler)
    return parser


def _is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "tracelake.json"))


def with_default_store(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``$TRACELAKE_STORE`` put in as STORE when the command takes one and
    its first positional argument is not a store's directory."""
    default = os.environ.get(STORE_ENV)
    at = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if not default or at is None or not COMMANDS[argv[at]].store:
        return argv
    sub = next(
        a
        for a in parser._subparsers._group_actions  # type: ignore[union-attr]
        if isinstance(a, argparse._SubParsersAction)
    ).choices[argv[at]]
    i = at + 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            i += 1
            break
        if token.startswith("-") and token != "-":
            action = sub._option_string_actions.get(token.split("=")[0])
            takes = action is not None and action.nargs != 0 and "=" not in token
            i += 2 if takes else 1
            continue
        break
    if i < len(argv) and _is_store(argv[i]):
        return argv
    return [*argv[: at + 1], default, *argv[at + 1 :]]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit status."""
    parser = build_parser()
    argv = with_default_store(list(sys.argv[1:] if argv is None else argv), parser)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except TraceLakeError as exc:  # every failure of the store or a query, DuckDB's too
        print(f"tracelake {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `tracelake query ... | head`: the reader left; so do we
        # Python flushes stdout again at exit: point it at /dev/null so that it cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        print(f"tracelake {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    raise SystemExit(main())
