"""The op record is declared once (recorder/record.py) and everything else follows it:
the row layout, the C header, the catalog's DDL and Arrow schemas, inserts by name, the
query whitelist. The strongest check is the one a maintainer meets: add a field to the
declaration, and see it flow from the recorder to a query."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
import torch
from torch import nn

import tracelake as tl
from tracelake.query import schema as query_schema
from tracelake.recorder import compiled, record
from tracelake.store import schema

REPO = Path(tl.__file__).resolve().parent.parent
FORMAT1 = Path(__file__).parent / "data" / "format1" / "store.tar.gz"


def test_the_c_header_is_generated_from_the_declaration() -> None:
    header = (REPO / "recorder" / "_record.h").read_text()
    assert header == record.c_header(), "run `python recorder/record.py` and reinstall"
    assert not compiled.STALE, "the extension was built for another row layout: reinstall"


def test_rows_are_built_by_name_with_defaults() -> None:
    values = {name: f"<{name}>" for name in record.ROW_FIELDS}
    row = record.make_row(**{record.row_param(n): v for n, v in values.items()})
    assert row == tuple(values[name] for name in record.ROW_FIELDS)
    for name in record.ROW_FIELDS:
        assert row[record.position(name)] == values[name]
    with pytest.raises(TypeError):
        record.make_row(func="relu")  # every field without a default is required


def test_stats_are_the_statistics_columns() -> None:
    fields = [f.name for f in record.OPS.fields if f.stat]
    assert fields == list(record.STAT_FIELDS) == list(record.Stats.__slots__)
    ops = query_schema.COLUMNS["ops"]
    assert all(ops[name] == "number" for name in fields)


def test_a_new_catalog_has_exactly_the_declared_columns(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s.tl")
    store.record(nn.Linear(2, 2), torch.ones(1, 2), name="a")
    store.flush()  # (the fold that inserts its rows makes the catalog file)
    con = duckdb.connect(str(tmp_path / "s.tl" / "catalog.duckdb"), read_only=True)
    for table in schema.TABLES.values():
        got = con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ? "
            "ORDER BY column_index",
            [table.name],
        ).fetchall()
        want = [(f.name, f.type.duckdb.replace('"', "")) for f in table.columns if f.type]
        assert [name for name, _ in got] == [name for name, _ in want]
        for (_, got_type), (name, want_type) in zip(got, want, strict=True):
            assert got_type.replace('"', "") == want_type, name
    con.close()


def test_inserts_go_by_name_not_position() -> None:
    con = duckdb.connect(":memory:")
    schema.create_schema(con)
    # Two columns of one type, given in the other order: each lands in its own column.
    rows = pa.table({"edge": [7], "child": [2], "parent": [1], "run_id": [1], "step": [0]})
    schema.insert(con, "edges", rows)
    assert con.execute("SELECT parent, child, edge, arg FROM edges").fetchall() == [(1, 2, 7, None)]
    with pytest.raises(duckdb.Error):  # a column the table does not have
        schema.insert(con, "edges", pa.table({"run_id": [1], "nonsense": [1]}))


def _package_copy(root: Path) -> Path:
    """The installed package's files laid out as ``tracelake/`` (rooms inside, as the
    install maps them), built extension included."""
    site = root / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.tl")
    shutil.copytree(REPO / "tracelake", site / "tracelake", ignore=ignore)
    for room in ("recorder", "store", "query"):
        shutil.copytree(REPO / room, site / "tracelake" / room, ignore=ignore)
    return site


#: The one-line additions: a field the recorder keeps (with a default, so no producer
#: needs to change) and one the store derives (produced in the script below).
_NEW_FIELDS = (
    '        Field("phase", STR, "forward or backward", row=True, default="forward", '
    "has_default=True),\n"
    '        Field("depth", I32, "how many module calls the op sits in"),\n'
)

_SCRIPT = """
import json, sys, tarfile
sys.path.insert(0, {site!r})
import torch
from torch import nn
import tracelake as tl
from tracelake.recorder import compiled, record
from tracelake.store import rows
assert tl.__file__.startswith({site!r}), tl.__file__
rows.PRODUCERS["depth"] = lambda ops: [len(stack) for stack in ops.column("modules")]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
x = torch.randn(3, 4)
log = tl.trace(model, x)
phases = sorted({{op.field("phase") for op in log}})
store = tl.open({store!r})
store.record(model, x, name="a")
res = store.query("select label, phase, depth from ops where phase = 'forward' order by idx")
with tarfile.open({format1!r}) as tar:
    tar.extractall({old!r}, filter="data")
old = tl.open({old!r} + "/store.tl", create=False)
before = old.query("select count(*) as n from ops where phase = 'forward'").df()["n"][0]
old.record(model, x, name="new")
after = old.query("select run, count(*) as n from ops where phase = 'forward' group by run")
print(json.dumps({{
    "stale": compiled.STALE, "phases": phases, "rows": res.df().values.tolist(),
    "old_rows": int(before), "after": sorted(map(list, after.df().values.tolist())),
}}))
"""


def test_a_field_added_to_the_declaration_flows_to_queries(tmp_path: Path) -> None:
    site = _package_copy(tmp_path)
    declaration = site / "tracelake" / "recorder" / "record.py"
    text = declaration.read_text()
    anchor = '        Field("kind", STR,'
    at = text.index(anchor)
    declaration.write_text(text[:at] + _NEW_FIELDS + text[at:])
    script = _SCRIPT.format(
        site=str(site),
        store=str(tmp_path / "s.tl"),
        format1=str(FORMAT1),
        old=str(tmp_path / "old"),
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The extension was built for the old row layout: it steps aside rather than build
    # rows of the wrong shape (reinstalling regenerates and rebuilds it).
    assert result["stale"] is True
    assert "built for another op record" in out.stderr  # and says so, once
    assert result["phases"] == ["forward"]
    assert result["rows"] == [
        ["input_1", "forward", 0],
        ["linear_1_1", "forward", 1],
        ["relu_1_2", "forward", 2],
        ["linear_2_3", "forward", 2],
        ["output_1", "forward", 0],
    ]
    # A store written before the field existed reads it as its default, and takes new
    # runs that have it.
    assert result["old_rows"] > 0
    runs = dict((name, n) for name, n in result["after"])
    assert runs["new"] == 5 and sum(runs.values()) == result["old_rows"] + 5


def test_the_query_docs_list_the_declared_columns() -> None:
    """docs/query.md's table of columns is the declarations', in their order."""
    text = (REPO / "docs" / "query.md").read_text()
    for table in ("ops", "runs", "modules", "edges", "grads", "rules", "calls"):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{table}` |"))
        listed = row.rsplit("|", 2)[-2].strip().strip("`").split()
        declared = [f.name for f in schema.TABLES[table].columns if f.query]
        assert listed == declared, f"docs/query.md's {table} columns differ from the declaration"
