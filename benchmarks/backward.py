"""Backward capture and recorded call arguments, side by side with plain PyTorch.

Run: ``python benchmarks/backward.py [--repeats 7] [--small]``. One process, one model
(the GPT-2 config of ``capture_overhead.py``: ``GPT2Model``, ``n_layer=4, n_embd=256,
n_head=4``, random weights, input ids (4, 128); ``--small``: (2, 32) for a quick look),
``torch.set_num_threads(1)``, CPU time per call, conditions interleaved round-robin.

Forward + backward of ``loss = last_hidden_state.square().mean()``:

* ``plain fwd+bwd``: the reference every ratio is against;
* ``hooks: every grad``: a ``TorchFunctionMode`` registering ``tensor.register_hook`` on
  every op output, each hook keeping the gradient (what a hook-based capture costs);
* ``tracelake: every grad``: ``tl.trace(..., capture=CaptureOptions(backward_ready=True),
  save=tl.none(), save_grads=tl.all())`` then ``trace.backward(loss)``;
* ``tracelake: every act + grad``: the same saving every activation too;
* ``store: every grad``: ``store.record(..., save=tl.none(), save_grads=tl.all(),
  backward=loss)`` into a fresh store (commit included);
* ``store: none + plain bwd``: a recording block saving nothing (``save=tl.none()``)
  around a forward and a plain backward, into a fresh store: a stored run's fixed costs
  (catalog transactions, fsync) with the same work, so the difference to the line above
  is what storing the gradients costs.

Forward only, no grad (the cost of ``record_args`` for ``tl.validate``):

* ``plain fwd``, ``tracelake none`` (metadata only) and ``tracelake none+args``
  (``CaptureOptions(record_args=True)``: Python interception plus each call encoded).

Reported: median ms per call and the median over rounds of each round's ratio to its
reference. The issue's bound: ``tracelake: every grad`` <= 2x ``plain fwd+bwd``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import tracelake as tl

BACKWARD = tl.options.CaptureOptions(backward_ready=True)
ARGS = tl.options.CaptureOptions(record_args=True)


def _model(small: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, attn_implementation="sdpa")
    model = GPT2Model(config).eval()
    shape = (2, 32) if small else (4, 128)
    return model, torch.randint(0, config.vocab_size, shape)


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


def _conditions(model: torch.nn.Module, x: torch.Tensor, root: str) -> dict[str, Callable]:
    def plain() -> None:
        _loss(model(x, use_cache=False)).backward()

    def hooks() -> None:
        mode = _GradHooks()
        with mode:
            out = model(x, use_cache=False)
        _loss(out).backward()

    def grads(save: Any) -> Callable[[], None]:
        def run() -> None:
            trace = tl.trace(
                model, x, use_cache=False, capture=BACKWARD, save=save, save_grads=tl.all()
            )
            trace.backward(_loss(trace.output))
            trace.cleanup()

        return run

    count = iter(range(1_000_000))

    def store(grads: bool) -> Callable[[], None]:
        def run() -> None:
            path = f"{root}/s{next(count)}"
            st = tl.open(path)
            if grads:
                st.record(
                    model, x, use_cache=False, save=tl.none(), save_grads=tl.all(), backward=_loss
                )
            else:  # the same run's fixed costs (catalog, fsync), a plain backward in it
                with st.recording("r", model, save=tl.none()):
                    _loss(model(x, use_cache=False)).backward()
            st.close()
            shutil.rmtree(path)

        return run

    def forward(capture: Any) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                if capture is None:
                    model(x, use_cache=False)
                else:
                    tl.trace(model, x, use_cache=False, save=tl.none(), capture=capture)

        return run

    return {
        "plain fwd+bwd": plain,
        "hooks: every grad": hooks,
        "tracelake: every grad": grads(tl.none()),
        "tracelake: every act + grad": grads(tl.all()),
        "store: every grad": store(True),
        "store: none + plain bwd": store(False),
        "plain fwd": forward(None),
        "tracelake none": forward(tl.options.CaptureOptions()),
        "tracelake none+args": forward(ARGS),
    }


_REFERENCE = {"plain fwd": "plain fwd", "tracelake none": "plain fwd"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--small", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    model, x = _model(options.small)
    root = tempfile.mkdtemp(prefix="tl-backward-bench-")
    try:
        conditions = _conditions(model, x, root)
        for fn in conditions.values():  # warm up
            fn()
            model.zero_grad(set_to_none=True)
        times: dict[str, list[float]] = {name: [] for name in conditions}
        names = list(conditions)
        for r in range(options.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                gc.collect()
                start = time.process_time()
                conditions[name]()
                times[name].append(time.process_time() - start)
                model.zero_grad(set_to_none=True)
        trace = tl.trace(
            model, x, use_cache=False, capture=BACKWARD, save=tl.none(), save_grads=tl.all()
        )
        trace.backward(_loss(trace.output))
        fires = trace.grad_fires
        grad_bytes = sum(f.grad.nbytes for f in fires if f.grad is not None)
        model.zero_grad(set_to_none=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"GPT-2 config, input {tuple(x.shape)}, {options.repeats} rounds, CPU time")
    print(f"every grad: {len(fires)} gradients, {grad_bytes / 2**20:.0f} MiB per call")
    print(f"{'condition':30} {'ms/call':>9} {'ratio':>7}  reference")
    for name, samples in times.items():
        ref = _REFERENCE.get(name, "plain fwd+bwd")
        if name == "tracelake none+args":
            ref = "tracelake none"
        ratios = [a / b for a, b in zip(samples, times[ref], strict=True)]
        print(
            f"{name:30} {statistics.median(samples) * 1e3:9.1f} "
            f"{statistics.median(ratios):7.2f}x {ref}"
        )


if __name__ == "__main__":
    main()
