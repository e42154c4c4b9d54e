"""The store's write path up close: what the forward thread copies, the buffers it copies
into, and the statistics the workers compute, against plain PyTorch."""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import astuple, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hook_capture import assert_bitwise
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tracelake as tl
from tracelake.recorder.record import Stats
from tracelake.recorder.stats import compute_stats
from tracelake.store.rows import distinct_codes
from tracelake.store.tensors import CHUNK_BYTES, RunArrays
from tracelake.store.writer import TensorWriter

MiB = 1 << 20
STATS = [f.name for f in fields(Stats)]


def small_tensors() -> list[torch.Tensor]:
    """Small tensors of every kind the writer's fast byte copy must get right or refuse:
    contiguous, strided views, the negative and conjugate bits, autograd leaves, odd
    dtypes, empty and 0-d."""
    torch.manual_seed(0)
    x = torch.randn(6, 10)
    z = torch.complex(x, -x)
    leaf = torch.randn(3, 3, requires_grad=True)
    return [
        x,
        x.t(),
        x[:, 1::3],
        x[2],
        torch._neg_view(x),
        z,
        z.conj(),
        leaf,
        leaf * 2,
        x.to(torch.bfloat16),
        x.to(torch.float16),
        (x > 0),
        x.to(torch.int64),
        x.to(torch.float8_e4m3fn),
        torch.empty(0, 4),
        torch.tensor(3.5),
        x.double(),
        torch.tensor([float("nan"), 1.0, float("inf")]),
    ]


def mid_size_tensors() -> list[torch.Tensor]:
    """Packed tensors of whole 64 KiB inner chunks or more, which the workers write from
    the tensors' own memory (the bytes before the first and after the last whole inner
    chunk copied at once), and ones that must be copied instead."""
    torch.manual_seed(1)
    x = torch.randn(300, 1000)  # 1.2 MB, starting mid inner chunk
    qkv = torch.randn(4, 128, 768)  # GPT-2's attention: per-head views of a third of it
    head = qkv.split(256, dim=-1)[1].view(4, 128, 4, 64).transpose(1, 2)
    return [
        x,
        torch.randn(128, 1024),  # 512 KiB, GPT-2's size
        x.t(),  # not contiguous: gathered by a worker
        x.half(),  # the zstd pack
        torch.randn(64, 1024)[:, :1000],  # a strided view: gathered by a worker
        torch.randn(3, 65536)[1],  # a third of its storage: copied
        head,  # gathered by a worker
        head.half(),
        torch.randn(5, 256, 256)[:, ::2, 1:],  # a strided view of most of its storage
        torch.randn(9, 65536)[::3],  # strided, a third of its storage: gathered
        torch.randn(20, 65536)[::5],  # a fifth of its storage: copied at once
    ]


def test_saved_bytes_are_the_values(tmp_path: Path) -> None:
    """Every tensor reads back bit for bit, whichever copy the writer took."""
    arrays = RunArrays(tmp_path / "t", "r", create=True, flat=True)
    writer = TensorWriter(arrays)
    tensors = [*small_tensors(), *mid_size_tensors(), torch.randn(1100, 1024)]  # last: own
    slots = [writer.save(t) for t in tensors]
    writer.close()
    for slot, tensor in zip(slots, tensors, strict=True):
        loc = writer.location(slot)
        want = tensor.detach().resolve_conj().resolve_neg()
        if loc.offset >= 0:
            got = arrays.read_packed(loc.array, loc.offset, loc.nbytes, loc.dtype, loc.shape, "x")
        else:
            got = arrays.read_array(loc.array, loc.dtype, loc.shape, "x")
        assert_bitwise(got, want.contiguous(), f"slot {slot}")


def test_statistics_are_compute_stats(tmp_path: Path) -> None:
    """The workers' statistics are compute_stats' numbers (a large tensor's from its
    chunks' reductions: float32 norms of 4 MiB parts, closer to the float64 value than one
    norm of the whole, hence the tolerance); undefined ones (empty tensors, complex means)
    stay undefined."""
    writer = TensorWriter(RunArrays(tmp_path / "t", "r", create=True, flat=True))
    tensors = [
        *small_tensors(),
        *mid_size_tensors(),
        torch.full((70,), 131072.0),
        torch.randn(1100, 1024),
    ]
    slots = [writer.save(t) for t in tensors]
    writer.close()
    values, valid = writer.stat_matrix()
    assert not valid[-1].any(), "the row that index -1 reads is all undefined"
    for slot, tensor in zip(slots, tensors, strict=True):
        want = compute_stats(tensor.detach().resolve_conj().resolve_neg())
        for k, name in enumerate(
            ("mean", "std", "min", "max", "absmax", "l2", "frac_zero", "nan_count", "inf_count")
        ):
            expected = getattr(want, name)
            assert valid[slot, k] == (expected is not None), (slot, name)
            if expected is not None:
                assert math.isclose(values[slot, k], expected, rel_tol=1e-4, abs_tol=1e-6) or (
                    math.isnan(values[slot, k]) and math.isnan(expected)
                ), (slot, name)


def test_buffers_never_exceed_the_cap(tmp_path: Path) -> None:
    """Copies in flight plus buffers kept for reuse stay within max_inflight, with large
    tensors of several sizes going through; nothing is kept after close."""
    cap = 3 * CHUNK_BYTES
    writer = TensorWriter(RunArrays(tmp_path / "t", "r", create=True, flat=True), max_inflight=cap)
    buffers = writer._buffers
    for k in range(12):
        writer.save(torch.full(((4 + k % 4) * MiB // 4,), float(k)))
        writer.save(torch.full((1000,), float(k)))
        writer.save(torch.full((k + 1, 65536), float(k)))  # written from its own memory
        assert buffers.used + buffers.kept <= cap
    writer.close()
    assert writer.peak_inflight <= cap
    assert buffers.kept == 0


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_writer_that_ended_refuses_tensors_instead_of_waiting(tmp_path: Path, end: str) -> None:
    """A late save (a stale hook of an ended recording) raises at once: the writer's
    workers are gone, and bytes its cancelled writes still count in flight would
    otherwise make it wait for room for ever."""
    cap = 2 * CHUNK_BYTES
    writer = TensorWriter(RunArrays(tmp_path / "t", "r", create=True, flat=True), max_inflight=cap)
    writer.save(torch.ones(1000))
    writer._buffers.used = cap  # as cancelled writes leave it: counted, never released
    getattr(writer, end)()
    refused: list[BaseException] = []

    def late() -> None:
        try:
            writer.save(torch.ones(CHUNK_BYTES // 4))
        except tl.StoreError as exc:
            refused.append(exc)

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the late save waited for room that never comes"
    assert refused and "has ended" in str(refused[0])


class InPlaceAfter(nn.Module):
    """Saves ``a = x * 2`` and ``v = a[1]`` (a view), then writes them in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        v = a[1]
        a.add_(1)
        v.mul_(10)
        return a


@pytest.mark.parametrize("rows", [4, 128, 4096], ids=["packed", "mid-size", "own-array"])
def test_a_later_in_place_op_cannot_change_a_stored_value(tmp_path: Path, rows: int) -> None:
    x = torch.randn(rows, 1024)
    run = tl.open(tmp_path / "s").record(InPlaceAfter(), x, name="r")
    assert_bitwise(run["mul_1_1"].out, x * 2, "x * 2, before add_")
    assert_bitwise(run["getitem_1_2"].out, (x * 2)[1], "the view, before either write")
    assert_bitwise(run["output_1"].out, InPlaceAfter()(x), "the output")


class Reshapes(nn.Module):
    """A linear layer's ``view`` of its input and output (as GPT-2's Conv1D), then the
    output written in place after its view was recorded, and a view made after an
    in-place write of what it views."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        flat = y.view(-1, y.shape[-1])  # the bytes of y, saved already
        out = flat.view(y.shape)  # again
        y.mul_(3)  # after both views: they are stored as they were
        later = y.view(-1)  # after the write: bytes y's slot does not hold
        return out + later.view(y.shape)


@pytest.mark.parametrize("rows", [4, 128, 1100], ids=["small", "mid-size", "own-array"])
def test_a_reshape_of_saved_bytes_is_stored_once_and_reads_as_it_was(
    tmp_path: Path, rows: int
) -> None:
    """A recorded tensor that only reshapes the bytes of one saved earlier in the step,
    with no write between, is stored as an alias of its slot (same array and offset, no
    bytes written again) when packed and at least an inner chunk; every tensor reads back
    as it was when recorded, in a new process's view of the store, and its statistics are
    its own."""
    x = torch.randn(rows, 1024)
    store = tl.open(tmp_path / "s")
    run = store.record(Reshapes(), x, name="r")
    y = x * 2
    assert_bitwise(run["mul_1_1"].out, y, "y, before mul_")
    assert_bitwise(run["view_1_2"].out, y.view(-1, 1024), "its view, before mul_")
    assert_bitwise(run["view_2_3"].out, y, "the view of the view, before mul_")
    assert_bitwise(run["view_3_5"].out, (y * 3).view(-1), "the view after mul_")
    assert_bitwise(run["output_1"].out, Reshapes()(x), "the output")
    rows_of = (
        tl.open(tmp_path / "s")
        .sql(
            "SELECT o.label, t.array, t.byte_offset, t.nbytes FROM ops o JOIN tensors t "
            "ON o.run_id = t.run_id AND o.tensor = t.slot"
        )
        .set_index("label")
    )
    where = rows_of[["array", "byte_offset"]].astype(str).apply(tuple, axis=1)
    aliased = rows == 128  # packed and past ALIAS_BYTES (small: copied; large: own array)
    assert (where["view_1_2"] == where["mul_1_1"]) == aliased
    assert (where["view_2_3"] == where["mul_1_1"]) == aliased
    assert where["view_3_5"] != where["mul_1_1"], "bytes written in place since: saved anew"
    stats = store.sql("SELECT label, max FROM ops").set_index("label")
    assert stats.loc["view_2_3", "max"] == stats.loc["mul_1_1", "max"] == y.max().item()
    assert stats.loc["view_3_5", "max"] == (y * 3).max().item()


def test_stored_ops_carry_their_tensors_location(tmp_path: Path) -> None:
    """An op row's array and byte offset are those of its tensor's row, packed or not."""
    x = torch.randn(4096, 1024)
    store = tl.open(tmp_path / "s")
    store.record(InPlaceAfter(), x, name="r")
    joined = store.sql(
        "SELECT o.label, o.array = t.array AS same_array, "
        "o.byte_offset IS NOT DISTINCT FROM t.byte_offset AS same_offset, t.byte_offset "
        "FROM ops o JOIN tensors t ON o.run_id = t.run_id AND o.tensor = t.slot"
    )
    assert joined["same_array"].all() and joined["same_offset"].all()
    assert joined["byte_offset"].isna().any() and joined["byte_offset"].notna().any()
    assert np.isin(["mul_1_1", "getitem_1_2"], joined["label"]).all()


def test_catalog_transactions_let_go_of_the_file(tmp_path: Path) -> None:
    """Writers attach the catalog to a DuckDB kept by the process and detach it after
    each transaction: right after a commit, another process opens the file read-write
    (DuckDB refuses that while any process holds it), even under a path with a quote."""
    import subprocess
    import sys

    root = tmp_path / "it's a store"
    store = tl.open(root)
    store.record(InPlaceAfter(), torch.randn(4, 8), name="r")
    store.flush()  # (its rows into the file, which the other process reads directly)
    code = (
        "import duckdb, sys; con = duckdb.connect(sys.argv[1]); "
        "print(con.execute('SELECT name, status FROM runs').fetchall()); con.close()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root / "catalog.duckdb")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "('r', 'complete')" in done.stdout
    store.record(InPlaceAfter(), torch.randn(4, 8), name="s")  # and the writer goes on
    assert set(store.runs()["name"]) == {"r", "s"}


def test_a_catalog_left_attached_is_detached_by_the_next_transaction(tmp_path: Path) -> None:
    """A transaction whose detach failed leaves the catalog attached to the process's
    writing DuckDB; the next transaction detaches it first (and only then: a clean one
    skips those statements), and lets go of the file as always."""
    from tracelake.store import catalog

    store = tl.open(tmp_path / "s")
    store.record(InPlaceAfter(), torch.randn(4, 8), name="r")
    assert not catalog._ENGINE.attached
    con = catalog._ENGINE.connection()
    con.execute(f"ATTACH '{tmp_path / 's' / 'catalog.duckdb'}' AS tl_catalog")
    catalog._ENGINE.attached = True
    store.record(InPlaceAfter(), torch.randn(4, 8), name="s")  # (sealed: no transaction)
    store.flush()  # a transaction: inserts the sealed run's rows
    assert not catalog._ENGINE.attached
    assert con.execute(
        "SELECT count(*) FROM duckdb_databases() WHERE database_name = 'tl_catalog'"
    ).fetchone() == (0,)
    assert set(store.runs()["name"]) == {"r", "s"}


@pytest.mark.parametrize("rows", [128, 4096], ids=["mid-size", "own-array"])
def test_what_the_user_writes_after_a_step_is_not_stored(tmp_path: Path, rows: int) -> None:
    """Large and mid-size tensors are written from the forward's own memory while the
    next steps run; a step's output (and input) that the caller writes in place after
    the step, outside any recording, keeps its value as of the step."""
    x = torch.randn(rows, 1024)
    given = x.clone()
    model = InPlaceAfter()
    store = tl.open(tmp_path / "s")
    with store.recording("steps", model) as rec:
        first = model(x)
        want = first.clone()
        first.mul_(-1)  # the caller's own in-place write, after the step
        x.add_(5)  # and on the input, before the next step
        rec.record(model, x)
    run = store["steps"]
    assert_bitwise(run.step(0)["output_1"].out, want, "step 0's output, as returned")
    assert_bitwise(run.step(0)["input_1"].out, given, "step 0's input, as given")
    assert_bitwise(run.step(1)["input_1"].out, x, "step 1's input")


@pytest.mark.parametrize(
    ("held", "rows", "dtype"),
    [
        ("writing", 128, torch.float32),
        ("statistics", 128, torch.float16),  # (a zstd pack's: torch reductions)
        ("writing", 4096, torch.float32),
    ],
    ids=["mid-size", "mid-size-half", "own-array"],
)
def test_the_end_of_a_step_waits_for_no_write_of_a_tensor_only_the_writer_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str, rows: int, dtype: torch.dtype
) -> None:
    """While a worker writes a tensor from the forward's own memory (holding its lock),
    the end of the step (``settle``) finds nothing but the writer holding it and goes
    on: the worker reads the memory without a handle on its storage, which would count
    as a holder outside the writer, and make the step's end wait for the write only to
    copy bytes by then written (~4 ms of a GPT-2 step, a 32 MiB copy on the wide model)."""
    from tracelake.recorder import stats as stats_module
    from tracelake.store import tensors as tensors_module

    inside, go = threading.Event(), threading.Event()
    module, name = (  # where the worker is held: writing, or computing its statistics
        (stats_module, "_real")
        if held == "statistics"
        else (RunArrays, "write_pack_chunk")
        if rows == 128
        else (tensors_module, "encode_chunk")
    )
    writes = getattr(module, name)

    def held_back(*args: object, **kwargs: object) -> object:
        inside.set()  # the worker holds the tensor's lock, its bytes being read
        go.wait(30)
        return writes(*args, **kwargs)

    monkeypatch.setattr(module, name, held_back)
    writer = TensorWriter(RunArrays(tmp_path / "t", "r", create=True, flat=True))
    x = torch.randn(rows, 1024).to(dtype)
    slot = writer.save(x * 3)  # a temporary of the forward: only the writer holds it
    writer.flush()
    assert inside.wait(30), "the worker never started the write"
    settling = threading.Thread(target=writer.settle)
    settling.start()
    settling.join(10)
    waited = settling.is_alive()
    go.set()
    settling.join()
    writer.close()
    assert not waited, "the end of the step waited for the worker's write"
    loc = writer.location(slot)
    arrays = writer.arrays
    if loc.offset >= 0:
        got = arrays.read_packed(loc.array, loc.offset, loc.nbytes, loc.dtype, loc.shape, "x")
    else:
        got = arrays.read_array(loc.array, loc.dtype, loc.shape, "x")
    assert_bitwise(got, x * 3, "the tensor, written from the forward's memory")


class Unseen(nn.Module):
    """Writes a saved tensor in place where the recorder cannot see it."""

    def __init__(self, gate: object):
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        with torch._C.DisableTorchFunction():
            a.add_(1)  # no torch function mode here: only its version counter moves
        self.gate.set()  # type: ignore[attr-defined]
        return a * 3


@pytest.mark.parametrize(
    ("rows", "write"), [(128, "write_pack_chunk"), (4096, "write_array")], ids=["mid-size", "own"]
)
def test_an_unseen_in_place_write_drops_the_value_never_stores_it_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, write: str
) -> None:
    import threading
    import warnings

    gate = threading.Event()
    writes = getattr(RunArrays, write)

    def held_back(self: RunArrays, *args: object, **kwargs: object) -> object:
        gate.wait(30)  # the workers start only once the forward has written `a`
        return writes(self, *args, **kwargs)

    monkeypatch.setattr(RunArrays, write, held_back)
    x = torch.randn(rows, 1024)
    store = tl.open(tmp_path / "s")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = store.record(Unseen(gate), x, name="r")
    assert any("mul_1_1 was written in place" in str(w.message) for w in caught)
    assert not run["mul_1_1"].saved and run["mul_1_1"].out is None
    assert_bitwise(run["mul_2_2"].out, (x * 2 + 1) * 3, "the next op, stored")
    assert_bitwise(run["input_1"].out, x, "the input")
    assert not store.verify().problems


def test_unsynced_files_are_durable_at_close_and_errors_surface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's window of files written but not yet durable: a thread of its own
    syncs them; close() waits for all of them and raises what syncing raised."""
    import os

    from tracelake.store import tensors

    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(tensors.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    pending = tensors.Unsynced(window=2)
    fds = []
    for k in range(7):
        fd = os.open(tmp_path / f"f{k}", os.O_WRONLY | os.O_CREAT)
        os.write(fd, b"x" * 1000)
        fds.append(fd)
        pending.add(fd)
    pending.close()
    assert sorted(synced) == sorted(fds)
    for fd in fds:  # every one closed
        with pytest.raises(OSError):
            os.fstat(fd)

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(tensors.os, "fdatasync", failing)
    pending = tensors.Unsynced(window=2)
    for k in range(3):
        pending.add(os.open(tmp_path / f"g{k}", os.O_WRONLY | os.O_CREAT))
    with pytest.raises(OSError, match="Input/output"):
        pending.close()


def test_files_left_to_the_caller_are_written_back_not_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's writer leaves durability to the run's commit (``sync=False``): its large
    files, written through the page cache (``DIRECT`` off, or a filesystem refusing
    ``O_DIRECT``), are written back (pages out and waited for, then dropped), never
    fdatasync'd one by one; small ones are just closed; every descriptor is closed; a
    failed writeback surfaces at close(), and the files read back as written."""
    import ctypes
    import os

    from tracelake.store import local

    monkeypatch.setattr(local, "DIRECT", False)
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(local.os, "fdatasync", lambda fd: calls.append(("fdatasync", fd)))
    real = local._SYNC_FILE_RANGE
    assert real is not None, "Linux's sync_file_range is missing from libc"

    def written_back(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(("range", flags))
        return int(real(fd, offset, nbytes, flags))

    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", written_back)
    store = local.LocalBackend(tmp_path / "objects")
    pending = store.pending(window=2, sync=False)
    big = [bytes([k]) * (2 * MiB + k) for k in range(5)]
    for k, data in enumerate(big):
        store.put(f"big/{k}", [data[:1000], data[1000:]], pending)
    for k in range(3):
        store.put(f"small/{k}", [b"s" * 1000], pending)
    pending.close()
    assert calls == [("range", 7)] * 5, "large files written back, and only that"
    assert [store.get(f"big/{k}") for k in range(5)] == big
    assert store.get("small/2") == b"s" * 1000
    opened = set(os.listdir("/proc/self/fd"))
    pending = store.pending(sync=False)
    store.put("big/again", [big[0]], pending)  # (the descriptor goes in close())
    pending.close()
    assert set(os.listdir("/proc/self/fd")) <= opened, "a descriptor was left open"

    def failing(fd: int, offset: int, nbytes: int, flags: int) -> int:
        ctypes.set_errno(5)
        return -1

    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", failing)
    pending = store.pending(window=2, sync=False)
    for k in range(3):
        store.put(f"bad/{k}", [big[0]], pending)
    with pytest.raises(OSError, match="Input/output"):
        pending.close()


@pytest.mark.parametrize(("ops", "rows"), [(2, 4), (24, 512)])
def test_every_file_of_a_run_is_durable_before_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ops: int, rows: int
) -> None:
    """The writer syncs no file itself: the run's commit makes them durable before what
    makes the run visible (one syncfs of the filesystem for many files, an fsync each,
    all at once, for a few), and nothing is written after it: for a new store's first
    run, the COMMIT of the catalog transaction that makes the catalog; for the next, its
    seal. Tiny tensors: three files (group and pack metadata, one shard); 49 of 2 MiB:
    a pack of two dozen shards."""
    from tracelake.store import catalog, layout

    events: list[tuple[str, frozenset[str]]] = []
    runs = tmp_path / "s" / "runs"

    def in_run(path: Path) -> str:  # (staged under .staging/<dir>, then renamed to <id>)
        parts = path.relative_to(runs).parts if path.is_relative_to(runs) else ()
        if len(parts) < 2:
            return str(path)
        return "/".join(parts[2:] if parts[0] == ".staging" else parts[1:])

    earlier: set[Path] = set()  # the files of the runs recorded before this one

    def files() -> frozenset[str]:
        return frozenset(in_run(p) for p in runs.rglob("*") if p.is_file() and p not in earlier)

    real_syncfs, real_fsync = layout._syncfs, layout._fsync_one
    assert real_syncfs is not None, "Linux's syncfs is missing from libc"
    synced: set[str] = set()

    # Syncs that take a while: a commit that did not wait for those going on beside it
    # (the first run's, begun before its transaction) would come before them.
    def syncfs(fd: int) -> int:
        time.sleep(0.2)
        events.append(("syncfs", files()))
        return int(real_syncfs(fd))

    def fsync_one(path: str | int, is_dir: bool) -> None:
        # a path, or a descriptor opened beforehand (its file's name now, maybe renamed)
        name = os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else path
        time.sleep(0.05)
        synced.add(in_run(Path(name)))
        real_fsync(path, is_dir)

    committing: list[bool] = []  # inside commit_batch

    def visible(name: str) -> Any:
        real = getattr(catalog.CatalogWriter, name)

        def commit(self: catalog.CatalogWriter, *args: object, **kwargs: object) -> object:
            if name == "commit_batch":
                committing.append(True)
                try:
                    return real(self, *args, **kwargs)
                finally:
                    committing.pop()
            if name == "seal" or committing:
                events.append(("commit", files()))
            return real(self, *args, **kwargs)

        return commit

    monkeypatch.setattr(layout, "_syncfs", syncfs)
    monkeypatch.setattr(layout, "_fsync_one", fsync_one)
    # what makes a run visible: its seal, or the COMMIT of the transaction that inserts
    # its rows (a new store's first run: its files' syncs go on while the transaction
    # inserts them, and are waited for before that COMMIT)
    for name in ("seal", "commit_batch", "_commit"):
        monkeypatch.setattr(catalog.CatalogWriter, name, visible(name))
    if ops > 2:  # the pack's two dozen shards and their directories: one syncfs (the
        # bound itself, 48, is a measured trade-off; here it only picks the path)
        monkeypatch.setattr(layout, "_FSYNC_FILES", 8)

    class Chain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(ops):
                x = x * 1.5 + 0.25
            return x

    store = tl.open(tmp_path / "s", create=True)
    x = torch.randn(rows, 1024)
    for name in ("first", "sealed"):
        events.clear()
        synced.clear()
        earlier.update(runs.rglob("*") if runs.exists() else ())
        store.record(Chain(), x, name=name)
        kinds = [kind for kind, _ in events]
        written = events[kinds.index("commit")][1]
        tensors = {f for f in written if f.startswith("tensors/")}
        if ops == 2:
            assert len(tensors) == 3 and "syncfs" not in kinds
            assert tensors <= synced, "a file not fsync'd before the commit"
        else:
            assert len(tensors) > 8 and kinds.index("syncfs") < kinds.index("commit")
            assert tensors <= events[kinds.index("syncfs")][1], "a file written after the syncfs"
        assert {f for f in files() if f.startswith("tensors/")} == tensors, "written after"
        run = tl.open(tmp_path / "s")[name]
        assert_bitwise(run[f"add_1_2:{ops}"].out, Chain()(x), "the last op")


@pytest.mark.parametrize("syncfs", [False, True])
def test_every_file_of_a_batch_is_durable_before_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: bool
) -> None:
    """A batch's files are synced while its tables are built and its transaction inserts
    them (their directories renamed to their ids meanwhile), and the COMMIT that makes
    the runs visible waits for every sync: each file (told by its inode: its name moves)
    was fsync'd, or a syncfs of the filesystem had ended, before that COMMIT. Syncs are
    slowed, so that a commit not waiting for them would come first."""
    from tracelake.store import catalog, layout

    runs = tmp_path / "s" / "runs"
    store = tl.open(tmp_path / "s", create=True)
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    store.record(model, x, name="before")
    earlier = {p for p in runs.rglob("*") if p.is_file()}
    synced: set[int] = set()
    at_commit: list[tuple[int, set[int], set[int]]] = []  # (files, their inodes, synced)
    whole: list[int] = []  # syncfs calls ended (each covers every file there was)

    def batch_files() -> list[Path]:  # the batch's runs' arrays (not its bookkeeping),
        # by name: a file's inode may be another's (metadata shared by a hard link)
        return [p for p in runs.rglob("tensors/**/*") if p.is_file() and p not in earlier]

    def inodes() -> set[int]:
        return {p.stat().st_ino for p in batch_files()}

    real_syncfs, real_fsync = layout._syncfs, layout._fsync_one
    assert real_syncfs is not None, "Linux's syncfs is missing from libc"

    def slow_syncfs(fd: int) -> int:
        time.sleep(0.2)
        there = inodes()
        done = int(real_syncfs(fd))
        synced.update(there)
        whole.append(1)
        return done

    def fsync_one(path: str | int, is_dir: bool) -> None:
        time.sleep(0.02)
        inode = os.fstat(path).st_ino if isinstance(path, int) else os.stat(path).st_ino
        real_fsync(path, is_dir)
        synced.add(inode)

    real_commit = catalog.CatalogWriter._commit

    def commit(self: catalog.CatalogWriter, *args: Any, **kwargs: Any) -> None:
        at_commit.append((len(batch_files()), inodes(), set(synced)))
        real_commit(self, *args, **kwargs)

    monkeypatch.setattr(layout, "_syncfs", slow_syncfs)
    monkeypatch.setattr(layout, "_fsync_one", fsync_one)
    monkeypatch.setattr(layout, "_FSYNC_FILES", 4 if syncfs else 1 << 20)
    monkeypatch.setattr(catalog.CatalogWriter, "_commit", commit)
    with store.batch():
        for k in range(3):
            store.record(model, x, name=f"b{k}")
    count, files, durable = at_commit[-1]  # (the batch's: the last transaction)
    assert count >= 9, "three runs' group and pack metadata and shards"
    assert bool(whole) == syncfs
    assert files <= durable, "a file not durable before the COMMIT"
    for k in range(3):
        assert_bitwise(tl.open(tmp_path / "s")[f"b{k}"]["linear_1_1"].out, model(x), "out")


_SHAPE = (4, 4)


@pytest.mark.parametrize(
    ("values", "identity", "distinct", "codes"),
    [
        ([], False, [], []),
        ([_SHAPE] * 3, False, [_SHAPE], [0, 0, 0]),
        ([tuple([4, 4]), tuple([4, 4]), (2,)], False, [_SHAPE, (2,)], [0, 0, 1]),
        ([tuple([4, 4]), tuple([4, 4]), (2,)], True, [_SHAPE, _SHAPE, (2,)], [0, 1, 2]),
        ([_SHAPE, (2,), _SHAPE], True, [_SHAPE, (2,)], [0, 1, 0]),
        (("b", "a", "b", "c", "a"), False, ["b", "a", "c"], [0, 1, 0, 2, 1]),
        (
            [torch.float32, torch.int64, torch.float32],
            False,
            [torch.float32, torch.int64],
            [0, 1, 0],
        ),
        ([1, 1.0, True], False, [1], [0, 0, 0]),  # a dict's idea of equal
    ],
)
def test_distinct_codes(values: list, identity: bool, distinct: list, codes: list) -> None:
    """Distinct values in order of first appearance and each row's index into them; by
    identity, equal values that are other objects may stay apart (the rows of one
    value are one value however they are compared)."""
    got, got_codes = distinct_codes(values, identity=identity)
    assert got == distinct and [type(v) for v in got] == [type(v) for v in distinct]
    assert got_codes.dtype == np.int32 and got_codes.tolist() == codes


class Heads(nn.Module):
    """GPT-2's attention's per-head views: one projection split three ways, each viewed
    per head and transposed (strided views of one storage, which the workers gather into
    their pack's buffer), then the projection written in place: as an op the recorder
    sees (``before_write``), or where it cannot (``gate``: an unseen write, which only
    moves the version counter). Returns one head's view: its storage outlives the step."""

    def __init__(self, gate: threading.Event | None = None, write: bool = True):
        super().__init__()
        self.gate = gate
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = x * 2
        q, k, v = qkv.split(x.shape[-1] // 3, dim=-1)
        heads = [t.view(*t.shape[:2], 4, -1).transpose(1, 2) for t in (q, k, v)]
        if self.gate is not None:
            with torch._C.DisableTorchFunction():
                qkv.add_(1)
            self.gate.set()
        elif self.write:
            qkv.add_(1)
        return heads[0]


def test_files_written_directly_wait_for_nothing_but_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large files are written with ``O_DIRECT`` (their blocks from a staging buffer, the
    last partial block through the page cache): left to the caller's durability they
    are closed at once, neither written back nor fdatasync'd; made durable on the spot
    they are fdatasync'd (their metadata and the device's cache); they read back as
    written, and every descriptor is closed."""
    import os

    from tracelake.store import local

    if not local.DIRECT:
        pytest.skip("no O_DIRECT here")
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    calls: list[str] = []
    monkeypatch.setattr(local.os, "fdatasync", lambda fd: calls.append("fdatasync"))
    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", lambda *a: calls.append("range") or 0)
    opened_direct: list[bool] = []
    create = local._create
    monkeypatch.setattr(
        local,
        "_create",
        lambda path, extra=0: (opened_direct.append(bool(extra)), create(path, extra))[1],
    )
    store = local.LocalBackend(tmp_path / "objects")
    opened = set(os.listdir("/proc/self/fd"))
    pending = store.pending(window=2, sync=False)
    big = [bytes([k + 1]) * (local.DIRECT_BYTES + 4096 * k + 3 * k) for k in range(4)]
    for k, data in enumerate(big):
        store.put(f"big/{k}", [data[:1001], data[1001:]], pending)
    store.put("small", [b"s" * 100], pending)
    pending.close()
    assert opened_direct == [True] * 4 + [False]
    assert calls == [], "no writeback, no fdatasync: the commit makes them durable"
    assert [store.get(f"big/{k}") for k in range(4)] == big
    assert set(os.listdir("/proc/self/fd")) <= opened, "a descriptor was left open"
    store.put("now", [big[1]])  # durable on the spot
    assert calls == ["fdatasync"] and store.get("now") == big[1]
    huge = np.arange(3 * local.STAGE_BYTES // 8 + 5, dtype=np.int64)  # several stagings
    store.put("huge", [huge, b"tail"])
    assert store.get("huge") == huge.tobytes() + b"tail"


def _gathered(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each strided tensor saved went to a worker to gather (recorded)."""
    seen: list[bool] = []
    gather_later = TensorWriter._gather_later

    def spy(self: TensorWriter, *args: object) -> bool:
        seen.append(gather_later(self, *args))  # type: ignore[arg-type]
        return seen[-1]

    monkeypatch.setattr(TensorWriter, "_gather_later", spy)
    return seen


@pytest.mark.parametrize("write", [False, True], ids=["no-write", "seen-write"])
def test_strided_views_gathered_by_the_workers_read_back_as_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: bool
) -> None:
    """Strided views of mid-size tensors are gathered by a worker rather than copied on
    the forward thread; each reads back bit for bit as it was when recorded, in-place
    write of their storage afterwards or not, with its own statistics, as the in-memory
    trace has them."""
    seen = _gathered(monkeypatch)
    x = torch.randn(4, 128, 768)
    want = tl.trace(Heads(write=write), x)
    run = tl.open(tmp_path / "s").record(Heads(write=write), x, name="r")
    assert seen.count(True) >= 9, "the split, view and transpose of q, k and v"
    for op in want:
        got = run[op.label]
        assert_bitwise(got.out, op.out, op.label)
        # (a strided tensor's are reduced from its contiguous copy, as before workers
        # gathered it: sums in another order, the last bits apart from the trace's)
        for name, value in zip(STATS, astuple(op.stats), strict=True):
            assert math.isclose(getattr(got.stats, name), value, rel_tol=1e-12), (op.label, name)
    assert not tl.open(tmp_path / "s").verify().problems


def test_a_gathered_view_the_caller_writes_after_the_step_keeps_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's output that is a strided view (its storage held by the caller, so it
    is gathered at the step's end, before the caller's code runs) keeps its value as of
    the step when the caller then writes it in place."""
    seen = _gathered(monkeypatch)
    x = torch.randn(4, 128, 768)
    model = Heads(write=False)
    store = tl.open(tmp_path / "s")
    with store.recording("steps", model) as rec:
        out = model(x)
        want = out.clone()
        out.mul_(-1)  # the caller's in-place write, on the storage of every view
        rec.record(model, x)
    assert any(seen)
    run = store["steps"]
    assert_bitwise(run.step(0)["output_1"].out, want, "step 0's output, as returned")
    assert_bitwise(run.step(0)["transpose_1_6"].out, want, "the view it is")
    assert_bitwise(run.step(1)["split_2_3"].out, (x * 2)[..., 256:512], "step 1's split")


def test_an_unseen_write_before_the_gather_drops_the_views_never_stores_them_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker gathers a strided view only if its version counter has not moved: one
    written where the recorder cannot see it is dropped, with a warning, like any tensor
    written in place unseen."""
    import warnings

    seen = _gathered(monkeypatch)
    gate = threading.Event()
    write_chunk = TensorWriter._write_chunk

    def held_back(self: TensorWriter, *args: object) -> None:
        gate.wait(30)  # the workers gather only once the forward has written qkv
        write_chunk(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TensorWriter, "_write_chunk", held_back)
    x = torch.randn(4, 128, 768)
    store = tl.open(tmp_path / "s")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = store.record(Heads(gate), x, name="r")
    assert seen.count(True) >= 9
    for label in ("split_1_2", "view_2_7", "transpose_3_10"):
        assert any(f"{label} was written in place" in str(w.message) for w in caught), label
        assert not run[label].saved and run[label].out is None
    assert_bitwise(run["input_1"].out, x, "the input")
    assert not store.verify().problems


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=2, max_size=3),
    order=st.randoms(use_true_random=False),
    step=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.int32, torch.bfloat16]),
)
def test_strided_tensors_round_trip_bitwise(
    tmp_path_factory: pytest.TempPathFactory,
    shape: list[int],
    order: object,
    step: int,
    dtype: torch.dtype,
) -> None:
    """Any strided view (dimensions permuted, every ``step``-th row), of any size around
    ``GATHER_BYTES``, copied now or gathered by a worker, reads back as its values."""
    import random

    assert isinstance(order, random.Random)
    shape[-1] *= 64  # sizes on both sides of GATHER_BYTES (up to 442 KiB)
    base = (torch.randn(*shape) * 100).to(dtype)
    dims = list(range(len(shape)))
    order.shuffle(dims)
    views = [base.permute(*dims), base[::step], base.permute(*dims)[::step]]
    arrays = RunArrays(tmp_path_factory.mktemp("t"), "r", create=True, flat=True)
    writer = TensorWriter(arrays)
    slots = [writer.save(v) for v in views]
    writer.close()
    for slot, view in zip(slots, views, strict=True):
        loc = writer.location(slot)
        got = arrays.read_packed(loc.array, loc.offset, loc.nbytes, loc.dtype, loc.shape, "x")
        assert_bitwise(got, view.contiguous(), f"slot {slot}")


def test_a_strided_tensor_the_writer_cannot_copy_fails_at_save_not_at_close(
    tmp_path: Path,
) -> None:
    """Only tensors of dtypes a plain byte copy holds (numpy's) are gathered later: one
    whose copy fails (a quantized tensor) fails at ``save``, on the forward thread, as it
    did, and the writer's other tensors are written (not the whole run's ``close``)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch deprecates quantized tensors)
        q = torch.quantize_per_tensor(torch.randn(300, 300), 0.1, 0, torch.qint8)
    arrays = RunArrays(tmp_path / "t", "r", create=True, flat=True)
    writer = TensorWriter(arrays)
    with pytest.raises(RuntimeError, match="quantized"):
        writer.save(q.t())
    kept = torch.randn(300, 300).t()
    slot = writer.save(kept)
    writer.close()
    loc = writer.location(slot)
    got = arrays.read_packed(loc.array, loc.offset, loc.nbytes, loc.dtype, loc.shape, "x")
    assert_bitwise(got, kept.contiguous(), "the strided tensor saved after")
