"""A sealed run's rows: everything its catalog transaction would insert, in one file.

``Store.record`` returns once its run is *sealed* (``CatalogWriter.seal``): the run's
files and this file durable, its directory renamed to ``runs/<id>``, this file moved to
``runs/.sealed/<id>``. Its rows reach ``catalog.duckdb`` in the next catalog transaction
of any writer (the writer folds every :data:`~tracelake.store.catalog.FOLD_AFTER` runs,
and when its store closes or its process exits), or of any reader (a reader whose
catalog changed folds before it reads): so the run is seen by every query from its
return on, and a crash after the return loses nothing. One DuckDB transaction then
inserts many runs' rows, where each run took one of its own (~10 ms on a tiny run).

The file: a first line naming the format, a line of JSON (the run's ``runs`` values and
each table's byte length, in order), then each table's rows as an Arrow IPC stream, one
after another. No pickle; every value is read back as typed data.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tracelake.errors import StoreError

from .layout import write_new

#: The file's first line, with its format number (a newer one is refused).
MAGIC = b"tracelake-sealed-run"
FORMAT = 1
#: The values of a sealed run's ``runs`` row it keeps, besides its tables.
HEADER_KEYS = ("name", "overwrite", "created", "finished", "info", "summary", "host", "pid")


def write_sealed(path: Path, header: dict[str, Any], tables: dict[str, Any]) -> None:
    """Write a run's rows to the new file ``path`` (not synced: the caller makes it
    durable with the run's other files). ``header``: the :data:`HEADER_KEYS` (JSON
    values); ``tables``: its catalog tables by name (Arrow tables; None or empty ones
    are left out)."""
    import pyarrow as pa

    parts: list[bytes] = []
    lengths: list[tuple[str, int]] = []
    for name, table in tables.items():
        if table is None or not table.num_rows:
            continue
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue().to_pybytes()
        parts.append(data)
        lengths.append((name, len(data)))
    about = {key: header[key] for key in HEADER_KEYS}
    about["tables"] = lengths
    head = MAGIC + b" %d\n" % FORMAT + json.dumps(about).encode() + b"\n"
    write_new(path, head + b"".join(parts))


def read_sealed(path: Path, tables: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sealed run's header and (``tables``) its tables by name. ``StoreError`` naming
    the file if it is not one this code wrote, or is cut short."""
    try:
        with open(path, "rb", buffering=0) as file:
            data = file.read() if tables else file.read(1 << 16)
            if data.count(b"\n") < 2:  # (a header past 64 KiB: a large meta)
                data += file.read()
    except OSError as exc:
        raise StoreError(f"cannot read the sealed run {str(path)!r}: {exc}") from exc
    first, _, rest = data.partition(b"\n")
    line, _, body = rest.partition(b"\n")
    magic, _, version = first.partition(b" ")
    try:
        about = json.loads(line)
        if magic != MAGIC or int(version) > FORMAT or not isinstance(about, dict):
            raise ValueError("not a sealed run of a format this tracelake reads")
        missing = [key for key in (*HEADER_KEYS, "tables") if key not in about]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)}")
    except ValueError as exc:
        raise StoreError(f"the sealed run {str(path)!r} is unreadable: {exc}") from exc
    if not tables:
        return about, {}
    import pyarrow as pa

    out: dict[str, Any] = {}
    at = 0
    try:
        for name, length in about["tables"]:
            chunk = body[at : at + length]
            if len(chunk) != length:
                raise ValueError(f"its table {name!r} is cut short")
            out[name] = pa.ipc.open_stream(pa.py_buffer(chunk)).read_all()
            at += length
    except (ValueError, TypeError, pa.ArrowException) as exc:
        raise StoreError(f"the sealed run {str(path)!r} is unreadable: {exc}") from exc
    return about, out


def remove_sealed(path: Path) -> None:
    """Remove a folded run's rows (already gone: a fold killed after it removed them)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
