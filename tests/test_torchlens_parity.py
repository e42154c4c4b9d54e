"""tracelake's graph is TorchLens's: the same model and input traced by both give the same
ordered labels, parents and children, module stacks and saved tensors.

TorchLens 2.36.1 (the ``dev`` extra) runs in this process: it wraps torch's functions
while it traces and its wrappers are removed after each trace (``unwrap_torch``), so
tracelake always traces first, on plain torch. The models are tests/parity_models.py's,
one per kind of graph, and the transformers models of tests/model_zoo.py. Where matching
TorchLens would break a stronger promise, or is not done yet, the model is listed in
``DIFFERENT`` with the reason (docs/architecture.md lists the same), and the test checks
that the difference is still there (strict xfail), so that a fix shows up.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import model_zoo
import pytest
import torch
from parity_models import MODELS
from test_store import run_python

import tracelake as tl

torchlens = pytest.importorskip("torchlens", minversion="2.36.1")
from torchlens.backends.torch.wrappers import unwrap_torch  # noqa: E402

#: model name -> why its graph differs from TorchLens's.
DIFFERENT: dict[str, str] = {}

Graph = list[dict[str, Any]]


def _torchlens_graph(model: torch.nn.Module, inputs: tuple[Any, ...]) -> Graph:
    try:
        log = torchlens.trace(model, inputs[0] if len(inputs) == 1 else list(inputs))
    finally:
        unwrap_torch()
    graph = []
    for op in log.ops:
        label = op.label if op.num_passes > 1 else op.label.split(":")[0]
        graph.append(
            {
                "label": label,
                "parents": tuple(op.parents),
                "children": tuple(op.children),
                "modules": tuple(op.modules or ()),
                "out": op.out,
            }
        )
    return graph


def _our_graph(model: torch.nn.Module, inputs: tuple[Any, ...]) -> Graph:
    trace = tl.trace(model, *inputs)
    return [
        {
            "label": op.label,
            "parents": op.parents,
            "children": op.children,
            "modules": tuple(f"{path}:{n}" for path, n in op.modules),
            "out": op.out,
        }
        for op in trace
    ]


def differences(model: torch.nn.Module, inputs: tuple[Any, ...]) -> list[str]:
    """How tracelake's graph of ``model(*inputs)`` differs from TorchLens's (empty: not
    at all)."""
    # TorchLens's run starts from the state tracelake's did (a BatchNorm in train mode
    # updates its buffers)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _our_graph(model, inputs)
        model.load_state_dict(state)
        theirs = _torchlens_graph(model, inputs)
    ours_labels = [op["label"] for op in ours]
    their_labels = [op["label"] for op in theirs]
    if ours_labels != their_labels:
        return [f"labels: tracelake {ours_labels}\n        TorchLens {their_labels}"]
    found = []
    for a, b in zip(ours, theirs, strict=True):
        for key in ("parents", "children", "modules"):
            if a[key] != b[key]:
                found.append(f"{a['label']} {key}: tracelake {a[key]}, TorchLens {b[key]}")
        mine, other = a["out"], b["out"]
        if isinstance(mine, torch.Tensor) and isinstance(other, torch.Tensor):
            if mine.shape != other.shape or not torch.equal(mine, other.to(mine.dtype)):
                found.append(f"{a['label']} saved tensor differs")
        elif isinstance(other, torch.Tensor) and mine is None:
            found.append(f"{a['label']} saved by TorchLens only")
    return found


def _case(name: str) -> Any:
    if name in DIFFERENT:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=DIFFERENT[name]))
    return name


@pytest.mark.parametrize("name", [_case(name) for name in MODELS])
def test_graph_is_torchlens_graph(name: str) -> None:
    model, inputs = MODELS[name]()
    found = differences(model, inputs)
    assert not found, "\n".join(found)


def test_enough_models_of_every_kind() -> None:
    assert len(MODELS) >= 60


ZOO = ["mlp", "cnn", "repeated_block", "lstm_model", "gpt2", "llama"]


@pytest.mark.parametrize("name", [_case(f"zoo:{name}") for name in ZOO])
def test_model_zoo_graph_is_torchlens_graph(name: str) -> None:
    model, inputs = getattr(model_zoo, name.removeprefix("zoo:"))()
    with torch.no_grad():
        found = differences(model, inputs)
    assert not found, "\n".join(found)


def _transformers_case(name: str) -> tuple[torch.nn.Module, tuple[Any, ...], bool]:
    """Small random-weight ``transformers`` models on which tracelake once differed from
    TorchLens (found by differential sweeps): the model, its inputs, and whether it
    runs in train mode."""
    import transformers as hf

    torch.manual_seed(0)
    ids = torch.randint(3, 90, (2, 12))
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    if name == "t5-labels":  # the position_bias= its layers hand back; labels=ids
        config = hf.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100,
            decoder_start_token_id=0,
        )  # fmt: skip
        return hf.T5ForConditionalGeneration(config), (ids, *[None] * 7, ids), False
    if name == "gemma":  # self.weight.float() hands the parameter back
        config = hf.GemmaConfig(num_key_value_heads=2, head_dim=8, intermediate_size=64, **sizes)
        return hf.GemmaModel(config), (ids,), False
    if name == "bert-mlm-labels":  # model(ids, labels=ids): one input
        config = hf.BertConfig(intermediate_size=64, **sizes)
        return hf.BertForMaskedLM(config), (ids, None, None, None, None, None, ids), False
    assert name == "resnet-train"  # BatchNorm's running statistics, written in training
    config = hf.ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8)
    return hf.ResNetModel(config), (torch.randn(2, 3, 32, 32),), True


@pytest.mark.parametrize("name", ["t5-labels", "gemma", "bert-mlm-labels", "resnet-train"])
def test_transformers_graph_is_torchlens_graph(name: str) -> None:
    pytest.importorskip("transformers")
    model, inputs, train = _transformers_case(name)
    model.train(train)
    found = differences(model, inputs)
    assert not found, "\n".join(found)


def test_labels_are_stable_between_runs() -> None:
    for name in ("LoopSinMul", "ReusedSequential", "LstmCellLoop"):
        model, inputs = MODELS[name]()
        assert tl.trace(model, *inputs).labels == tl.trace(model, *inputs).labels


def test_store_keeps_the_labels_and_func_takes_either_name(tmp_path: Any) -> None:
    model, inputs = MODELS["Spelling"]()
    trace = tl.trace(model, *inputs)
    store = tl.open(tmp_path / "runs.tl")
    store.record(model, *inputs, name="a")
    reopened = tl.open(tmp_path / "runs.tl")
    run = reopened["a"]
    assert run.labels == trace.labels
    assert "buffer_1" in run.labels and "layernorm_1_5" in run.labels
    for name in ("layer_norm", "layernorm"):
        rows = reopened.query(f"select label from ops where func = '{name}'").df()
        assert rows["label"].tolist() == ["layernorm_1_5"], name
    both = reopened.query("select label from ops where func = 'batch_norm' or func = 'zeroslike'")
    assert sorted(both.df()["label"]) == ["batchnorm_1_2", "zeroslike_1_6"]
    for op in trace:
        if op.out is not None:
            assert torch.equal(run[op.label].out, op.out), op.label


def test_store_keeps_in_place_activations_and_handed_back_arguments(tmp_path: Any) -> None:
    # The ops the recorder found only since matching TorchLens on these (an in-place
    # write by a call TorchLens does not see; arguments a call hands back; repeated
    # operands of a crawled call; parents in TorchLens's order, the branches of torch's
    # boolean_dispatch functions) reach the store and another process as recorded.
    store = tl.open(tmp_path / "runs.tl")
    traces = {}
    names = ("InplaceActivations", "ArgumentsHandedBack", "RepeatedOperands", "ArgumentOrder")
    for name in (*names, "DispatchedBranches"):
        model, inputs = MODELS[name]()
        with torch.no_grad():
            plain = model(*[x.clone() for x in inputs])
        traces[name] = tl.trace(model, *[x.clone() for x in inputs])
        store.record(model, *[x.clone() for x in inputs], name=name)
        assert torch.equal(traces[name]["output_1"].out, plain)
    script = f"""
import json, tracelake as tl
store = tl.open({str(tmp_path / "runs.tl")!r}, create=False)
graphs = {{n: [[op.label, list(op.parents)] for op in store[n]] for n in {list(traces)!r}}}
print(json.dumps(graphs))
where = "run = 'InplaceActivations' and func = 'silu_'"
print(json.dumps(store.query("select label from ops where " + where).df()["label"].tolist()))
"""
    graphs, silu = (json.loads(line) for line in run_python(script).stdout.splitlines()[-2:])
    for name, trace in traces.items():
        assert graphs[name] == [[op.label, list(op.parents)] for op in trace], name
        for op in trace:
            if op.out is not None:
                assert torch.equal(tl.open(tmp_path / "runs.tl")[name][op.label].out, op.out)
    assert silu == ["silu_1_2", "silu_2_6"]
    assert graphs["RepeatedOperands"][2] == ["einsum_1_2", ["input_1"]]
