"""Source tensors no ``TorchFunctionMode`` sees, ``torch.from_numpy`` and
``torch.Tensor([...])``, are recorded as TorchLens records them (``fromnumpy``, ``new``),
through replacements installed only while a recording runs (recorder/sources.py): torch
is restored exactly afterwards, and other threads are not recorded."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hook_capture import assert_bitwise
from test_store import run_python
from torch import nn

import tracelake as tl

torchlens = pytest.importorskip("torchlens", minversion="2.36.1")
from torchlens.backends.torch.wrappers import unwrap_torch  # noqa: E402

FROM_NUMPY = torch.from_numpy


class Sources(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        #: Called in the middle of the forward (a test parks a thread there).
        self.between = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.from_numpy(np.arange(3, dtype=np.float32))
        self.between()
        weights = torch.Tensor([0.5, 1.0, 2.0])
        return self.fc(x + offsets) * weights


X = torch.randn(2, 3)
LABELS = ["input_1", "fromnumpy_1_1", "new_1_2", "add_1_3", "linear_1_4", "mul_1_5", "output_1"]


def _restored() -> None:
    assert torch.from_numpy is FROM_NUMPY
    assert "__new__" not in torch.Tensor.__dict__


def test_sources_are_recorded_as_torchlens_records_them() -> None:
    torch.manual_seed(0)
    model = Sources()
    trace = tl.trace(model, X)
    _restored()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            log = torchlens.trace(model, X)
        finally:
            unwrap_torch()
    assert trace.labels == [op.label.split(":")[0] for op in log.ops] == LABELS
    assert trace["add_1_3"].parents == ("input_1", "fromnumpy_1_1")
    assert trace["mul_1_5"].parents == ("linear_1_4", "new_1_2")
    assert trace["fromnumpy_1_1"].func == "from_numpy" and trace["new_1_2"].func == "new"
    assert_bitwise(trace["fromnumpy_1_1"].out, torch.arange(3.0), "from_numpy")
    assert_bitwise(trace["new_1_2"].out, torch.tensor([0.5, 1.0, 2.0]), "new")
    assert_bitwise(trace["output_1"].out, model(X), "output")
    assert trace.find(func="from_numpy") == [trace["fromnumpy_1_1"]]


def test_torch_is_restored_after_a_forward_that_raises() -> None:
    model = Sources()

    def boom() -> None:
        raise ValueError("boom")

    model.between = boom
    with pytest.raises(ValueError, match="boom"):
        tl.trace(model, X)
    _restored()
    assert torch.Tensor([1.0]).tolist() == [1.0]  # the C constructor is back


def test_other_threads_are_not_recorded_and_get_torchs_results() -> None:
    model = Sources()
    inside, done = threading.Event(), threading.Event()
    seen: dict[str, torch.Tensor] = {}

    def park() -> None:
        inside.set()
        assert done.wait(20)

    def other() -> None:
        assert inside.wait(20)
        seen["numpy"] = torch.from_numpy(np.ones(2, dtype=np.float32))
        seen["new"] = torch.Tensor([3.0, 4.0])
        done.set()

    model.between = park
    thread = threading.Thread(target=other)
    thread.start()
    trace = tl.trace(model, X)
    thread.join()
    assert trace.labels == LABELS  # nothing of the other thread's
    assert seen["numpy"].tolist() == [1.0, 1.0] and seen["new"].tolist() == [3.0, 4.0]
    _restored()


def test_subclasses_and_the_recorders_own_tensors_are_left_alone() -> None:
    class Tagged(torch.Tensor):
        pass

    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tagged = Tagged([1.0, 2.0, 3.0])  # a subclass: torch's constructor, as is
            assert type(tagged) is Tagged
            return x + tagged.as_subclass(torch.Tensor)

    trace = tl.trace(Model(), X, stats="all")
    assert "new_1_1" not in trace.labels
    assert_bitwise(trace["output_1"].out, X + torch.tensor([1.0, 2.0, 3.0]), "output")
    _restored()


def test_a_stored_run_keeps_the_sources_across_processes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Sources()
    store = tl.open(tmp_path / "s.tl")
    store.record(model, X, name="r", save=tl.all())
    _restored()
    code = r"""
import json, sys, tracelake as tl
store = tl.open(sys.argv[1], create=False)
rows = store.query("select label, func from ops where run = 'r' order by idx").df()
run = store["r"]
print(json.dumps({
    "rows": [[r.label, r.func] for r in rows.itertuples()],
    "numpy": run["fromnumpy_1_1"].out.tolist(),
    "new": run["new_1_2"].out.tolist(),
    "out": run["output_1"].out.tolist(),
    "selected": store.query("select label from ops where func = 'fromnumpy'").df()["label"]
    .tolist(),
}))
"""
    got = json.loads(run_python(code, str(tmp_path / "s.tl")).stdout)
    assert [label for label, _ in got["rows"]] == LABELS
    assert dict(got["rows"])["new_1_2"] == "new"
    assert got["numpy"] == [0.0, 1.0, 2.0] and got["new"] == [0.5, 1.0, 2.0]
    assert torch.equal(torch.tensor(got["out"]), model(X))
    assert got["selected"] == ["fromnumpy_1_1"]
