"""Gradients of a stored run: kept by a backward call of a recording, streamed through
the run's :class:`~.writer.TensorWriter` (the same packs, statistics and bounded
in-flight memory as activations), catalogued in the ``grads`` table (declared with the
op record, :data:`tracelake.recorder.record.GRADS`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracelake.recorder.backward import GradFire
from tracelake.recorder.record import GRADS, STAT_FIELDS

from . import arrow
from .rows import _assembled, _taken, distinct_codes, stat_columns
from .schema import arrow_schema
from .tensors import dtype_name
from .writer import TensorWriter

__all__ = ["StoreGrads", "grads_table"]


class StoreGrads:
    """The sink of a recording's backward calls: each gradient goes to the writer at
    once (one slot), its fire to :attr:`fires`.

    The engine hands the same gradient to several nodes (an addition passes its
    gradient on to both of its inputs' nodes as it is, a view's backward a view of it):
    its bytes are stored once. A contiguous gradient whose bytes are those of one saved
    earlier in the same backward call (same device, address, size and dtype), while that
    one is still alive (so the memory is still its storage's) and neither version has
    moved since (views share their base's counter), gets that one's slot, or an alias
    of it with its own shape (:meth:`TensorWriter.alias`, packed bytes only): nothing
    is copied or written again. Only weak references are kept, so no gradient lives
    longer than the engine keeps it.
    """

    def __init__(self, writer: TensorWriter):
        self._writer = writer
        self.fires: list[tuple[GradFire, int]] = []  # (fire, slot)
        # (device, address, nbytes, dtype) -> (the gradient saved there, its version, slot)
        self._saved: dict[tuple[Any, int, int, torch.dtype], tuple[Any, int, int]] = {}

    def keep(self, fire: GradFire, grad: torch.Tensor) -> None:
        writer = self._writer
        writer.step = fire.step
        if not grad.is_contiguous() or not grad.nbytes:
            self.fires.append((fire, writer.save(grad)))
            return
        key = (grad.device, grad.data_ptr(), grad.nbytes, grad.dtype)
        version = grad._version
        seen = self._saved.get(key)
        if seen is not None:
            held, held_version, slot = seen
            same = held()
            if same is not None and same._version == held_version == version:
                shape = tuple(grad.shape)
                if shape == tuple(same.shape):
                    self.fires.append((fire, slot))
                    return
                if writer.slots[slot][1] >= 0:  # packed: read by offset, any shape
                    self.fires.append((fire, writer.alias(slot, shape)))
                    return
        slot = writer.save(grad)
        self._saved[key] = (weakref.ref(grad), version, slot)
        self.fires.append((fire, slot))

    def done(self) -> None:
        self._saved.clear()  # a later call's gradients are new tensors
        self._writer.settle()  # the engine's buffers are free to go once copied

    def slots_of(self, step: int) -> list[int]:
        return [slot for fire, slot in self.fires if fire.step == step]


def grads_table(
    run_id: int,
    fires: Sequence[tuple[GradFire, int]],
    labels: Sequence[list[str]],
    slots: list[Any],
    stats: tuple[np.ndarray, np.ndarray],
    lost: set[int],
) -> pa.Table:
    """The ``grads`` rows of a run: ``fires`` as :class:`StoreGrads` kept them, the
    steps' ``labels``, the writer's ``slots`` and statistics matrix (by slot); slots in
    ``lost`` are recorded unsaved."""
    n = len(fires)
    slot_of = np.array([slot for _, slot in fires], dtype=np.int64)
    saved = np.array([slot not in lost for slot in slot_of.tolist()], dtype=bool)
    slot_of = np.where(saved, slot_of, -1)
    where = [slots[slot] if slot >= 0 else None for slot in slot_of.tolist()]
    shapes, shape_of = distinct_codes([tuple(slots[s][3]) for _, s in fires])
    dtypes, dtype_of = distinct_codes([slots[s][4] for _, s in fires])
    numel = np.array([int(np.prod(sh)) for sh in shapes], dtype=np.int64)
    itemsize = np.array([dt.itemsize for dt in dtypes], dtype=np.int64)
    columns: dict[str, Any] = {
        "run_id": np.full(n, run_id, dtype=np.int32),
        "step": [f.step for f, _ in fires],
        "idx": [f.op for f, _ in fires],
        "label": [labels[f.step][f.op] for f, _ in fires],
        "backward": [f.backward for f, _ in fires],
        "fire": [f.fire for f, _ in fires],
        "node": [f.node for f, _ in fires],
        "shape": _taken([list(sh) for sh in shapes], shape_of, pa.list_(pa.int64())),
        "dtype": _taken([dtype_name(dt) for dt in dtypes], dtype_of, pa.string()),
        "nbytes": numel[shape_of] * itemsize[dtype_of] if n else [],
        "saved": saved,
        "tensor": arrow.array(slot_of, pa.int32(), mask=~saved),
        "array": [w[0] if w else None for w in where],
        "byte_offset": [w[1] if w and w[1] >= 0 else None for w in where],
    }
    columns.update(stat_columns(stats, slot_of))
    schema = arrow_schema(GRADS)
    assert set(STAT_FIELDS) <= set(columns)
    return _assembled(schema, columns)
