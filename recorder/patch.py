"""``tl.patch_from(source)``: replace each selected op's output with the aligned op's
saved value in another recording: a stored run (a ``Run``, or its name with
``store=``) or an in-memory trace.

Ops are aligned by their stable key (``on="key"``, the comparison's: module call,
function, ordinal) or by label (``on="label"``). What can be known before the forward
runs is checked then: the source has ops the rule selects, and saved them. An op the
source lacks, or whose saved value has another shape, fails at that op, naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from tracelake.errors import InterventionError

from .actions import HELPERS, Action, HookContext
from .selectors import Selector

__all__ = ["patch_from"]

_ON = ("key", "label")


def _stored_run(source: Any) -> bool:
    return hasattr(source, "num_steps") and hasattr(source, "step") and hasattr(source, "id")


class PatchAction(Action):
    """The action ``tl.patch_from`` builds; reads its source when a step begins."""

    def __init__(self, source: Any, on: str, describe: str, params: dict[str, Any], stored: bool):
        super().__init__(
            "patch_from",
            params,
            self._patch,
            replayable=stored,
            reason=None if stored else "tl.patch_from of an in-memory trace (not stored)",
        )
        self._source = source
        self._on = on
        self._describe = describe
        self._values: dict[Any, torch.Tensor] = {}
        self._unsaved: dict[Any, str] = {}
        # what prepare() read, by step and selector: a recording's sources do not change
        self._read: dict[tuple[int, str], tuple[dict[Any, torch.Tensor], dict[Any, str]]] = {}

    def _view(self, step: int) -> Any:
        source = self._source
        if not _stored_run(source):
            return source
        if source.num_steps == 1:
            return source.step(0)
        if step >= source.num_steps:
            raise InterventionError(
                f"tl.patch_from({self._describe}): the source has {source.num_steps} steps, "
                f"none for step {step} of this recording"
            )
        return source.step(step)

    def _align_key(self, op: Any) -> Any:
        return op.key if self._on == "key" else op.label

    def prepare(self, step: int, selector: Selector | None = None) -> None:
        """Read the source's values of the ops ``selector`` picks there; refuse now,
        before the forward, what cannot work whatever the forward does."""
        read = self._read.get((step, repr(selector)))
        if read is None:
            read = self._read[step, repr(selector)] = self._read_source(step, selector)
        self._values, self._unsaved = read
        if not self._values and not self._unsaved:
            raise InterventionError(
                f"tl.patch_from({self._describe}): the source has no op that {selector!r} "
                "selects, so nothing could be patched"
            )
        if self._unsaved:
            some = ", ".join(sorted(self._unsaved.values())[:5])
            raise InterventionError(
                f"tl.patch_from({self._describe}): the source did not save {some}, which "
                f"{selector!r} selects; record the source with save= including them"
            )

    def _read_source(
        self, step: int, selector: Selector | None
    ) -> tuple[dict[Any, torch.Tensor], dict[Any, str]]:
        values: dict[Any, torch.Tensor] = {}
        unsaved: dict[Any, str] = {}
        for op in self._view(step):
            if op.kind != "op" or (selector is not None and not selector.matches_op(op)):
                continue
            value = op.out
            if value is None:
                unsaved[self._align_key(op)] = op.label
            else:
                values[self._align_key(op)] = value
        return values, unsaved

    def _patch(self, out: torch.Tensor, hook: HookContext) -> torch.Tensor:
        key = hook.key if self._on == "key" else hook.label
        value = self._values.get(key)
        if value is None:
            raise InterventionError(
                f"tl.patch_from({self._describe}) at {hook.where}: the source has no op "
                f"with {'key ' + repr(key) if self._on == 'key' else 'that label'}"
            )
        if tuple(value.shape) != tuple(out.shape):
            raise InterventionError(
                f"tl.patch_from({self._describe}) at {hook.where}: the source's value has "
                f"shape {list(value.shape)}, this op's output {list(out.shape)}"
            )
        return value.to(device=out.device, dtype=out.dtype, copy=True)


def patch_from(source: Any, *, store: Any = None, on: str = "key") -> Action:
    """Patch each selected op with the aligned op's saved value in ``source``: a stored
    run (a ``Run``, or its name with ``store=``) or an in-memory trace (not replayable).
    ``on``: align by ``"key"`` (stable across runs, the default) or ``"label"``."""
    if on not in _ON:
        raise ValueError(f"tl.patch_from(on=...) takes 'key' or 'label', not {on!r}")
    if isinstance(source, str):
        if store is None:
            raise TypeError(
                f"tl.patch_from({source!r}) names a stored run: pass the store too, "
                f"tl.patch_from({source!r}, store=store), or the Run itself"
            )
        source = store[source]
    if _stored_run(source):
        params = {"source": source.name, "on": on}
        return PatchAction(source, on, repr(source.name), params, stored=True)
    if hasattr(source, "labels") and hasattr(source, "ops"):
        described = f"<trace of {getattr(source, 'model_class', '?')}>"
        return PatchAction(source, on, described, {"source": described, "on": on}, stored=False)
    raise TypeError(
        "tl.patch_from(source) takes a stored run (a Run, or its name with store=) or an "
        f"in-memory trace, not {type(source).__name__}"
    )


HELPERS["patch_from"] = patch_from
