"""``grad`` in ops queries: each op's latest gradient, read back in a new process, bit for
bit what tensor hooks (``register_hook``) and full backward hooks on a plain
forward+backward see; its reductions from the stored statistics; several backward calls
(the latest fire); joins across runs; lazy reads; refusals."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from grad_reference import GradHookMode, module_grad_outputs
from model_zoo import gpt2, mlp

import tracelake as tl

BACKWARD = tl.options.CaptureOptions(backward_ready=True)
MODELS = {"mlp": mlp, "gpt2": gpt2}


def loss_of(output) -> torch.Tensor:
    out = output if isinstance(output, torch.Tensor) else output.logits
    return (out.float().square().mean() + out.float().sin().sum()) / 3


def _digest(t: torch.Tensor) -> list:
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(data).hexdigest()]


# Runs in a new process: the queries' answers, each gradient as a digest.
_QUERY = r"""
import hashlib, json, sys
import torch
import tracelake as tl
from tracelake.query.results import run_query

def digest(t):
    if t is None:
        return None
    data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(data).hexdigest()]

store = tl.open(sys.argv[1], create=False)
answer = {}
for run in ("twice", "once"):
    res = store.query(
        "select idx, kind, grad, norm(grad), sum(grad), grad[0] from ops "
        "where run = :run and step = 0 order by idx",
        run=run,
    )
    answer[run] = [
        [r["idx"], r["kind"], digest(r["grad"]), r["norm(grad)"], r["sum(grad)"],
         digest(r["grad[0]"])]
        for r in res
    ]
lazy = run_query(
    store, "select idx, grad from ops where run = 'twice' order by idx", lazy=True
)
answer["lazy"] = [[r["idx"], digest(r["grad"])] for r in lazy.read_rows(0, len(lazy))]
fires = store.query(
    "select idx, backward, out from grads where run = 'twice' order by fire"
)
answer["fires"] = [[r["idx"], r["backward"], digest(r["out"])] for r in fires]
modules = store.query(
    "select path, num_passes, output_ops from modules where run = 'once' and step = 0"
)
answer["modules"] = [[r["path"], r["num_passes"], r["output_ops"]] for r in modules]
pairs = store.query(
    "select a.idx, max_abs_diff(a.grad, b.grad) as d, cosine(a.out, a.grad) as c "
    "from ops a join ops b using (idx) where a.run = 'twice' and b.run = 'once' "
    "and norm(a.grad) > 0 order by a.idx"
)
answer["pairs"] = [[r["a.idx"], r["d"], r["c"]] for r in pairs]
print(json.dumps(answer))
"""


@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
@pytest.mark.filterwarnings("ignore:For backward hooks:UserWarning")
@pytest.mark.parametrize("name", list(MODELS))
def test_grad_reads_back_bitwise_as_hooks_see_it(name, tmp_path):
    build = MODELS[name]
    model, inputs = build()
    store = tl.open(tmp_path / "runs.tl")
    # "twice": two backward calls over one graph; "once": store.record's backward=.
    with store.recording("twice", model, capture=BACKWARD) as rec:
        loss = loss_of(model(*inputs))
        rec.backward(loss, retain_graph=True)
        rec.backward(loss * 2)
    model.zero_grad(set_to_none=True)
    store.record(model, *inputs, name="once", backward=loss_of)
    store.close()

    done = subprocess.run(
        [sys.executable, "-c", _QUERY, str(tmp_path / "runs.tl")],
        capture_output=True,
        text=True,
        check=True,
    )
    answer = json.loads(done.stdout)

    # The reference: tensor hooks on every op output of a plain forward, two backward
    # calls as "twice" made (each hook list: the first call's gradient, then the second's).
    ref_model, ref_inputs = build()
    mode = GradHookMode()
    with mode:
        output = ref_model(*ref_inputs)
    ref_loss = loss_of(output)
    ref_loss.backward(retain_graph=True)
    (ref_loss * 2).backward()
    hooked = [grads for _, per_call in mode.calls for grads in per_call]

    for run, latest in (("twice", -1), ("once", 0)):
        ops = [row for row in answer[run] if row[1] == "op"]
        assert len(ops) == len(hooked), f"{run}: {len(ops)} ops, hooks saw {len(hooked)}"
        compared = 0
        for (_idx, _kind, grad, norm, total, first), grads in zip(ops, hooked, strict=True):
            if not grads:
                assert grad is None and norm is None
                continue
            want = grads[latest]
            assert grad == _digest(want)
            assert first == _digest(want[0])
            reference = float(want.double().norm())
            assert norm == pytest.approx(reference, rel=1e-5, abs=1e-6)
            assert total == pytest.approx(float(want.double().sum()), rel=1e-4, abs=1e-5)
            compared += 1
        assert compared > len(ops) // 2
    # the latest fire is twice the first: the second call's loss was doubled
    twice = {idx: grad for idx, _k, grad, *_ in answer["twice"] if grad is not None}
    fires: dict[int, list] = {}
    for idx, backward, grad in answer["fires"]:
        fires.setdefault(idx, []).append((backward, grad))
    assert fires.keys() == twice.keys()
    for idx, per_fire in fires.items():
        assert [b for b, _ in per_fire] == [1, 2], idx
        assert twice[idx] == per_fire[-1][1]  # grad is the last fire's row of grads
    assert dict(answer["lazy"]) == {idx: g for idx, _k, g, *_ in answer["twice"]}

    # Across runs: the second call's loss was doubled, so "twice"'s grads differ from
    # "once"'s wherever they are non-zero; cosine(out, grad) is a number.
    assert answer["pairs"] and all(d is not None and d > 0 for _, d, _c in answer["pairs"])
    assert all(c is None or -1.0 <= c <= 1.0 + 1e-6 for *_, c in answer["pairs"])

    # Full backward hooks: each module's grad_output is its output op's grad.
    ref_model, ref_inputs = build()
    module_hooks = module_grad_outputs(
        ref_model, lambda: loss_of(ref_model(*ref_inputs)).backward()
    )
    once = {idx: grad for idx, _k, grad, *_ in answer["once"]}
    compared = 0
    for path, passes, output_ops in answer["modules"]:
        seen = module_hooks.get(path)
        if passes != 1 or len(output_ops) != 1 or output_ops[0] < 0 or not seen:
            continue
        (grad_output,) = seen
        if len(grad_output) != 1 or grad_output[0] is None:
            continue
        assert once[output_ops[0]] == _digest(grad_output[0]), path
        compared += 1
    assert compared >= 3


def test_grad_is_null_without_backward_and_refused_outside_ops(tmp_path):
    model, (x,) = mlp()
    store = tl.open(tmp_path / "runs.tl")
    store.record(model, x, name="plain")
    store.record(model, x, name="relus", backward=loss_of, save_grads=tl.func("relu"))
    res = store.query(
        "select run, func, grad, norm(grad) from ops where kind = 'op' order by run, idx"
    )
    rows = list(res)
    assert all(r["grad"] is None and r["norm(grad)"] is None for r in rows if r["run"] == "plain")
    relus = [r for r in rows if r["run"] == "relus"]
    assert {r["func"] for r in relus if r["grad"] is not None} == {"relu"}
    run = store["relus"]
    kept = [op.grad for op in run if op.func == "relu"]
    got = [r["grad"] for r in relus if r["func"] == "relu"]
    assert len(got) == len(kept) == 2
    for a, b in zip(got, kept, strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert len(store.query("select label from ops where norm(grad) > 0")) == 2
    for query, message in (
        ("select grad from grads", "in grads, out is the gradient"),
        ("select grad from modules", "grad is a tensor of ops"),
        ("select label from ops where grad > 0", "is a tensor"),
        ("select grad, count(*) from ops group by grad", "group by"),
    ):
        with pytest.raises(tl.QueryError, match=message):
            store.query(query)


class _Residual(torch.nn.Module):
    """The engine hands one gradient to several nodes: the addition's to both of its
    inputs, the views' on as views (same bytes, other shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        r = torch.relu(h).view(-1)
        return h + r.view(h.shape) * 1.0


def test_a_gradient_handed_to_several_ops_is_stored_once(tmp_path):
    torch.manual_seed(0)
    model, x = _Residual(), torch.randn(256, 64)
    store = tl.open(tmp_path / "runs.tl")
    store.record(model, x, name="r", backward=lambda out: (out * out).sum())
    res = store.query(
        "select idx, kind, shape, grad, norm(grad), mean(grad), absmax(grad) from ops "
        "where run = 'r' order by idx"
    )
    ref = _Residual()
    ref.load_state_dict(model.state_dict())
    mode = GradHookMode()
    with mode:
        out = ref(x)
    (out * out).sum().backward()
    hooked = [grads for _, per_call in mode.calls for grads in per_call]
    ops = [row for row in res if row["kind"] == "op"]
    assert len(ops) == len(hooked) == 6  # linear, relu, view, view, mul, add
    for row, grads in zip(ops, hooked, strict=True):
        (want,) = grads
        assert row["grad"].shape == want.shape == tuple(row["shape"])
        assert torch.equal(row["grad"], want), row["idx"]
        assert row["norm(grad)"] == pytest.approx(float(want.double().norm()), rel=1e-6)
        assert row["mean(grad)"] == pytest.approx(float(want.double().mean()), rel=1e-5, abs=1e-9)
        assert row["absmax(grad)"] == float(want.abs().max())
    # several ops' rows name the same bytes (written once)
    where = store.sql('select "array", byte_offset from grads')
    assert len(where.drop_duplicates()) < len(where) - 2
