"""Gradients of a stored run: kept by a backward call of a recording, streamed through
the run's :class:`~.writer.TensorWriter` (the same packs, statistics and bounded
in-flight memory as activations), catalogued in the ``grads`` table (declared with the
op record, :data:`tracelake.recorder.record.GRADS`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracelake.recorder.backward import GradFire
from tracelake.recorder.record import GRADS, STAT_FIELDS

from .rows import _array, distinct_codes, stat_columns
from .schema import arrow_schema
from .tensors import dtype_name
from .writer import TensorWriter

__all__ = ["StoreGrads", "grads_table"]


class StoreGrads:
    """The sink of a recording's backward calls: each gradient goes to the writer at
    once (one slot), its fire to :attr:`fires`."""

    def __init__(self, writer: TensorWriter):
        self._writer = writer
        self.fires: list[tuple[GradFire, int]] = []  # (fire, slot)

    def keep(self, fire: GradFire, grad: torch.Tensor) -> None:
        writer = self._writer
        writer.step = fire.step
        self.fires.append((fire, writer.save(grad)))

    def done(self) -> None:
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
        "shape": pa.array([list(sh) for sh in shapes], pa.list_(pa.int64())).take(shape_of),
        "dtype": pa.array([dtype_name(dt) for dt in dtypes], pa.string()).take(dtype_of),
        "nbytes": numel[shape_of] * itemsize[dtype_of] if n else [],
        "saved": saved,
        "tensor": pa.array(slot_of, mask=~saved, type=pa.int32()),
        "array": [w[0] if w else None for w in where],
        "byte_offset": pa.array(
            [w[1] if w and w[1] >= 0 else None for w in where], type=pa.int64()
        ),
    }
    columns.update(stat_columns(stats, slot_of))
    schema = arrow_schema(GRADS)
    assert set(STAT_FIELDS) <= set(columns)
    return pa.Table.from_arrays([_array(columns[f.name], f.type) for f in schema], schema=schema)
