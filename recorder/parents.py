"""An op's parents in the order TorchLens lists them.

The recorder lists one parent per argument that took an entry, in argument order, with
the argument each came in (``parent_args``: a position, ``"p.j"`` for member ``j`` of
a list at position ``p``, a keyword, ``"k.j"``). TorchLens 2.36.1 lists most calls so,
because it reads their tensors through a static argument spec whose positions are in
argument order (``capture/arg_positions.py``: ``FUNC_ARG_SPECS``,
``extract_tensors_and_params``). Where it reads them otherwise,
:func:`in_torchlens_order` gives its order once the layers are grouped (TorchLens keys
an op by all its arguments, in argument order), and :func:`zipped` the parents of each
output of a ``torch._foreach_*`` call as the call is recorded (TorchLens groups and
prunes the graph with those):

- *Crawled*: TorchLens crawls the arguments of its variadic functions (``einsum``,
  ``block_diag``, ... :data:`_CRAWLED`) and of a call whose spec does not cover a tensor
  argument, which every ``out=`` is (no spec lists it): each tensor once, top-level
  arguments first (positional, then keywords in call order), then list members.
- *Spec order*: a few specs list a later position first (``index_put``'s values before
  its list of indices; ``_foreach_add``'s second operand before the first): positions
  in the spec's order, then keywords in the spec's order (:data:`_SPEC_ORDER`, read
  from TorchLens 2.36.1's table; a tensor argument it does not name is crawled).
- *Zipped*: output ``i`` of a ``torch._foreach_*`` call takes member ``i`` of each list
  argument and every argument that is not a list, each once
  (``_project_foreach_member_parent_fields``).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["FOREACH", "in_torchlens_order", "zipped"]

#: Functions whose parents TorchLens finds by crawling the call's arguments, each tensor
#: once (TorchLens 2.36.1's ``arg_positions.VARIADIC_TENSOR_ARG_FUNCS``: a variable number
#: of tensor operands, and names it shares with collectives, ``scatter`` among them),
#: where other calls list a tensor once per argument: ``torch.einsum(eq, x, x)`` and
#: ``x.scatter(0, i, x)`` have ``x``'s entry once, ``torch.mm(x, x)`` twice. Keyed as
#: TorchLens keys them: lower case, no underscores (``scatter_`` is ``scatter``).
_CRAWLED = frozenset(
    {
        *("aligntensors", "atleast1d", "atleast2d", "atleast3d", "blockdiag"),
        *("broadcasttensors", "cartesianprod", "chainmatmul", "einsum", "meshgrid"),
        *("reducescatter", "alltoall", "scatter"),
    }
)
_CRAWL = "crawl"
#: The prefix of the functions whose outputs take their own list members' parents.
FOREACH = "_foreach_"

_INDEX_PUT = ((0, 2, 1), ("self", "indices", "values"))
_FOREACH_BINARY = ((1, 0), ("self", "other"))
_FOREACH_TERNARY = ((3, 0, 1, 2), ("self", "tensor1", "tensor2", "scalars"))
_LSTM_CELL = ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh")
#: The functions whose static spec in TorchLens 2.36.1 reads positions out of argument
#: order: (the positions in its order, the keywords in its order), keyed as above.
_SPEC_ORDER: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "indexput": ((0, 2, 1), ("input", *_INDEX_PUT[1])),
    "indexputimpl": _INDEX_PUT,
    "unsafeindexput": _INDEX_PUT,
    "unsafemaskedindexputaccumulate": ((0, 1, 3, 2), ("self", "mask", "indices", "values")),
    "foreachadd": _FOREACH_BINARY,
    "foreachdiv": _FOREACH_BINARY,
    "foreachmul": _FOREACH_BINARY,
    "foreachaddcdiv": _FOREACH_TERNARY,
    "foreachaddcmul": _FOREACH_TERNARY,
    "ampforeachnonfinitecheckandunscale": ((1, 2, 0), ("self", "found_inf", "inv_scale")),
    "lstmcell": ((0, 2, 3, 4, 5, 1), _LSTM_CELL),
    "quantizedlstmcell": (
        (0, *range(2, 10), 1),
        (*_LSTM_CELL, "packed_ih", "packed_hh", "col_offsets_ih", "col_offsets_hh"),
    ),
    "miopenrnn": ((0, 3, 4, 13, 1), ("input", "weight", "hx", "cx", "dropout_state")),
}


def _key(func: str) -> str:
    return func.lower().replace("_", "")


@functools.cache
def _rule(func: str) -> Any:
    key = _key(func)
    return _CRAWL if key in _CRAWLED else _SPEC_ORDER.get(key)


def _slot(where: Any) -> tuple[int | str, int]:
    """An argument position as (position or keyword, list member or -1)."""
    if where.__class__ is int:
        return where, -1
    head, _, member = str(where).partition(".")
    return (int(head) if head.isdigit() else head), (int(member) if member else -1)


def _writes_out(where: tuple[Any, ...]) -> bool:
    return any(w.__class__ is str and _slot(w)[0] == "out" for w in where)


def _crawled(slots: list[tuple[int | str, int]], parents: tuple[int, ...]) -> list[int]:
    """The order of a crawl (breadth first, each entry once): top-level arguments,
    positional then keywords in call order, then the members of lists likewise."""
    keywords = list(dict.fromkeys(slot for slot, _ in slots if isinstance(slot, str)))

    def level(at: int) -> tuple[bool, bool, int, int]:
        slot, member = slots[at]
        if isinstance(slot, str):
            return member >= 0, True, keywords.index(slot), member
        return member >= 0, False, slot, member

    seen: set[int] = set()
    order = []
    for at in sorted(range(len(parents)), key=level):
        if parents[at] not in seen:
            seen.add(parents[at])
            order.append(at)
    return order


def _spec_order(
    spec: tuple[tuple[int, ...], tuple[str, ...]], slots: list[tuple[int | str, int]]
) -> list[int] | None:
    """The order of a static spec's reading (None where it does not name an argument)."""
    positions, keywords = spec
    spelled = [_key(keyword) for keyword in keywords]
    ranks = []
    for slot, member in slots:
        if isinstance(slot, int):
            if slot not in positions:
                return None
            rank = positions.index(slot)
        else:
            key = _key(slot)
            if key not in spelled:
                return None
            rank = len(positions) + spelled.index(key)
        ranks.append((rank, member))
    return sorted(range(len(slots)), key=ranks.__getitem__)


def _order(func: str, where: tuple[Any, ...], parents: tuple[int, ...]) -> list[int] | None:
    rule = _rule(func)
    if rule is None and not _writes_out(where):
        return None
    slots = [_slot(w) for w in where]
    order = None if rule is None or rule is _CRAWL else _spec_order(rule, slots)
    return _crawled(slots, parents) if order is None else order


def in_torchlens_order(
    func: str, parents: tuple[int, ...], where: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """The parents (and their argument positions) of a call of ``func`` as TorchLens
    lists them, where that differs from argument order; else None."""
    if func.startswith(FOREACH):  # listed as recorded (zipped)
        return None
    order = _order(func, where, parents)
    if order is None or order == list(range(len(parents))):
        return None
    return tuple(parents[at] for at in order), tuple(where[at] for at in order)


def zipped(
    func: str, parents: tuple[int, ...], where: tuple[Any, ...], n: int
) -> list[tuple[tuple[int, ...], tuple[Any, ...]]]:
    """For a ``torch._foreach_*`` call (``func`` starts with :data:`FOREACH`) with ``n``
    outputs: each output's parents and their argument positions."""
    order = _order(func, where, parents) or range(len(parents))
    slots = [_slot(where[at]) for at in order]
    found = []
    for i in range(n):
        # a parent is output i's where one of its arguments is (not a list member,
        # or member i), listed where it first comes, each once
        mine: dict[int, Any] = {}
        for at, (_, member) in zip(order, slots, strict=True):
            if member < 0 or member == i:
                mine.setdefault(parents[at], where[at])
        kept = tuple(dict.fromkeys(parents[at] for at in order if parents[at] in mine))
        found.append((kept, tuple(mine[parent] for parent in kept)))
    return found
