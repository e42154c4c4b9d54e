"""Dask arrays over a result's stored tensors (:meth:`Result.to_dask`), for aggregations
larger than memory or than one core (PCA, covariances, probes).

Nothing is read when the array is built: a tensor with its own Zarr array becomes
``dask.array.from_zarr`` of that array (read through zarr-python, which checks every
chunk's CRC32C), and packed small tensors become ``dask.delayed`` readers built from the
catalog's locations (run, pack, offset, bytes), a block of consecutive rows per task
(up to :data:`BLOCK_BYTES`), read by the store's own pack reader. Rows are stacked along
a new first axis in the result's order, so ``result.to_dask().compute()`` equals
``result.stack()`` bitwise.

Dask comes with the ``scale`` extra and is imported only here, when called.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from tracelake.errors import MissingExtraError, QueryError
from tracelake.store.dtypes import numpy_dtype, parse_dtype

if TYPE_CHECKING:
    import dask.array

    from tracelake.store.run import LazyTensor

    from .results import _Fetcher

__all__ = ["BLOCK_BYTES", "dask_array", "sliced_shape"]

#: The most stored bytes of packed tensors one Dask task reads (a block of rows).
BLOCK_BYTES = 32 << 20


def _dask_array_module() -> Any:
    try:
        import dask.array as da
    except ImportError as exc:
        raise MissingExtraError("Result.to_dask()", "scale", exc.name or "dask") from exc
    return da


def sliced_shape(shape: tuple[int, ...], key: Any) -> tuple[int, ...]:
    """The shape of ``tensor[key]`` (basic indexing) for a tensor of ``shape``, without
    the tensor: numpy's own indexing of a zero-strided view."""
    if key is None:
        return shape
    view = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape, (0,) * len(shape))
    return tuple(view[key].shape)


def _read_block(lazies: list[LazyTensor], key: Any) -> np.ndarray:
    """One block of packed rows, read and stacked (a Dask task)."""
    return np.stack([(lazy.read() if key is None else lazy[key]).numpy() for lazy in lazies])


def dask_array(column: str, fetcher: _Fetcher, key: Any) -> dask.array.Array:
    """The tensors of ``column`` (rows located by ``fetcher``, each indexed by ``key``)
    as one unread Dask array, rows first. ``QueryError`` where ``Result.stack`` would
    refuse (unsaved rows, mixed shapes) or where numpy has no dtype for the tensors."""
    da = _dask_array_module()
    from dask import delayed

    locations = fetcher.locations
    if not locations:
        raise QueryError(f"cannot make a Dask array of {column!r}: the result has no rows")
    missing = [row for row, location in enumerate(locations) if location[0] is None]
    if missing:
        raise QueryError(
            f"cannot make a Dask array of {column!r}: rows {missing[:10]} have no saved "
            "tensor (filter with `saved = true`)"
        )
    shapes = {sliced_shape(tuple(loc[3]), key) for loc in locations}
    dtypes = {loc[4] for loc in locations}
    if len(shapes) > 1 or len(dtypes) > 1:
        listed = ", ".join(f"{list(s)}" for s in sorted(shapes)[:10])
        raise QueryError(
            f"cannot make a Dask array of {column!r}: the tensors differ in shape or dtype "
            f"({listed}; {sorted(dtypes)}); slice them to one shape in the query first"
        )
    (shape,), (dtype_name,) = shapes, dtypes
    dtype = numpy_dtype(parse_dtype(dtype_name))
    if dtype is None:
        raise QueryError(
            f"cannot make a Dask array of {column!r}: numpy has no dtype for {dtype_name} "
            "(read it with result.stack(), or record the op in float32)"
        )

    token = uuid.uuid4().hex  # task names: nothing is hashed or pickled to name them
    parts: list[Any] = []
    block: list[LazyTensor] = []
    block_bytes = 0

    def flush() -> None:
        nonlocal block, block_bytes
        if block:
            name = f"tracelake-packed-{token}-{len(parts)}"
            task = delayed(_read_block, pure=True)(block, key, dask_key_name=name)
            parts.append(da.from_delayed(task, (len(block), *shape), dtype))
        block, block_bytes = [], 0

    for row, (array, offset, nbytes, stored_shape, _dtype) in enumerate(locations):
        lazy = fetcher.lazy(row)
        assert lazy is not None  # every row is saved (checked above)
        if offset is not None:  # packed: a delayed read, with its neighbours
            if block and block_bytes + (nbytes or 0) > BLOCK_BYTES:
                flush()
            block.append(lazy)
            block_bytes += nbytes or 0
            continue
        flush()
        parts.append(_own_array(da, fetcher, row, array, tuple(stored_shape), key, token)[None])
    flush()
    return parts[0] if len(parts) == 1 else da.concatenate(parts, axis=0)


def _own_array(
    da: Any,
    fetcher: _Fetcher,
    row: int,
    name: str,
    shape: tuple[int, ...],
    key: Any,
    token: str,
) -> Any:
    """Row ``row``'s own Zarr array as a Dask array (``from_zarr``), indexed by ``key``.
    Its chunks are checked to exist first: zarr-python reads a missing chunk as zeros."""
    run_id = fetcher.run_ids[row]
    label = fetcher.labels[row]
    arrays = fetcher.store.arrays(run_id, fetcher.names.get(run_id))
    arrays.require_chunks(name, label)
    data = da.from_zarr(arrays.array(name, label), name=f"tracelake-{token}-{row}")
    if not shape:  # 0-d tensors are stored as shape (1,)
        data = data.reshape(())
    return data if key is None else data[key]
