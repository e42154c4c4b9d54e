"""Backward capture, interventions and recorded call arguments, side by side with plain
PyTorch and hooks (issue 13's benchmarks, printed in one run).

Run: ``nice python benchmarks/backward.py [--repeats 9] [--small] [--markdown]``. One
process, one model (the GPT-2 config of ``capture_overhead.py``: ``GPT2Model``,
``n_layer=4, n_embd=256, n_head=4``, random weights, input ids (4, 128); ``--small``:
(2, 32) for a quick look), ``torch.set_num_threads(1)``, CPU time per call (every
thread of the process: the store's writer threads too), conditions interleaved
round-robin, the order rotated each round.

Forward + backward of ``loss = last_hidden_state.square().mean()``:

* ``plain fwd+bwd``: the reference every ratio is against;
* ``hooks: every grad``: a ``TorchFunctionMode`` registering ``tensor.register_hook`` on
  every op output, each hook keeping the gradient (what a hook-based capture costs);
* ``tracelake: every grad``: ``tl.trace(..., capture=CaptureOptions(backward_ready=True),
  save=tl.none(), save_grads=tl.all())`` then ``trace.backward(loss)``;
* ``tracelake: every act + grad``: the same saving every activation too;
* ``store: every grad``: ``store.record(..., save=tl.none(), save_grads=tl.all(),
  backward=loss)``, a new run of an open store (all of ``record``: the run's writes,
  statistics, catalog transactions and fsync; the store is opened once, as a user
  opens one for many runs, and each run is deleted and collected off the clock);
* ``store: none + plain bwd``: a recording block saving nothing (``save=tl.none()``)
  around a forward and a plain backward, the same way: a stored run's fixed costs
  (catalog transactions, fsync) with the same work, so the difference to the line above
  is what storing the gradients costs.

Forward only, no grad (``benchmarks/intervene.py``'s conditions, and the cost of
``record_args`` for ``tl.validate``):

* ``plain fwd``; ``hook patch`` (the reference: a forward hook on ``h[3]`` returning
  another prompt's block-3 hidden state); ``tracelake patch``: ``tl.trace(...,
  intervene=tl.when(tl.label(<that op>), tl.patch_from(donor)))``, the donor an
  in-memory trace, ``patch (stored)``: a stored run;
* ``tracelake none`` (metadata only) and ``tracelake none+args``
  (``CaptureOptions(record_args=True)``: Python interception plus each call encoded).

Reported: median ms per call and the median over rounds of each round's ratio to its
reference. The issue's bounds: ``tracelake: every grad`` and ``store: every grad`` <= 2x
``plain fwd+bwd``; ``tracelake patch`` <= 1.1x ``plain fwd``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import tracelake as tl

BACKWARD = tl.options.CaptureOptions(backward_ready=True)
ARGS = tl.options.CaptureOptions(record_args=True)
TARGETS = {"tracelake: every grad": 2.0, "store: every grad": 2.0, "tracelake patch": 1.1}


def _model(small: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    from capture_overhead import build_model

    model, (ids,) = build_model("gpt2")  # GPT2Model, 4 layers, d=256, use_cache off
    model.eval()
    return model, ids[:2, :32] if small else ids


def _loss(output: Any) -> torch.Tensor:
    return output.last_hidden_state.square().mean()


class _GradHooks(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.grads: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self.grads.append)
        return out


@dataclass
class Condition:
    """One timed call; ``prepare`` and ``after`` run around it, off the clock."""

    run: Callable[[], Any]
    reference: str = "plain fwd+bwd"
    prepare: Callable[[], None] | None = None
    after: Callable[[], None] | None = None


def _conditions(model: torch.nn.Module, x: torch.Tensor, root: str) -> dict[str, Condition]:
    def plain() -> None:
        _loss(model(x)).backward()

    def hooks() -> None:
        mode = _GradHooks()
        with mode:
            out = model(x)
        _loss(out).backward()

    def grads(save: Any) -> Condition:
        def run() -> None:
            trace = tl.trace(model, x, capture=BACKWARD, save=save, save_grads=tl.all())
            trace.backward(_loss(trace.output))
            trace.cleanup()

        return Condition(run)

    count = iter(range(1_000_000))

    def store(grads: bool) -> Condition:
        st = tl.open(f"{root}/{'grads' if grads else 'none'}.tl")
        names: list[str] = []

        def prepare() -> None:
            names.append(f"r{next(count)}")

        def run() -> None:
            name = names[-1]
            if grads:
                st.record(model, x, name=name, save=tl.none(), save_grads=tl.all(), backward=_loss)
            else:  # the same run's fixed costs (catalog, fsync), a plain backward in it
                with st.recording(name, model, save=tl.none()):
                    _loss(model(x)).backward()

        def after() -> None:
            st.delete(names.pop())
            st.gc(progress=False)

        return Condition(run, prepare=prepare, after=after)

    def no_grad(fn: Callable[[], Any], reference: str = "plain fwd") -> Condition:
        def run() -> None:
            with torch.no_grad():
                fn()

        return Condition(run, reference)

    from intervene import _conditions as intervene_conditions

    other = torch.randint(0, 50257, x.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        patches = intervene_conditions(model, x, other, root)  # (its donor's store: in root)
    return {
        "plain fwd+bwd": Condition(plain),
        "hooks: every grad": Condition(hooks),
        "tracelake: every grad": grads(tl.none()),
        "tracelake: every act + grad": grads(tl.all()),
        "store: every grad": store(True),
        "store: none + plain bwd": store(False),
        "plain fwd": no_grad(lambda: model(x)),
        "hook patch": no_grad(patches["hook patch"]),
        "tracelake patch": no_grad(patches["tracelake patch"]),
        "tracelake patch (stored)": no_grad(patches["tracelake patch (stored)"]),
        "tracelake none": no_grad(lambda: tl.trace(model, x, save=tl.none())),
        "tracelake none+args": no_grad(
            lambda: tl.trace(model, x, save=tl.none(), capture=ARGS), "tracelake none"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    model, x = _model(options.small)
    root = tempfile.mkdtemp(prefix="tl-backward-bench-")
    try:
        conditions = _conditions(model, x, root)
        for c in conditions.values():  # warm up
            _sample(c)
            model.zero_grad(set_to_none=True)
        times: dict[str, list[float]] = {name: [] for name in conditions}
        names = list(conditions)
        for r in range(options.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(_sample(conditions[name]))
                model.zero_grad(set_to_none=True)
        trace = tl.trace(model, x, capture=BACKWARD, save=tl.none(), save_grads=tl.all())
        trace.backward(_loss(trace.output))
        fires = trace.grad_fires
        grad_bytes = sum(f.grad.nbytes for f in fires if f.grad is not None)
        model.zero_grad(set_to_none=True)
        st = tl.open(f"{root}/bytes.tl")
        st.record(model, x, name="r", save=tl.none(), save_grads=tl.all(), backward=_loss)
        stored = st.sql(
            "select count(*) as n, sum(nbytes) as b from "
            '(select distinct "array", byte_offset, nbytes from grads)'
        )
        st.close()
        model.zero_grad(set_to_none=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = {
        name: statistics.median(
            a / b for a, b in zip(samples, times[conditions[name].reference], strict=True)
        )
        for name, samples in times.items()
    }
    print(
        f"GPT-2 config, input {tuple(x.shape)}, {options.repeats} rounds, CPU time; "
        f"every grad: {len(fires)} gradients, {grad_bytes / 2**20:.0f} MiB per call "
        f"(a store writes {int(stored['n'][0])} of them, {int(stored['b'][0]) / 2**20:.0f} "
        "MiB: the rest are the same bytes)"
    )
    if options.markdown:
        print("| condition | median ms | ratio | reference |\n|---|---:|---:|---|")
    for name, samples in times.items():
        ms, ref = statistics.median(samples) * 1e3, conditions[name].reference
        if options.markdown:
            print(f"| {name} | {ms:.1f} | {ratios[name]:.2f}x | {ref} |")
        else:
            print(f"{name:30} {ms:9.1f} {ratios[name]:7.2f}x  {ref}")
    for name, bound in TARGETS.items():
        verdict = "MET" if ratios[name] <= bound else "MISSED"
        print(
            f"{name} <= {bound}x {conditions[name].reference}: {verdict} "
            f"(measured {ratios[name]:.2f}x)"
        )


def _sample(condition: Condition) -> float:
    if condition.prepare is not None:
        condition.prepare()
    gc.collect()
    start = time.process_time()
    condition.run()
    took = time.process_time() - start
    if condition.after is not None:
        condition.after()
    return took


if __name__ == "__main__":
    main()
