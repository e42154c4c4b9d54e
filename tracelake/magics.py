"""IPython / Jupyter magics: ``%load_ext tracelake``, then

    %tlq select run, label, absmax from ops where absmax > 100
    %%tlq runs.tl
    select run, out[0, -1, :] from ops
    where label = 'linear_4_12'

run a query against the last store opened with ``tl.open`` in this process, or the store
named before the query (``%tlq STORE select ...``; a cell's first line). The result is
returned (and so displayed, as an HTML table); query errors print the caret message.
"""

from __future__ import annotations

import os
from typing import Any

from tracelake.errors import QueryError, StoreError

__all__ = ["load_ipython_extension"]


def _split(line: str, cell: str | None) -> tuple[str | None, str]:
    """(store path or None, query text) from a magic's line and cell."""
    line = line.strip()
    if cell is not None:
        return (line or None), cell
    first, _, rest = line.partition(" ")
    if first.lower() != "select" and rest and os.path.isdir(os.path.expanduser(first)):
        return first, rest
    return None, line


def tlq(line: str, cell: str | None = None) -> Any:
    from tracelake.store import Store, last_opened

    path, text = _split(line, cell)
    try:
        store = Store(path, create=False) if path else last_opened()
        return store.query(text)
    except (QueryError, StoreError) as exc:
        print(exc)
        return None


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magic_function(tlq, magic_kind="line_cell", magic_name="tlq")
