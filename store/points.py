"""The op index of a reader's catalog mirror: where an op's tensor lies, by run and label.

Fetching one activation (``select out from ops where run = 'a' and label = 'relu_1_2'``)
is the commonest query of a notebook, and DuckDB cannot answer it fast: a statement of
that shape has a fixed cost of its own even over a table of one row, plus a scan of
the run's row group (``benchmarks/query_latency.py`` measures both). This index answers
it from memory in microseconds.

It keeps, for every op row of the mirror's complete runs, only what locates its tensor
(``FIELDS``), as numpy columns sorted by ``(run_id, label)``: a few machine words a
row, strings and shapes as codes into lists of their distinct values. Runs are indexed when a lookup
first needs them (one query of the mirror for all the runs not indexed yet, one segment
per such batch); runs that left the catalog are dropped from their segments at the
refresh that saw them go. A store never asked such a query twice pays nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

# numpy and pyarrow (pyarrow.compute: a third of a second to import) load when the index
# is first used: listing runs never uses it, and starts without them.

__all__ = ["FIELDS", "OpIndex"]

#: The columns of ``ops`` the index answers with (``shape`` comes in as its text).
FIELDS = (
    "run_id",
    "step",
    "idx",
    "label",
    "tensor",
    "array",
    "byte_offset",
    "nbytes",
    "shape",
    "dtype",
)
#: What a loader returns: ``FIELDS`` of the given runs' ops, ``shape`` as VARCHAR.
Loader = Callable[[list[int]], "pa.Table"]


class _Codes:
    """The distinct values of a column across the index, each with a code."""

    def __init__(self, decode: Callable[[str], Any] = str):
        self.code: dict[str, int] = {}
        self.values: list[Any] = []
        self._decode = decode

    def encode(self, column: Any) -> np.ndarray:
        """Each row's code (-1 for null)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        from . import arrow

        encoded = pc.dictionary_encode(
            column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        )
        known = np.fromiter(
            (self._add(v) for v in encoded.dictionary.to_pylist()),
            np.int64,
            len(encoded.dictionary),
        )
        indices = arrow.numbers(encoded.indices, null=-1)
        codes = np.full(len(indices), -1, dtype=np.int64)
        present = indices >= 0
        codes[present] = known[indices[present]]
        return codes

    def _add(self, value: str) -> int:
        code = self.code.get(value)
        if code is None:
            code = self.code[value] = len(self.values)
            self.values.append(self._decode(value))
        return code

    def get(self, code: int) -> Any:
        return None if code < 0 else self.values[code]


class _Segment:
    """The rows of some runs, every column in ``(run_id, label code)`` order."""

    __slots__ = ("columns", "keys")

    def __init__(self, keys: np.ndarray, columns: dict[str, np.ndarray]):
        self.keys = keys  # run id << 32 | label code (-1: no label)
        self.columns = columns

    def find(self, key: int) -> range:
        lo, hi = self.keys.searchsorted([key, key + 1])
        return range(int(lo), int(hi))

    def without(self, gone: np.ndarray) -> _Segment | None:
        import numpy as np

        keep = ~np.isin(self.keys >> 32, gone)
        if keep.all():
            return self
        if not keep.any():
            return None
        return _Segment(self.keys[keep], {k: v[keep] for k, v in self.columns.items()})


class OpIndex:
    """``(run id, label) -> rows`` over the ops of a mirror's complete runs; ``load``
    reads the rows of runs from the mirror."""

    def __init__(self, load: Loader):
        self._load = load
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # runs to index at the next lookup
        self._segments: list[_Segment] = []
        self._labels = _Codes()
        self._arrays = _Codes()
        self._dtypes = _Codes()
        self._shapes = _Codes(json.loads)

    def add(self, run_ids: Iterable[int]) -> None:
        """Runs newly loaded into the mirror."""
        with self._lock:
            self._pending.update(run_ids)

    def drop(self, run_ids: Iterable[int]) -> None:
        """Runs that left the mirror."""
        import numpy as np

        gone = np.array(sorted(set(run_ids)), dtype=np.int64)
        with self._lock:
            self._pending.difference_update(gone.tolist())
            kept = (seg.without(gone) for seg in self._segments)
            self._segments = [seg for seg in kept if seg is not None]

    def lookup(self, run_id: int, label: str) -> list[dict[str, Any]]:
        """The rows of op ``label`` in run ``run_id`` in (step, idx) order, as dicts of
        ``FIELDS`` with the values DuckDB gives."""
        with self._lock:
            if self._pending:
                self._index(sorted(self._pending))
                self._pending.clear()
            code = self._labels.code.get(label)
            if code is None:
                return []
            key = (run_id << 32) | code
            found = []
            for seg in self._segments:
                c = seg.columns
                for i in seg.find(key):
                    tensor, offset = int(c["tensor"][i]), int(c["byte_offset"][i])
                    nbytes = int(c["nbytes"][i])
                    found.append(
                        {
                            "run_id": run_id,
                            "step": int(c["step"][i]),
                            "idx": int(c["idx"][i]),
                            "label": label,
                            "tensor": None if tensor < 0 else tensor,
                            "array": self._arrays.get(int(c["array"][i])),
                            "byte_offset": None if offset < 0 else offset,
                            "nbytes": None if nbytes < 0 else nbytes,
                            "shape": self._shapes.get(int(c["shape"][i])),
                            "dtype": self._dtypes.get(int(c["dtype"][i])),
                        }
                    )
        return found

    def _index(self, run_ids: list[int]) -> None:
        import numpy as np

        from . import arrow

        rows = self._load(run_ids)
        if not rows.num_rows:
            return
        run_of = arrow.numbers(rows.column("run_id")).astype(np.int64)
        labels = self._labels.encode(rows.column("label"))
        # a row without a label (no op has none) gets key -1, which no lookup asks for
        keys = np.where(labels >= 0, (run_of << 32) | labels, -1)
        order = np.argsort(keys, kind="stable")  # equal keys stay in (step, idx) order

        def ints(name: str, dtype: Any) -> np.ndarray:
            return arrow.numbers(rows.column(name), null=-1).astype(dtype)[order]

        columns = {
            "step": ints("step", np.int32),
            "idx": ints("idx", np.int32),
            "tensor": ints("tensor", np.int32),
            "byte_offset": ints("byte_offset", np.int64),
            "nbytes": ints("nbytes", np.int64),
            "array": self._arrays.encode(rows.column("array")).astype(np.int32)[order],
            "shape": self._shapes.encode(rows.column("shape")).astype(np.int32)[order],
            "dtype": self._dtypes.encode(rows.column("dtype")).astype(np.int32)[order],
        }
        self._segments.append(_Segment(keys[order], columns))
