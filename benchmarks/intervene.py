"""The cost of an intervention: one patched op against a plain forward and a hook.

Run: ``python benchmarks/intervene.py [--repeats 9] [--markdown]``. One process, the
GPT-2 of ``capture_overhead.py`` (``GPT2Model``, 4 layers, d=256, input ids 4 x 128),
``torch.no_grad()``, one thread. Conditions, side by side:

* ``plain``: ``model(ids)``.
* ``hook patch`` (the reference): a forward hook on ``h[3]`` that returns another
  prompt's block-3 hidden state (registered and removed inside the sample).
* ``tracelake none``: ``tl.trace(model, ids, save=tl.none())``, no rule (the recorder's
  own floor, for scale).
* ``tracelake patch``: the same with ``intervene=tl.when(tl.label(<the op that produced
  h[3]'s output>), tl.patch_from(donor))``, the donor an in-memory trace of the other
  prompt; ``patch (stored)``: the donor a stored run.

Method as ``capture_overhead.py``: warm-up, then rounds in which every condition takes one
sample, the order rotated each round; CPU time; "x plain" is the median over rounds of
that round's ratio to plain. Target (issue 13): one patched op <= 1.1x a plain forward.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from capture_overhead import build_model

import tracelake as tl

TARGET = 1.1


def _conditions(
    model: Any, ids: torch.Tensor, other: torch.Tensor, where: str
) -> dict[str, Callable]:
    block = model.h[3]
    donor_trace = tl.trace(model, other, save=tl.in_module("h.3"))
    residual = donor_trace["h.3"].output_labels[0]
    donor_hidden = donor_trace[residual].out
    store = tl.open(where + "/bench.tl")
    stored = store.record(model, other, name="donor", save=tl.in_module("h.3"))
    in_memory = tl.when(tl.label(residual), tl.patch_from(donor_trace))
    from_store = tl.when(tl.label(residual), tl.patch_from(stored))

    def hook_patch() -> Any:
        def patch(m: Any, a: Any, out: Any) -> Any:
            if isinstance(out, torch.Tensor):
                return donor_hidden.clone()
            return (donor_hidden.clone(), *out[1:])

        handle = block.register_forward_hook(patch)
        try:
            return model(ids)
        finally:
            handle.remove()

    def traced(rule: Any) -> Callable[[], Any]:
        def run() -> Any:
            log = tl.trace(model, ids, save=tl.none(), intervene=rule)
            log.cleanup()
            return log

        return run

    # the patched forward equals the hook's, bit for bit, before anything is timed
    expected = hook_patch().last_hidden_state
    got = tl.trace(model, ids, save=tl.none(), intervene=in_memory).output.last_hidden_state
    assert torch.equal(expected, got), "the patch and the hook disagree"
    return {
        "plain": lambda: model(ids),
        "hook patch": hook_patch,
        "tracelake none": traced(None),
        "tracelake patch": traced(in_memory),
        "tracelake patch (stored)": traced(from_store),
    }


def _sample(fn: Callable[[], Any], calls: int) -> float:
    gc.collect()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--markdown", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="tl-intervene-") as where:
        model, (ids,) = build_model("gpt2")
        model.eval()
        other = torch.randint(0, 50257, ids.shape, generator=torch.Generator().manual_seed(1))
        conditions = _conditions(model, ids, other, where)
        names = list(conditions)
        for fn in conditions.values():  # warm-up
            fn()
            fn()
        times: dict[str, list[float]] = {name: [] for name in names}
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(options.repeats):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            got = {name: _sample(conditions[name], 3) for name in order}
            for name in names:
                times[name].append(got[name])
                ratios[name].append(got[name] / got["plain"])
    rows = [
        (name, statistics.median(times[name]) * 1e3, statistics.median(ratios[name]))
        for name in names
    ]
    if options.markdown:
        print("| condition | median ms | x plain |\n|---|---:|---:|")
        for name, ms, ratio in rows:
            print(f"| {name} | {ms:.3f} | {ratio:.2f}x |")
    else:
        for name, ms, ratio in rows:
            print(f"{name:26s} {ms:10.3f} ms  {ratio:5.2f}x plain")
    patch = statistics.median(ratios["tracelake patch"])
    verdict = "MET" if patch <= TARGET else "MISSED"
    print(f"\none patched op <= {TARGET}x a plain forward: {verdict} (measured {patch:.2f}x)")


if __name__ == "__main__":
    main()
