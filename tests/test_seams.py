"""The rooms talk through public names, and data flows recorder → store → query.

Parses the source (nothing is imported) and fails on:

- ``from tracelake.<room>... import _x`` of another room's private name;
- ``obj._x``: an underscore attribute that no module of the reading room defines and
  another room does (defined: a ``def``/``class``, an assignment to ``self._x`` or
  ``cls._x``, a class or module level assignment, a ``__slots__`` entry);
- a module-level import going backwards (the recorder importing the store or the query
  room, the store importing the query room), or a room importing the facade package
  (``tracelake.errors`` is shared by all and imports nothing of tracelake) other than
  by a documented lazy edge;
- a lazy (function-level) import going backwards that is not one of ``LAZY_BACK_EDGES``,
  each documented in ``docs/architecture.md`` with its reason;
- DuckDB imported anywhere but its error boundary (``store/boundary.py``) and the
  catalog behind it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The rooms in the order data flows; the facade (tracelake/) sits on top of them all.
ROOMS = ("recorder", "store", "query", "tracelake")
ORDER = {"recorder": 0, "store": 1, "query": 2, "tracelake": 3}
#: Every room may import these; they import no room (the errors; progress bars; the lazy
#: package exports that keep catalog-only work free of torch).
SHARED = {"tracelake.errors", "tracelake.progress", "tracelake._lazy"}

#: Underscore names that are public API of the standard library (namedtuple's).
PUBLIC_UNDERSCORED = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}
#: torch.nn.Module's own attributes that the recorder reads (a module's parameters and
#: buffers, as named_parameters() walks them): torch's, whatever a room names its own.
TORCH_UNDERSCORED = {"_parameters", "_buffers"}

#: The modules that may import DuckDB: its boundary and the catalog behind it.
# (store/lake.py: the DuckLake catalog, the same job as catalog.py for a shared store)
DUCKDB_MODULES = {"store/boundary.py", "store/catalog.py", "store/lake.py"}

#: Deliberate lazy imports against the flow: (importing file, imported module).
LAZY_BACK_EDGES = {
    # Store.query / Store.sql hand the text to the query room, imported when called so
    # that the store never loads the query room (Lark, the compiler) at import.
    ("store/store.py", "tracelake.query.results"),
    # Pictures: traces, runs, results and comparisons draw and display themselves
    # (``graph()``, ``plot()``, ``_repr_html_``), the drawing code living in the facade
    # (Graphviz, matplotlib and HTML are no room's business), imported when called.
    ("recorder/trace.py", "tracelake.graph"),
    ("recorder/trace.py", "tracelake.reprs"),
    ("store/run.py", "tracelake.reprs"),
    ("store/store.py", "tracelake.reprs"),
    ("store/compare.py", "tracelake.reprs"),
    ("store/compare.py", "tracelake.plots"),
    ("query/results.py", "tracelake.reprs"),
    ("query/results.py", "tracelake.plots"),
}

#: Known findings that a change in progress removes, each with the change named.
ALLOWED: set[tuple[str, str]] = set()


def _files(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_room(module: str) -> str | None:
    """The room of an absolute module name (``tracelake.store.run`` → store)."""
    parts = module.split(".")
    if parts[0] != "tracelake":
        return None
    if len(parts) > 1 and parts[1] in ("recorder", "store", "query"):
        return parts[1]
    return "tracelake"


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from ... import``."""
    if not node.level:
        return node.module or ""
    room = _rel(path).split("/")[0]
    package = ["tracelake"] if room == "tracelake" else ["tracelake", room]
    package += list(path.relative_to(ROOT / room).parent.parts)
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """The underscore names a module defines (functions, classes, attributes)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)
            and isinstance(node.value, (ast.Tuple, ast.List))
        ):
            names.update(
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            )
    return {n for n in names if _private(n)}


def _trees() -> dict[str, tuple[Path, ast.Module]]:
    return {
        _rel(path): (path, ast.parse(path.read_text(), str(path)))
        for room in ROOMS
        for path in _files(room)
    }


TREES = _trees()
DEFINED = {room: set[str]() for room in ROOMS}
for rel, (_path, tree) in TREES.items():
    DEFINED[rel.split("/")[0]] |= _defined(tree)


def _imports(path: Path, tree: ast.Module) -> Iterator[tuple[ast.AST, str, list[str], bool]]:
    """(node, module, names imported from it, whether at module level) of each import;
    imports under ``if TYPE_CHECKING:`` are for the type checker and left out."""
    lazy: set[int] = set()
    checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            yield node, module, [a.name for a in node.names], id(node) not in lazy
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, [], id(node) not in lazy


def findings() -> set[tuple[str, str]]:
    """Every breach of a seam: (file, what)."""
    found: set[tuple[str, str]] = set()
    for rel, (path, tree) in TREES.items():
        room = rel.split("/")[0]
        for node, module, names, top in _imports(path, tree):
            target = _module_room(module)
            if module.split(".")[0] == "duckdb" and rel not in DUCKDB_MODULES:
                found.add((rel, f"imports duckdb (line {node.lineno})"))
            if target is None or target == room:
                continue
            for name in names:
                if _private(name):
                    found.add((rel, f"imports {module}.{name}"))
            if any(_private(part) for part in module.split(".")):
                found.add((rel, f"imports private module {module}"))
            shared = module in SHARED or any(f"{module}.{n}" in SHARED for n in names)
            if shared:
                continue
            if target == "tracelake" and room != "tracelake":
                if top or (rel, module) not in LAZY_BACK_EDGES:
                    found.add((rel, f"imports the facade package ({module})"))
            elif ORDER[target] > ORDER[room]:
                if top:
                    found.add((rel, f"imports {module} at module level (against the flow)"))
                elif (rel, module) not in LAZY_BACK_EDGES:
                    found.add((rel, f"imports {module} lazily (an undocumented back-edge)"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and node.attr not in PUBLIC_UNDERSCORED
                and not (room == "recorder" and node.attr in TORCH_UNDERSCORED)
                and node.attr not in DEFINED[room]
                and any(node.attr in DEFINED[r] for r in ROOMS if r != room)
            ):
                found.add((rel, f"reads {ast.unparse(node.value)}.{node.attr}"))
    return found


def test_no_room_uses_another_rooms_private_names() -> None:
    found = findings()
    unexpected = sorted(found - ALLOWED)
    assert not unexpected, "\n".join(f"{f}: {what}" for f, what in unexpected)


def test_the_allow_list_is_not_stale() -> None:
    stale = sorted(ALLOWED - findings())
    assert not stale, f"fixed, so remove from ALLOWED: {stale}"


def test_lazy_back_edges_are_all_still_there() -> None:
    """A documented back-edge that no longer exists is removed from the list (and docs)."""
    present = {
        (rel, module)
        for rel, (path, tree) in TREES.items()
        for _node, module, _names, top in _imports(path, tree)
        if not top
    }
    assert present >= LAZY_BACK_EDGES


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from tracelake.recorder.capture import _check_model\n", "imports"),
        ("def f(store):\n    return store._catalog_mirror\n", "reads"),
        ("from tracelake.query.results import run_query\n", "at module level"),
        ("def f():\n    from tracelake.query.parser import parse\n", "lazily"),
        ("import duckdb\n", "imports duckdb"),
    ],
)
def test_the_checker_catches(source: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule fires on a planted breach in a store module."""
    path = ROOT / "store" / "_planted.py"
    tree = ast.parse(source)
    monkeypatch.setitem(TREES, "store/_planted.py", (path, tree))
    monkeypatch.setitem(DEFINED, "query", DEFINED["query"] | {"_catalog_mirror"})
    monkeypatch.setitem(DEFINED, "recorder", DEFINED["recorder"] | {"_check_model"})
    planted = {what for rel, what in findings() if rel == "store/_planted.py"}
    assert any(expected in what for what in planted), planted


@pytest.mark.parametrize("shared", sorted(SHARED))
def test_the_shared_modules_import_no_room(shared: str) -> None:
    """The shared modules are imported by every room, so they may import none of them."""
    path, tree = TREES[shared.replace(".", "/") + ".py"]
    imported = {module for _node, module, _names, _top in _imports(path, tree)}
    assert not {m for m in imported if m.split(".")[0] == "tracelake"}, imported
