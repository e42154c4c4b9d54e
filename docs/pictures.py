"""Draw the README's pictures: ``python docs/pictures.py [--out docs/images]``.

A two-layer GPT-2 with random weights (``tests/model_zoo.py``) is recorded twice into a
temporary store, the second time with block 1's MLP input weights scaled by 1.5; then

* ``op-graph.svg``: the first run's op graph, modules as clusters, every op coloured by
  its ``absmax`` (``run.graph(color="absmax")``);
* ``op-graph-diff.svg``: the same graph collapsed to depth 2, coloured by how much each
  op differs between the two runs (``run.graph(diff=store.compare(...))``);
* ``by-block.png``: that difference by block (``comparison.plot()``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import matplotlib
import torch

import tracelake as tl

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    matplotlib.use("Agg")
    sys.path.insert(0, str(ROOT / "tests"))
    from model_zoo import gpt2

    torch.set_num_threads(1)
    model, inputs = gpt2()
    with tempfile.TemporaryDirectory() as tmp:
        store = tl.open(Path(tmp) / "runs.tl")
        store.record(model, *inputs, name="base", save=tl.all())
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.mul_(1.5)
        store.record(model, *inputs, name="ft", save=tl.all())
        base = store["base"]
        base.graph(color="absmax").save(out / "op-graph.svg")
        comparison = store.compare("base", "ft")
        base.graph(diff=comparison, depth=2).save(out / "op-graph-diff.svg")
        comparison.plot().figure.savefig(out / "by-block.png", dpi=80)
        store.close()
    for name in ("op-graph.svg", "op-graph-diff.svg", "by-block.png"):
        print(out / name)


if __name__ == "__main__":
    main()
