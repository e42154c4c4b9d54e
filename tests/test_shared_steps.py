"""The ``ops`` and ``edges`` rows of steps of one graph (every step of a loop) are built
once and gathered into each step's place (``rows._distinct_steps``): they must be the
rows built step by step, for loops whose first step differs, layers of several passes,
selective saving, statistics of every op, recorded calls and batches of runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tracelake as tl
from tracelake.store import rows


class Looped(nn.Module):
    """A block run three times (layers of several passes) and, on its first call only,
    an extra op: the loop's first step is a graph of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            x = x * 2
        for _ in range(3):
            x = self.block(x) + x
        a, b = torch.chunk(x, 2, dim=1)
        return self.head(torch.cat([b, a], dim=1)).relu()


def _record(store: tl.Store, **options: Any) -> None:
    torch.manual_seed(0)
    model, x = Looped(), torch.randn(3, 4)
    with torch.no_grad():
        with store.recording("loop", model, **options):
            for _ in range(4):
                model(x)
        with store.batch():  # small runs built together
            for k in range(3):
                store.record(model, x + k, name=f"tiny{k}", **options)


def _tables(store: tl.Store) -> dict[str, str]:
    return {
        table: store.sql(f"select * exclude (run_id) from {table} order by {order}").to_json(
            orient="records", default_handler=str
        )
        for table, order in (("ops", "step, idx, label"), ("edges", "step, child, edge, parent"))
    }


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"save": tl.func("linear", "relu")},
        {"stats": "all", "save": tl.none()},
        {"capture": tl.options.CaptureOptions(record_args=True)},
    ],
    ids=["save-all", "selective", "stats-all", "record-args"],
)
def test_steps_of_one_graph_have_the_rows_built_step_by_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    shared = tl.open(tmp_path / "shared")
    found: list[tuple[int, int]] = []
    distinct = rows._distinct_steps

    def counting(tables: list[Any]) -> Any:
        out = distinct(tables)
        found.append((len(out[0]), len(tables)))
        return out

    monkeypatch.setattr(rows, "_distinct_steps", counting)
    _record(shared, **options)
    assert (2, 4) in found  # the loop: its first step, and one graph for the other three

    def every_step(tables: list[Any]) -> Any:
        import numpy as np

        return list(range(len(tables))), np.arange(len(tables))

    monkeypatch.setattr(rows, "_distinct_steps", every_step)
    alone = tl.open(tmp_path / "alone")
    _record(alone, **options)
    assert _tables(shared) == _tables(alone)
