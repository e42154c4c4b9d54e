"""The web explorer: ``tracelake serve STORE`` (or :func:`serve`, :func:`running`).

A read-only Starlette app over one store: the runs list with meta and provenance
(``/``), a run's op table filtered with the query language (``/run``), its op graph
(``/graph``), one op with its statistics, source line, parents, children and tensor
(``/op``), and two runs compared with their first divergence (``/compare``). Every
page is answered through the store's query API (``store.query``, ``store.compare``),
never raw SQL; a filter the user types is one condition of the query language, checked
on its own before it joins the page's query. Pages are plain HTML and SVG rendered on
the server (Jinja2 with autoescaping; no JavaScript, and a Content-Security-Policy
that allows none), so a run name or meta value from an untrusted store is only ever
text. The server binds 127.0.0.1 unless told otherwise and answers only GET.

Starlette, uvicorn and Jinja2 come with the ``web`` extra (``pip install
'tracelake[web]'``); this module imports none of them, nor torch, until an app is made.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import json
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracelake import drawing
from tracelake.errors import (
    LabelError,
    QueryError,
    RecorderError,
    RunNotFoundError,
    TraceLakeError,
)

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from tracelake.query.results import Result
    from tracelake.store import Store

__all__ = ["ExplorerError", "create_app", "running", "serve"]

#: Rows per page of the runs list and of a run's op table.
PAGE_ROWS = 200
#: Most nodes the graph view draws (the first ones in execution order).
GRAPH_NODES = 2000
#: Most rows and columns of the heatmap slice, and of a 1-D tensor shown as one row.
HEATMAP_SIDE = 128
HEATMAP_ROW = 1024
#: Largest tensor whose histogram covers all of it (else: the heatmap's slice).
HISTOGRAM_BYTES = 16 << 20
#: The Host headers the explorer answers by default.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
#: Runs kept read op by op for comparisons.
RUN_CACHE = 16
#: Rows of a comparison shown around its first divergence.
COMPARE_ROWS = 100

#: What the runs list and a run's op table select (the query language's column names).
RUN_COLUMNS = (
    "id, name, created, steps, op_count, bytes, model_class, torch_version, device, host, "
    "param_fingerprint, input_fingerprint, meta"
)
OP_COLUMNS = (
    "idx, label, func, kind, module, shape, dtype, saved, mean, std, absmax, source_file, "
    "source_line"
)
STAT_COLUMNS = ("mean", "std", "min", "max", "absmax", "l2", "frac_zero", "nan_count", "inf_count")

_CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)


class ExplorerError(TraceLakeError):
    """The web explorer cannot start (its extra is not installed, the port is taken)."""


def _condition(table: str, text: str) -> str:
    """``text`` as one condition of the query language on ``table``, ready to stand in
    parentheses inside a page's query; a ``QueryError`` (with the caret) if it is not."""
    from tracelake.query import parse

    text = " ".join(text.split())  # one line: a `--` comment ends at the newline added
    if not text:
        return ""
    query = parse(f"select * from {table} where {text}")
    if query.group_by or query.order_by or query.limit or query.having or query.joins:
        raise QueryError(
            "the filter is one condition (as after `where`), without group by, order by "
            "or limit: the page orders and pages the rows itself"
        )
    return f" and (\n{text}\n)"


def _link(path: str, **params: Any) -> str:
    """A URL of this app with its query string encoded (any run name is safe in it)."""
    kept = {k: v for k, v in params.items() if v not in (None, "")}
    return f"{path}?{urllib.parse.urlencode(kept)}" if kept else path


def _num(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    return str(value)


def _size(n: Any) -> str:
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # (unreachable)


def _shape(shape: Any) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def _numpy(tensor: Any) -> Any:
    """A torch tensor as a float64 numpy array (complex: its magnitude)."""
    t = tensor.detach().cpu()
    if t.is_complex():
        t = t.abs()
    return t.double().numpy()


class _Reading:
    """A stored run's catalog SQL: on the catalog file while ``file`` is set, else on
    the mirror (``mirror``)."""

    def __init__(self, mirror: Callable[..., Any]):
        self.mirror = mirror
        self.file: Callable[..., Any] | None = None

    def __call__(self, sql: str, params: list[Any] | None = None) -> Any:
        return (self.file or self.mirror)(sql, params)


@dataclass
class Page:
    """What a view renders: a template and its values."""

    template: str
    values: dict[str, Any]
    status: int = 200


class Explorer:
    """The views, over one store. One lock serialises them: the store's catalog mirror
    is one DuckDB connection."""

    def __init__(self, store: Store):
        self.store = store
        self.lock = threading.Lock()
        #: Runs read op by op (for comparisons), by catalog id: a run never changes once
        #: complete, and a name recorded again gets a new id.
        self._runs: dict[int, Any] = {}

    def _loaded(self, info: dict[str, Any], file: Callable[..., Any] | None = None) -> Any:
        """Run ``info`` (a row of ``runs``) with its steps read, kept for the next pages.
        ``file``: SQL on the catalog file (``CatalogMirror.on_file``), which a run not
        read before reads its rows from rather than having them copied into the mirror
        first; after that its SQL goes to the mirror again."""
        run = self._runs.pop(info["id"], None)
        if run is None:
            from tracelake.store.run import Run

            reading = _Reading(functools.partial(self.store.catalog.query, runs=(info["id"],)))
            reading.file = file
            arrays = self.store.arrays(info["id"], info["name"], info["created"])
            run = Run(info, arrays, reading)
            run.steps  # noqa: B018  (read its ops now, once)
            reading.file = None
        self._runs[info["id"]] = run  # (most recently used last)
        while len(self._runs) > RUN_CACHE:
            del self._runs[next(iter(self._runs))]
        return run

    def warm(self, render: Callable[[Page], str]) -> None:
        """Answer each kind of page once, on the store's most recent run, and render it
        (``render``): what a first request would pay for once (torch and the query
        room imported, the catalog mirror loaded, the query parser's tables built,
        templates compiled) is paid at start, so that the first request a user makes is
        about as fast as the ones after it (``benchmarks/explorer_latency.py``). A store
        it cannot read is left to the pages to report."""
        with self.lock, contextlib.suppress(KeyError, TraceLakeError):  # (as the pages do)
            render(self.runs("", 0))
            names = self._run_names()
            if not names:
                return
            name = names[-1]
            render(self.run(name, 0, "", 0))
            render(self.graph(name, 0))
            label = next(
                (
                    r["label"]
                    for r in self._query(
                        "select label from ops where run = :run and step = 0 and saved = true "
                        "order by idx limit 1",
                        run=name,
                    )
                ),
                None,
            )
            if label is not None:
                render(self.op(name, 0, label, ""))
            render(self.compare(name, name))

    # -- helpers ----------------------------------------------------------------------

    def _query(self, text: str, **params: Any) -> Result:
        """``store.query``, without a progress bar on the server's terminal."""
        from tracelake.query.results import run_query

        return run_query(self.store, text, params, progress=False)

    def _run_names(self) -> list[str]:
        return [r["name"] for r in self._query("select name from runs order by id")]

    def _run_info(self, name: str, step: int = 0) -> dict[str, Any]:
        """The run's catalog row (``RunNotFoundError`` with suggestions if there is no
        complete run of that name; ``RecorderError`` if it has no step ``step``)."""
        rows = list(self._query(f"select {RUN_COLUMNS} from runs where name = :n", n=name))
        if not rows:
            raise RunNotFoundError(name, self._run_names())
        steps = int(rows[0]["steps"] or 0)
        if not 0 <= step < max(steps, 1):
            raise RecorderError(
                f"run {name!r} has steps 0..{steps - 1}; step {step} does not exist"
            )
        return _run_row(rows[0])

    # -- views ------------------------------------------------------------------------

    def runs(self, where: str, offset: int) -> Page:
        cond = error = None
        rows: list[dict[str, Any]] = []
        total = 0
        try:
            cond = _condition("runs", where)
            text = f"select {RUN_COLUMNS} from runs where true{cond}"
            total = self._count("runs", f"true{cond}", {})
            rows = [
                _run_row(r)
                for r in self._query(
                    text + "\norder by id limit :limit offset :offset",
                    limit=PAGE_ROWS,
                    offset=offset,
                )
            ]
        except QueryError as exc:
            error = exc
        return Page(
            "runs.html",
            {
                "rows": rows,
                "total": total,
                "offset": offset,
                "where": where,
                "error": error,
                "pages": _pages(total, offset, lambda o: _link("/", where=where, offset=o)),
                "names": [r["name"] for r in rows],
            },
        )

    def _count(self, table: str, where: str, params: dict[str, Any]) -> int:
        result = list(self._query(f"select count(*) as n from {table} where {where}", **params))
        return int(result[0]["n"]) if result else 0

    def run(self, name: str, step: int, where: str, offset: int) -> Page:
        info = self._run_info(name, step)
        params = {"run": name, "step": step}
        error = None
        rows: list[dict[str, Any]] = []
        total = 0
        text = ""
        try:
            cond = _condition("ops", where)
            base = f"run = :run and step = :step{cond}"
            text = f"select {OP_COLUMNS} from ops where {base}"
            total = self._count("ops", base, params)
            rows = list(
                self._query(
                    text + "\norder by idx limit :limit offset :offset",
                    limit=PAGE_ROWS,
                    offset=offset,
                    **params,
                )
            )
        except QueryError as exc:
            error = exc
        for row in rows:
            row["href"] = _link("/op", run=name, step=step, label=row["label"])
        others = [n for n in self._run_names() if n != name]
        return Page(
            "run.html",
            {
                "info": info,
                "step": step,
                "steps": range(int(info["steps"] or 0)),
                "where": where,
                "rows": rows,
                "total": total,
                "offset": offset,
                "error": error,
                "query": text,
                "others": others[:1000],
                "graph": _link("/graph", run=name, step=step),
                "pages": _pages(
                    total,
                    offset,
                    lambda o: _link("/run", run=name, step=step, where=where, offset=o),
                ),
            },
        )

    def _ops_by_idx(self, name: str, step: int, idxs: list[int]) -> list[dict[str, Any]]:
        if not idxs:
            return []
        found = {
            r["idx"]: r
            for r in self._query(
                "select idx, label, func, shape from ops where run = :run and step = :step "
                "and idx in :idxs",
                run=name,
                step=step,
                idxs=sorted(set(idxs)),
            )
        }
        return [
            {**found[i], "href": _link("/op", run=name, step=step, label=found[i]["label"])}
            for i in idxs
            if i in found
        ]

    def _neighbours(
        self, name: str, step: int, idx: int, side: str, other: str, order: str
    ) -> list[dict[str, Any]]:
        """The ops at the ``side`` end of the edges whose ``other`` end is op ``idx``."""
        found = self._query(
            f"select {side} from edges where run = :run and step = :step and {other} = :idx "
            f"order by {order}",
            run=name,
            step=step,
            idx=idx,
        )
        return self._ops_by_idx(name, step, [r[side] for r in found])

    def op(self, name: str, step: int, label: str, at: str) -> Page:
        info = self._run_info(name, step)
        rows = list(
            self._query(
                "select * from ops where run = :run and step = :step and label = :label",
                run=name,
                step=step,
                label=label,
            )
        )
        if not rows:
            labels = [
                r["label"]
                for r in self._query(
                    "select label from ops where run = :run and step = :step", run=name, step=step
                )
            ]
            raise LabelError(label, labels)
        op = rows[0]
        parents = self._neighbours(name, step, op["idx"], "parent", "child", "edge")
        children = self._neighbours(name, step, op["idx"], "child", "parent", "child")
        tensor = self._tensor_view(name, step, label, op, at) if op["saved"] else None
        return Page(
            "op.html",
            {
                "info": info,
                "step": step,
                "op": op,
                "stats": [(c, op.get(c)) for c in STAT_COLUMNS],
                "parents": parents,
                "children": children,
                "tensor": tensor,
                "run_href": _link("/run", run=name, step=step),
            },
        )

    def _tensor_view(
        self, name: str, step: int, label: str, op: dict[str, Any], at: str
    ) -> dict[str, Any]:
        shape = [int(n) for n in op["shape"]]
        lead: list[int] = []
        error = None
        if len(shape) > 2:
            try:
                lead = [int(p) for p in at.replace(" ", "").split(",")] if at.strip() else []
            except ValueError:
                error = f"the slice is {len(shape) - 2} indices separated by commas, not {at!r}"
                lead = []
            if len(lead) != len(shape) - 2 or any(
                not -n <= i < n for i, n in zip(lead, shape, strict=False)
            ):
                if at.strip() and error is None:
                    error = (
                        f"the slice takes {len(shape) - 2} indices within {shape[:-2]}, "
                        f"not {at!r}; showing index 0"
                    )
                lead = [0] * (len(shape) - 2)
        if len(shape) >= 2:
            index = [*map(str, lead), f":{HEATMAP_SIDE}", f":{HEATMAP_SIDE}"]
        elif len(shape) == 1:
            index = [f":{HEATMAP_ROW}"]
        else:
            index = []
        params = {"run": name, "step": step, "label": label}
        where = "where run = :run and step = :step and label = :label"
        sliced = None
        if index:
            got = list(
                self._query(f"select out[{', '.join(index)}] as s from ops {where}", **params)
            )
            sliced = _numpy(got[0]["s"]) if got and got[0]["s"] is not None else None
        whole = op["nbytes"] is not None and int(op["nbytes"]) <= HISTOGRAM_BYTES
        if whole:
            got = list(self._query(f"select out from ops {where}", **params))
            values = _numpy(got[0]["out"]) if got and got[0]["out"] is not None else None
        else:
            values = sliced
        heatmap = None
        if sliced is not None and sliced.size:
            grid = sliced.reshape(1, -1) if sliced.ndim == 1 else sliced
            scale = max(1, min(8, 512 // max(grid.shape)))
            png, lo, hi = drawing.heatmap_png(grid, scale)
            heatmap = {
                "src": "data:image/png;base64," + base64.b64encode(png).decode("ascii"),
                "rows": grid.shape[0],
                "cols": grid.shape[1],
                "lo": lo,
                "hi": hi,
                "slice": f"[{', '.join(index)}]",
                "width": grid.shape[1] * scale,
                "height": grid.shape[0] * scale,
            }
        hist = drawing.histogram(values) if values is not None else None
        return {
            "heatmap": heatmap,
            "histogram": drawing.histogram_svg(hist) if hist is not None else "",
            "counts": hist,
            "over": "the whole tensor" if whole else f"the slice {heatmap and heatmap['slice']}",
            "numel": int(values.size) if values is not None else 0,
            "lead": ", ".join(map(str, lead)),
            "lead_shape": shape[:-2],
            "error": error,
        }

    def graph(self, name: str, step: int) -> Page:
        info = self._run_info(name, step)
        params = {"run": name, "step": step}
        ops = list(
            self._query(
                "select idx, label, func, kind from ops where run = :run and step = :step "
                "order by idx limit :limit",
                limit=GRAPH_NODES,
                **params,
            )
        )
        position = {r["idx"]: i for i, r in enumerate(ops)}
        edges = [
            (position[r["parent"]], position[r["child"]])
            for r in self._query(
                "select parent, child from edges where run = :run and step = :step", **params
            )
            if r["parent"] in position and r["child"] in position
        ]
        total = self._count("ops", "run = :run and step = :step", params)
        svg = drawing.graph_svg(
            [(r["label"], r["func"], r["kind"]) for r in ops],
            edges,
            [_link("/op", run=name, step=step, label=r["label"]) for r in ops],
        )
        return Page(
            "graph.html",
            {
                "info": info,
                "step": step,
                "svg": svg,
                "nodes": len(ops),
                "edges": len(edges),
                "total": total,
                "run_href": _link("/run", run=name, step=step),
            },
        )

    def compare(self, a: str, b: str) -> Page:
        info_a, info_b = self._run_info(a), self._run_info(b)
        catalog = self.store.catalog
        with contextlib.ExitStack() as stack:
            file = None
            if any(i["id"] not in self._runs for i in (info_a, info_b)):
                if catalog.reads_file:
                    # runs not read before read their rows from the catalog file, in
                    # one opening of it, rather than having them copied into the
                    # mirror (and compressed there) first: about half the CPU time of
                    # a first comparison (README, "The web explorer")
                    file = stack.enter_context(catalog.on_file())
                else:  # both runs' rows into the mirror in one read of the catalog
                    catalog.refresh(runs={info_a["id"], info_b["id"]})
            run_a, run_b = self._loaded(info_a, file), self._loaded(info_b, file)
        comparison = self.store.compare(run_a, run_b)
        first = comparison.first_divergence()
        at = 0  # the first divergence's row: its metrics, and those before it, are known
        while first is not None and at < len(comparison) and comparison.row(at) is not first:
            at += 1
        start = max(0, at - 5) if first is not None else 0
        shown = []
        for k in range(start, min(len(comparison), start + COMPARE_ROWS)):
            row = comparison.row(k)  # only the rows shown are computed
            shown.append(
                {
                    **row,
                    "href_a": row["label_a"]
                    and _link("/op", run=a, step=row["step_a"], label=row["label_a"]),
                    "href_b": row["label_b"]
                    and _link("/op", run=b, step=row["step_b"], label=row["label_b"]),
                    "first": first is not None and k == at,
                }
            )
        return Page(
            "compare.html",
            {
                "a": info_a,
                "b": info_b,
                "summary": comparison.summary(),
                "first": first,
                "rows": shown,
                "start": start,
                "total": len(comparison),
                "atol": comparison.atol,
                "rtol": comparison.rtol,
                "first_href": first
                and _link("/op", run=a, step=first["step_a"], label=first["label_a"]),
            },
        )


def _run_row(row: dict[str, Any]) -> dict[str, Any]:
    meta = row.get("meta")
    try:
        parsed = json.loads(meta) if meta else None
    except ValueError:
        parsed = meta
    return {
        **row,
        "meta_text": json.dumps(parsed, ensure_ascii=False, sort_keys=True) if parsed else "",
        "href": _link("/run", run=row["name"]),
    }


def _pages(total: int, offset: int, link: Callable[[int], str]) -> dict[str, Any]:
    return {
        "first": offset + 1 if total else 0,
        "last": min(total, offset + PAGE_ROWS),
        "prev": link(max(0, offset - PAGE_ROWS)) if offset > 0 else None,
        "next": link(offset + PAGE_ROWS) if offset + PAGE_ROWS < total else None,
    }


def _int(request: Request, name: str, default: int = 0) -> int:
    value = request.query_params.get(name, "")
    try:
        return max(0, int(value)) if value else default
    except ValueError:
        return default


def create_app(store: Store | str, allowed_hosts: list[str] | None = None) -> Starlette:
    """The explorer's ASGI app over ``store`` (a :class:`~tracelake.Store`, or the path
    of an existing one: never created). ``allowed_hosts``: the ``Host`` headers it
    answers (default: local names only, which keeps a DNS-rebinding page out)."""
    try:
        import jinja2
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.trustedhost import TrustedHostMiddleware
        from starlette.responses import HTMLResponse
        from starlette.routing import Route
    except ImportError as exc:
        raise ExplorerError(
            f"the web explorer needs the `web` extra ({exc.name} is missing): "
            "pip install 'tracelake[web]'"
        ) from exc
    from tracelake.store import open_store

    if isinstance(store, str):
        store = open_store(store, create=False)
    explorer = Explorer(store)
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tracelake", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["num"] = _num
    env.filters["size"] = _size
    env.filters["shape"] = _shape
    env.globals["link"] = _link
    env.globals["store_path"] = store.path

    def render(view: Callable[[Request], Page]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            started, cpu = time.perf_counter(), time.process_time()
            try:
                with explorer.lock:
                    page = view(request)
            except QueryError as exc:  # (a filter's own errors are shown on its page)
                page = Page("error.html", {"error": exc, "title": "query error"}, 400)
            except (KeyError, TraceLakeError) as exc:
                page = Page("error.html", {"error": exc, "title": "not found"}, 404)
            elapsed = time.perf_counter() - started
            body = env.get_template(page.template).render(**page.values, elapsed_ms=elapsed * 1000)
            total = (time.perf_counter() - started) * 1000
            # the process's CPU time meanwhile (all its threads, DuckDB's too): what the
            # page costs whatever else the machine runs
            cpu_ms = (time.process_time() - cpu) * 1000
            return HTMLResponse(
                body,
                status_code=page.status,
                headers={
                    "Content-Security-Policy": _CSP,
                    "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer",
                    "Server-Timing": f"app;dur={total:.2f}, cpu;dur={cpu_ms:.2f}",
                    "Cache-Control": "no-store",
                },
            )

        return endpoint

    explorer.warm(lambda page: env.get_template(page.template).render(**page.values, elapsed_ms=0))

    def q(request: Request, name: str) -> str:
        return request.query_params.get(name, "")

    routes = [
        Route("/", render(lambda r: explorer.runs(q(r, "where"), _int(r, "offset")))),
        Route(
            "/run",
            render(
                lambda r: explorer.run(
                    q(r, "run"), _int(r, "step"), q(r, "where"), _int(r, "offset")
                )
            ),
        ),
        Route("/graph", render(lambda r: explorer.graph(q(r, "run"), _int(r, "step")))),
        Route(
            "/op",
            render(lambda r: explorer.op(q(r, "run"), _int(r, "step"), q(r, "label"), q(r, "at"))),
        ),
        Route("/compare", render(lambda r: explorer.compare(q(r, "a"), q(r, "b")))),
    ]
    hosts = allowed_hosts or list(LOCAL_HOSTS)
    return Starlette(
        routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)]
    )


def _hosts(host: str) -> list[str] | None:
    """The Host headers to answer when bound to ``host``: local names, plus ``host``
    itself; any when bound to every interface (the user asked for it)."""
    if host in ("0.0.0.0", "::", ""):
        return ["*"]
    return [*LOCAL_HOSTS, host]


def _server(store: Store | str, host: str, port: int) -> Any:
    try:
        import uvicorn
    except ImportError as exc:
        raise ExplorerError(
            "the web explorer needs the `web` extra (uvicorn is missing): "
            "pip install 'tracelake[web]'"
        ) from exc
    app = create_app(store, _hosts(host))
    # What the warm start left alive (torch, the query room, the catalog mirror: ~240,000
    # objects) is kept out of the collector's full passes, which otherwise took ~150 ms
    # of some requests (every few comparisons; README, "The web explorer"). running()
    # gives it back when its block ends.
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    return uvicorn.Server(config)


def serve(
    store: Store | str,
    host: str = "127.0.0.1",
    port: int = 8765,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the explorer until interrupted (what ``tracelake serve`` runs); ``ready`` is
    given its URL once the port is known to be free (not before: a URL printed for a
    port in use leads nowhere)."""
    server = _server(store, host, port)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ExplorerError(
                f"cannot serve on {host}:{port} ({exc.strerror}); pick another --port"
            ) from exc
    if ready is not None:
        ready(_base_url(host, port) + "/")
    server.run()


def _base_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@contextlib.contextmanager
def running(store: Store | str, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The explorer served from a background thread for the ``with`` block; yields its
    base URL (``port=0``: a free port)."""
    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    server = _server(store, host, port)
    thread = threading.Thread(target=server.run, name="tracelake-explorer", daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ExplorerError(f"the explorer did not start on {host}:{port}")
            time.sleep(0.02)
        yield _base_url(host, port)
    finally:
        server.should_exit = True
        if thread.is_alive():
            thread.join(10)
        gc.unfreeze()
