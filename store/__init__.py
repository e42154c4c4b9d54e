"""The store: a DuckDB catalog plus Zarr arrays on disk, many runs in one place.

``layout`` (the directory, locks, durability) · ``tensors`` (Zarr arrays, packs,
codecs) · ``writer`` (the streaming write path) · ``catalog`` (DuckDB: writers'
transactions, readers' mirror) · ``rows`` (catalog rows to and from recorder tables) ·
``run`` (a stored run, read lazily) · ``compare`` (two recordings op by op) ·
``verify`` · ``store`` (the facade).
"""

from .compare import Comparison, PairMetrics, tensor_metrics
from .run import LazyTensor, Run, StepView, StoredOpEntry
from .store import Recording, Store, open_store
from .verify import Problem, VerifyReport

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
    "VerifyReport",
    "open_store",
    "tensor_metrics",
]
