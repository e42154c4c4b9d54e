"""Hardening (issue 17, items 6-9): a store from someone else never reaches outside
itself. Each test records a real small store, tampers with it the way a crafted store
would (catalog views and macros, array names that are paths, symbolic links to files
outside, a zarr.json without its checksum codec), and checks that opening, listing,
querying, verifying and recording into it neither read nor write outside it (a sentinel
file outside keeps its content and mtime, and its content is never returned), and that
what fails is a ``StoreError`` saying what is wrong."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from model_zoo import BUILDERS
from torch import nn

import tracelake as tl
from tracelake.cli import main
from tracelake.store.format import chunk_key
from tracelake.store.tensors import clear_chunk_cache

SECRET = "outside-secret-3f9a"


def _sentinel(tmp_path: Path) -> tuple[Path, tuple[str, int]]:
    """A file outside the store, and what must stay true of it (content, mtime)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text(SECRET * 4)
    os.utime(secret, ns=(1_000_000_000, 1_000_000_000))
    return secret, (secret.read_text(), secret.stat().st_mtime_ns)


def _unchanged(secret: Path, before: tuple[str, int]) -> None:
    assert (secret.read_text(), secret.stat().st_mtime_ns) == before


def _store(root: Path, big: bool = False) -> tuple[nn.Module, torch.Tensor]:
    """A store with one run ``a`` (``big``: of a model whose outputs get arrays of their
    own rather than a place in a pack)."""
    if big:
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
        x = torch.randn(1100, 1024)  # 4.3 MB outputs: over CHUNK_BYTES
    else:
        model, (x,) = BUILDERS["mlp"]()
    with tl.open(root) as store:  # (closed: its fold makes the catalog file)
        store.record(model, x, name="a")
    return model, x


def _tamper(root: Path, *statements: str) -> None:
    con = duckdb.connect(str(root / "catalog.duckdb"))
    try:
        for sql in statements:
            con.execute(sql)
    finally:
        con.close()


def _read_outs(store: tl.Store) -> list[Any]:
    """Every op's output through the query language (results are lazy: read them)."""
    return [row["out"] for row in store.query("select run, out from ops")]


def _no_secret(value: Any) -> None:
    assert SECRET not in str(value)


def _every_read(root: Path, capsys: pytest.CaptureFixture[str]) -> list[Callable[[], Any]]:
    """Each way of listing or querying a store, on a fresh handle each time."""
    return [
        lambda: tl.open(root).runs(),
        lambda: tl.open(root).runs(all=True),
        lambda: tl.open(root).sql("SELECT * FROM runs"),
        lambda: tl.open(root).query("select run, label from ops"),
        lambda: tl.open(root)["a"],
    ]


# -- 6. views and macros planted in the catalog ------------------------------------------


@pytest.mark.parametrize(
    "planted",
    [
        # a view in place of the runs table, reading a file outside
        (
            "ALTER TABLE runs RENAME TO runs_base",
            "CREATE VIEW runs AS SELECT r.* REPLACE (s.content AS host) FROM runs_base r, "
            "read_text('{secret}') s",
        ),
        # a view in place of ops, reading the file as its labels
        (
            "ALTER TABLE ops RENAME TO ops_base",
            "CREATE VIEW ops AS SELECT o.* REPLACE (s.content AS label) FROM ops_base o, "
            "read_text('{secret}') s",
        ),
        # a view of another name, and a macro: neither is something tracelake makes
        ("CREATE VIEW spy AS SELECT content FROM read_text('{secret}')",),
        ("CREATE MACRO greatest(a, b) AS a",),
    ],
    ids=["runs-view", "ops-view", "extra-view", "macro"],
)
def test_planted_catalog_objects_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: tuple[str, ...]
) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    model, x = _store(root)
    _tamper(root, *(s.format(secret=secret) for s in planted))
    for read in _every_read(root, capsys):
        with pytest.raises(tl.StoreError, match="tracelake never creates") as info:
            read()
        _no_secret(info.value)
    # the command line says so too, and prints nothing of the file
    assert main(["runs", str(root)]) != 0
    out = capsys.readouterr()
    assert "tracelake never creates" in out.err + out.out
    _no_secret(out)
    # writers refuse it as well: they never run a view's SQL or a planted macro
    with pytest.raises(tl.StoreError, match="tracelake never creates"):
        tl.open(root).record(model, x, name="b")
    with pytest.raises(tl.StoreError, match="tracelake never creates"):
        tl.open(root).verify()
    _unchanged(secret, before)


def test_objects_planted_while_a_reader_is_open_are_refused(tmp_path: Path) -> None:
    """A reader checks the catalog file whenever it changed since its last read: one that
    loaded a run, then finds a macro planted, refuses the next run's rows (and the first
    run's too); it skips the check only for the very file it checked."""
    root = tmp_path / "s"
    model, x = _store(root)
    tl.open(root).record(model, x, name="b")
    reader = tl.open(root)
    assert len(reader.query("select label from ops where run = 'a'")) > 0
    labels_b = [r["label"] for r in reader.query("select label from ops where run = 'b'")]
    assert labels_b == [
        r["label"] for r in tl.open(root).query("select label from ops where run = 'b'")
    ]
    tl.open(root).record(model, x, name="c")
    _tamper(root, "CREATE MACRO greatest(a, b) AS a")
    for text in ("select label from ops where run = 'c'", "select label from ops where run = 'a'"):
        with pytest.raises(tl.StoreError, match="tracelake never creates"):
            reader.query(text)


def test_readers_catalog_connection_has_no_file_access(tmp_path: Path) -> None:
    """Even a base table with a default reading a file is copied as plain values: the
    reader's connection to the catalog file cannot read files or load extensions."""
    from tracelake.store.catalog import _SOURCE_CONFIG

    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    _store(root)
    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True, config=_SOURCE_CONFIG)
    try:
        with pytest.raises(duckdb.Error, match="disabled"):
            con.execute(f"SELECT * FROM read_text('{secret}')").fetchall()
        with pytest.raises(duckdb.Error):
            con.execute("SET enable_external_access = true")
    finally:
        con.close()
    assert list(tl.open(root).runs()["name"]) == ["a"]
    _unchanged(secret, before)


# -- 7. array names that are paths --------------------------------------------------------


@pytest.mark.parametrize("name", ["{outside}", "../../../../outside/arr", "pack_raw/../x", ""])
def test_array_names_must_be_the_writers_own(tmp_path: Path, name: str) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    _store(root)
    # a real zarr array outside, with good checksums: only the path is wrong
    outside = secret.parent / "arr"
    import zarr

    zarr.create_array(str(outside), shape=(4096,), dtype="uint8", chunks=(4096,), compressors=None)[
        :
    ] = 7
    name = name.format(outside=outside)
    _tamper(
        root,  # (the ops table repeats each tensor's array, for the query language)
        f"UPDATE tensors SET \"array\" = '{name}'",
        f'UPDATE ops SET "array" = \'{name}\' WHERE "array" IS NOT NULL',
    )
    clear_chunk_cache()
    store = tl.open(root)
    run = store["a"]
    with pytest.raises(tl.StoreError, match="never writes") as info:
        run["input_1"].out  # noqa: B018  (reading is the test)
    assert "input_1" in str(info.value) and "a" in str(info.value)
    with pytest.raises(tl.StoreError, match="never writes"):
        _read_outs(store)
    report = store.verify()
    assert not report.ok
    assert any("never writes" in p.what for p in report.problems)
    _unchanged(secret, before)


# -- 8. links out of the store, and arrays without their checksum ------------------------


def _own_array(root: Path) -> Path:
    arrays = root / "runs" / "00000001" / "tensors"
    own = sorted(p for p in arrays.iterdir() if p.name.startswith("t"))
    assert own, "the model's outputs should have arrays of their own"
    return own[0]


def _strip_crc(array: Path) -> None:
    meta = json.loads((array / "zarr.json").read_text())
    codecs = meta["codecs"]
    if codecs[-1]["name"] == "sharding_indexed":
        config = codecs[-1]["configuration"]
        config["codecs"] = [c for c in config["codecs"] if c["name"] != "crc32c"]
    else:
        meta["codecs"] = [c for c in codecs if c["name"] != "crc32c"]
    (array / "zarr.json").write_text(json.dumps(meta))


def test_array_without_its_checksum_codec_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _store(root, big=True)
    _strip_crc(_own_array(root))
    clear_chunk_cache()
    store = tl.open(root)
    with pytest.raises(tl.StoreError, match="crc32c"):
        _read_outs(store)
    report = store.verify()
    assert any("crc32c" in p.what for p in report.problems)


def test_symlinked_chunk_is_never_read_and_verify_reports_it(tmp_path: Path) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    _store(root, big=True)
    array = _own_array(root)
    _strip_crc(array)
    chunks = sorted(p for p in array.iterdir() if p.name != "zarr.json")
    size = chunks[0].stat().st_size
    big = secret.parent / "big.bin"
    big.write_bytes((SECRET.encode() * (size // len(SECRET) + 1))[:size])
    chunks[0].unlink()
    chunks[0].symlink_to(big)
    clear_chunk_cache()
    store = tl.open(root)
    with pytest.raises(tl.StoreError) as info:
        _read_outs(store)
    _no_secret(info.value)
    report = store.verify()
    assert not report.ok
    assert any("symbolic link" in p.what for p in report.problems)
    _unchanged(secret, before)


def test_symlinked_pack_shard_and_run_directory_are_refused(tmp_path: Path) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    _store(root)
    shard = root / "runs" / "00000001" / "tensors" / chunk_key("pack_raw", 0)
    shard.unlink()
    shard.symlink_to(secret)
    clear_chunk_cache()
    with pytest.raises(tl.StoreError, match="symbolic link"):
        tl.open(root)["a"]["input_1"].out  # noqa: B018
    assert any("symbolic link" in p.what for p in tl.open(root).verify().problems)
    # the whole run directory moved outside, a link left in its place
    run_dir = root / "runs" / "00000001"
    moved = secret.parent / "run"
    run_dir.rename(moved)
    run_dir.symlink_to(moved)
    clear_chunk_cache()
    with pytest.raises(tl.StoreError, match="symbolic link"):
        tl.open(root)["a"]["input_1"].out  # noqa: B018
    _unchanged(secret, before)


# -- 9. links that would make tracelake write outside --------------------------------------


@pytest.mark.parametrize("name", ["catalog.lock", "catalog.duckdb.wal", "runs"])
def test_planted_links_are_not_written_through(tmp_path: Path, name: str) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    model, x = _store(root)
    target = root / name
    if name == "runs":
        moved = secret.parent / "runs"
        target.rename(moved)
        target.symlink_to(moved)
    else:
        target.unlink(missing_ok=True)
        target.symlink_to(secret)
    with pytest.raises(tl.StoreError, match="symbolic link"):
        tl.open(root).record(model, x, name="b")
    with pytest.raises(tl.StoreError, match="symbolic link"):
        tl.open(root).gc()
    _unchanged(secret, before)


def test_generation_temp_file_link_is_replaced_not_followed(tmp_path: Path) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    model, x = _store(root)
    (root / f".gen.{os.getpid()}").symlink_to(secret)
    tl.open(root).record(model, x, name="b")
    assert not (root / "catalog.gen").is_symlink()
    assert sorted(tl.open(root).runs()["name"]) == ["a", "b"]
    _unchanged(secret, before)


def test_gc_removes_a_linked_orphan_directory_not_its_target(tmp_path: Path) -> None:
    secret, before = _sentinel(tmp_path)
    root = tmp_path / "s"
    _store(root)
    victim = secret.parent / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    (root / "runs" / "00000099").symlink_to(victim)
    result = tl.open(root).gc()
    assert result["orphans"] == 1 and result["bytes"] == 0
    assert not (root / "runs" / "00000099").exists()
    assert (victim / "keep.txt").read_text() == "keep"
    _unchanged(secret, before)


# -- 13. a zarr.json declaring a huge shape or chunk grid --------------------------------


@pytest.mark.parametrize("which", ["own-shape", "own-chunks", "pack-shape", "pack-shards"])
def test_a_huge_zarr_json_costs_verify_one_problem(tmp_path: Path, which: str) -> None:
    root = tmp_path / "s"
    _store(root, big=which.startswith("own"))
    arrays = root / "runs" / "00000001" / "tensors"
    packs = sorted(p for p in arrays.iterdir() if p.name.startswith("pack"))
    array = _own_array(root) if which.startswith("own") else packs[0]
    meta = json.loads((array / "zarr.json").read_text())
    if which.endswith("shape"):
        meta["shape"] = [2**40, *meta["shape"][1:]]
    elif which == "own-chunks":
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [1] * len(meta["shape"])
    else:  # a 1-byte shard: one shard per byte the catalog points at
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [1]
        meta["codecs"][-1]["configuration"]["chunk_shape"] = [1]
    (array / "zarr.json").write_text(json.dumps(meta))
    clear_chunk_cache()
    store = tl.open(root)
    report = store.verify()  # (before: 48 s and a million problems for the shape 2^40)
    # (a pack longer than its tensors is harmless: nothing points past them)
    assert (which != "pack-shape") <= len(report.problems) <= 2, report.problems
    assert report.chunks < 100
    for problem in report.problems:
        assert problem.label != "?" and "?" not in problem.what.split(":")[0]
        assert array.name in problem.what


# -- links and garbage in every place: open, list, query, verify, record ------------------


def _outside_catalog(tmp_path: Path) -> Path:
    """A real catalog outside the store (another store's), for links to point at."""
    other = tmp_path / "outside" / "other"
    _store(other)
    return other / "catalog.duckdb"


@pytest.mark.parametrize(
    "place",
    [
        "catalog.duckdb",
        "catalog.duckdb.wal",
        "catalog.gen",
        "catalog.lock",
        "catalog.reserve",
        "tracelake.json",
        "runs/00000001/run.json",
        "runs/00000001/writing.lock",
        "runs/00000001/tensors",
        "runs/00000001/tensors/zarr.json",
        "runs/00000001/tensors/PACK/zarr.json",
        "runs/00000001/tensors/PACK/0",
        "runs/00000001",
        "runs",
    ],
)
def test_a_link_in_any_place_is_never_followed_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], place: str
) -> None:
    secret, before = _sentinel(tmp_path)
    outside_catalog = _outside_catalog(tmp_path)
    watched = {
        p: (p.stat().st_mtime_ns, p.read_bytes())
        for p in outside_catalog.parent.rglob("*")
        if p.is_file()
    }
    root = tmp_path / "s"
    model, x = _store(root)
    pack = next(
        p.name for p in (root / "runs/00000001/tensors").iterdir() if p.name.startswith("pack")
    )
    target = root / place.replace("PACK", pack)
    moved = tmp_path / "outside" / "moved"
    if target.exists() or target.is_symlink():
        target.rename(moved)
    link_to = (
        outside_catalog
        if place == "catalog.duckdb"
        else (moved if place in ("runs", "runs/00000001", "runs/00000001/tensors") else secret)
    )
    target.symlink_to(link_to)
    outcomes = []
    for action in [
        *_every_read(root, capsys),
        lambda: _read_outs(tl.open(root)),
        lambda: tl.open(root).verify(),
        lambda: tl.open(root).record(model, x, name="b"),
        lambda: tl.open(root).gc(),
        lambda: main(["runs", str(root)]),
        lambda: main(["verify", str(root)]),
    ]:
        try:
            value = action()
            outcomes.append("ok")
        except tl.TraceLakeError as exc:
            value = str(exc)
            outcomes.append(type(exc).__name__)
        except SystemExit as exc:
            value = exc.code
            outcomes.append(f"exit {exc.code}")
        _no_secret(value)
        if hasattr(value, "problems"):  # verify() says what is wrong
            assert any("symbolic link" in str(p) for p in value.problems), value.problems
    _no_secret(capsys.readouterr())
    _unchanged(secret, before)
    for path, (mtime, data) in watched.items():  # the other store: not read into ours...
        assert (path.stat().st_mtime_ns, path.read_bytes()) == (mtime, data), path
    if place == "catalog.duckdb":  # ...nor its runs listed as ours
        assert all(o != "ok" for o in outcomes[:4]), outcomes


@pytest.mark.parametrize(
    "place, content",
    [
        ("tracelake.json", b"\xff\xfe garbage"),
        ("tracelake.json", b'{"format": "x"}'),
        ("tracelake.json", b"[]"),
        ("tracelake.json", b"{" * 100_000),
        ("runs/00000001/run.json", b"\xff garbage"),
        ("runs/00000001/run.json", b'{"run": 7, "created": 1}'),
        ("runs/00000001/run.json", b"[1]"),
        ("catalog.gen", b"\x00" * 10_000),
    ],
)
def test_garbled_marker_files_say_what_is_wrong(tmp_path: Path, place: str, content: bytes) -> None:
    root = tmp_path / "s"
    _model, _x = _store(root)
    (root / place).write_bytes(content)
    if place == "tracelake.json":
        with pytest.raises(tl.StoreFormatError, match=r"tracelake\.json|format"):
            tl.open(root)
        return
    store = tl.open(root)
    if place == "catalog.gen":
        assert list(store.runs()["name"]) == ["a"]
        return
    with pytest.raises(tl.StoreError, match="marker"):
        store["a"]["input_1"].out  # noqa: B018
    report = store.verify()
    assert any("marker" in p.what for p in report.problems)
