"""Dask arrays over stored tensors (``result.to_dask()``, ``store.dask_array``): bitwise
what stacking the tensors gives, and what a plain forward computed; nothing read until
computed; clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracelake as tl
from tracelake.query import aggregate
from tracelake.store.tensors import RunArrays

torch.set_num_threads(1)


class Tower(torch.nn.Module):
    """Small activations (packed) from a repeated linear, and large ones (each in its own
    Zarr array, several chunks) from a wide projection."""

    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Linear(64, 64)
        self.wide = torch.nn.Linear(64, 1100)

    def forward(self, x: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
        for _ in range(12):
            x = torch.tanh(self.small(x))
        wide = big @ self.wide.weight.T  # (1100, 1100) float32: about 4.6 MiB
        return torch.relu(wide).sum() + torch.sigmoid(wide).mean() + x.sum()


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=g), torch.randn(1100, 64, generator=g)


def _plain(model: Tower, seed: int) -> dict[str, list[torch.Tensor]]:
    """The activations a plain forward computes (no tracelake)."""
    x, big = _inputs(seed)
    tanhs = []
    with torch.no_grad():
        for _ in range(12):
            x = torch.tanh(model.small(x))
            tanhs.append(x)
        wide = big @ model.wide.weight.T
    return {"tanh": tanhs, "relu": [torch.relu(wide)], "sigmoid": [torch.sigmoid(wide)]}


@pytest.fixture(scope="module")
def tower_store(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("agg") / "store"
    store = tl.open(root)
    torch.manual_seed(0)
    model = Tower()
    plain = {}
    for seed in (1, 2, 3):
        with torch.no_grad():
            store.record(model, *_inputs(seed), name=f"r{seed}")
        plain[f"r{seed}"] = _plain(model, seed)
    return root, store, plain


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(_bits(got), _bits(want))


ORDERED = "order by run, step, idx"


def test_packed_tensors_bitwise(tower_store, monkeypatch: pytest.MonkeyPatch) -> None:
    _root, store, plain = tower_store
    monkeypatch.setattr(aggregate, "BLOCK_BYTES", 5000)  # several rows a block, many blocks
    text = f"select run, out from ops where func = 'tanh' {ORDERED}"
    res = store.query(text)
    arr = res.to_dask()
    assert arr.shape == (36, 8, 64) and arr.dtype == np.float32
    assert arr.npartitions > 3
    got = arr.compute()
    assert_same_bits(got, res.stack().numpy())
    want = np.stack([t.numpy() for run in ("r1", "r2", "r3") for t in plain[run]["tanh"]])
    assert_same_bits(got, want)
    # a reduction Dask computes agrees with numpy's over the same values (in float64:
    # only the order of summation differs)
    got_mean = arr.astype(np.float64).mean(axis=0).compute()
    np.testing.assert_allclose(got_mean, want.astype(np.float64).mean(axis=0), atol=1e-12)


def test_own_arrays_bitwise_and_slices(tower_store) -> None:
    _root, store, plain = tower_store
    text = f"select out from ops where func in ('relu', 'sigmoid') {ORDERED}"
    res = store.query(text)
    arr = res.to_dask()
    assert arr.shape == (6, 1100, 1100)
    assert max(arr.chunks[1]) < 1100  # the array's own Zarr chunks, not one block
    want = np.stack(
        [plain[run][f][0].numpy() for run in ("r1", "r2", "r3") for f in ("relu", "sigmoid")]
    )
    assert_same_bits(arr.compute(), want)
    assert_same_bits(arr.compute(), res.stack().numpy())
    sliced = store.query(f"select out[-3::-7, 5:9] as s from ops where func = 'relu' {ORDERED}")
    got = sliced.to_dask().compute()
    assert_same_bits(got, sliced.stack().numpy())
    assert_same_bits(got[0], plain["r1"]["relu"][0].numpy()[-3::-7, 5:9])


def test_packed_and_own_rows_in_one_array(tower_store) -> None:
    """A slice to one shape of packed (8 x 64) and own (1100 x 1100) tensors: rows stay
    in the result's order across both kinds of source."""
    _root, store, _plain = tower_store
    text = f"select out[1:3, 0:4] as s from ops where func in ('tanh', 'relu') {ORDERED}"
    res = store.query(text)
    arr = res.to_dask("s")
    assert arr.shape == (39, 2, 4)
    assert_same_bits(arr.compute(), res.stack("s").numpy())


def test_nothing_read_until_computed(tower_store, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _store, plain = tower_store
    store = tl.open(root)  # a new reader
    calls = []
    real_packed, real_array = RunArrays.read_packed, RunArrays.read_array
    monkeypatch.setattr(RunArrays, "read_packed", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setattr(RunArrays, "read_array", lambda *a, **k: calls.append(a) or 1 / 0)
    arr = store.dask_array(f"select out from ops where func = 'tanh' and run = 'r2' {ORDERED}")
    assert calls == [] and arr.shape == (12, 8, 64)
    monkeypatch.setattr(RunArrays, "read_packed", real_packed)
    monkeypatch.setattr(RunArrays, "read_array", real_array)
    assert_same_bits(arr.compute(), np.stack([t.numpy() for t in plain["r2"]["tanh"]]))


def test_in_a_new_process_with_a_pca(tower_store, tmp_path: Path) -> None:
    """Reopen the store in a new process, compute there (a PCA as docs/query.md shows
    it), compare here with a plain forward's values."""
    root, _store, plain = tower_store
    script = f"""
import numpy as np, dask.array as da, tracelake as tl
store = tl.open({str(root)!r}, create=False)
x = store.dask_array("select out from ops where func = 'tanh' {ORDERED}")
np.save({str(tmp_path / "x.npy")!r}, x.compute())
rows = x.reshape(-1, 64)
centred = rows - rows.mean(axis=0)
u, s, v = da.linalg.svd(centred.rechunk({{1: -1}}))
np.save({str(tmp_path / "s.npy")!r}, s.compute())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    want = np.stack([t.numpy() for run in ("r1", "r2", "r3") for t in plain[run]["tanh"]])
    assert_same_bits(np.load(tmp_path / "x.npy"), want)
    rows = want.reshape(-1, 64).astype(np.float64)
    expected = np.linalg.svd(rows - rows.mean(axis=0), compute_uv=False)
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), expected, rtol=1e-4)


def test_errors(tower_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _root, store, _plain = tower_store
    with pytest.raises(tl.QueryError, match="differ in shape"):
        store.query("select out from ops where func in ('tanh', 'relu')").to_dask()
    with pytest.raises(tl.QueryError, match="no stored tensors"):
        store.query("select mean(out[0]) as m from ops where func = 'tanh'").to_dask("m")
    with pytest.raises(tl.QueryError, match="no rows"):
        store.dask_array("select out from ops where func = 'conv2d'")
    # unsaved rows, and a dtype numpy lacks
    other = tl.open(tmp_path / "other")
    lin = torch.nn.Linear(4, 4)
    with torch.no_grad():
        other.record(lin, torch.randn(2, 4), name="half", save=~tl.func("linear"))
        other.record(lin.bfloat16(), torch.randn(2, 4).bfloat16(), name="bf")
    with pytest.raises(tl.QueryError, match="no saved tensor"):
        other.dask_array("select out from ops where func = 'linear' and run = 'half'")
    with pytest.raises(tl.QueryError, match="numpy has no dtype for bfloat16"):
        other.dask_array("select out from ops where func = 'linear' and run = 'bf'")
    # Dask missing: the extra is named
    monkeypatch.setitem(sys.modules, "dask.array", None)
    with pytest.raises(tl.MissingExtraError, match=r"pip install 'tracelake\[scale\]'") as exc:
        store.dask_array("select out from ops where func = 'tanh'")
    assert isinstance(exc.value, ImportError) and isinstance(exc.value, tl.TraceLakeError)


def test_missing_chunk_is_corruption_not_zeros(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s")
    torch.manual_seed(0)
    model = Tower()
    with torch.no_grad():
        store.record(model, *_inputs(1), name="r")
    row = store.query("select run, array from ops where func = 'relu'").df().iloc[0]
    chunks = sorted((tmp_path / "s" / "runs").glob(f"*/tensors/{row['array']}/*.*"))
    assert len(chunks) > 1
    chunks[-1].unlink()
    with pytest.raises(tl.ChunkCorruptError, match="missing"):
        store.dask_array("select out from ops where func = 'relu'")


def test_default_path_imports_no_dask_or_obstore(tower_store) -> None:
    root, _store, _plain = tower_store
    script = f"""
import sys, tracelake as tl
store = tl.open({str(root)!r}, create=False)
store.query("select out from ops where func = 'tanh'").stack()
loaded = [m for m in sys.modules if m.split(".")[0] in ("dask", "obstore")]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
