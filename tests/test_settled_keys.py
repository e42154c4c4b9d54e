"""A graph recorded again (every step of a loop) takes its keys and blocks from the
settled graph's, computed once: they must be those computed afresh, inputs named by
keyword included."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import tracelake as tl
from tracelake.recorder import entries


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x) * scale
        return torch.chunk(x, 2, dim=1)[0].sum()


def _keys(store: tl.Store, run: str) -> dict[int, list[tuple[str, str, object]]]:
    rows = store.query(f"select step, label, key, block from ops where run = '{run}'").df()
    out: dict[int, list[tuple[str, str, object]]] = {}
    for step, label, key, block in zip(
        rows["step"], rows["label"], rows["key"], rows["block"], strict=True
    ):
        kept = None if block != block else int(block)  # (pandas' NaN: none)
        out.setdefault(int(step), []).append((label, key, kept))
    return out


def test_a_graph_recorded_again_keeps_the_keys_computed_afresh(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, scale = Tower(), torch.randn(3, 4), torch.tensor(0.5)
    store = tl.open(tmp_path / "s")
    with torch.no_grad(), store.recording("loop", model):
        for _ in range(3):
            model(x, scale=scale)
    entries._SETTLED.clear()  # nothing settled: computed afresh
    with torch.no_grad(), store.recording("fresh", model):
        model(x, scale=scale)
    loop, fresh = _keys(store, "loop"), _keys(store, "fresh")
    assert len(loop) == 3 and all(step == fresh[0] for step in loop.values())
    keys = [key for _, key, _ in fresh[0]]
    assert "scale" in keys and any(key.endswith(".1") for key in keys)  # named; chunk's 2nd
    assert any(block == 1 for _, _, block in fresh[0])
