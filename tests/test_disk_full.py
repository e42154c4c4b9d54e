"""Hardening (issue 17, item 12): a full disk. On a small filesystem of its own (a tmpfs
mounted for the test; skipped, saying why, only where mounting is impossible), recording
until the disk is full fails with a ``StoreError`` that names the cause; ``delete`` and
``gc`` still work on the full disk and give the space back; the same process then
records again, and every run kept reads back bitwise."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hook_capture import assert_bitwise
from torch import nn

import tracelake as tl


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs at a fresh directory, unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24M", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_full_disk_is_a_store_error_and_space_comes_back(small_disk: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    x = torch.randn(512, 512)  # ~3.2 MB a run
    store = tl.open(small_disk / "s")
    kept: list[str] = []
    failures: list[tl.StoreError] = []
    for i in range(20):
        try:
            store.record(model, x, name=f"r{i}")
            kept.append(f"r{i}")
        except tl.StoreError as exc:  # nothing else may come out
            failures.append(exc)
            if len(failures) == 3:
                break
    assert kept and len(failures) == 3
    for exc in failures:
        assert "No space left on device" in str(exc)
        assert "disk holding the store is full" in str(exc)
    # a tiny run fails too: the disk is full, not just short of a large run's room
    with pytest.raises(tl.StoreError, match="full"):
        store.record(nn.Linear(2, 2), torch.randn(1, 2), name="tiny")
    assert _free(small_disk) < 1 << 20
    assert list(store.runs()["name"]) == kept

    # reclaim through tracelake, on the full disk
    store.delete(kept[0])
    store.delete(kept[1])
    freed = store.gc()
    assert freed["runs"] >= 2 and freed["bytes"] > 6_000_000
    assert _free(small_disk) > 6_000_000

    # the same process records again (its catalog writer recovered) and nothing is lost
    store.record(model, x, name="after")
    fresh = tl.open(small_disk / "s", create=False)
    assert list(fresh.runs()["name"]) == [*kept[2:], "after"]
    assert set(fresh.runs(all=True)["status"]) <= {"complete", "collected"}
    plain = model(x)
    for name in [*kept[2:], "after"]:
        assert_bitwise(fresh[name]["output_1"].out, plain)
    assert fresh.verify().ok
    # a second gc() finds nothing left behind by the failures
    assert fresh.gc()["bytes"] == 0
