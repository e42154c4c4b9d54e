"""How a ``store.batch()`` stages its runs and writes a small run's tensors, end to end.

A batch keeps its runs in one directory of its own under one writing lock (not one of
each a run), a small run's last chunk is written by the recording thread itself (no
hand-off to the workers), and a run's fingerprints hash the same bytes whichever path
reads them. What a user sees must not change: every run of a batch reads back bit for
bit as the plain forward gives it, in another process too; a ``gc()`` meanwhile, from
anywhere, takes nothing of an open batch; a run that fails inside a batch leaves
nothing behind and the others commit; a write that fails is a ``StoreError``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store import run_python
from torch import nn

import tracelake as tl
from tracelake.store.tensors import RunArrays


def _staging(root: Path) -> list[Path]:
    staging = root / "runs" / ".staging"
    return list(staging.iterdir()) if staging.is_dir() else []


def test_a_batch_stages_its_runs_in_one_directory_no_gc_can_take(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = tl.open(root)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    inputs = [torch.randn(2, 8) + k for k in range(4)]
    with store.batch() as batch:
        for k, x in enumerate(inputs[:3]):
            store.record(model, x, name=f"r{k}")
        with pytest.raises(RuntimeError), store.recording("broken", model):
            model(inputs[3])
            raise RuntimeError("a failed run in the batch")
        store.record(model, inputs[3], name="r3")
        (staged,) = _staging(root)  # one directory for the batch, one lock in it
        files = sorted(p.name for p in staged.iterdir() if p.is_file())
        assert files == ["staged.jsonl", "writing.lock"]  # (what listing the runs shows)
        listed = tl.open(root, create=False).runs(all=True).set_index("name")["status"]
        assert listed.to_dict() == {f"r{k}": "recording" for k in range(4)}  # not "broken"
        assert len([p for p in staged.iterdir() if p.is_dir()]) == 4  # the failed one: gone
        # a gc() of another process while the batch is open takes none of it
        done = run_python(
            "import sys, tracelake as tl; print(tl.open(sys.argv[1]).gc())", str(root)
        ).stdout
        assert "'orphans': 0" in done, done
        assert store.gc()["orphans"] == 0  # nor one of this process (another open file)
        assert staged.is_dir() and len(list(staged.iterdir())) == 6
    assert batch.names == ["r0", "r1", "r2", "r3"]
    assert not _staging(root)  # committed: nothing staged left
    assert sorted(p.name for p in (root / "runs").iterdir()) == [".staging"] + [
        f"{i:08d}" for i in (1, 2, 3, 4)
    ]
    code = """
        import sys, torch, tracelake as tl
        store = tl.open(sys.argv[1], create=False)
        print(sorted(store.runs()["name"]), store.verify().ok)
        torch.save({n: store[n]["output_1"].out for n in ["r0", "r1", "r2", "r3"]}, sys.argv[2])
    """
    saved = tmp_path / "outs.pt"
    assert run_python(code, str(root), str(saved)).stdout.split() == [
        "['r0',",
        "'r1',",
        "'r2',",
        "'r3']",
        "True",
    ]
    outs = torch.load(saved)
    for k, x in enumerate(inputs):  # bit for bit, as the plain forward gives them
        assert_bitwise(outs[f"r{k}"], model(x), f"r{k}")


def test_a_batch_whose_commit_fails_leaves_its_runs_to_gc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracelake.store import catalog

    root = tmp_path / "s"
    store = tl.open(root)
    model, x = nn.Linear(4, 4), torch.randn(3, 4)
    store.record(model, x, name="before")

    def refused(*_: object, **__: object) -> object:
        raise tl.StoreError("the catalog refused the batch")

    monkeypatch.setattr(catalog.CatalogWriter, "commit_batch", refused)
    with pytest.raises(tl.StoreError, match="refused"), store.batch():
        store.record(model, x, name="lost")
    monkeypatch.undo()
    listed = store.runs(all=True).set_index("name")["status"].to_dict()
    assert listed == {"before": "complete", "lost": "interrupted"}
    assert len(_staging(root)) == 1  # its lock let go: gc's to remove
    collected = store.gc()
    assert collected["runs"] == 1 and collected["orphans"] == 0 and not _staging(root)
    with store.batch():  # and the store takes the name afterwards
        store.record(model, x, name="lost")
    assert_bitwise(store["lost"]["output_1"].out, model(x), "lost")
    assert store.verify().ok


@pytest.mark.parametrize("in_batch", [False, True], ids=["run", "batch"])
def test_a_small_run_whose_write_fails_is_a_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_batch: bool
) -> None:
    """A small run's last chunk is written by the recording thread itself: a failure
    there surfaces as a worker's would, and the run stays invisible."""
    store = tl.open(tmp_path / "s")
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    store.record(model, x, name="ok")
    writes = RunArrays.write_pack_chunk

    def failing(self: RunArrays, *args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(RunArrays, "write_pack_chunk", failing)
    if in_batch:
        with pytest.raises(tl.StoreError, match="writing tensors failed"), store.batch():
            store.record(model, x, name="bad")
    else:
        with pytest.raises(tl.StoreError, match="writing tensors failed"):
            store.record(model, x, name="bad")
    monkeypatch.setattr(RunArrays, "write_pack_chunk", writes)
    assert sorted(store.runs()["name"]) == ["ok"]
    with store.batch():
        store.record(model, x + 1, name="after")
    assert_bitwise(store["after"]["output_1"].out, model(x + 1), "after")
    store.gc()
    assert store.verify().ok


def test_fingerprints_do_not_depend_on_memory_layout(tmp_path: Path) -> None:
    """The same parameter and input values give the same fingerprints, whether their
    tensors are plain contiguous ones (hashed from their memory at once) or not."""
    store = tl.open(tmp_path / "s")
    torch.manual_seed(0)
    plain = nn.Linear(6, 6)
    strided = nn.Linear(6, 6)
    with torch.no_grad():
        strided.weight = nn.Parameter(plain.weight.detach().t().contiguous().t())
        strided.bias.copy_(plain.bias)
    assert not strided.weight.is_contiguous()
    x = torch.randn(3, 6)
    y = x.t().contiguous().t()
    with store.batch():
        store.record(plain, x, name="plain")
        store.record(strided, y, name="strided")
    store.record(plain, x + 1, name="other-input")
    with torch.no_grad():
        plain.weight[0, 0] += 1
    store.record(plain, x, name="other-weights")
    fingerprints = {
        name: (store[name].info["param_fingerprint"], store[name].info["input_fingerprint"])
        for name in ("plain", "strided", "other-input", "other-weights")
    }
    assert fingerprints["plain"] == fingerprints["strided"]
    params, given = fingerprints["plain"]
    assert fingerprints["other-input"][0] == params and fingerprints["other-input"][1] != given
    assert fingerprints["other-weights"][0] != params and fingerprints["other-weights"][1] == given


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    scale=st.sampled_from([1.0, 1e-3, 1e6]),
    special=st.sampled_from([None, "nan", "inf", "constant"]),
    seed=st.integers(0, 2**16),
)
def test_a_few_tiny_tensors_statistics_are_the_general_paths_to_the_bit(
    dtype: torch.dtype, sizes: list[int], scale: float, special: str | None, seed: int
) -> None:
    """A small run's chunk (a few tiny tensors of one dtype) gathers its tensors' bytes
    by slices; the statistics are those of the index-built gather, bit for bit."""
    import numpy as np

    from tracelake.store import writer

    gen = torch.Generator().manual_seed(seed)
    buffer = np.zeros(1 << 16, dtype=np.uint8)
    slots: list[tuple[str, int, int, tuple[int, ...], torch.dtype, int]] = []
    at = 0
    for k, n in enumerate(sizes):
        values = torch.randn(n, generator=gen) * scale
        if special == "nan" and k % 3 == 0:
            values[0] = math.nan
        elif special == "inf" and k % 3 == 0:
            values[-1] = math.inf
        elif special == "constant":
            values.fill_(3.0)
        tensor = values.to(dtype)
        buffer[at : at + tensor.nbytes] = tensor.view(torch.uint8).numpy()
        slots.append(("pack", at, tensor.nbytes, (n,), dtype, 0))
        at = (at + tensor.nbytes + 63) & -64
    members = list(range(len(sizes)))
    fast = writer._chunk_stats(buffer, 0, members, slots)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer, "_FEW", 0)
        general = writer._chunk_stats(buffer, 0, members, slots)
    assert len(fast[0]) == len(general[0])
    for (slots_a, moments_a), (slots_b, moments_b) in zip(fast[0], general[0], strict=True):
        assert np.array_equal(slots_a, slots_b)
        assert np.array_equal(moments_a, moments_b, equal_nan=True)  # to the bit
        assert moments_a.tobytes() == moments_b.tobytes()
    assert fast[1].keys() == general[1].keys()
    for slot, stats in fast[1].items():
        assert repr(stats) == repr(general[1][slot])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.bool]
)
def test_a_fingerprint_is_the_same_whichever_path_hashes_the_tensor(dtype: torch.dtype) -> None:
    from tracelake.store.store import _fingerprint

    values = (torch.randn(7, 5) * 4).to(dtype)
    strided = values.t().contiguous().t()  # the same values, not contiguous
    assert values.is_contiguous() and not strided.is_contiguous()
    assert _fingerprint([("w", values)]) == _fingerprint([("w", strided)])
    assert _fingerprint([("w", nn.Parameter(values, requires_grad=False))]) == _fingerprint(
        [("w", values)]
    )
    assert _fingerprint([("w", values)]) != _fingerprint([("w", torch.zeros_like(values))])


def test_names_the_store_makes_up_never_repeat_however_fast_runs_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run recorded without a name gets one the store makes up, from the model's class,
    the second and random bits. Thousands of runs a second (a batch of tiny runs) made
    24 random bits repeat, and the batch failed with ``RunExistsError`` for a name its
    user never chose. Here the random bits always repeat: the names must not."""
    import os

    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: b"\0" * n if n == 3 else real(n))
    store = tl.open(tmp_path / "s", create=True)
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    with store.batch():
        runs = [store.record(model, x) for _ in range(3)]
    alone = store.record(model, x)
    names = [run.name for run in [*runs, alone]]
    assert len(set(names)) == 4
    assert sorted(store.runs()["name"]) == sorted(names)
    assert all(name.startswith("linear-") for name in names)


def test_runs_recorded_in_a_loop_open_their_arrays_only_when_read(tmp_path: Path) -> None:
    """A loop of many runs keeps nothing of each open: the ``Run`` that ``record``
    returns opens its arrays when first read (each one opened stays in the store's
    cache, so a loop of 10,000 unread runs kept 10,000: ~1.5 MB a thousand)."""
    store = tl.open(tmp_path / "s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    inputs = [torch.randn(2, 8) + k for k in range(12)]
    returned = [store.record(model, x) for x in inputs[:4]]
    with store.batch():
        returned += [store.record(model, x) for x in inputs[4:]]
    assert store._open_arrays.ids() == []  # twelve runs recorded, none read yet
    for k in (1, 6):  # read back, one alone and one of the batch: bit for bit
        run = returned[k]
        out = run[run.labels[-1]].array[...]
        assert_bitwise(out, model(inputs[k]).detach())
    assert sorted(store._open_arrays.ids()) == sorted(returned[k].id for k in (1, 6))


def test_a_store_keeps_only_the_runs_it_read_last_open(tmp_path: Path) -> None:
    """Runs read by name and by query stay open only up to the store's bound (before,
    every run a long-lived store ever read stayed open: ~0.7 KB each); a run it let go
    reads back bit for bit when read again, by name and by a query."""
    store = tl.open(tmp_path / "s")
    store._open_arrays.kept = 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    inputs = [torch.randn(2, 8) + k for k in range(6)]
    with store.batch():
        names = [store.record(model, x, name=f"r{k}").name for k, x in enumerate(inputs)]
    for name, x in zip(names, inputs, strict=True):
        run = store[name]
        assert_bitwise(run[run.labels[-1]].array[...], model(x).detach())
        assert len(store._open_arrays.ids()) <= 3
    assert store._open_arrays.ids() == [store[n].id for n in names[-3:]]
    first = store[names[0]]  # let go: opened again
    assert_bitwise(first[first.labels[-1]].array[...], model(inputs[0]).detach())
    got = {
        row["run"]: row["out"]
        for row in store.query("select run, out from ops where func = 'relu'")
    }
    assert sorted(got) == names
    for name, x in zip(names, inputs, strict=True):
        assert_bitwise(got[name], model(x).detach())
    assert len(store._open_arrays.ids()) == 3


def test_a_query_opening_runs_again_asks_the_catalog_nothing_per_run(tmp_path: Path) -> None:
    """A query over more runs than the store keeps open opens the others again; their
    names and creation times (what each identity marker is checked against) come from
    the catalog mirror's runs table, not from a catalog query a run (0.9 ms each: a
    label stacked across 1,000 runs took 0.9 s). A run whose directory holds another
    run's data is still refused."""
    store = tl.open(tmp_path / "s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    inputs = [torch.randn(2, 8) + k for k in range(6)]
    with store.batch():
        for k, x in enumerate(inputs):
            store.record(model, x, name=f"r{k}")
    store._open_arrays.kept = 2
    asked: list[str] = []
    query = store._query
    store._query = lambda sql, *a, **k: (asked.append(sql), query(sql, *a, **k))[1]  # type: ignore[method-assign]
    for _ in range(2):  # the second time every run is opened again (two kept of six)
        stacked = store.query("select out from ops where func = 'relu' order by run").stack()
        assert_bitwise(stacked, torch.stack([model(x).detach() for x in inputs]))
    assert not [sql for sql in asked if "FROM runs WHERE id" in sql]
    marker = store.paths.run_marker(store["r0"].id)
    marker.write_text(marker.read_text().replace('"created": ', '"created": 1'))
    fresh = tl.open(tmp_path / "s", create=False)  # (nothing open: r0 is opened, checked)
    with pytest.raises(tl.StoreError, match="another run's data"):
        fresh.query("select out from ops where func = 'relu' and run = 'r0'").stack()
