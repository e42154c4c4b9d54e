"""Compiled models (``torch.compile(model)``, ``model.compile()``, a compiled submodule)
are recorded running eagerly: every op of the eager model, module paths without
``_orig_mod``, nothing compiled while recording, a one-time ``TraceLakeWarning`` saying
so, and ``tl.trace``, ``store.record`` and a recording block agree.

The eager backend stands in for inductor here (compiling with inductor takes minutes on
a small CI machine); the recorder does not depend on the backend, since nothing is
compiled while it records."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from model_zoo import gpt2

import tracelake as tl

#: torch's own note that a compiled submodule's wrapper fires global hooks too (the
#: recorder leaves wrappers out of module calls).
pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`")


def _in_place(model: torch.nn.Module) -> torch.nn.Module:
    model.compile(backend="eager")
    return model


def _wrapped(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")


def _block_compiled(model: torch.nn.Module) -> torch.nn.Module:
    blocks = model.transformer.h  # type: ignore[union-attr]
    blocks[0] = torch.compile(blocks[0], backend="eager")
    return model


COMPILE: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "torch.compile": _wrapped,
    "model.compile": _in_place,
    "compiled block": _block_compiled,
}


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _stance() -> str:
    return str(torch._dynamo.eval_frame._stance.stance)


def _warnings(call: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if w.category is tl.TraceLakeWarning]


@pytest.mark.parametrize("how", list(COMPILE))
def test_a_compiled_model_is_recorded_eagerly_op_for_op(tmp_path: Path, how: str) -> None:
    torch._dynamo.reset()
    model, (ids,) = gpt2()
    with torch.no_grad():
        reference = tl.trace(model, ids)  # the plain eager model
        eager_logits = model(ids).logits
        compiled = COMPILE[how](model)
        compiled_logits = compiled(ids).logits  # compiles now
        graphs = _graphs()
        assert graphs > 0
        trace, said = _warnings(lambda: tl.trace(compiled, ids))
        again, said_again = _warnings(lambda: tl.trace(compiled, ids))
        store = tl.open(tmp_path / "s.tl")
        run = store.record(compiled, ids, name="run")
        with store.recording("block", compiled):
            block_logits = compiled(ids).logits
        assert _graphs() == graphs  # nothing was compiled (or traced by dynamo) while recording
        assert _stance() == "default"
        assert torch.equal(compiled(ids).logits, compiled_logits)  # still compiled after
    assert len(said) == 1 and "running eagerly" in said[0] and "GPT2LMHeadModel" in said[0]
    assert said_again == []  # once per model
    # Every op of the eager model, with the eager model's labels and module paths.
    assert trace.labels == reference.labels == again.labels
    assert [m.label for m in trace.modules] == [m.label for m in reference.modules]
    assert not any("_orig_mod" in op.module for op in trace)
    assert not any("_orig_mod" in p for op in trace for p in op.params)
    assert torch.equal(trace.output.logits, eager_logits)
    assert torch.equal(block_logits, eager_logits)
    for op, ref in zip(trace, reference, strict=True):
        assert op.parents == ref.parents and op.module == ref.module
        if ref.saved:
            assert torch.equal(op.out, ref.out), op.label
    # store.record and a recording block agree with tl.trace.
    assert run.labels == trace.labels
    assert store["block"].labels == trace.labels
    assert [m.label for m in run.modules] == [m.label for m in trace.modules]
    assert torch.equal(run["output_1"].out, eager_logits)


def test_a_model_never_compiled_gets_no_warning() -> None:
    model, (ids,) = gpt2()
    with torch.no_grad():
        _, said = _warnings(lambda: tl.trace(model, ids))
    assert said == []
