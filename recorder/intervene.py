"""Interventions: ``intervene=tl.when(selector, action)`` (one rule or a list), applied
while a forward pass is recorded.

Each op entry is offered to the rules in order as it is recorded (before the emitter
keeps it): a rule whose selector matches applies its action to the output, and the
next rule sees the result. The op's row carries ``intervened`` and the first ``rule``
that changed it; the recording keeps the rules as JSON specs with the number of ops each
touched (:meth:`Interventions.audit`). The changed tensor is what the model goes on
with (the interception mode returns it; see ``intercept.Interceptor``), what later ops
find as their producer, and what is saved.

With no rules, nothing here runs: the recording uses its usual (compiled) path.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from tracelake.errors import InterventionError, TraceLakeWarning

from .actions import Action, HookContext, action_from_spec, as_action
from .entries import FUNC, INPLACE, INTERVENED, KIND, OUT_INDEX, PASS, RULE, OpEntry, OpTable
from .entries import next_op_key as _next_op_key
from .labels import Emitter, Labeller
from .selectors import Selector, labels_named, parse_selector

__all__ = ["InterveningEmitter", "Interventions", "Rule", "as_rules", "when"]


@dataclass(frozen=True, eq=False)
class Rule:
    """One intervention rule: where (a selector) and what (an :class:`Action`)."""

    selector: Selector
    action: Action

    def __repr__(self) -> str:
        return f"tl.when({self.selector!r}, {self.action!r})"


def when(selector: Selector, action: Any) -> Rule:
    """A rule: apply ``action`` to the output of every op ``selector`` selects.

    ``action`` is a helper (``tl.zero_ablate()``, ``tl.scale(0.5)``,
    ``tl.patch_from(run)``, ...) or a callable ``fn(out, *, hook)`` returning the new
    output (recorded by name; a run using one is not replayable)."""
    if not isinstance(selector, Selector):
        raise TypeError(
            f"tl.when(selector, action) takes a selector such as tl.func('relu') first, "
            f"not {type(selector).__name__} {selector!r}"
        )
    return Rule(selector, as_action(action))


def as_rules(intervene: Any) -> tuple[Rule, ...]:
    """The rules of an ``intervene=`` argument: ``None``, one rule or a list of them."""
    if intervene is None:
        return ()
    if isinstance(intervene, Rule):
        return (intervene,)
    if isinstance(intervene, (list, tuple)) and all(isinstance(r, Rule) for r in intervene):
        return tuple(intervene)
    raise TypeError(
        "intervene= takes tl.when(selector, action) or a list of them, "
        f"not {type(intervene).__name__} {intervene!r}"
    )


class Interventions:
    """The rules of one recording (all its steps) and how many ops each changed."""

    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        self.touched = [0] * len(rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def step(self, step: int, table: OpTable, emitter: Emitter) -> InterveningEmitter:
        """The emitter wrapper for one forward pass; each action prepares for it first
        (``patch_from`` reads its source and refuses what cannot work, now)."""
        for rule in self.rules:
            rule.action.prepare(step, rule.selector)
        return InterveningEmitter(self, table, emitter)

    @property
    def not_replayable(self) -> list[str]:
        """Why the rules cannot be replayed (empty: they can)."""
        return [
            f"rule {n} ({rule!r}): {reason}"
            for n, rule in enumerate(self.rules)
            if (reason := _unreplayable(rule)) is not None
        ]

    def audit(self) -> list[dict[str, Any]]:
        """One row per rule: its number, selector, action and JSON spec, whether it can
        be replayed (and why not) and how many ops it changed."""
        return [
            {
                "rule": n,
                "selector": repr(rule.selector),
                "action": rule.action.name,
                "spec": json.dumps(rule.action.spec()),
                "replayable": _unreplayable(rule) is None,
                "reason": _unreplayable(rule),
                "touched": self.touched[n],
            }
            for n, rule in enumerate(self.rules)
        ]

    def warn_unused(self, labels: Collection[str] = (), stacklevel: int = 3) -> None:
        """Warn of each rule that changed nothing. ``labels``: the recording's final
        labels, to tell a label rule that missed an op the recording has (its label was
        not known yet when the op ran: see :meth:`.entries.OpTable.settled_label`)."""
        for rule, count in zip(self.rules, self.touched, strict=True):
            if count:
                continue
            known = sorted(labels_named(rule.selector) & set(labels))
            if known:
                message = (
                    f"{rule!r} selected no op, though this recording has {known[0]!r}: "
                    "rules see each op during the forward, and a label (the pass of a "
                    "layer, and the numbers after it) is final only after the forward, "
                    "unless this process recorded the same graph before; record the "
                    "model once first (tl.trace(model, x)), or select the op by module "
                    "and function (tl.in_module(...) & tl.func(...))"
                )
            else:
                message = (
                    f"{rule!r} selected no op, so it changed nothing; check the selector "
                    "against the trace's labels, functions and modules"
                )
            warnings.warn(message, TraceLakeWarning, stacklevel=stacklevel)


def _unreplayable(rule: Rule) -> str | None:
    """Why ``rule`` cannot be rebuilt from what a recording keeps, or None."""
    if not rule.action.replayable:
        return rule.action.reason
    try:
        parse_selector(repr(rule.selector))
    except ValueError:
        return f"its selector {rule.selector!r} is not built from tl.func, tl.label, ..."
    return None


def rules_from_audit(rows: list[dict[str, Any]], **context: Any) -> tuple[Rule, ...]:
    """The rules a stored audit describes, rebuilt (for replay). The selector is
    rebuilt from its ``repr`` only through the selector constructors."""
    return tuple(
        Rule(parse_selector(row["selector"]), action_from_spec(json.loads(row["spec"]), **context))
        for row in rows
    )


class InterveningEmitter:
    """Wraps a recording's emitter: offers each op entry to the rules before the
    emitter sees it. ``swaps`` maps the id of a call's output to the tensor that replaces
    it (the interception mode returns that one); ``error`` holds what a rule raised, for
    the mode to raise into the forward (not to be swallowed as a recording problem)."""

    def __init__(self, owner: Interventions, table: OpTable, inner: Emitter):
        self.wants_ops = True
        self.swaps: dict[int, torch.Tensor] = {}
        self.error: BaseException | None = None
        self._owner = owner
        self._rules = owner.rules
        self._inner = inner
        self._inner_entry = inner.on_entry if inner.wants_ops else None
        self._table = table
        self._rows = table.rows
        self._counts: dict[tuple[Any, str], int] = {}
        self._first_key = ""
        self._labeller: Labeller | None = None

    def bind(self, labeller: Labeller) -> None:
        self._labeller = labeller

    def on_entry(self, index: int, tensor: torch.Tensor, same_as: int) -> None:
        row = self._rows[index]
        if row[KIND] == "op":
            try:
                tensor = self._intervene(index, row, tensor)
            except Exception as exc:  # raised into the forward by the mode, not swallowed
                if self.error is None:
                    self.error = exc
        if self._inner_entry is not None:
            self._inner_entry(index, tensor, same_as)

    def _intervene(self, index: int, row: tuple, tensor: torch.Tensor) -> torch.Tensor:
        out_index = row[OUT_INDEX]
        if out_index:  # a later output of the call whose first output came just before
            key = f"{self._first_key}.{out_index}"
        else:
            key = self._first_key = _next_op_key(self._counts, row)
        op = OpEntry(self._table, None, index)
        new, first = tensor, None
        for number, rule in enumerate(self._rules):
            if not rule.selector.matches_op(op):
                continue
            label = op.settled_label() or ""
            hook = HookContext(op.layer, row[PASS], key, row[FUNC], op.module, index, number, label)
            value = rule.action.apply(new, hook)
            _check(value, tensor, rule, hook)
            new = value
            self._owner.touched[number] += 1
            if first is None:
                first = number
        if first is None:
            return tensor
        changed = list(row)
        changed[INTERVENED], changed[RULE] = True, first
        self._rows[index] = tuple(changed)
        if row[INPLACE]:  # the call wrote into this very tensor: so does the rule
            self._inner.before_write(tensor)
            tensor.copy_(new)
            return tensor
        self.swaps[id(tensor)] = new
        assert self._labeller is not None
        self._labeller.rebind(index, new)
        return new

    # -- the rest of the emitter protocol: the wrapped emitter's ------------------------

    def before_write(self, tensor: torch.Tensor) -> None:
        self._inner.before_write(tensor)

    def finish_ops(self) -> None:
        self._inner.finish_ops()

    def renumber(self, new: list[int], modules: list[Any]) -> set[int]:
        return self._inner.renumber(new, modules)

    def on_module_enter(
        self, entry: Any, tensors: list[torch.Tensor], producers: list[int]
    ) -> None:
        self._inner.on_module_enter(entry, tensors, producers)

    def on_module_exit(
        self, entry: Any, output: Any, tensors: list[torch.Tensor], producers: list[int]
    ) -> None:
        self._inner.on_module_exit(entry, output, tensors, producers)


def _check(value: Any, out: torch.Tensor, rule: Rule, hook: HookContext) -> None:
    if not isinstance(value, torch.Tensor):
        raise InterventionError(
            f"{rule!r} at {hook.where}: the action returned {type(value).__name__}, not a tensor"
        )
    if value.shape != out.shape or value.dtype != out.dtype:
        raise InterventionError(
            f"{rule!r} at {hook.where}: the action returned {list(value.shape)} "
            f"{value.dtype}, the op's output is {list(out.shape)} {out.dtype}"
        )
