"""A store written by older code (format 1: commit 017e061, ``tests/data/format1/``) still
opens, reads, queries, verifies and takes new runs with this code.

The store is opened in new processes (this file run as a script), as a user opens a store
written long before: nothing the writer left in memory can help. The first process checks
what the old code wrote and appends a run; a second one reopens the store and reads the
new run back beside the old ones. Each process reports what it found as JSON; the tests
below compare that report with ``facts.json`` and ``expected.npz`` (the values the old code
read back right after writing, bfloat16 as its uint16 bits).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).parent / "data" / "format1"
OLD_RUNS = ["base", "relu-only", "steps"]  # in the order they were recorded
RELU_LABELS = ("relu_1_2", "relu_2_6")


def test_runs_listed() -> None:
    report = _report("read")
    assert report["runs"] == OLD_RUNS
    assert report["gone"]["listed"] is False
    assert report["gone"]["status"] not in (None, "complete")
    assert report["gone"]["lookup"] == "RunNotFoundError"


def test_steps_and_labels_as_written() -> None:
    facts = json.loads((DATA / "facts.json").read_text())["runs"]
    report = _report("read")
    assert report["steps"] == {name: facts[name]["steps"] for name in OLD_RUNS}
    assert report["labels"] == {name: facts[name]["labels"] for name in OLD_RUNS}


def test_every_saved_tensor_bitwise() -> None:
    report = _report("read")
    assert report["tensors"]["mismatched"] == []
    assert report["tensors"]["missing"] == [] and report["tensors"]["unexpected"] == []
    with _expected() as expected:
        assert report["tensors"]["checked"] == len(expected.files)


def test_queries() -> None:
    q = _report("read")["queries"]
    # base and steps saved every op; relu-only saved its ReLUs: 1 + 1 + 2 steps, 2 each
    assert q["relu"]["rows"] == 8
    assert q["relu"]["mismatched"] == []
    assert q["meta_lr"] == ["base"]
    assert q["meta_lr_ops"] == ["base"]
    assert q["stats"]["rows"] == 8
    assert q["stats"]["absmax_off"] == []
    assert q["nan"] == 0


def test_verify_clean() -> None:
    verify = _report("read")["verify"]
    assert verify == {"ok": True, "runs": 3, "problems": []}


def test_append_to_old_store() -> None:
    appended = _report("read")["append"]
    assert appended["same"] is True
    # the run is written as format 1 wrote runs (chunks under c/), in a store still of
    # format 1: the tracelake that made the store reads it
    assert appended["format"] == 1
    assert appended["files"] == ["pack_raw/c/0", "pack_raw/zarr.json", "zarr.json"]
    reopened = _report("reopen")
    assert reopened["runs"] == [*OLD_RUNS, "new"]
    assert reopened["new_same"] is True
    assert reopened["new_by_meta"] == ["new"]
    assert reopened["old_still"] is True
    assert reopened["verify"] == {"ok": True, "runs": 4, "problems": []}


# -- the processes that open the store ---------------------------------------------------

_REPORTS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Extract the old store once; each phase runs in its own process, in order."""
    tmp = tmp_path_factory.mktemp("format1")
    with tarfile.open(DATA / "store.tar.gz") as tar:
        tar.extractall(tmp, filter="data")
    for phase in ("read", "reopen"):
        proc = subprocess.run(
            [sys.executable, __file__, phase, str(tmp / "store.tl"), str(DATA)],
            capture_output=True,
            text=True,
            cwd=tmp,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"{phase} process failed:\n{proc.stdout}\n{proc.stderr}"
        _REPORTS[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
    yield
    _REPORTS.clear()


def _report(phase: str) -> dict[str, Any]:
    report = _REPORTS[phase]
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    return report


def _expected() -> Any:
    import numpy as np

    return np.load(DATA / "expected.npz", allow_pickle=False)


# -- run in the child process ------------------------------------------------------------


def _bits(t: Any) -> Any:
    """A tensor as numpy, bfloat16 as its uint16 bits (as expected.npz holds it)."""
    import torch

    t = t.detach().cpu()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def _same(t: Any, want: Any) -> bool:
    got = _bits(t)
    return bool(
        got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    )


def _views(store: Any, name: str) -> list[Any]:
    run = store[name]
    return [run.step(k) for k in range(run.num_steps)]


def _listing(store: Any) -> dict[str, Any]:
    import tracelake as tl

    every = store.runs(all=True).set_index("name")["status"].to_dict()
    try:
        store["gone"]
        lookup = "found"
    except tl.TraceLakeError as exc:
        lookup = type(exc).__name__
    return {"listed": "gone" in list(store), "status": every.get("gone"), "lookup": lookup}


def _tensors(store: Any, expected: Any) -> dict[str, Any]:
    seen, mismatched, unexpected = set(), [], []
    for name in OLD_RUNS:
        for k, view in enumerate(_views(store, name)):
            for label in view.labels:
                out, key = view[label].out, f"{name}/{k}/{label}"
                if out is None:
                    continue
                if key not in expected.files:
                    unexpected.append(key)
                    continue
                seen.add(key)
                if not _same(out, expected[key]):
                    mismatched.append(key)
    missing = sorted(set(expected.files) - seen)
    return {
        "checked": len(seen),
        "mismatched": mismatched,
        "missing": missing,
        "unexpected": unexpected,
    }


def _keys(frame: Any) -> list[str]:
    """expected.npz's keys of a result's rows: run/step/label."""
    return [
        f"{r}/{s}/{lab}"
        for r, s, lab in zip(frame["run"], frame["step"], frame["label"], strict=True)
    ]


def _queries(store: Any, expected: Any) -> dict[str, Any]:
    import numpy as np

    relu = store.query("select run, step, label, out from ops where func = 'relu'")
    frame = relu.df()
    off = [
        key
        for key, out in zip(_keys(frame), relu.tensors(), strict=True)
        if out is None or not _same(out, expected[key])
    ]
    stats = store.query(
        "select run, step, label, absmax from ops where func = 'relu' and absmax >= 0"
    ).df()
    absmax_off = [
        key
        for key, value in zip(_keys(stats), stats["absmax"], strict=True)
        if not np.isclose(value, np.abs(expected[key]).max(), rtol=1e-6)
    ]
    return {
        "relu": {"rows": len(frame), "mismatched": off},
        "meta_lr": store.query("select name from runs where meta.lr > 0.05").df()["name"].tolist(),
        "meta_lr_ops": sorted(
            set(
                store.query("select run from ops where meta.lr > 0.05 and label = 'relu_1_2'")
                .df()["run"]
                .tolist()
            )
        ),
        "stats": {"rows": len(stats), "absmax_off": absmax_off},
        "nan": len(store.query("select run, label from ops where nan_count > 0").df()),
    }


def _verify(store: Any) -> dict[str, Any]:
    report = store.verify()
    return {"ok": report.ok, "runs": report.runs, "problems": [str(p) for p in report.problems]}


def _new_model() -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), torch.randn(4, 8)


def _append(store: Any) -> dict[str, Any]:
    import torch

    model, x = _new_model()
    with torch.no_grad():
        store.record(model, x, name="new", meta={"lr": 0.5})
        want = model(x)
    root = Path(store.path)
    arrays = root / "runs" / f"{store['new'].id:08d}" / "tensors"
    return {
        "same": _same(store["new"]["relu_1_2"].out, _bits(want)),
        "format": json.loads((root / "tracelake.json").read_text())["format"],
        "files": sorted(p.relative_to(arrays).as_posix() for p in arrays.rglob("*") if p.is_file()),
    }


def _section(report: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        report[key] = fn()
    except Exception:
        report[key] = {"error": traceback.format_exc()}


def _child(phase: str, root: str, data: str) -> dict[str, Any]:
    import numpy as np
    import torch

    import tracelake as tl

    torch.set_num_threads(1)
    expected = np.load(Path(data) / "expected.npz", allow_pickle=False)
    store = tl.open(root, create=False)
    report: dict[str, Any] = {"runs": list(store)}
    if phase == "read":
        _section(report, "gone", lambda: _listing(store))
        _section(report, "steps", lambda: {n: store[n].num_steps for n in OLD_RUNS})
        _section(
            report,
            "labels",
            lambda: {n: [list(v.labels) for v in _views(store, n)] for n in OLD_RUNS},
        )
        _section(report, "tensors", lambda: _tensors(store, expected))
        _section(report, "queries", lambda: _queries(store, expected))
        _section(report, "verify", lambda: _verify(store))
        _section(report, "append", lambda: _append(store))
    else:
        model, x = _new_model()
        with torch.no_grad():
            want = _bits(model(x))
        report["new_same"] = _same(store["new"]["relu_1_2"].out, want)
        report["new_by_meta"] = (
            store.query("select name from runs where meta.lr > 0.2").df()["name"].tolist()
        )
        key = "steps/1/relu_2_6"
        report["old_still"] = _same(store["steps"].step(1)["relu_2_6"].out, expected[key])
        _section(report, "verify", lambda: _verify(store))
    store.close()
    return report


if __name__ == "__main__":
    print(json.dumps(_child(*sys.argv[1:4])))
