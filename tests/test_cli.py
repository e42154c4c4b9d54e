"""The command line as a user drives it: real `tracelake` processes, their exit codes and
outputs; catalog-only commands without torch; exports that give back every value exactly."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from model_zoo import mlp
from torch import nn

import tracelake as tl

TRACELAKE = str(Path(sys.executable).parent / "tracelake")


class Wide(nn.Module):
    """A float32 (64, 256) activation (64 KiB), NaN and infinities in a bfloat16 one."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        z = y.to(torch.bfloat16) / torch.tensor(0.0, dtype=torch.bfloat16)  # inf, -inf, nan
        return torch.relu(y) + z.float().nan_to_num(0.0)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "runs.tl"
    store = tl.open(root)
    model, (x,) = mlp()
    torch.manual_seed(1)
    with torch.no_grad():
        store.record(model, x, name="base", meta={"lr": 0.1, "variant": "a"})
        store.record(model, x * 2, name="ft", meta={"lr": 0.01, "variant": "b"})
        store.record(Wide().eval(), torch.randn(64, 32), name="wide")
        with pytest.raises(ValueError), store.recording("broken", model):
            model(x)
            raise ValueError("boom: the data loader failed")
    return root


def run(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> Any:
    return subprocess.run(
        [TRACELAKE, *args],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
        timeout=300,
    )


_NO_TORCH = """
import sys
from tracelake.cli import main
for argv in {commands!r}:
    try:
        main(argv)
    except SystemExit:
        pass
    assert "torch" not in sys.modules, (argv, "imported torch")
print("no torch", sorted(m for m in ("pandas", "zarr", "lark") if m in sys.modules))
"""


def test_catalog_commands_never_import_torch(store_path: Path, tmp_path: Path) -> None:
    store = str(store_path)
    commands = [
        ["--help"],
        ["--version"],
        ["runs", store],
        ["runs", store, "--all", "--json"],
        ["show", store, "base"],
        ["show", store, "ft", "--json"],
        ["query", store, "select run, label, absmax from ops where func = 'relu'"],
        ["query", store, "select name, meta.lr from runs", "--format", "json"],
        ["verify", store, "--catalog"],
        ["runs", "--help"],
    ]
    code = _NO_TORCH.format(commands=commands)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "no torch" in done.stdout
    # rm and gc too, on a copy (they delete)
    doomed = tmp_path / "copy.tl"
    subprocess.run(["cp", "-r", store, str(doomed)], check=True)
    changes = [["rm", str(doomed), "ft"], ["gc", str(doomed)], ["runs", str(doomed)]]
    code = _NO_TORCH.format(commands=changes)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "no torch" in done.stdout, done.stderr
    assert [r["name"] for r in tl.open(doomed, create=False).run_rows(all=True)] == [
        "base",
        "wide",
    ]


def _imports_none_of(modules: tuple[str, ...], commands: list[list[str]]) -> str:
    """Run ``commands`` one after another in a new process; assert that none of
    ``modules`` was imported; return what they printed."""
    code = (
        "import sys\n"
        "from tracelake.cli import main\n"
        f"for argv in {commands!r}:\n"
        "    main(argv)\n"
        f"print('imported', sorted(m for m in {modules!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "imported []", done.stdout[-500:]
    return done.stdout


def test_listing_runs_imports_only_duckdb_and_rich(store_path: Path) -> None:
    """``tracelake runs`` (the startup benchmark's command) reads the catalog with DuckDB
    and prints with rich: no torch, pandas, pyarrow, numpy or zarr is imported (each
    costs startup time: ``benchmarks/cli_startup.py``)."""
    # (the fixture's runs are sealed until someone folds them into the catalog, which
    # builds Arrow tables: the first reader does, here, and not the listing measured)
    assert run("runs", str(store_path)).returncode == 0
    commands = [["runs", str(store_path)], ["runs", str(store_path), "--json"]]
    out = _imports_none_of(("torch", "pandas", "pyarrow", "numpy", "zarr"), commands)
    assert "base" in out and '"name": "base"' in out


def test_reading_the_catalog_does_not_import_pandas(tmp_path: Path) -> None:
    """A reader's mirror makes its connection ready for rows without pandas (pyarrow's
    ``Schema.empty_table()`` imports it: ~0.25 s of `tracelake verify --catalog`'s
    ~0.7 s, and of a query command's start, in a process with no other use for it), and
    folds the runs its writer left sealed without it (``store/arrow.py``: ``pa.array``
    imports pandas)."""
    store = tl.open(tmp_path / "s.tl")
    model, (x,) = mlp()
    with torch.no_grad():
        store.record(model, x, name="base")
        store.record(model, x + 1, name="other")
    assert store._catalog.sealed_waiting == 2  # (the verify below folds them)
    commands = [
        ["verify", str(tmp_path / "s.tl"), "--catalog"],
        ["query", str(tmp_path / "s.tl"), "select run, label from ops where func = 'relu'"],
    ]
    out = _imports_none_of(("torch", "pandas"), commands)
    assert "checked against the catalog: ok" in out and "relu" in out and "other" in out
    assert not store._catalog.paths.sealed_ids()  # (folded by the verify)
    store.close()


def test_runs_lists_sizes_for_people_and_failures_with_their_reason(store_path: Path) -> None:
    done = run("runs", str(store_path))
    assert done.returncode == 0, done.stderr
    assert "base" in done.stdout and "KiB" in done.stdout and "broken" not in done.stdout
    every = run("runs", str(store_path), "--all")
    assert "broken" in every.stdout and "failed" in every.stdout
    assert "ValueError: boom" in every.stdout  # (folded onto more lines where narrow)
    rows = json.loads(run("runs", str(store_path), "--all", "--json").stdout)
    broken = next(r for r in rows if r["name"] == "broken")
    assert broken["error"] == "ValueError: boom: the data loader failed"
    assert isinstance(next(r for r in rows if r["name"] == "base")["bytes"], int)


def test_a_default_store_from_the_environment(store_path: Path, tmp_path: Path) -> None:
    env = {"TRACELAKE_STORE": str(store_path)}
    assert "base" in run("runs", env=env).stdout
    shown = run("show", "base", "--step", "0", env=env)
    assert shown.returncode == 0 and "relu" in shown.stdout, shown.stderr
    queried = run("query", "select count(*) as n from runs", "--format", "json", env=env)
    assert json.loads(queried.stdout) == [{"n": 3}]
    # a store named explicitly still wins
    other = tmp_path / "other.tl"
    tl.open(other)
    assert "no runs yet" in run("runs", str(other), env=env).stdout
    missing = run("runs")
    assert missing.returncode == 2 and "STORE" in missing.stderr  # usage error, no default


def test_query_text_from_stdin_or_a_file(store_path: Path, tmp_path: Path) -> None:
    text = "select run, label from ops where func = 'relu' and run = 'base' order by idx"
    piped = run("query", str(store_path), "-", "--format", "json", stdin=text)
    assert [r["label"] for r in json.loads(piped.stdout)] == ["relu_1_2", "relu_2_4"]
    path = tmp_path / "q.sql"
    path.write_text(text + "\n")
    from_file = run("query", str(store_path), "-f", str(path), "--format", "json")
    assert json.loads(from_file.stdout) == json.loads(piped.stdout)
    # a .sql file ends its statement with a semicolon, as SQL does
    path.write_text(text + ";\n")
    with_semicolon = run("query", str(store_path), "-f", str(path), "--format", "json")
    assert json.loads(with_semicolon.stdout) == json.loads(piped.stdout), with_semicolon.stderr
    both = run("query", str(store_path), text, "-f", str(path))
    assert both.returncode != 0 and "not both" in both.stderr
    bad = run("query", str(store_path), "select run frm ops")
    assert bad.returncode == 2 and "^" in bad.stderr and "Traceback" not in bad.stderr


def test_typos_on_the_command_line(store_path: Path, tmp_path: Path) -> None:
    show = run("show", str(store_path), "bsae")
    assert show.returncode == 1 and "did you mean 'base'" in show.stderr
    query = run("query", str(store_path), "select label from ops where run = 'bsae'")
    assert query.returncode == 1 and "did you mean 'base'" in query.stderr
    missing = tmp_path / "errz.tl"
    opened = run("runs", str(missing))
    assert opened.returncode == 1 and "no tracelake store" in opened.stderr
    assert not missing.exists()  # the command line never creates a store


def test_a_closed_pipe_ends_quietly(store_path: Path) -> None:
    shell = (
        f"{TRACELAKE} query {store_path} \"select run, out from ops where run = 'wide'\" "
        "--format json | head -c 100 > /dev/null; echo ${PIPESTATUS[0]}"
    )
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stdout.strip() in ("0", "141")


def test_wide_results_elide_columns_readably(store_path: Path) -> None:
    done = run("query", str(store_path), "select * from ops where run = 'base' limit 3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 160
    assert "more column(s) not shown" in done.stdout
    header = next(line for line in lines if "run" in line and "label" in line)
    assert "label" in header and "func" in header  # whole names, not 1-character slivers


def test_help_is_written_for_users() -> None:
    done = run("--help")
    assert done.returncode == 0
    assert "examples:" in done.stdout and "TRACELAKE_STORE" in done.stdout
    assert "Terminal output lives here" not in done.stdout  # not the module's docstring
    assert run("--version").stdout.startswith("tracelake ")
    # every argument of every command says what it is in `tracelake COMMAND --help`
    from tracelake.cli import build_parser

    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    bare = [
        f"{name} {action.dest}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not action.help
    ]
    assert bare == []


def _stored(store_path: Path, run_name: str) -> dict[str, torch.Tensor]:
    store = tl.open(store_path, create=False)
    return {op.label: op.out for op in store[run_name] if op.out is not None}


def test_parquet_and_arrow_exports_keep_dtype_shape_and_every_bit(
    store_path: Path, tmp_path: Path
) -> None:
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    stored = _stored(store_path, "wide")
    text = "select label, absmax, out from ops where run = 'wide' and func = 'relu'"
    for fmt in ("parquet", "arrow"):
        out = tmp_path / f"relu.{fmt}"
        done = run("query", str(store_path), text, "--format", fmt, "-o", str(out))
        assert done.returncode == 0, done.stderr
        table = pq.read_table(out) if fmt == "parquet" else pa.ipc.open_file(out).read_all()
        column = table.column("out")
        assert isinstance(column.type, pa.FixedShapeTensorType)
        assert column.type.value_type == pa.float32() and list(column.type.shape) == [64, 256]
        got = torch.from_numpy(column.chunk(0).to_numpy_ndarray()[0].copy())
        label = table.column("label")[0].as_py()
        assert torch.equal(got.view(torch.int32), stored[label].view(torch.int32))
        assert table.column("absmax")[0].as_py() == stored[label].abs().max().item()
    # DuckDB reads the Parquet file back: the tensor as an array of float32
    con = duckdb.connect()
    got = con.execute(f"select out from '{tmp_path / 'relu.parquet'}'").fetchone()
    assert got is not None and len(got[0]) == 64 * 256
    # bfloat16 tensors: their bits, the dtype noted in the field's metadata
    bf = tmp_path / "bf.parquet"
    text = "select label, out from ops where run = 'wide' and func = 'to'"
    assert run("query", str(store_path), text, "--format", "parquet", "-o", str(bf)).returncode == 0
    field = pq.read_schema(bf).field("out")
    assert field.metadata == {b"tracelake.dtype": b"bfloat16"}
    assert isinstance(field.type, pa.FixedShapeTensorType) and field.type.value_type == pa.uint16()
    table = pq.read_table(bf)
    bits = table.column("out").chunk(0).to_numpy_ndarray()[0].copy()
    expected = stored[table.column("label")[0].as_py()].view(torch.int16).numpy().view("uint16")
    assert (bits == expected).all()
    # tensors of several shapes in one column: dtype, shape and the raw bytes per row
    mixed = tmp_path / "mixed.parquet"
    text = "select label, out from ops where run = 'wide' and dtype = 'bfloat16'"
    done = run("query", str(store_path), text, "--format", "parquet", "-o", str(mixed))
    assert done.returncode == 0, done.stderr
    table = pq.read_table(mixed)
    shapes = set()
    labels, cells = table.column("label").to_pylist(), table.column("out").to_pylist()
    for label, cell in zip(labels, cells, strict=True):
        tensor = stored[label]
        assert cell["dtype"] == "bfloat16" and cell["shape"] == list(tensor.shape)
        assert cell["data"] == tensor.contiguous().view(torch.int16).numpy().tobytes()
        shapes.add(tuple(tensor.shape))
    assert len(shapes) > 1


class _Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return h, h > 0.1


def test_exported_tensor_columns_keep_unsaved_rows_null_and_bool_tensors(tmp_path: Path) -> None:
    """A column of one shape with rows whose op saved nothing (null rows among tensors,
    batched together), and a column of bool tensors (bits in Arrow): both come back
    exactly from Parquet and Arrow IPC, and DuckDB reads the Parquet file."""
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "s.tl"
    torch.manual_seed(3)
    with torch.no_grad():
        tl.open(root).record(_Gated(), torch.randn(4, 8), name="sel", save=tl.func("relu", "gt"))
    stored = _stored(root, "sel")
    queries = {
        "gaps": "select label, out from ops where run = 'sel' and func in ('relu', 'linear')",
        "bits": "select label, out from ops where run = 'sel' and func = 'gt'",
    }
    for name, text in queries.items():
        for fmt in ("parquet", "arrow"):
            out = tmp_path / f"{name}.{fmt}"
            done = run("query", str(root), text, "--format", fmt, "-o", str(out))
            assert done.returncode == 0, done.stderr
            table = pq.read_table(out) if fmt == "parquet" else pa.ipc.open_file(out).read_all()
            column = table.column("out").combine_chunks()
            assert isinstance(column.type, pa.FixedShapeTensorType)
            assert list(column.type.shape) == [4, 8]
            labels = table.column("label").to_pylist()
            assert len(labels) == (4 if name == "gaps" else 1)
            for i, label in enumerate(labels):
                if label not in stored:  # a linear op: nothing saved
                    assert column.storage.is_null()[i].as_py()
                    continue
                assert not column.storage.is_null()[i].as_py()
                values = column.storage[i].values.to_numpy(zero_copy_only=False)
                expected = stored[label].reshape(-1).numpy()
                if name == "bits":
                    assert column.type.value_type == pa.bool_()
                    assert (values == expected).all()
                else:
                    assert (values.view("int32") == expected.view("int32")).all()
            assert sum(label in stored for label in labels) == (2 if name == "gaps" else 1)
        got = duckdb.connect().execute(f"select out from '{tmp_path / name}.parquet'").fetchall()
        assert sum(row[0] is None for row in got) == (2 if name == "gaps" else 0)


def test_json_export_is_valid_json_and_csv_floats_round_trip(
    store_path: Path, tmp_path: Path
) -> None:
    stored = _stored(store_path, "wide")
    text = "select label, dtype, mean, out from ops where run = 'wide' order by idx"

    def refuse(name: str) -> None:
        raise AssertionError(f"JSON holds {name}")

    done = run("query", str(store_path), text, "--format", "json")
    rows = json.loads(done.stdout, parse_constant=refuse)  # no NaN / Infinity tokens
    assert any(None in r["out"]["data"] for r in rows if r["dtype"] == "bfloat16")
    for row in rows:
        tensor = stored.get(row["label"])
        if tensor is None:
            continue
        assert row["out"]["shape"] == list(tensor.shape)
        assert row["out"]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        flat = tensor.float().reshape(-1).tolist()
        assert [None if not math.isfinite(v) else v for v in flat] == row["out"]["data"]
    out = tmp_path / "wide.csv"
    done = run("query", str(store_path), text, "--format", "csv", "-o", str(out))
    assert done.returncode == 0, done.stderr
    import csv

    csv.field_size_limit(1 << 30)  # a tensor's text is one cell
    with open(out, newline="") as f:
        records = list(csv.DictReader(f))
    exact = tl.open(store_path, create=False).query(text)
    for record, row in zip(records, exact, strict=True):
        mean = row["mean"]  # every digit, not 6 (NaN where the tensor has one)
        assert float(record["mean"]) == mean or (math.isnan(mean) and record["mean"] == "nan")
        if row["out"] is not None:
            data = json.loads(record["out"])["data"]  # NaN / Infinity as Python reads them
            got = torch.tensor(data, dtype=torch.float32)
            want = row["out"].float().reshape(-1)
            assert torch.equal(got.isnan(), want.isnan())
            finite = ~got.isnan()
            assert torch.equal(got[finite], want[finite])


def test_show_and_diff_json_are_valid_json(store_path: Path) -> None:
    def refuse(name: str) -> None:
        raise AssertionError(f"JSON holds {name}")

    shown = run("show", str(store_path), "wide", "--json")
    assert shown.returncode == 0, shown.stderr
    ops = json.loads(shown.stdout, parse_constant=refuse)
    assert {"label", "func", "absmax", "nan_count"} <= set(ops[0])
    diff = run("diff", str(store_path), "base", "ft", "--format", "json")
    json.loads(diff.stdout, parse_constant=refuse)


def test_progress_is_shown_where_someone_watches(
    store_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from tracelake import progress
    from tracelake.query.export import export
    from tracelake.query.results import run_query

    store = tl.open(store_path, create=False)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setenv("TRACELAKE_PROGRESS", "1")
    text = "select label, out from ops where run = 'wide'"
    export(run_query(store, text, lazy=True), "parquet", str(tmp_path / "a.parquet"))
    assert "writing parquet" in capsys.readouterr().err
    export(run_query(store, text, lazy=True), "json", str(tmp_path / "a.json"), progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("TRACELAKE_PROGRESS")  # stderr is not a terminal here: silent
    export(run_query(store, text, lazy=True), "csv", str(tmp_path / "a.csv"))
    assert capsys.readouterr().err == ""
