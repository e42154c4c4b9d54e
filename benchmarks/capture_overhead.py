"""Capture overhead of tracelake (and alternatives) relative to a plain forward pass.

Run: ``python benchmarks/capture_overhead.py [--repeats 9] [--models gpt2,mlp,cnn,chain]
[--markdown] [--no-torchlens] [--json PATH]``. Conditions, measured in one process on one
model and input:

* ``plain``: ``model(*args)``.
* ``bare mode``: a TorchFunctionMode that only calls through: the floor of any op-level
  capture, and the yardstick of this machine's speed for the per-op target.
* ``hooks (detach)``: a forward hook on every module storing ``output.detach()`` for tensor
  outputs; registering and removing the handles is timed.
* ``tracelake none``: ``tl.trace(model, *args, save=tl.none())`` (metadata only);
  ``tracelake none+stats`` adds ``stats="all"``; ``tracelake all`` saves every op.
* ``torchlens all`` / ``torchlens none`` (only if ``import torchlens`` works):
  ``torchlens.trace(m, list(args), capture=CaptureOptions(layers_to_save="all" | None))``.
  TorchLens patches torch process-wide and wraps module forwards persistently, which
  would slow every other condition, so it traces a deep copy of the model and
  ``wrap_torch()`` / ``unwrap_torch()`` run untimed around each of its samples.

Method: ``torch.no_grad()``, ``torch.set_num_threads(1)``. Each condition is warmed up
twice; the second call sets how many calls one sample makes (~20 ms worth, so fast models
are not timer noise). Then ``--repeats`` rounds; in each, every condition takes one
sample, in an order rotated by one per round (round-robin), so drift and noise hit all
conditions alike. Time is CPU time (``time.process_time``): on this shared virtual
machine, wall time also counts the moments the host runs someone else, which swing plain
forwards by 1.5x between runs. GC is collected before each sample and stays on during it
(the recorder's allocations are part of its cost); traces are ``cleanup()``-ed after it,
untimed. Reported: median ms per call;
"x plain" = median over rounds of that round's condition/plain ratio (paired); µs/op =
median over rounds of (condition - plain) / ops, ops = ``len(log)`` (TorchLens:
``len(trace)``).

Models: ``gpt2`` = ``transformers.GPT2Model`` (no LM head, so the 50k-vocab projection
does not dilute overhead), ``GPT2Config(n_layer=4, n_embd=256, n_head=4)``, random
weights, ``attn_implementation="sdpa"``, ``use_cache=False``, input ids (4, 128); ``mlp``
= 4 x (Linear 256 + ReLU) on (32, 256); ``cnn`` = 2 x (conv, ReLU, max-pool) + Linear on
(8, 3, 32, 32); ``chain`` = 1,000 elementwise ops (``+1``, ``*0.5``, relu, sin) on (4, 4).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import tracelake as tl

try:  # optional comparison; the benchmark runs without it
    import torchlens
    from torchlens.backends.torch.wrappers import unwrap_torch, wrap_torch
    from torchlens.options import CaptureOptions

    HAVE_TORCHLENS = True
except Exception:  # ImportError, or an API this script does not know
    HAVE_TORCHLENS = False

ALL_MODELS = ("gpt2", "mlp", "cnn", "chain")
SAMPLE_TARGET_S = 0.02


class Chain(nn.Module):
    """``n_ops`` small elementwise ops in a row: a per-op overhead probe."""

    def __init__(self, n_ops: int = 1000) -> None:
        super().__init__()
        self.n_ops = n_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n_ops):
            step = i % 4
            if step == 0:
                x = x + 1
            elif step == 1:
                x = x * 0.5
            elif step == 2:
                x = torch.relu(x)
            else:
                x = x.sin()
        return x


def build_model(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """A model (eval mode, seeded random weights) and its positional inputs."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        settings: dict[str, Any] = {
            "n_layer": 4,
            "n_embd": 256,
            "n_head": 4,
            "n_positions": 128,
            "use_cache": False,
            "attn_implementation": "sdpa",
        }
        config = GPT2Config(**settings)
        model: nn.Module = GPT2Model(config)
        args: tuple[Any, ...] = (torch.randint(0, config.vocab_size, (4, 128)),)
    elif name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        model, args = nn.Sequential(*layers), (torch.randn(32, 256),)
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 10),
        )
        args = (torch.randn(8, 3, 32, 32),)
    elif name == "chain":
        model, args = Chain(1000), (torch.randn(4, 4),)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(ALL_MODELS)}")
    return model.eval(), args


def _noop(*_: object) -> None:
    return None


@dataclass
class Condition:
    """One way of running the forward pass. ``run`` is timed; the rest is not."""

    name: str
    run: Callable[[], Any]
    dispose: Callable[[Any], None] = _noop
    count: Callable[[Any], int] | None = None  # ops recorded, from one result
    setup: Callable[[], None] = _noop
    teardown: Callable[[], None] = _noop
    number: int = 1  # calls per sample
    ops: int | None = None
    samples: list[float] = field(default_factory=list)  # seconds per call, one per round


class _BareMode(TorchFunctionMode):
    """The floor of op-level interception: a TorchFunctionMode that only calls through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _hooked_forward(model: nn.Module, args: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    saved: dict[str, torch.Tensor] = {}

    def make_hook(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                saved[name] = output.detach()

        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, m in model.named_modules()]
    try:
        model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return saved


def _torchlens_conditions(model: nn.Module, args: tuple[Any, ...]) -> list[Condition]:
    own = copy.deepcopy(model)  # TorchLens wraps module forwards persistently

    def runner(layers: str | None) -> Callable[[], Any]:
        def run() -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torchlens.trace(
                    own, list(args), capture=CaptureOptions(layers_to_save=layers)
                )

        return run

    common: dict[str, Any] = {
        "dispose": lambda t: t.cleanup(),
        "count": len,
        "setup": wrap_torch,
        "teardown": unwrap_torch,
    }
    return [
        Condition("torchlens all", runner("all"), **common),
        Condition("torchlens none", runner(None), **common),
    ]


def build_conditions(
    model: nn.Module, args: tuple[Any, ...], with_torchlens: bool
) -> list[Condition]:
    def cleanup(log: Any) -> None:
        log.cleanup()

    def bare_mode() -> None:
        with _BareMode():
            model(*args)

    conditions = [
        Condition("plain", lambda: model(*args)),
        Condition("bare mode", bare_mode),
        Condition("hooks (detach)", lambda: _hooked_forward(model, args)),
        Condition("tracelake none", lambda: tl.trace(model, *args, save=tl.none()), cleanup, len),
        Condition(
            "tracelake none+stats",
            lambda: tl.trace(model, *args, save=tl.none(), stats="all"),
            cleanup,
            len,
        ),
        Condition("tracelake all", lambda: tl.trace(model, *args), cleanup, len),
    ]
    if with_torchlens:
        conditions += _torchlens_conditions(model, args)
    return conditions


def take_sample(cond: Condition, number: int) -> float:
    """CPU seconds per call over ``number`` back-to-back calls, disposal untimed."""
    results: list[Any] = []
    cond.setup()
    try:
        gc.collect()
        start = time.process_time()
        for _ in range(number):
            results.append(cond.run())
        elapsed = time.process_time() - start
        if cond.count is not None and cond.ops is None:
            cond.ops = cond.count(results[0])
        for result in results:
            cond.dispose(result)
    finally:
        cond.teardown()
    return elapsed / number


def measure(conditions: list[Condition], repeats: int) -> None:
    for cond in conditions:  # warm-up; the second call calibrates the sample size
        take_sample(cond, 1)
        cond.number = max(1, math.ceil(SAMPLE_TARGET_S / take_sample(cond, 1)))
    for r in range(repeats):
        shift = r % len(conditions)
        for cond in conditions[shift:] + conditions[:shift]:
            cond.samples.append(take_sample(cond, cond.number))


@dataclass
class Row:
    model: str
    condition: str
    median_ms: float
    ratio: float
    ops: int | None
    us_per_op: float | None


def summarize(model: str, conditions: list[Condition]) -> list[Row]:
    plain = conditions[0].samples
    rows = []
    for cond in conditions:
        ratio = statistics.median(c / p for c, p in zip(cond.samples, plain, strict=True))
        per_op = None
        if cond.ops:
            per_op = statistics.median(
                (c - p) / cond.ops * 1e6 for c, p in zip(cond.samples, plain, strict=True)
            )
        rows.append(
            Row(model, cond.name, statistics.median(cond.samples) * 1e3, ratio, cond.ops, per_op)
        )
    return rows


def render(rows: list[Row], markdown: bool) -> str:
    header = ["model", "condition", "median ms", "x plain", "ops", "µs/op"]
    body = [
        [
            r.model,
            r.condition,
            f"{r.median_ms:.3f}",
            f"{r.ratio:.2f}x",
            "" if r.ops is None else str(r.ops),
            "" if r.us_per_op is None else f"{r.us_per_op:.1f}",
        ]
        for r in rows
    ]
    if markdown:
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---", "---", "---:", "---:", "---:", "---:"]) + "|",
        ]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])


def _per_op_vs_bare(rows: list[Row], row: Row) -> float:
    bare = next((r for r in rows if r.model == row.model and r.condition == "bare mode"), None)
    if bare is None or row.us_per_op is None or not row.ops:
        return math.inf
    bare_per_op = (bare.median_ms - _plain_ms(rows, row.model)) * 1e3 / row.ops
    return row.us_per_op / bare_per_op if bare_per_op > 0 else math.inf


def _plain_ms(rows: list[Row], model: str) -> float:
    return next(r.median_ms for r in rows if r.model == model and r.condition == "plain")


def render_targets(rows: list[Row], markdown: bool) -> str:
    def find(model: str, condition: str) -> Row | None:
        return next((r for r in rows if r.model == model and r.condition == condition), None)

    checks: list[tuple[str, Row | None, Callable[[Row], float], float, str]] = [
        (
            "metadata-only (tracelake none) <= 1.2x plain, GPT-2",
            find("gpt2", "tracelake none"),
            lambda r: r.ratio,
            1.2,
            "x",
        ),
        (
            "metadata-only <= 10 µs per op, chain",
            find("chain", "tracelake none"),
            lambda r: r.us_per_op if r.us_per_op is not None else math.inf,
            10.0,
            " µs/op",
        ),
        (
            "metadata-only <= 4x the bare mode's per-op cost, chain (10 µs / 2.5 µs: the "
            "target's ratio, independent of this machine's speed)",
            find("chain", "tracelake none"),
            lambda r: _per_op_vs_bare(rows, r),
            4.0,
            "x",
        ),
        (
            "metadata-only <= 1.5x the bare mode's per-op cost, chain, in CPU time here "
            "(issue 16's target is counted in instructions: benchmarks/instructions.py)",
            find("chain", "tracelake none"),
            lambda r: _per_op_vs_bare(rows, r),
            1.5,
            "x",
        ),
        (
            "save-all (tracelake all) <= 2x plain, GPT-2",
            find("gpt2", "tracelake all"),
            lambda r: r.ratio,
            2.0,
            "x",
        ),
        (
            "statistics for every op (tracelake none+stats) <= 1.2x plain, GPT-2",
            find("gpt2", "tracelake none+stats"),
            lambda r: r.ratio,
            1.2,
            "x",
        ),
    ]
    lines = ["## Targets" if markdown else "Targets"]
    for text, row, value, limit, unit in checks:
        if row is None:
            verdict = "not run"
        else:
            got = value(row)
            verdict = f"{'MET' if got <= limit else 'MISSED'} (measured {got:.2f}{unit})"
        lines.append(f"{'- ' if markdown else '  '}{text}: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument(
        "--models",
        default=",".join(ALL_MODELS),
        help="comma-separated subset of gpt2,mlp,cnn,chain",
    )
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--no-torchlens", action="store_true", help="skip TorchLens")
    parser.add_argument("--json", help="also write the results to this file (for ab.py)")
    ns = parser.parse_args(argv)
    models = [m.strip() for m in ns.models.split(",") if m.strip()]
    if unknown := sorted(set(models) - set(ALL_MODELS)):
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(ALL_MODELS)}")
    if ns.repeats < 1:
        parser.error("--repeats must be at least 1")
    with_torchlens = HAVE_TORCHLENS and not ns.no_torchlens

    torch.set_num_threads(1)
    lens = f"torchlens {torchlens.__version__}" if with_torchlens else "torchlens not used"
    from tracelake.recorder import compiled

    hot = (
        "compiled hot path"
        if compiled.ENABLED
        else "pure Python recorder" + ("" if compiled.AVAILABLE else " (extension not built)")
    )
    print(
        f"torch {torch.__version__}, tracelake {tl.__version__} ({hot}), {lens}, "
        f"python {platform.python_version()}, threads 1, repeats {ns.repeats}"
        + (" (fewer than 7: medians are fragile)" if ns.repeats < 7 else "")
    )
    started = time.perf_counter()
    rows: list[Row] = []
    with torch.no_grad():
        for name in models:
            model, args = build_model(name)
            conditions = build_conditions(model, args, with_torchlens)
            measure(conditions, ns.repeats)
            rows += summarize(name, conditions)
    print()
    print(render(rows, ns.markdown))
    print()
    print(render_targets(rows, ns.markdown))
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"\n(total benchmark time {time.perf_counter() - started:.1f} s; load {load})")
    if ns.json:
        write_json(ns.json, rows)


def write_json(path: str, rows: list[Row]) -> None:
    """CPU ms per call of every condition (the controls show this machine's noise), and
    for tracelake's conditions the paired ratio to plain and the cost per op."""
    from ab import write_results

    measures = []
    for r in rows:
        measures.append((f"{r.model} {r.condition}: ms", r.median_ms, "lower"))
        if r.condition.startswith("tracelake"):
            measures.append((f"{r.model} {r.condition}: x plain", r.ratio, "lower"))
            if r.us_per_op is not None:
                measures.append((f"{r.model} {r.condition}: µs/op", r.us_per_op, "lower"))
    write_results(path, measures)


if __name__ == "__main__":
    main()
