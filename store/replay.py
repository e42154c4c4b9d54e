"""``store.replay(run, model)``: re-execute a stored run from its stored inputs, with its
stored interventions, and report op by op whether the stored values were reproduced.

Everything that could stop a replay is checked before the model runs: each step's call
was kept and holds only what a recording keeps (tensors, plain values, lists, tuples,
dicts), its inputs were saved, every rule can be rebuilt from its spec (no user
callable, no patch from an in-memory trace), and the stored inputs still match the
fingerprint taken when they were recorded (a tampered input is refused, naming it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from tracelake.errors import ReplayError
from tracelake.recorder.capture import trace as record_trace
from tracelake.recorder.intervene import rules_from_audit
from tracelake.recorder.replay import (
    ReplayReport,
    as_recorded,
    call_problems,
    compare_views,
    decode_call,
    replay_plan,
    saved_inputs,
)

from .schema import RULES

if TYPE_CHECKING:
    from .run import Run
    from .store import Store

__all__ = ["replay_run"]


def _stored_rules(run: Run) -> list[dict[str, Any]]:
    names = ", ".join(f'"{n}"' for n in RULES.column_names if n != "run_id")
    rows = run._query(f"SELECT {names} FROM rules WHERE run_id = ? ORDER BY rule", [run.id])
    columns = [d[0] for d in rows.description]
    return [dict(zip(columns, r, strict=True)) for r in rows.fetchall()]


def _stored_calls(run: Run) -> dict[int, str]:
    rows = run._query("SELECT step, call FROM calls WHERE run_id = ?", [run.id]).fetchall()
    return {int(step): call for step, call in rows}


def _check_fingerprint(store: Store, run: Run, inputs: list[torch.Tensor]) -> None:
    from .store import _fingerprint

    recorded = run.info.get("input_fingerprint")
    if recorded is None:
        return
    now = _fingerprint([(str(i), t) for i, t in enumerate(inputs)])
    if now != recorded:
        labels = ", ".join(op.label for op in run.step(0).inputs)
        raise ReplayError(
            f"run {run.name!r} cannot be replayed: its stored inputs ({labels}) do not match "
            "the fingerprint taken when they were recorded; they were changed since"
        )


def replay_run(
    store: Store,
    run: Any,
    model: torch.nn.Module,
    name: str | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> ReplayReport:
    """See :meth:`tracelake.store.Store.replay`."""
    if isinstance(run, str):
        run = store[run]
    what = f"run {run.name!r}"
    audit = _stored_rules(run)
    calls = _stored_calls(run)
    problems = [
        f"rule {row['rule']} ({row['selector']}, {row['action']}): {row['reason']}"
        for row in audit
        if not row["replayable"]
    ]
    for step in range(run.num_steps):
        problems += [f"step {step}: {p}" for p in call_problems(calls.get(step))]
    replay_plan(what, problems)
    steps = [run.step(k) for k in range(run.num_steps)]
    inputs = [saved_inputs(view, f"{what} (step {view.step})") for view in steps]
    _check_fingerprint(store, run, inputs[0])
    for row in audit:
        json.loads(row["spec"])  # a damaged spec fails here, before the model runs
    rules = list(rules_from_audit(audit, store=store)) or None
    report = ReplayReport()
    if name is None:
        for view, given in zip(steps, inputs, strict=True):
            args, kwargs = decode_call(calls[view.step], given)
            with as_recorded(calls[view.step], model):
                again = record_trace(model, *args, intervene=rules, **kwargs)
            report.traces.append(again)
            compare_views(view.step, view, again, report, atol, rtol)
        return report
    with store.recording(name, model, intervene=rules, meta={"replay_of": run.name}) as rec:
        for view, given in zip(steps, inputs, strict=True):
            args, kwargs = decode_call(calls[view.step], given)
            with as_recorded(calls[view.step], model):
                model(*args, **kwargs)
    report.run = replayed = store[rec.name or name]
    for view in steps:
        compare_views(view.step, view, replayed.step(view.step), report, atol, rtol)
    return report
