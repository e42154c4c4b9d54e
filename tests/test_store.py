"""The store end to end: record, reopen in another process, read back bit for bit.

Every comparison is against what plain PyTorch gives: forward hooks on the same model
(tests/hook_capture.py), or an in-memory ``tl.trace`` of the same forward.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from model_zoo import BUILDERS
from torch import nn

import tracelake as tl
from tracelake.store.format import chunk_key
from tracelake.store.tensors import CHUNK_BYTES

TESTS = Path(__file__).parent


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (tests/ on its path); fail loudly if it fails."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=TESTS,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


# -- round trip across processes --------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILDERS))
def test_record_then_reopen_elsewhere_matches_forward_hooks(tmp_path: Path, name: str) -> None:
    model, inputs = BUILDERS[name]()
    store = tl.open(tmp_path / "s")
    with torch.no_grad():
        run = store.record(model, *inputs, name=f"{name}-run", meta={"model": name})
    labels, n_ops = run.labels, len(run)
    # A different process opens the store, rebuilds the same seeded model, captures it
    # with plain forward hooks and compares every stored module call and op output.
    done = run_python(
        """
        import json, sys
        from collections import Counter
        import torch
        import tracelake as tl
        from hook_capture import assert_bitwise, call_label, flatten, run_with_hooks
        from model_zoo import BUILDERS

        root, name = sys.argv[1], sys.argv[2]
        model, inputs = BUILDERS[name]()
        with torch.no_grad():
            hooks = run_with_hooks(model, inputs)
            log = tl.trace(model, *inputs)
        run = tl.open(root, create=False)[f"{name}-run"]
        calls = Counter(path for path, _ in hooks.order)
        for path, call in hooks.order:
            label = call_label(path, call, calls)
            entry = run[label]
            for i, (got, want) in enumerate(zip(entry.outputs, hooks.outputs[(path, call)],
                                                strict=True)):
                assert_bitwise(got, want, f"{label} output {i}")
            for i, (got, want) in enumerate(zip(entry.inputs, hooks.inputs[(path, call)],
                                                strict=True)):
                assert_bitwise(got, want, f"{label} input {i}")
            assert len(flatten(entry.out)) == len(hooks.outputs[(path, call)])
        for op in log:
            stored = run[op.label]
            assert (stored.func, stored.kind, stored.module, stored.modules, stored.parents,
                    stored.children, stored.shape, stored.dtype, stored.pass_num) == (
                    op.func, op.kind, op.module, op.modules, op.parents, op.children,
                    op.shape, op.dtype, op.pass_num)
            assert_bitwise(stored.out, op.out, op.label)
        assert_bitwise(run[log.outputs[0].label].out, flatten(hooks.output)[0], "output")
        print(json.dumps({"labels": run.labels, "meta": run.meta}))
        """,
        str(tmp_path / "s"),
        name,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["labels"] == labels and len(labels) == n_ops
    assert seen["meta"] == {"model": name}


def test_stored_run_answers_like_a_trace(tmp_path: Path) -> None:
    model, inputs = BUILDERS["repeated_block"]()
    log = tl.trace(model, *inputs)
    run = tl.open(tmp_path / "s").record(model, *inputs, name="r")
    assert run.labels == log.labels
    assert run.module_labels == log.module_labels
    with pytest.raises(tl.AmbiguousLabelError) as info:
        run["block"]
    assert "block:2" in str(info.value)
    with pytest.raises(tl.LabelError, match="did you mean"):
        run["linear_1_2"]
    for op in log:
        stored = run[op.label]
        assert stored.source == op.source  # lines inside model_zoo.py's forward
        assert stored.source is None or stored.source.file.endswith("model_zoo.py")
        assert stored.stats is not None and op.stats is not None
        for field in ("mean", "std", "min", "max", "absmax", "l2", "frac_zero"):
            assert math.isclose(
                getattr(stored.stats, field), getattr(op.stats, field), rel_tol=1e-5, abs_tol=1e-6
            ), (op.label, field)
    df = run.df()
    assert list(df["label"]) == log.labels and df["saved"].all()


def test_save_selector_and_unsaved_ops(tmp_path: Path) -> None:
    model, inputs = BUILDERS["mlp"]()
    store = tl.open(tmp_path / "s")
    run = store.record(model, *inputs, name="relu-only", save=tl.func("relu"), stats="all")
    for op in run:
        if op.func == "relu":
            assert op.saved and op.out is not None and op.array is not None
        else:
            assert not op.saved and op.out is None and op.array is None
            assert op.stats is not None  # stats="all": computed during the forward
    nothing = store.record(model, *inputs, name="none", save=tl.none())
    assert not any(op.saved for op in nothing) and all(op.stats is None for op in nothing)


# -- dtypes -----------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


class Caster(nn.Module):
    """Emits one tensor of each dtype, small and large (a pack and an own array)."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for dtype in DTYPES:
            for base in (x[:3, :5], x):
                y = base * 3.5 - 1
                if dtype is torch.bool:
                    outs.append(y > 0)
                elif dtype is torch.complex64:
                    outs.append(torch.complex(y, -y))
                else:
                    outs.append(y.to(dtype))
        return outs


def test_every_dtype_round_trips_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    # 8.6 MiB in float32, 4.3 in bfloat16: own arrays; x[:3, :5] is packed.
    x = torch.randn(2048, 1100)
    x[0, 0] = float("nan")
    x[0, 1] = -0.0
    model = Caster()
    want = model(x)
    tl.open(tmp_path / "s").record(model, x, name="dtypes")
    run = tl.open(tmp_path / "s", create=False)["dtypes"]
    got = run["output_1"], *[run[f"output_{i}"] for i in range(2, len(want) + 1)]
    assert len(got) == len(want)
    for entry, w in zip(got, want, strict=True):
        assert_bitwise(entry.out, w, f"{entry.label} {w.dtype}")
    kinds = {
        run._only()._tensors._slots[s].array.startswith("t")
        for s in run._only()._tensors._op_slots.values()
    }
    assert kinds == {True, False}, "both packed and own-array tensors were exercised"
    # Plain zarr-python, knowing nothing of tracelake, reads the same bits.
    import zarr

    group = zarr.open_group(str(tmp_path / "s" / "runs" / f"{run.id:08d}" / "tensors"), mode="r")
    bf16 = run[f"output_{2 * DTYPES.index(torch.bfloat16) + 2}"]
    array = group[bf16.array._slot.array]
    assert array.attrs["torch_dtype"] == "bfloat16"
    bits = torch.from_numpy(array[...].view("uint16").astype("int32")).to(torch.int16)
    assert_bitwise(
        bits.view(torch.bfloat16),
        want[2 * DTYPES.index(torch.bfloat16) + 1],
        "bfloat16 through plain zarr",
    )
    # A new store is of format 2: every chunk a file beside its array's zarr.json, no
    # directory below an array's (format 1's c/ and one per leading index)
    assert json.loads((tmp_path / "s" / "tracelake.json").read_text())["format"] == 2
    tensors = tmp_path / "s" / "runs" / f"{run.id:08d}" / "tensors"
    assert [p for p in tensors.rglob("*") if p.is_dir() and p.parent != tensors] == []


# -- multi-step recordings --------------------------------------------------------------


def test_recording_block_records_each_forward_as_a_step(tmp_path: Path) -> None:
    model, (x,) = BUILDERS["mlp"]()
    store = tl.open(tmp_path / "s")
    inputs = [x, x * 2, x[:2]]
    with store.recording("gen", model, meta={"prompt": "A"}, save=tl.func("relu")) as rec:
        outs = [model(inp) for inp in inputs]  # called by user code: each call is a step
        rec.record(model, x + 1)  # explicit step
    run = store["gen"]
    assert run.num_steps == 4 and store.runs().loc[0, "steps"] == 4
    for k, (inp, out) in enumerate(zip([*inputs, x + 1], [*outs, model(x + 1)], strict=True)):
        step = run.step(k)
        assert_bitwise(step["input_1"].out if step["input_1"].saved else inp, inp, "input")
        relus = step.find(func="relu")
        assert len(relus) == 2
        want = torch.relu(model[0](inp))
        assert_bitwise(relus[0].out, want, f"step {k} relu")
        assert step["output_1"].shape == tuple(out.shape)
    with pytest.raises(tl.RecorderError, match=r"run.step\(k\)"):
        run["relu_1_2"]
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_recording_takes_the_model_and_name_as_record_does(tmp_path: Path) -> None:
    """``store.record(model, x, name=...)`` takes the model first; ``recording(model,
    name="gen")`` failed with Python's 'got multiple values for argument name', since
    ``recording`` took the name first. Either order works now, by position or keyword;
    a second name or model, or something that is neither, is a clear ``TypeError``."""
    model, (x,) = BUILDERS["mlp"]()
    store = tl.open(tmp_path / "s")
    calls = {
        "a": lambda: store.recording("a", model),
        "b": lambda: store.recording(model, "b"),
        "c": lambda: store.recording(model, name="c"),
        "d": lambda: store.recording(name="d", model=model),
        "e": lambda: store.recording("e", model=model),
    }
    for recording in calls.values():
        with recording():
            model(x)
    assert sorted(store.runs()["name"]) == sorted(calls)
    for name in calls:
        assert_bitwise(store[name]["output_1"].out, model(x), name)
    with store.recording(model):  # a name made up from the model's class
        model(x)
    assert len(store) == 6 and store.runs()["name"].str.startswith("sequential-").sum() == 1
    for wrong, message in (
        (lambda: store.recording("f", "g"), "second name"),
        (lambda: store.recording(model, model), "second model"),
        (lambda: store.recording(model, name="h", model=model), "second model"),
        (lambda: store.recording(3), "neither"),
        (lambda: store.recording("i", model, 3), "not 3 positional"),
    ):
        with pytest.raises(TypeError, match=message):
            wrong()
    assert len(store.runs(all=True)) == 6


def test_recording_that_raises_is_never_visible(tmp_path: Path) -> None:
    model, (x,) = BUILDERS["mlp"]()
    store = tl.open(tmp_path / "s")
    with pytest.raises(RuntimeError, match="boom"), store.recording("bad", model):
        model(x)
        raise RuntimeError("boom")
    assert "bad" not in store and len(store) == 0
    listed = store.runs(all=True)
    assert list(listed["status"]) == ["failed"]
    assert store.gc()["runs"] == 1
    assert len(store.runs(all=True)) == 0


# -- lazy, partial reads ----------------------------------------------------------------


class Wide(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


def test_partial_read_touches_only_the_chunks_it_needs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 256, 1024)  # 16 MiB float32: chunks of 4 rows of 256 x 1024
    run = tl.open(tmp_path / "s").record(Wide(), x, name="wide")
    entry = run["mul_1_2"]
    lazy = entry.array
    assert lazy.shape == (16, 256, 1024) and lazy.dtype == torch.float32
    want = torch.relu(x) * 2
    # Remove every chunk file but the one holding x[5]: a read of x[5, :, 3:9] must
    # still succeed, because it never opens another chunk.
    tensors = tmp_path / "s" / "runs" / f"{run.id:08d}" / "tensors"
    chunk_dir = tensors / lazy._slot.array
    # a store's arrays name their chunks flat: every one a file beside zarr.json
    assert sorted(p.name for p in chunk_dir.iterdir()) == [
        "0.0.0",
        "1.0.0",
        "2.0.0",
        "3.0.0",
        "zarr.json",
    ]
    for key in ("0.0.0", "2.0.0", "3.0.0"):
        (chunk_dir / key).unlink()
    assert_bitwise(lazy[5, :, 3:9], want[5, :, 3:9], "x[5, :, 3:9]")
    backwards = torch.from_numpy(want.numpy()[-11, ::-3, -5:].copy())
    assert_bitwise(lazy[-11, ::-3, -5:], backwards, "negative indices and steps")
    assert_bitwise(lazy[4:8, ..., 7], want[4:8, ..., 7], "ellipsis")
    with pytest.raises(tl.ChunkCorruptError) as info:
        lazy[0]
    assert "wide" in str(info.value) and "mul_1_2" in str(info.value)


# -- damage -----------------------------------------------------------------------------


def _flip_byte(root: Path, run: tl.Run, label: str, at: int, bit: int = 0x40) -> None:
    """Damage the first chunk file of the array holding ``label``'s tensor: one bit of
    its byte ``at``."""
    where = run[label].array._slot.array
    chunk = root / "runs" / f"{run.id:08d}" / "tensors" / chunk_key(where, 0)
    data = bytearray(chunk.read_bytes())
    data[at] ^= bit
    chunk.write_bytes(bytes(data))


def test_corrupted_chunk_is_reported_by_run_and_label(tmp_path: Path) -> None:
    model, inputs = BUILDERS["mlp"]()
    store = tl.open(tmp_path / "s")
    store.record(model, *inputs, name="ok")
    store.record(model, *inputs, name="damaged", save=tl.func("relu"))
    assert store.verify().ok
    run = store["damaged"]
    # a small run: its only chunk, in a pack tail
    assert run["relu_1_2"].array._slot.array.startswith("pack_raw")
    _flip_byte(tmp_path / "s", run, "relu_1_2", 10)
    fresh = tl.open(tmp_path / "s")
    with pytest.raises(tl.ChunkCorruptError) as info:
        _ = fresh["damaged"]["relu_1_2"].out
    assert "'damaged'" in str(info.value) and "relu_1_2" in str(info.value)
    report = fresh.verify()
    assert not report.ok
    assert {p.run for p in report.problems} == {"damaged"}
    assert "relu_1_2" in report.problems[0].label
    assert_bitwise(fresh["ok"]["relu_1_2"].out, torch.relu(model[0](inputs[0])), "intact run")


def test_verify_names_exactly_the_tensors_a_damaged_inner_chunk_holds(tmp_path: Path) -> None:
    """A byte flipped in the first inner chunk of a pack shard: verify() names the
    tensors whose reads fail, each once, and none that still reads back."""
    from tracelake.demo import DemoNet, demo_inputs

    store = tl.open(tmp_path / "s")
    torch.manual_seed(0)
    store.record(DemoNet().eval(), demo_inputs(), name="demo")
    _flip_byte(tmp_path / "s", store["demo"], "embedding_1_1", 1000)
    fresh = tl.open(tmp_path / "s")
    damaged, intact = set(), set()
    for op in fresh["demo"]:
        try:
            _ = op.out
        except tl.ChunkCorruptError:
            damaged.add(op.label)
        else:
            intact.add(op.label)
    assert damaged and intact  # the shard holds more than the damaged inner chunk
    named = [p.label for p in fresh.verify().problems]
    assert sorted(named) == sorted(damaged)


class _MidSize(nn.Module):
    """512 KiB float32 activations (GPT-2's), whose whole 64 KiB inner chunks the workers
    checksum, reduce and write from the tensors' own memory; the 28-byte slice makes the
    tensors after it start mid inner chunk."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2.0
        s = a[:1, :7] + 1.0
        b = torch.tanh(a)
        return b + s.sum()


def test_mid_size_tensors_round_trip_with_their_checksums_and_statistics(
    tmp_path: Path,
) -> None:
    """Written from their own memory with the compiled pass's checksums and statistics:
    reopened in a new process they equal a plain forward bit for bit; their statistics
    are compute_stats' numbers to the bit; verify() (zarr-python checking every CRC32C)
    finds nothing; a byte flipped inside one of those inner chunks is caught by a read
    and by verify()."""
    from tracelake.recorder.stats import compute_stats

    store = tl.open(tmp_path / "s", create=True)
    torch.manual_seed(0)
    x = torch.randn(128, 1024)
    run = store.record(_MidSize(), x, name="mid")
    offsets = {op.label: op.array._slot.offset for op in run}
    assert offsets["tanh_1_4"] % (64 << 10), "a tensor starting mid inner chunk"
    run_python(
        f"""
        import torch
        import tracelake as tl
        from hook_capture import assert_bitwise
        from test_store import _MidSize
        torch.manual_seed(0)
        x = torch.randn(128, 1024)
        a = x * 2.0
        s = a[:1, :7] + 1.0
        b = torch.tanh(a)
        want = {{"input_1": x, "mul_1_1": a, "getitem_1_2": a[:1, :7], "add_1_3": s,
                 "tanh_1_4": b, "add_2_6": b + s.sum(), "output_1": _MidSize()(x)}}
        run = tl.open({str(tmp_path / "s")!r}, create=False)["mid"]
        for label, tensor in want.items():
            assert_bitwise(run[label].out, tensor, label)
        """
    )
    for label in ("input_1", "mul_1_1", "tanh_1_4", "add_2_6"):
        assert run[label].stats == compute_stats(run[label].out), label
    assert store.verify().ok
    shard = tmp_path / "s" / "runs" / f"{run.id:08d}" / "tensors" / chunk_key("pack_raw", 0)
    data = bytearray(shard.read_bytes())
    inner = offsets["tanh_1_4"] // (64 << 10) + 1  # its first whole inner chunk
    data[inner * ((64 << 10) + 4) + 1000] ^= 0x01
    shard.write_bytes(bytes(data))
    fresh = tl.open(tmp_path / "s", create=False)
    with pytest.raises(tl.ChunkCorruptError, match="tanh_1_4"):
        _ = fresh["mid"]["tanh_1_4"].out
    assert_bitwise(fresh["mid"]["mul_1_1"].out, x * 2.0, "another chunk of the shard")
    problems = fresh.verify().problems
    assert problems and {p.label for p in problems} >= {"tanh_1_4"}


# -- names, lifecycle -------------------------------------------------------------------


def test_names_are_data_never_paths(tmp_path: Path) -> None:
    model, inputs = BUILDERS["mlp"]()
    store = tl.open(tmp_path / "s")
    odd = "../../etc/passwd; DROP TABLE runs; --"
    store.record(model, *inputs, name=odd)
    assert odd in store and store[odd].name == odd
    assert not (tmp_path / "etc").exists()
    for bad in ("", " padded ", "a\nb", "x" * 201):
        with pytest.raises(tl.InvalidRunNameError):
            store.record(model, *inputs, name=bad)
    with pytest.raises(tl.RunExistsError, match="overwrite=True"):
        store.record(model, *inputs, name=odd)
    replaced = store.record(model, *inputs, name=odd, overwrite=True, meta={"v": 2})
    assert store[odd].meta == {"v": 2} and store[odd].id == replaced.id
    assert len(store) == 1
    generated = store.record(model, *inputs)
    assert generated.name.startswith("sequential-")


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(tl.StoreNotFoundError):
        tl.open(tmp_path / "missing", create=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file.txt").write_text("x")
    with pytest.raises(tl.StoreFormatError, match="not a tracelake store"):
        tl.open(tmp_path / "busy")
    tl.open(tmp_path / "s")
    marker = tmp_path / "s" / "tracelake.json"
    marker.write_text(json.dumps({"format": 99}))
    with pytest.raises(tl.StoreFormatError, match="newer"):
        tl.open(tmp_path / "s")
    with pytest.raises(tl.RunNotFoundError):
        marker.write_text(json.dumps({"format": 1}))
        tl.open(tmp_path / "s")["nope"]
    with pytest.raises(ValueError, match="JSON"):
        tl.open(tmp_path / "s").record(nn.ReLU(), torch.ones(2), meta={"x": object()})


def test_a_new_store_makes_its_catalog_with_its_first_fold(tmp_path: Path) -> None:
    """Opening a new store runs no catalog transaction, and its first run is sealed as
    every run is: the catalog file comes with the first fold. Until a run is recorded
    readers (this process and another one) see no runs; then both see it, and the other
    process's read inserts its rows, making the catalog with its schema."""
    store = tl.open(tmp_path / "s")
    assert not (tmp_path / "s" / "catalog.duckdb").exists()
    assert len(store.runs()) == 0 and len(store.runs(all=True)) == 0
    assert len(tl.open(tmp_path / "s", create=False).sql("SELECT * FROM ops")) == 0
    store.record(nn.ReLU(), torch.randn(3), name="first")
    assert not (tmp_path / "s" / "catalog.duckdb").exists()
    done = run_python(
        "import sys, tracelake as tl; "
        "print(tl.open(sys.argv[1], create=False).runs()['name'].tolist())",
        str(tmp_path / "s"),
    )
    assert "['first']" in done.stdout
    assert (tmp_path / "s" / "catalog.duckdb").exists() and not store.paths.sealed_ids()
    tl.open(tmp_path / "s").record(nn.ReLU(), torch.randn(3), name="second")
    assert sorted(store.runs()["name"]) == ["first", "second"]


def test_delete_then_gc_reclaims_space(tmp_path: Path) -> None:
    model, inputs = BUILDERS["cnn"]()
    store = tl.open(tmp_path / "s")
    keep = store.record(model, *inputs, name="keep")
    gone = store.record(model, *inputs, name="gone")
    gone_dir = tmp_path / "s" / "runs" / f"{gone.id:08d}"
    assert gone_dir.exists()
    store.delete("gone")
    assert "gone" not in store and list(store.runs()["name"]) == ["keep"]
    with pytest.raises(tl.RunNotFoundError):
        store.delete("gone")
    with pytest.raises(TypeError, match="call it once for each"):
        store.delete(["keep", "gone"])  # type: ignore[arg-type]
    assert "keep" in store
    freed = store.gc()
    assert freed["runs"] == 1 and freed["bytes"] > 0 and not gone_dir.exists()
    assert store.verify().ok
    assert_bitwise(store["keep"]["output_1"].out, keep["output_1"].out, "kept run")


# -- bounded memory ---------------------------------------------------------------------


class Big(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(12):
            x = x + 1
        return x


def test_back_pressure_caps_bytes_in_flight(tmp_path: Path) -> None:
    x = torch.zeros(1024, 1024 * 2)  # 8 MiB per op, 12 ops: ~100 MiB through a 12 MiB cap
    cap = 3 * CHUNK_BYTES
    store = tl.open(tmp_path / "s")
    with store.recording("big", max_inflight=cap) as rec:
        rec.record(Big(), x)
        writer = rec._writer
    assert writer is not None
    assert writer.peak_inflight <= cap
    assert writer.bytes_written >= 12 * x.nbytes
    assert_bitwise(store["big"]["output_1"].out, x + 12, "output")


# -- the command line -------------------------------------------------------------------


class Cli:
    """Runs ``tracelake`` commands in this process (each in a subprocess would spend
    seconds importing torch) and keeps what they printed."""

    def __init__(self, capsys: pytest.CaptureFixture[str]):
        self.capsys = capsys

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        from tracelake.cli import main

        code = main(list(args))
        out, err = self.capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)


def test_cli_runs_show_verify_rm_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = Cli(capsys)
    model, inputs = BUILDERS["mlp"]()
    root = str(tmp_path / "s")
    store = tl.open(root)
    store.record(model, *inputs, name="base", meta={"lr": 0.1})
    store.record(model, *inputs, name="other")
    listed = json.loads(cli("runs", root, "--json").stdout)
    assert [r["name"] for r in listed] == ["base", "other"] and listed[0]["meta"] == {"lr": 0.1}
    human = cli("runs", root)
    assert human.returncode == 0 and "base" in human.stdout and "complete" in human.stdout
    ops = json.loads(cli("show", root, "base", "--json").stdout)
    assert [o["label"] for o in ops] == store["base"].labels
    assert ops[1]["func"] == "linear" and ops[1]["mean"] is not None
    shown = cli("show", root, "base")
    assert "relu_1_2" in shown.stdout and "linear" in shown.stdout
    missing = cli("show", root, "bsae")
    assert missing.returncode == 1 and "did you mean 'base'" in missing.stderr
    assert cli("runs", str(tmp_path / "none")).returncode == 1
    assert json.loads(cli("verify", root, "--json").stdout)["ok"] is True
    # damage one chunk: verify names the run and the labels, and fails
    _flip_byte(tmp_path / "s", store["other"], "relu_1_2", 3, bit=1)
    bad = cli("verify", root)
    assert bad.returncode == 1 and "other" in bad.stdout and "damaged" in bad.stdout
    assert cli("rm", root, "other").returncode == 0
    freed = json.loads(cli("gc", root, "--json").stdout)
    assert freed["runs"] == 1
    assert cli("verify", root).returncode == 0
    assert [r["name"] for r in json.loads(cli("runs", root, "--json", "--all").stdout)] == ["base"]
    # and once for real, as a script would run it: exit status and output
    done = subprocess.run(
        [sys.executable, "-m", "tracelake.cli", "verify", root, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["runs"] == 1


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(3, 7)  # a shape error, after some ops ran


def test_a_forward_that_raises_leaves_nothing_visible(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s")
    model = Broken()
    with pytest.raises(RuntimeError, match="shape"):
        store.record(model, torch.randn(2, 4), name="broken")
    assert "broken" not in store and len(store) == 0
    assert store.runs(all=True)["status"].tolist() == ["failed"]
    assert not model._forward_hooks and not model.lin._forward_hooks
    from torch.overrides import _get_current_function_mode_stack

    assert not _get_current_function_mode_stack()
    store.record(model.lin, torch.randn(2, 4), name="broken")  # the name is free again
    assert store.gc()["runs"] == 1 and store.verify().ok


def test_a_batch_commits_its_runs_together(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s")
    model, inputs = BUILDERS["mlp"]()
    store.record(model, *inputs, name="before")
    reader = tl.open(tmp_path / "s")  # another view of the store, as another process's
    returned = []
    with store.batch() as batch:
        for k in range(4):
            xs = tuple(x + k for x in inputs)
            returned.append(store.record(model, *xs, name=f"r{k}", meta={"k": k}))
        with pytest.raises(tl.StoreError, match=r"open store\.batch"):
            _ = returned[0].labels  # no id before the commit
        with store.recording("steps", model) as rec:  # a multi-step run, in the batch
            model(*inputs)
            rec.record(model, *inputs)
        with pytest.raises(tl.RunExistsError):  # taken earlier in this batch
            store.record(model, *inputs, name="r1")
        with pytest.raises(tl.RunExistsError):  # taken in the store
            store.record(model, *inputs, name="before")
        with pytest.raises(RuntimeError), store.recording("broken", model):
            raise RuntimeError("a failed run in a batch")
        with pytest.raises(tl.StoreError):
            store.batch().__enter__()  # batches do not nest
        assert sorted(reader.runs()["name"]) == ["before"]  # nothing visible yet
    assert batch.names == ["r0", "r1", "r2", "r3", "steps"]
    for k, run in enumerate(returned):  # what record returned is the committed run
        assert run.name == f"r{k}" and run.meta == {"k": k}
        assert run.info == reader[f"r{k}"].info  # its row, every column, as read back
        assert_bitwise(run["output_1"].out, reader[f"r{k}"]["output_1"].out, f"r{k}")
    assert sorted(reader.runs()["name"]) == ["before", "r0", "r1", "r2", "r3", "steps"]
    assert "broken" not in reader.runs(all=True)["name"].tolist()
    for k in range(4):
        xs = tuple(x + k for x in inputs)
        run = reader[f"r{k}"]
        assert run.meta == {"k": k}
        assert_bitwise(run["output_1"].out, model(*xs), f"r{k}")
    assert len(reader["steps"].steps) == 2
    runs_dir = tmp_path / "s" / "runs"
    assert len([p for p in runs_dir.iterdir() if p.name.isdigit()]) == 6
    assert not list((runs_dir / ".staging").iterdir())  # no staging left
    assert reader.verify().ok
    # a block that raises still commits the runs that completed; overwrite replaces
    with pytest.raises(KeyError), store.batch():
        store.record(model, *inputs, name="r0", overwrite=True, meta={"again": 1})
        raise KeyError("the user's error")
    assert reader["r0"].meta == {"again": 1}
    assert reader.gc()["runs"] == 1  # the replaced r0
    assert reader.verify().ok


@pytest.mark.parametrize("deferred", [None, (12, 15)], ids=["one-build", "several-builds"])
def test_runs_of_a_batch_have_the_rows_they_have_recorded_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deferred: tuple[int, int] | None
) -> None:
    """A batch builds its small runs' catalog rows together, several runs in one set of
    tables: each run's rows, every table and column but the run id, are the ones it
    gets recorded on its own (saved and unsaved ops, statistics of both, packs and
    own arrays, module entries, several steps, calls). ``deferred``: bounds on a run's
    ops and on the ops built at once that some runs pass (each built on its own) and
    the batch passes several times (built in groups)."""
    if deferred is not None:
        import tracelake.store.store as store_module

        monkeypatch.setattr(store_module, "DEFERRED_RUN_OPS", deferred[0])
        monkeypatch.setattr(store_module, "DEFERRED_OPS", deferred[1])
    cases = [
        ("mlp", "mlp", {}),
        ("cnn", "cnn", {"stats": "all", "save": tl.func("relu")}),
        ("block", "repeated_block", {"save": tl.none(), "stats": "all"}),
        ("lstm", "lstm", {}),
        ("mlp-2", "mlp", {"save": tl.func("linear")}),
        ("patched", "mlp", {"intervene": tl.when(tl.func("relu"), tl.scale(2.0))}),
    ]
    stores = {"alone": tl.open(tmp_path / "alone"), "batched": tl.open(tmp_path / "batched")}

    def record_all(store: tl.Store) -> None:
        for name, builder, options in cases:
            model, inputs = BUILDERS[builder]()
            torch.manual_seed(0)
            store.record(model, *inputs, name=name, **options)
        model, inputs = BUILDERS["mlp"]()
        with store.recording("steps", model, stats="all") as rec:
            model(*inputs)
            rec.record(model, *(x * 2 for x in inputs))

    torch.manual_seed(1)
    record_all(stores["alone"])
    torch.manual_seed(1)
    with stores["batched"].batch():
        record_all(stores["batched"])
    tables = ("ops", "edges", "modules", "tensors", "rules", "calls")
    for table in tables:
        frames = {}
        for kind, store in stores.items():
            frame = store.sql(
                f"SELECT r.name, t.* EXCLUDE (run_id) FROM {table} t JOIN runs r ON r.id = t.run_id"
            )
            frames[kind] = frame.sort_values(list(frame.columns[:3])).reset_index(drop=True)
        assert len(frames["alone"]) > 0, table
        assert frames["alone"].equals(frames["batched"]), table
    for store in stores.values():
        assert store.verify().ok
