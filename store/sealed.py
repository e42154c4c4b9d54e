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
each table's byte length, in order), then each table's rows as an Arrow IPC stream (a large
one's buffers LZ4-compressed: ``SEALED_CODEC``), one after another. No pickle; every value is
read back as typed data.
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
#: The codec of a sealed run's Arrow streams (read back by any Arrow reader, whatever
#: it is): the rows of a 1,000-op chain's 20 steps, 8.3 MB, took 23 ms to serialize and
#: write into the page cache (the machine's fresh pages: ~370 MB/s), and ~5 ms as 1.7 MB
#: of LZ4 (zstd: 1.0 MB, 6.8 ms); decompressing them at the fold costs ~3 ms.
SEALED_CODEC = "lz4"
#: Tables of at least this many bytes are compressed: compressing costs ~30-60 us a
#: buffer whatever its size (a tiny run's rows took 1.0-1.5 ms more, a GPT-2 run's 300
#: KB 1.5 ms more than writing them as they are).
COMPRESS_FROM = 1 << 20
#: The values of a sealed run's ``runs`` row it keeps, besides its tables.
HEADER_KEYS = ("name", "overwrite", "created", "finished", "info", "summary", "host", "pid")


def write_sealed(path: Path, header: dict[str, Any], tables: dict[str, Any]) -> None:
    """Write a run's rows to the new file ``path`` (not synced: the caller makes it
    durable with the run's other files). ``header``: the :data:`HEADER_KEYS` (JSON
    values); ``tables``: its catalog tables by name (Arrow tables; None or empty ones
    are left out)."""
    import pyarrow as pa

    plain, packed = pa.ipc.IpcWriteOptions(), pa.ipc.IpcWriteOptions(compression=_codec())
    parts: list[Any] = []
    lengths: list[tuple[str, int]] = []
    for name, table in tables.items():
        if table is None or not table.num_rows:
            continue
        large = table.get_total_buffer_size() >= COMPRESS_FROM
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema, options=packed if large else plain) as writer:
            writer.write_table(table)
        data = sink.getvalue()
        parts.append(data)
        lengths.append((name, data.size))
    about = {key: header[key] for key in HEADER_KEYS}
    about["tables"] = lengths
    head = MAGIC + b" %d\n" % FORMAT + json.dumps(about).encode() + b"\n"
    write_new(path, [head, *parts])  # (the streams' buffers as they are: no copy)


def _codec() -> str | None:
    """:data:`SEALED_CODEC` where this pyarrow has it, else none."""
    import pyarrow as pa

    return SEALED_CODEC if pa.Codec.is_available(SEALED_CODEC) else None


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
