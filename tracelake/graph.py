"""The op graph of a recording, drawn with Graphviz: ``trace.graph()``, ``run.graph()``
and ``tracelake graph STORE RUN -o FILE.svg``.

Module calls are clusters (boxes around their ops, nested as the calls were). A call
deeper than ``depth`` is collapsed into one node standing for all its ops; with no
``depth`` given, the deepest depth whose graph has at most ``max_nodes`` nodes is chosen,
so a model of ten thousand ops still lays out in seconds. ``collapse=[...]`` collapses
named module calls (path or label) whatever their depth.

Nodes are coloured by a statistic (``color="absmax"``; ops without statistics stay
grey), or by how two recordings differ (``diff=comparison``, colour by a metric of
:class:`~tracelake.Comparison`'s rows, ``max_abs_diff`` unless ``color`` names another);
a collapsed node takes the largest value among its ops.

It reads the recording only through the public trace interface (``modules``, ops'
``modules``, ``field("parents")``, ``stats``). Drawing needs the ``graphviz`` Python
package (``pip install 'tracelake[pictures]'``) and Graphviz's ``dot`` program (from the
OS packages: ``apt-get install graphviz``, ``brew install graphviz``, ``conda install
graphviz``); without them a :class:`~tracelake.errors.RenderError` says so.
"""

from __future__ import annotations

import difflib
import math
import os
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracelake.errors import RenderError, TraceLakeWarning
from tracelake.recorder.record import STAT_FIELDS

if TYPE_CHECKING:
    from tracelake.recorder.trace import TraceView
    from tracelake.store.compare import Comparison

__all__ = ["DOT_INSTALL", "MAX_NODES", "OpGraph", "build_graph", "require_dot"]

#: How to get Graphviz's ``dot`` program, said wherever it is missing.
DOT_INSTALL = (
    "install Graphviz from your OS packages (apt-get install graphviz; brew install "
    "graphviz; conda install graphviz) so that `dot` is on PATH"
)
_PY_INSTALL = "pip install 'tracelake[pictures]' (or pip install graphviz)"
#: Most nodes drawn when no ``depth`` is given.
MAX_NODES = 300
#: The comparison metric nodes are coloured by unless ``color`` names another.
_DEFAULT_DIFF = "max_abs_diff"
#: Fill colours from the smallest value to the largest (ColorBrewer's YlOrRd).
_RAMP = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#b10026")
_NO_VALUE = "#eeeeee"
_IO_FILL = "#cfe2f3"

Call = tuple[str, int]  # a module call: (path, pass)


def _graphviz() -> Any:
    try:
        import graphviz
    except ImportError as exc:
        raise RenderError(
            f"drawing an op graph needs the graphviz Python package: {_PY_INSTALL}"
        ) from exc
    return graphviz


def require_dot() -> str:
    """The path of Graphviz's ``dot`` program; a :class:`RenderError` saying how to
    install it when it is not on PATH."""
    found = shutil.which("dot")
    if found is None:
        raise RenderError(f"drawing an op graph needs Graphviz's `dot` program: {DOT_INSTALL}")
    return found


@dataclass
class _Node:
    """One drawn node: an op, or a collapsed module call standing for its ops."""

    name: str
    lines: list[str]
    tooltip: str
    cluster: tuple[Call, ...]
    kind: str = "op"
    ops: int = 1
    values: list[float] = field(default_factory=list)
    value: float | None = None


class OpGraph:
    """An op graph ready to draw: ``svg()``, ``save(path)`` (``.svg``, ``.png``, ``.pdf``,
    or ``.dot`` / ``.gv`` for the Graphviz source), ``source``, and in a notebook it
    displays as SVG. ``digraph`` is the ``graphviz.Digraph`` itself; ``nodes``,
    ``edges``, ``ops`` and ``depth`` say what was drawn (``depth``: the module depth
    shown expanded; deeper calls are collapsed nodes). Nodes are named ``op<index>``
    (an op, by its execution index) or ``module<k>`` (a collapsed call): the
    ``<title>`` of each node in the SVG, for pages that link nodes to ops."""

    def __init__(self, digraph: Any, nodes: int, edges: int, ops: int, depth: int):
        self.digraph = digraph
        self.nodes = nodes
        self.edges = edges
        self.ops = ops
        self.depth = depth

    @property
    def source(self) -> str:
        """The graph in Graphviz's dot language."""
        return str(self.digraph.source)

    def render(self, format: str = "svg") -> bytes:
        """The drawn graph in ``format`` (any format ``dot -T`` takes)."""
        require_dot()
        graphviz = _graphviz()
        try:
            return bytes(self.digraph.pipe(format=format))
        except graphviz.ExecutableNotFound as exc:
            raise RenderError(f"Graphviz's `dot` could not be run: {DOT_INSTALL}") from exc
        except graphviz.CalledProcessError as exc:
            detail = (exc.stderr or b"").decode(errors="replace").strip()
            raise RenderError(f"Graphviz's `dot` failed: {detail or exc}") from exc

    def svg(self) -> str:
        return self.render("svg").decode("utf-8")

    def save(self, path: str | os.PathLike[str], format: str | None = None) -> str:
        """Write the graph to ``path``, in ``format`` or the one its suffix names
        (``.dot`` / ``.gv``: the source, which needs no ``dot``). Returns the path."""
        path = os.fspath(path)
        fmt = (format or os.path.splitext(path)[1].lstrip(".") or "svg").lower()
        if fmt not in ("dot", "gv") and fmt not in _graphviz().FORMATS:
            raise ValueError(
                f"cannot write an op graph as '.{fmt}' ({path}): name the file .svg, .png, "
                ".pdf or .dot (or pass format=, one of Graphviz's output formats)"
            )
        data = self.source.encode() if fmt in ("dot", "gv") else self.render(fmt)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"image/svg+xml": self.svg(), "text/plain": repr(self)}

    def __repr__(self) -> str:
        return (
            f"<OpGraph: {self.ops} ops drawn as {self.nodes} nodes, {self.edges} edges, "
            f"modules expanded to depth {self.depth}>"
        )


def _values(
    view: TraceView, color: str | None, diff: Comparison | None, step: int
) -> tuple[str | None, dict[str, float]]:
    """(the coloured quantity, its value by op or module label)."""
    if diff is not None:
        metric = color or _DEFAULT_DIFF
        rows = diff.rows()
        if rows and metric not in rows[0]:
            _unknown("comparison column", metric, list(rows[0]))
        found: dict[str, float] = {}
        for row in rows:
            value, label = row.get(metric), row.get("label_a")
            if label is None or row.get("step_a") not in (None, step):
                continue
            if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
                found[label] = float(value)
        return metric, found
    if color is None:
        return None, {}
    if color not in STAT_FIELDS:
        _unknown("statistic", color, STAT_FIELDS)
    found = {}
    for op in view:
        stats = op.stats
        value = None if stats is None else getattr(stats, color)
        if value is not None and math.isfinite(value):
            found[op.label] = float(value)
    return color, found


def _unknown(what: str, name: str, known: Iterable[str]) -> None:
    known = list(known)
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"no {what} {name!r} to colour by{hint} (one of {', '.join(known)})")


def _check_collapse(collapse: set[str], modules: Iterable[Any]) -> None:
    """A ``ValueError`` for a name in ``collapse`` that is neither a module path nor a
    module call's label of the view (a typo would draw as if nothing were asked)."""
    known = {name for m in modules for name in (m.path, m.label)}
    for name in sorted(collapse - known):
        close = difflib.get_close_matches(name, sorted(known), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"no module {name!r} to collapse{hint}")


def _auto_depth(stacks: list[tuple[Call, ...]], max_nodes: int) -> int:
    """The deepest module depth whose graph has at most ``max_nodes`` nodes (0: every
    top-level module call collapsed, when even that has more)."""
    deepest = max((len(s) for s in stacks), default=0)
    for depth in range(deepest, 0, -1):
        groups = {s[: depth + 1] for s in stacks if len(s) > depth}
        if sum(len(s) <= depth for s in stacks) + len(groups) <= max_nodes:
            return depth
    return 0


def _collapsed_at(
    stack: tuple[Call, ...], depth: int, collapse: set[str], labels: dict[Call, str]
) -> int | None:
    """How many module calls of ``stack`` stay expanded around a collapsed node (None:
    the op is drawn itself)."""
    for k, call in enumerate(stack):
        if k >= depth or call[0] in collapse or labels.get(call) in collapse:
            return k
    return None


def build_graph(
    view: TraceView,
    *,
    depth: int | None = None,
    color: str | None = None,
    diff: Comparison | None = None,
    collapse: Iterable[str] = (),
    max_nodes: int = MAX_NODES,
    log: bool | None = None,
    rankdir: str = "TB",
) -> OpGraph:
    """The op graph of ``view`` (a trace or one step of a run); see the module's
    docstring for ``depth``, ``collapse``, ``color`` and ``diff``. ``log``: colour on a
    log scale (default: when the values are positive and span over three decades).
    ``rankdir``: Graphviz's direction (``"TB"`` top to bottom, ``"LR"``).

    ``diff``'s rows are matched to the view's ops by their ``label_a`` (and, for a step
    of a stored run, ``step_a``): draw side ``a`` of the comparison."""
    graphviz = _graphviz()
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise ValueError(f"depth is a module nesting depth, 0 or more, not {depth!r}")
    step = getattr(view, "step", 0)  # a stored run's step; an in-memory trace is one
    metric, values = _values(view, color, diff, step if isinstance(step, int) else 0)
    modules = {(m.path, m.pass_num): m for m in view.modules}
    labels = {call: m.label for call, m in modules.items()}
    ops = list(view)
    stacks = [tuple(op.modules) for op in ops]
    explicit = depth is not None
    if depth is None:
        depth = _auto_depth(stacks, max_nodes)
    collapse = set(collapse)
    _check_collapse(collapse, modules.values())
    nodes: dict[str, _Node] = {}
    node_of: list[str] = []
    names: dict[Call, str] = {}  # plain node names: dot reads "a:b" in an edge as a port
    for op, stack in zip(ops, stacks, strict=True):
        value = values.get(op.label)
        at = _collapsed_at(stack, depth, collapse, labels)
        if at is None:
            name = f"op{op.index}"
            shape = "x".join(map(str, op.shape)) or "scalar"
            nodes[name] = _Node(
                name,
                [op.label, f"{op.func} {shape}"],
                _op_tooltip(op),
                stack,
                kind=op.kind,
                values=[] if value is None else [value],
            )
        else:
            call = stack[at]
            name = names.setdefault(call, f"module{len(names)}")
            node = nodes.get(name)
            if node is None:
                module = modules.get(call)
                label = labels.get(call, call[0])
                node = nodes[name] = _Node(
                    name, [label], label, stack[:at], kind="module", ops=0, values=[]
                )
                node.lines.append(module.type if module is not None else "module")
                if label in values:  # a comparison of module calls
                    node.values.append(values[label])
            node.ops += 1
            if value is not None:
                node.values.append(value)
        node_of.append(name)
    if len(nodes) > max_nodes and not explicit:
        warnings.warn(
            f"the op graph has {len(nodes)} nodes even with every module call collapsed "
            f"(over max_nodes={max_nodes}): Graphviz may take long to draw it; collapse "
            "more with collapse=[...] or draw part of the model",
            TraceLakeWarning,
            stacklevel=3,
        )
    edges = _edges(ops, node_of)
    digraph = graphviz.Digraph(
        "ops",
        graph_attr={"rankdir": rankdir, "fontname": "Helvetica", "fontsize": "10"},
        node_attr={
            "fontname": "Helvetica",
            "fontsize": "9",
            "shape": "box",
            "style": "rounded,filled",
        },
        edge_attr={"arrowsize": "0.5", "color": "#555555"},
    )
    scale = _Scale([v for n in nodes.values() for v in n.values], log)
    _draw(digraph, graphviz, nodes, modules, scale)
    for a, b in edges:
        digraph.edge(a, b)
    if metric is not None:
        digraph.attr(label=graphviz.escape(scale.legend(metric)), labelloc="b")
    return OpGraph(digraph, len(nodes), len(edges), len(ops), depth)


def _edges(ops: list[Any], node_of: list[str]) -> list[tuple[str, str]]:
    """Edges between drawn nodes, each once (none inside a collapsed node)."""
    seen: dict[tuple[str, str], None] = {}
    for op in ops:
        target = node_of[op.index]
        for parent in op.field("parents"):
            source = node_of[parent]
            if source != target:
                seen[source, target] = None
    return list(seen)


def _op_tooltip(op: Any) -> str:
    lines = [f"{op.label} ({op.func})", f"shape {list(op.shape)} {op.dtype}"]
    if op.module:
        lines.append(f"in {op.module}")
    if op.source is not None:
        lines.append(f"at {op.source}")
    stats = op.stats
    if stats is not None:
        lines.append(
            ", ".join(
                f"{name} {getattr(stats, name):.4g}"
                for name in ("mean", "std", "absmax")
                if getattr(stats, name) is not None
            )
        )
    return "\n".join(lines)


class _Scale:
    """Values to fill colours, linear or logarithmic over their range."""

    def __init__(self, values: list[float], log: bool | None):
        self.lo = min(values, default=0.0)
        self.hi = max(values, default=0.0)
        if log is None:
            positive = [v for v in values if v > 0]
            log = bool(positive) and self.lo >= 0 and self.hi / min(positive) > 1e3
        self.log = log
        if log:
            self.lo = min((v for v in values if v > 0), default=1.0)

    def _position(self, value: float) -> float:
        if self.log:
            if value <= 0 or self.hi <= self.lo:
                return 0.0 if value <= 0 else 1.0
            return (math.log(value) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
        return 0.5 if self.hi == self.lo else (value - self.lo) / (self.hi - self.lo)

    def color(self, values: list[float]) -> tuple[str, str]:
        """(fill, font colour) of a node with these values (the largest counts)."""
        if not values:
            return _NO_VALUE, "black"
        t = min(1.0, max(0.0, self._position(max(values))))
        k = min(len(_RAMP) - 1, int(t * len(_RAMP)))
        return _RAMP[k], "white" if k >= 5 else "black"

    def legend(self, metric: str) -> str:
        how = ", log scale" if self.log else ""
        return (
            f"colour: {metric}, from {self.lo:.3g} (pale) to {self.hi:.3g} (dark red){how}; "
            "grey: no value"
        )


def _node_text(graphviz: Any, lines: list[str]) -> str:
    return "\\n".join(graphviz.escape(line) for line in lines)


def _draw(
    digraph: Any, graphviz: Any, nodes: dict[str, _Node], modules: dict[Call, Any], scale: _Scale
) -> None:
    """Nodes into nested clusters, one per expanded module call."""
    members: dict[tuple[Call, ...], list[_Node]] = {}
    children: dict[tuple[Call, ...], list[tuple[Call, ...]]] = {}
    for node in nodes.values():
        members.setdefault(node.cluster, []).append(node)
        for k in range(len(node.cluster), 0, -1):  # every enclosing cluster, once
            parent, child = node.cluster[: k - 1], node.cluster[:k]
            siblings = children.setdefault(parent, [])
            if child in siblings:
                break
            siblings.append(child)

    clusters: dict[tuple[Call, ...], str] = {}

    def fill(graph: Any, prefix: tuple[Call, ...]) -> None:
        for node in members.get(prefix, ()):
            fill_color, font = scale.color(node.values)
            attrs = {"tooltip": graphviz.escape(node.tooltip), "fontcolor": font}
            if node.kind == "module":
                node.lines.append(f"{node.ops} ops")
                attrs |= {"shape": "box3d", "style": "filled"}
            elif node.kind in ("input", "output"):
                attrs["shape"] = "oval"
            if node.values:
                node.lines.append(f"{max(node.values):.3g}")
            elif node.kind in ("input", "output"):
                fill_color = _IO_FILL
            attrs["fillcolor"] = fill_color
            graph.node(node.name, _node_text(graphviz, node.lines), **attrs)
        for child in children.get(prefix, ()):
            call = child[-1]
            module = modules.get(call)
            title = module.label if module is not None else call[0]
            kind = module.type if module is not None else ""
            name = clusters.setdefault(child, f"cluster{len(clusters)}")
            with graph.subgraph(name=name) as sub:
                sub.attr(
                    label=_node_text(graphviz, [f"{title}: {kind}" if kind else title]),
                    style="rounded",
                    color="#888888",
                    fontsize="9",
                    tooltip=graphviz.escape(title),
                )
                fill(sub, child)

    fill(digraph, ())
