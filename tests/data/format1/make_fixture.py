"""Build ``store.tar.gz`` and ``expected.npz``: a small store written by the code of the
commit named in ``README``, kept so that later code proves it still reads stores of
format 1 (tests/test_format_compat.py). Run from the repository root with that code
installed: ``python tests/data/format1/make_fixture.py``.

The expected values are the tensors as that code read them back right after writing
(numpy arrays, bfloat16 as its uint16 bits), so the test needs no forward pass that
could differ between CPUs.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import tracelake as tl

HERE = Path(__file__).parent


class Model(nn.Module):
    """Small packed tensors, one 4 MiB tensor (its own array), a tuple-returning module."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.wide = nn.Linear(8, 1 << 17)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        w = torch.relu(self.wide(h) - 1.0)
        return h.to(torch.bfloat16), w.sum(dim=-1)


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().copy()
    return t.numpy().copy()


def main() -> None:
    torch.manual_seed(0)
    model = Model().eval()
    with torch.no_grad():  # a repetitive wide output, so the tarball stays small
        model.wide.weight.zero_()
        model.wide.bias.copy_((torch.arange(1 << 17) % 7 - 3).float())
    x1, x2 = torch.randn(8, 8), torch.randn(8, 8)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store.tl"
        store = tl.open(root)
        with torch.no_grad():
            store.record(model, x1, name="base", meta={"lr": 0.1, "tag": "a"})
            store.record(model, x2, name="relu-only", save=tl.func("relu"), stats="all")
            with store.recording("steps", model, meta={"steps": 2}):
                model(x1)
                model(x2)
            store.record(model, x1, name="gone")
        store.delete("gone")
        expected: dict[str, np.ndarray] = {}
        facts: dict[str, object] = {"runs": {}}
        for name in ("base", "relu-only", "steps"):
            run = store[name]
            n_steps = len(store.runs().query("name == @name")) and int(
                store.runs().set_index("name").loc[name, "steps"]
            )
            facts["runs"][name] = {"steps": n_steps, "labels": []}
            for step in range(n_steps):
                view = run.step(step) if n_steps > 1 else run
                labels = list(view.labels)
                facts["runs"][name]["labels"].append(labels)
                for label in labels:
                    out = view[label].out
                    if out is not None:
                        expected[f"{name}/{step}/{label}"] = _numpy(out)
        del store
        with tarfile.open(HERE / "store.tar.gz", "w:gz") as tar:
            tar.add(root, arcname="store.tl")
        np.savez_compressed(HERE / "expected.npz", **expected)
        (HERE / "facts.json").write_text(json.dumps(facts, indent=1) + "\n")
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
