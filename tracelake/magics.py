"""IPython / Jupyter magics: ``%load_ext tracelake``, then

    lbl = "linear_4_12"
    r = %tlq select run, label, absmax from ops where label = :lbl

    %%tlq runs.tl -o r
    select run, out[0, -1, :] from ops
    where absmax > :limit

A query runs against the store named before it (a path, opened with ``create=False``
so that a mistyped path says no store is there, or the name of a notebook variable
holding a :class:`~tracelake.Store`), else the store ``tl.open`` opened last in this
process. ``:name`` parameters are bound from the notebook's variables. The magic returns
the :class:`~tracelake.query.results.Result` (``r = %tlq ...``; a cell displays it as a
table); ``-o NAME`` also stores it in the variable ``NAME``. Errors are raised, so the
cell fails with the query's caret message.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any

from tracelake.errors import QueryError, StoreError, TraceLakeError

__all__ = ["load_ipython_extension", "parameters", "run_magic"]

_USAGE = "%tlq [STORE] [-o NAME] select ...  /  %%tlq [STORE] [-o NAME] + a query cell"


def parameters(text: str) -> list[str]:
    """The names of the ``:name`` parameters a query uses, in no set order."""
    from tracelake.query import ast, parse
    from tracelake.query.operands import walk

    return sorted({n.name for n in walk(parse(text)) if isinstance(n, ast.Param)})


def _options(line: str, cell: str | None) -> tuple[str | None, str | None, str]:
    """(store, output variable, query text) from a magic's line and cell: a line
    magic's query begins at its first ``select``."""
    if cell is None:
        begins = re.search(r"(?i)(?:^|\s)(select\b)", line)
        head, text = (line[: begins.start(1)], line[begins.start(1) :]) if begins else (line, "")
    else:
        head, text = line, cell
    try:
        words = iter(shlex.split(head))
    except ValueError as exc:  # an unclosed quote
        raise QueryError(f"cannot read the magic's options ({exc}): {_USAGE}") from None
    stores: list[str] = []
    output = None
    for word in words:
        if word == "-o":
            output = next(words, None)
            if output is None or not output.isidentifier():
                raise QueryError(f"-o takes a variable name: {_USAGE}")
        else:
            stores.append(word)
    if len(stores) > 1:
        raise QueryError(f"name one store before the query, not {stores}: {_USAGE}")
    return (stores[0] if stores else None), output, text


def _store(name: str | None, namespace: dict[str, Any]) -> Any:
    """The store a magic names: a notebook variable holding a Store, or a path."""
    from tracelake.store import Store, last_opened

    if name is None:
        return last_opened()
    held = namespace.get(name) if name.isidentifier() else None
    if isinstance(held, Store):
        return held
    if held is not None and not os.path.exists(os.path.expanduser(name)):
        raise StoreError(f"{name!r} is a {type(held).__name__}, not a tracelake Store")
    return Store(os.path.expanduser(name), create=False)


def run_magic(line: str, cell: str | None, namespace: dict[str, Any]) -> Any:
    """What ``%tlq`` / ``%%tlq`` do, given the notebook's variables: the Result."""
    store_name, output, text = _options(line, cell)
    if not text.strip():
        raise QueryError(f"no query given: {_USAGE}")
    store = _store(store_name, namespace)
    missing = [name for name in parameters(text) if name not in namespace]
    if missing:
        raise QueryError(
            f"the query's parameter{'s' if len(missing) > 1 else ''} "
            f"{', '.join(':' + m for m in missing)} name no notebook variable: assign "
            f"{missing[0]} = ... first"
        )
    from tracelake.query.results import run_query  # (a variable may be named `progress`)

    result = run_query(store, text, {name: namespace[name] for name in parameters(text)})
    if output is not None:
        namespace[output] = result
    return result


def _magics_class() -> type:
    from IPython.core.magic import Magics, line_cell_magic, magics_class

    @magics_class
    class TraceLakeMagics(Magics):
        """``%tlq`` and ``%%tlq`` (see :mod:`tracelake.magics`)."""

        @line_cell_magic
        def tlq(self, line: str, cell: str | None = None) -> Any:
            """Query a tracelake store: ``%tlq [STORE] [-o NAME] select ...``, or a
            ``%%tlq [STORE] [-o NAME]`` cell; ``:name`` binds the variable ``name``."""
            try:
                shell: Any = self.shell
                return run_magic(line, cell, shell.user_ns)
            except TraceLakeError as exc:  # the cell fails on the message, not our frames
                raise exc.with_traceback(None)  # noqa: B904 (re-raised as it is)

    return TraceLakeMagics


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%tlq`` / ``%%tlq`` (``%load_ext tracelake`` calls it)."""
    ipython.register_magics(_magics_class())
