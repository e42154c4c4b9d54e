"""Orphans: the entries TorchLens prunes after the forward pass.

TorchLens 2.36.1 (``postprocess/graph_traversal._remove_orphan_nodes``) floods the graph
from the model's inputs, its outputs and the buffers a call wrote, following parents and
children alike, and drops every entry the flood did not reach (``keep_orphans=True``
keeps them); labels are numbered after that, so the op after a pruned ``ones`` is still
``add_1_1``. An entry is kept here when its connected component (entries joined by
dataflow edges, a call's outputs joined to each other) holds an input, an output, a
written buffer or an op an intervention changed (what the user changed stays on record).
"""

from __future__ import annotations

from .record import position

__all__ = ["kept_entries", "renumber"]

_KIND = position("kind")
_PARENTS = position("parents")
_OUT_INDEX = position("out_index")
_INTERVENED = position("intervened")


def kept_entries(rows: list[tuple]) -> list[int] | None:
    """The indices of the entries of ``rows`` to keep, in order, or None when every entry
    is kept (the common case, told by one pass: every entry descends from a parentless
    one, and when those are all inputs, all are connected to an input)."""
    if all(row[_PARENTS] or row[_KIND] == "input" for row in rows):
        return None
    root = list(range(len(rows)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = i = root[root[i]]
        return i

    seeds: list[int] = []
    for index, row in enumerate(rows):
        parents = row[_PARENTS]
        out_index = row[_OUT_INDEX]
        joined = (*parents, index - out_index) if out_index else parents
        if joined:  # rows come in order: every parent was placed before
            top = root[index] = find(joined[0])
            for parent in joined[1:]:
                other = find(parent)
                if other != top:
                    root[other] = top
        kind = row[_KIND]
        if kind != "op":
            if kind != "buffer" or parents:  # an input, an output, a written buffer
                seeds.append(index)
        elif row[_INTERVENED]:
            seeds.append(index)
    live = {find(seed) for seed in seeds}
    kept = [index for index in range(len(rows)) if find(index) in live]
    return None if len(kept) == len(rows) else kept


def renumber(kept: list[int], size: int) -> list[int]:
    """Old index -> new index for a table of ``size`` entries of which ``kept`` stay
    (-1: pruned)."""
    new = [-1] * size
    for number, index in enumerate(kept):
        new[index] = number
    return new
