"""Keyword inputs are entries labelled by their name, in memory, in the catalog and in
queries; nested ones by name and path. The model's inputs can always be told apart from
tracelake's own keywords: ``args=`` / ``kwargs=`` pass them explicitly, and a keyword
both the model's forward and tracelake take is refused rather than taken silently."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_zoo import gpt2
from test_store import run_python
from torch import nn

import tracelake as tl

Pair = collections.namedtuple("Pair", ["left", "right"])


class Encoder(nn.Module):
    """A BERT-style signature: ids, attention mask, token types, and a structured extra."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(10, 4)
        self.types = nn.Embedding(2, 4)
        self.out = nn.Linear(4, 4)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        extra: Any = None,
    ) -> torch.Tensor:
        h = self.words(input_ids) + self.types(token_type_ids)
        h = h * attention_mask[..., None]
        if extra is not None:
            h = h + extra["bias"] + extra["pair"].right + extra["list"][1]
        return self.out(h)


IDS = torch.tensor([[1, 2, 3, 4]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
TYPES = torch.tensor([[0, 0, 1, 1]])
EXTRA = {
    "bias": torch.full((4,), 0.5),
    "pair": Pair(torch.zeros(4), torch.ones(4)),
    "list": [torch.zeros(4), torch.full((4,), 2.0)],
}
NAMES = [
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "extra.bias",
    "extra.pair.left",
    "extra.pair.right",
    "extra.list.0",
    "extra.list.1",
]


def test_keyword_inputs_are_labelled_by_name() -> None:
    model = Encoder()
    plain = model(input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES, extra=EXTRA)
    trace = tl.trace(model, input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES, extra=EXTRA)
    assert torch.equal(trace.output, plain)
    assert [op.label for op in trace.inputs] == NAMES
    assert trace.labels[: len(NAMES)] == NAMES
    assert torch.equal(trace["attention_mask"].out, MASK)
    assert torch.equal(trace["extra.pair.right"].out, EXTRA["pair"].right)
    mask = trace["attention_mask"]
    assert mask.kind == "input" and mask.func == "input" and mask.layer == "attention_mask"
    assert mask.key == "attention_mask"
    assert any(c.startswith("getitem") for c in mask.children)
    # Selectors take the names as labels.
    saved = tl.trace(
        model,
        input_ids=IDS,
        attention_mask=MASK,
        token_type_ids=TYPES,
        extra=EXTRA,
        save=tl.label("token_type_ids"),
    )
    assert [op.label for op in saved if op.saved] == ["token_type_ids"]
    # Positional inputs keep their numbers; keywords after them keep their names.
    mixed = tl.trace(model, IDS, MASK, token_type_ids=TYPES)
    assert [op.label for op in mixed.inputs] == ["input_1", "input_2", "token_type_ids"]


def test_names_that_could_be_taken_for_other_entries_stay_numbered() -> None:
    class Clashing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, out: Any = None, **rest: Any) -> torch.Tensor:
            return self.out(x) + sum(rest.values()) + out

    x = torch.ones(1, 2)
    trace = tl.trace(
        Clashing(),
        x,
        out=torch.ones(2),
        input_1=torch.ones(2),
        relu_1_2=torch.ones(2),
        bias=torch.ones(2),
    )
    # `out` is a submodule's path, the next two look like generated labels.
    assert [op.label for op in trace.inputs] == ["input_1", "input_2", "input_3", "input_4", "bias"]
    assert trace["out"].type == "Linear"
    assert len(set(trace.labels)) == len(trace.labels)


def test_named_inputs_in_the_catalog_and_queries_from_another_process(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "s.tl")
    model = Encoder()
    run = store.record(
        model, name="enc", input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES, extra=EXTRA
    )
    assert [op.label for op in run.inputs] == NAMES
    with store.recording("steps", model) as rec:
        model(input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES)  # the block's hooks
        rec.record(
            model, kwargs={"input_ids": IDS, "attention_mask": MASK, "token_type_ids": TYPES}
        )
    code = r"""
import json, sys, tracelake as tl
store = tl.open(sys.argv[1], create=False)
result = store.query(
    "select run, step, label, layer, func from ops where kind = 'input' order by run, step, idx"
).df()
run = store["enc"]
print(json.dumps({
    "rows": [[r.run, r.step, r.label, r.layer, r.func] for r in result.itertuples()],
    "mask": run["attention_mask"].out.tolist(),
    "layer": run["extra.list.1"].layer,
    "children": list(run["input_ids"].children),
}))
"""
    done = run_python(code, str(tmp_path / "s.tl"))
    got = json.loads(done.stdout)
    three = ["input_ids", "attention_mask", "token_type_ids"]
    assert got["rows"] == [
        *(["enc", 0, name, name, "input"] for name in NAMES),
        *(["steps", 0, name, name, "input"] for name in three),
        *(["steps", 1, name, name, "input"] for name in three),
    ]
    assert got["mask"] == MASK.tolist() and got["layer"] == "extra.list.1"
    assert got["children"] and got["children"][0].startswith("embedding")


def test_a_transformers_model_keeps_its_keyword_names(tmp_path: Path) -> None:
    model, (ids,) = gpt2()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        trace = tl.trace(model, input_ids=ids, attention_mask=mask)
        run = tl.open(tmp_path / "s.tl").record(model, input_ids=ids, attention_mask=mask)
    assert torch.equal(trace.output.logits, plain)
    assert [op.label for op in trace.inputs] == ["input_ids", "attention_mask"]
    assert [op.label for op in run.inputs] == ["input_ids", "attention_mask"]
    assert run.labels == trace.labels


class TakesOptions(nn.Module):
    """A forward with keywords named like tracelake's own options."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(
        self, x: torch.Tensor, name: Any = None, save: bool = False, meta: Any = None
    ) -> torch.Tensor:
        y = self.lin(x)
        if meta is not None:
            y = y + meta
        return y * 2 if save else y


X = torch.ones(1, 2)


def test_a_clashing_keyword_is_refused_not_taken(tmp_path: Path) -> None:
    model = TakesOptions()
    store = tl.open(tmp_path / "s.tl")
    with pytest.raises(tl.ArgumentClashError, match=r"TakesOptions.forward takes save="):
        tl.trace(model, X, save=True)
    with pytest.raises(tl.ArgumentClashError, match=r"kwargs=\{'meta': \.\.\.\}"):
        store.record(model, X, meta={"a": 1})
    with pytest.raises(TypeError, match="name="):  # a TypeError too
        store.record(model, X, name="run")
    assert len(store) == 0
    # tracelake's defaults, or options the model does not take, are not ambiguous.
    assert tl.trace(model, X, stats="all").output.shape == (1, 2)
    assert store.record(model, X, overwrite=False).outputs[0].out.shape == (1, 2)


def test_kwargs_and_args_pass_the_model_its_inputs(tmp_path: Path) -> None:
    model = TakesOptions()
    plain = model(X, save=True, meta=torch.full((2,), 3.0))
    meta = torch.full((2,), 3.0)
    trace = tl.trace(model, X, kwargs={"save": True, "meta": meta}, save=tl.label("meta"))
    assert torch.equal(trace.output, plain)
    assert [op.label for op in trace if op.saved] == ["meta"]
    store = tl.open(tmp_path / "s.tl")
    run = store.record(
        model,
        args=(X,),
        kwargs={"name": None, "save": True, "meta": meta},
        name="explicit",
        meta={"note": "tracelake's meta"},
    )
    assert run.name == "explicit" and store.runs()["meta"][0] == {"note": "tracelake's meta"}
    assert torch.equal(run.outputs[0].out, plain)
    assert [op.label for op in run.inputs] == ["input_1", "meta"]
    with pytest.raises(TypeError, match="not both"):
        tl.trace(model, X, args=(X,))
    with pytest.raises(TypeError, match="meta given both"):
        tl.trace(model, X, kwargs={"meta": meta}, meta=meta)
    with pytest.raises(TypeError, match="kwargs= takes a dict"):
        tl.trace(model, X, kwargs=[("save", True)])  # type: ignore[arg-type]
