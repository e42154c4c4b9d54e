"""Layers and passes as TorchLens finds them, from a finished recording's rows.

TorchLens groups ops into layers after the forward pass: ops that use the same
parameters (one ``nn.Linear`` called in a loop, a reused block) are passes of one layer,
and so is a repeated parameter-free op sequence inside a Python loop (``sin`` then
``mul`` three times: ``sin_1_1:1..3``), while a parameter-free module called twice
outside such a loop (one ``nn.ReLU`` at two places) stays two layers. Users key their
scripts on those labels, so tracelake runs TorchLens's own grouping
(:mod:`._recurrence`, vendored) on the same graph: this module builds that graph from
the rows and reads back each op's layer (the row index of its first pass) and pass.

Each op is described as TorchLens describes it when it records the call: its function
in TorchLens's spelling, the parameters it used, its output slot, the module addresses
it ran in, and for parameter-free ops the positions and shapes of its tensor arguments
and its non-tensor arguments (``x * 1`` and ``x * 2`` are different ops to TorchLens);
ops with parameters called with different non-tensor arguments (``padding=0`` and
``padding=1``) are split by those too, as TorchLens splits them
(:mod:`.argkeys` keeps the arguments and spells them as TorchLens does).
"""

from __future__ import annotations

from typing import Any

from ._recurrence import RecurrenceGroupingGraph, RecurrenceNode, group_recurrent_nodes
from .argkeys import SEP, hash_tokens, signature
from .names import INPLACE_DUNDERS, spelling
from .record import position

__all__ = ["group_layers"]

_FUNC = position("func")
_KIND = position("kind")
_MODULES = position("modules")
_PARENTS = position("parents")
_PARENT_ARGS = position("parent_args")
_SHAPE = position("shape")
_OUT_INDEX = position("out_index")
_INPLACE = position("inplace")
_PARAMS = position("params")
_ARG_VALUES = position("arg_values")


def _multi_output(rows: list[tuple], index: int) -> bool:
    """Whether the call that produced row ``index`` returned several tensors."""
    row = rows[index]
    if row[_OUT_INDEX]:
        return True
    following = index + 1
    return (
        following < len(rows)
        and rows[following][_KIND] == "op"
        and rows[following][_OUT_INDEX] == 1
    )


def _keys(rows: list[tuple], index: int, raw: list[str]) -> tuple[str, str]:
    """An op's equivalence class as TorchLens writes it, without and with its module
    suffix (the base class gathers the candidates, the full one is matched)."""
    row = rows[index]
    func = row[_FUNC]
    layer_type = spelling(func)
    modules = row[_MODULES]
    slot = f"_outindex{row[_OUT_INDEX]}" if _multi_output(rows, index) else ""
    params = row[_PARAMS]
    if params:
        base = f"{layer_type}_{'_'.join(sorted(params))}{slot}"
    else:
        if row[_INPLACE] and (func[-1] == "_" or func in INPLACE_DUNDERS):
            layer_type += "_inplace"
        tokens = [
            f"pos{where}_tensor{rows[parent][_SHAPE]}"
            for parent, where in zip(row[_PARENTS], row[_PARENT_ARGS], strict=True)
        ]
        values = row[_ARG_VALUES]
        if values:
            tokens += hash_tokens(values)
        base = f"{layer_type}_{SEP.join(tokens) or 'no_args'}{slot}"
        if modules:
            base += f"_module{modules[-1][0]}"
    return base, base + "_".join(path for path, _ in modules)


def _signatures(
    rows: list[tuple], keys: list[tuple[str, str]]
) -> tuple[dict[int, str], dict[int, str]]:
    """The structural signature of each op with parameters, and the equivalence key of
    those whose class holds calls of different signatures (TorchLens's
    ``_differentiated_param_equivalence_classes``: the class's key + ``_argsig``)."""
    signatures: dict[int, str] = {}
    cohorts: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        if row[_KIND] == "op" and row[_PARAMS]:
            signatures[index] = signature(row[_ARG_VALUES])
            cohorts.setdefault(keys[index][1], []).append(index)
    split: dict[int, str] = {}
    for key, cohort in cohorts.items():
        if len({signatures[index] for index in cohort}) > 1:
            for index in cohort:
                split[index] = f"{key}_argsig{signatures[index]}"
    return signatures, split


def group_layers(rows: list[tuple]) -> tuple[list[int], list[int]]:
    """Each row's layer (the index of its layer's first pass) and pass number (from 1),
    grouped as TorchLens groups them. Inputs and outputs are single-pass layers."""
    n = len(rows)
    counts: dict[str, int] = {}
    raw: list[str] = []
    for index, row in enumerate(rows):
        layer_type = row[_FUNC] if row[_KIND] != "op" else spelling(row[_FUNC])
        counts[layer_type] = counts.get(layer_type, 0) + 1
        raw.append(f"{layer_type}_{counts[layer_type]}_{index + 1}_raw")
    children: list[list[str]] = [[] for _ in range(n)]
    for index, row in enumerate(rows):
        for parent in dict.fromkeys(row[_PARENTS]):
            children[parent].append(raw[index])
    keys: list[tuple[str, str]] = []
    members: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        if row[_KIND] == "op":
            base, full = _keys(rows, index, raw)
        else:  # each model input and output, each buffer entry is its own class
            base = full = f"{raw[index]}_{row[_KIND]}"
        keys.append((base, full))
        members.setdefault(base, []).append(index)
    signatures, split = _signatures(rows, keys)
    # a class's members sharing a key, one tuple per (class, key): a loop's ops share it
    equivalents: dict[tuple[str, str], tuple[str, ...]] = {}
    nodes: dict[str, RecurrenceNode] = {}
    sources: list[str] = []
    for index, row in enumerate(rows):
        label = raw[index]
        kind = row[_KIND]
        parents = tuple(raw[p] for p in dict.fromkeys(row[_PARENTS]))
        if not parents and kind != "output":  # inputs, buffers, ops of no tensors
            sources.append(label)
        params: Any = tuple(row[_PARAMS])
        modules = row[_MODULES]
        base, full = keys[index]
        key = split.get(index, full)
        equivalent = equivalents.get((base, key))
        if equivalent is None:
            equivalent = equivalents[base, key] = tuple(
                raw[m] for m in members[base] if split.get(m, full) == key
            )
        nodes[label] = RecurrenceNode(
            label=label,
            raw_order=index + 1,
            equivalence_key=key,
            equivalent_labels=equivalent,
            data_parents=parents,
            data_children=tuple(children[index]),
            layer_label=label,
            recurrent_labels=(),
            uses_params=bool(params),
            func_name=row[_FUNC] if kind == "op" else "none",
            param_barcodes=params,
            output_slot=row[_OUT_INDEX] if kind == "op" and _multi_output(rows, index) else None,
            recurrence_anchored=bool(modules) or kind == "buffer",
            module_site=tuple(path for path, _ in modules),
            arg_signature=signatures.get(index),
        )
    graph = RecurrenceGroupingGraph(
        nodes=nodes,
        raw_labels=tuple(raw),
        source_labels=tuple(sources),
        eligible_labels=tuple(raw),
    )
    assignments = group_recurrent_nodes(graph)
    at = {label: index for index, label in enumerate(raw)}
    layers = list(range(n))
    passes = [1] * n
    for label, assignment in assignments.items():
        index = at[label]
        layers[index] = at[assignment.recurrent_labels[0]]
        passes[index] = assignment.pass_index
    return layers, passes
