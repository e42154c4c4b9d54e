"""The store: a DuckDB catalog plus Zarr arrays on disk, many runs in one place.

``layout`` (the directory, locks, durability) · ``tensors`` (Zarr arrays, packs,
codecs) · ``writer`` (the streaming write path) · ``catalog`` (DuckDB: writers'
transactions, readers' mirror) · ``rows`` (catalog rows to and from recorder tables) ·
``run`` (a stored run, read lazily) · ``verify`` · ``store`` (the facade).
"""

from .run import LazyTensor, Run, StepView, StoredOpEntry
from .store import Recording, Store, open_store
from .verify import Problem, VerifyReport

__all__ = [
    "LazyTensor",
    "Problem",
    "Recording",
    "Run",
    "StepView",
    "Store",
    "StoredOpEntry",
    "VerifyReport",
    "open_store",
]
