"""The store: a DuckDB catalog plus Zarr arrays on disk, many runs in one place.

``layout`` (the directory, locks, durability) · ``tensors`` (Zarr arrays, packs,
codecs) · ``writer`` (the streaming write path) · ``catalog`` (DuckDB: writers'
transactions, readers' mirror) · ``boundary`` (what DuckDB's errors become) ·
``rows`` (catalog rows to and from recorder tables) · ``run`` (a stored run, read
lazily) · ``compare`` (two recordings op by op) · ``verify`` · ``store`` (the facade).

The names below load their module when first read (``tracelake._lazy``): the catalog's
modules (``catalog``, ``layout``, ``schema``, ``store``) import no torch, so that the
command line lists runs without it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compare import Comparison
    from .metrics import PairMetrics, tensor_metrics
    from .run import LazyTensor, Run, StepView, StoredOpEntry, TensorSlot
    from .store import Recording, Store, last_opened, open_store
    from .verify import Problem, VerifyReport
else:
    from tracelake._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "Comparison": ".compare",
            **dict.fromkeys(("PairMetrics", "tensor_metrics"), ".metrics"),
            **dict.fromkeys(
                ("LazyTensor", "Run", "StepView", "StoredOpEntry", "TensorSlot"), ".run"
            ),
            **dict.fromkeys(("Recording", "Store", "last_opened", "open_store"), ".store"),
            **dict.fromkeys(("Problem", "VerifyReport"), ".verify"),
        },
    )

__all__ = [
    "Comparison",
    "LazyTensor",
    "PairMetrics",
    "Problem",
    "Recording",
    "Run",
    "StepView",
    "Store",
    "StoredOpEntry",
    "TensorSlot",
    "VerifyReport",
    "last_opened",
    "open_store",
    "tensor_metrics",
]
