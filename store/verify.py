"""``store.verify()``: every chunk's checksum, and the agreement of catalog and arrays."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracelake.errors import ChunkCorruptError

from .duckfile import wal_of
from .layout import StorePaths

if TYPE_CHECKING:
    from .run import Run

__all__ = ["Problem", "VerifyReport", "tensor_rows", "verify_files", "verify_run"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong: in which run, which label(s), and what."""

    run: str
    label: str
    what: str

    def __str__(self) -> str:
        return f"{self.run}: {self.label}: {self.what}"


@dataclass
class VerifyReport:
    """What ``verify()`` checked and found; truthy when nothing is wrong."""

    runs: int = 0
    chunks: int = 0
    tensors: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong."""
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (what ``tracelake verify --json`` prints)."""
        return {
            "ok": self.ok,
            "runs": self.runs,
            "chunks": self.chunks,
            "tensors": self.tensors,
            "problems": [{"run": p.run, "label": p.label, "what": p.what} for p in self.problems],
        }


def verify_files(paths: StorePaths, report: VerifyReport) -> None:
    """The store's own files: a catalog without its change marker, run directories
    without a catalog, and symbolic links where tracelake keeps files (it makes none,
    and never follows one)."""
    wal = wal_of(paths.catalog)
    own = [paths.marker, paths.catalog, wal, paths.gen, paths.lock, paths.reserve, paths.runs]
    if not paths.runs.is_symlink():
        for run_id in paths.run_dir_ids():
            run_dir = paths.run_dir(run_id)
            own.append(run_dir)
            if not run_dir.is_symlink():
                own += [paths.run_marker(run_id), paths.writing_lock(run_id)]
    for path in own:
        if path.is_symlink():
            report.problems.append(
                Problem(
                    "-",
                    str(path.relative_to(paths.root)),
                    "is a symbolic link (refused: it may lead outside the store)",
                )
            )
    if paths.catalog.exists() and not paths.gen.exists():
        report.problems.append(
            Problem(
                "-",
                paths.gen.name,
                f"{paths.gen.name} is missing (the next write makes it again; readers "
                "watch the catalog file itself meanwhile)",
            )
        )
    sealed = set(paths.sealed_ids())  # (runs whose rows are in no catalog yet)
    made = [i for i in paths.run_dir_ids() if i not in sealed and paths.run_marker(i).exists()]
    if not paths.catalog.exists() and made:
        report.problems.append(
            Problem(
                "-",
                paths.catalog.name,
                f"{paths.catalog.name} is missing but {len(made)} run directories it "
                "committed exist: restore it; the store refuses writes until then",
            )
        )


#: ``verify`` reads the tensors' catalog rows of runs holding about this many ops
#: together in one statement.
BATCH_OPS = 200_000


def tensor_rows(
    query: Callable[[str, list[Any]], Any], runs: list[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], list[tuple[Any, ...]]]]:
    """Each of ``runs`` (``runs`` rows, ``op_count`` included) with its tensors' catalog
    rows (slot, array, offset, bytes, shape, dtype, the labels of the ops that hold it),
    read by one statement over every run for each batch of about ``BATCH_OPS`` ops
    (``query``: over every run; so a reader's mirror never copies run by run, and past
    ``MIRROR_OPS`` the catalog's own file or lake answers)."""
    batch: list[dict[str, Any]] = []
    for k, info in enumerate(runs):
        batch.append(info)
        if k + 1 < len(runs) and sum(int(i["op_count"] or 0) for i in batch) < BATCH_OPS:
            continue
        ids = ", ".join(str(int(i["id"])) for i in batch)  # (the catalog's own integers)
        rows = query(
            'SELECT t.run_id, t.slot, t."array", t.byte_offset, t.nbytes, t.shape, t.dtype, '
            "coalesce(string_agg(o.label, ', ' ORDER BY o.step, o.idx), 'tensor ' || t.slot) "
            "FROM tensors t LEFT JOIN ops o ON o.run_id = t.run_id AND o.tensor = t.slot "
            f'WHERE t.run_id IN ({ids}) GROUP BY t.run_id, t.slot, t."array", '
            "t.byte_offset, t.nbytes, t.shape, t.dtype ORDER BY t.run_id, t.slot",
            [],
        ).fetchall()
        by_run: dict[int, list[tuple[Any, ...]]] = {}
        for row in rows:
            by_run.setdefault(int(row[0]), []).append(row[1:])
        for info in batch:
            yield info, by_run.get(int(info["id"]), [])
        batch = []


def verify_run(run: Run, rows: list[tuple[Any, ...]], report: VerifyReport) -> None:
    """Check a run's arrays against its tensors' catalog rows (:func:`tensor_rows`)."""
    from .dtypes import parse_dtype  # (torch: only the tensors' half of verify needs it)

    report.runs += 1
    arrays = run._arrays
    by_array: dict[str, list[tuple[int, int, str]]] = {}
    misshapen: set[str] = set()  # own arrays whose zarr.json disagrees with the catalog
    # Links among the run's files: tracelake writes none, and reads refuse them (they
    # may lead outside the store), so each is a problem to report.
    try:
        links = arrays.links()
    except OSError as exc:
        links = []
        report.problems.append(Problem(run.name, "-", f"cannot list the run's files: {exc}"))
    for link in links:
        report.problems.append(
            Problem(run.name, "-", f"{link} is a symbolic link (refused: it may lead outside)")
        )
    for _slot, array, offset, nbytes, shape, dtype, labels in rows:
        report.tensors += 1
        try:
            arrays.check_name(array, labels)
        except ChunkCorruptError as exc:
            report.problems.append(Problem(run.name, labels, str(exc)))
            continue
        expected = math.prod(shape) * parse_dtype(dtype).itemsize
        if expected != nbytes:
            report.problems.append(
                Problem(
                    run.name,
                    labels,
                    f"catalog says {nbytes} bytes for shape {shape} {dtype} (expected {expected})",
                )
            )
        if offset is None:
            by_array.setdefault(array, []).append((0, nbytes, labels))
            if not _check_array_shape(run, arrays, array, shape, labels, report):
                misshapen.add(array)
        else:
            by_array.setdefault(array, []).append((offset, nbytes, labels))
    on_disk = set(arrays.names())
    for name in sorted(on_disk - set(by_array)):
        report.problems.append(Problem(run.name, "-", f"array {name} is not in the catalog"))
    for name, spans in by_array.items():
        if name not in on_disk:
            labels = ", ".join(sorted({s[2] for s in spans}))
            report.problems.append(Problem(run.name, labels, f"array {name} is missing"))
            continue
        if name in misshapen:  # reported once; its chunk grid says nothing of the tensor
            continue
        before = len(report.problems)
        _check_chunks(run, arrays, name, spans, report)
        if spans and spans[0][0] is not None and name.startswith("pack"):
            _check_spans(run, arrays, name, spans, report, shard_problems=before)


def _check_array_shape(
    run: Run, arrays: Any, name: str, shape: list[int], labels: str, report: VerifyReport
) -> bool:
    """Whether a tensor's own array has the shape the catalog gives (else one problem)."""
    try:
        array = arrays.array(name, labels)
    except ChunkCorruptError as exc:
        report.problems.append(Problem(run.name, labels, str(exc)))
        return False
    stored = tuple(array.shape)
    if stored != (tuple(shape) or (1,)):
        report.problems.append(
            Problem(
                run.name,
                labels,
                f"array {name} has shape {_shown(stored)}, the catalog says {tuple(shape)}",
            )
        )
        return False
    return True


def _shown(shape: tuple[int, ...]) -> str:
    """A shape for a message (a crafted zarr.json's may be long)."""
    return str(shape) if len(shape) <= 8 else f"({', '.join(map(str, shape[:8]))}, ...)"


#: The fewest bytes a chunk tracelake writes holds (far fewer, in truth): an array
#: whose metadata declares more chunks than its bytes could fill at this size was not
#: written by tracelake, and checking each would take unbounded time.
_MIN_CHUNK_BYTES = 4096


def _check_chunks(
    run: Run, arrays: Any, name: str, spans: list[tuple[int, int, str]], report: VerifyReport
) -> None:
    every = ", ".join(s[2] for s in spans)
    try:
        array = arrays.array(name, every)
    except ChunkCorruptError as exc:
        report.problems.append(Problem(run.name, every, str(exc)))
        return
    packed = array.ndim == 1 and array.attrs.get("tracelake") == "pack"
    nbytes = max((o + n for o, n, _ in spans), default=0)
    grid = (
        math.ceil(nbytes / _file_size(array))
        if packed
        else math.prod(math.ceil(n / c) for n, c in zip(array.shape, array.chunks, strict=True))
    )
    if grid > nbytes // _MIN_CHUNK_BYTES + 1:
        report.problems.append(
            Problem(
                run.name,
                every or name,
                f"array {name} declares {grid} chunks for {nbytes} bytes: its zarr.json "
                "was not written by tracelake (its chunks were not checked)",
            )
        )
        return
    if packed:
        end = max((o + n for o, n, _ in spans), default=0)
        if end > array.shape[0]:
            report.problems.append(
                Problem(
                    run.name,
                    name,
                    f"the catalog points past the end of {name} ({end} > {array.shape[0]} bytes)",
                )
            )
        indexes = [(k,) for k in range(math.ceil(end / _file_size(array)))]
    else:
        indexes = arrays.chunk_indexes(name)
    for idx in indexes:
        report.chunks += 1
        key = arrays.chunk_key(name, idx)
        sizes = (_file_size(array),) if packed else array.chunks
        selection = tuple(
            slice(i * c, min((i + 1) * c, n))
            for i, c, n in zip(idx, sizes, array.shape, strict=True)
        )
        if packed:  # only the bytes tensors occupy: the shard holds no inner chunk past them
            selection = (slice(selection[0].start, min(selection[0].stop, end)),)
        try:
            if not arrays.has_chunk(name, idx):
                raise ChunkCorruptError(run.name, every, key, "missing")
            array[selection]
        except Exception as exc:
            if packed:
                lo, hi = idx[0] * _file_size(array), (idx[0] + 1) * _file_size(array)
                labels = ", ".join(s[2] for s in spans if s[0] < hi and s[0] + s[1] > lo)
            else:
                labels = ", ".join(s[2] for s in spans)
            what = "missing" if isinstance(exc, ChunkCorruptError) else f"damaged ({exc})"
            report.problems.append(Problem(run.name, labels or name, f"chunk {key} is {what}"))


def _file_size(array: Any) -> int:
    """Elements per file of a 1-D array: its shard when sharded, else its chunk."""
    shards = getattr(array, "shards", None)
    return int(shards[0]) if shards else int(array.chunks[0])


def _check_spans(
    run: Run,
    arrays: Any,
    name: str,
    spans: list[tuple[int, int, str]],
    report: VerifyReport,
    shard_problems: int,
) -> None:
    """Every packed tensor's bytes read the way queries read them (the shard index must
    hold each inner chunk a tensor lies in, with a good checksum). A damaged shard
    (``report.problems[shard_problems:]``, from :func:`_check_chunks`) named every
    tensor in it; where these reads name the tensors its damaged inner chunks hold, they
    replace it, so that a tensor which still reads back is not called damaged."""
    import torch

    seen: set[str] = {p.label for p in report.problems[:shard_problems] if p.run == run.name}
    found = []
    for offset, nbytes, labels in spans:
        if labels in seen:
            continue
        try:
            arrays.read_packed(name, offset, nbytes, torch.uint8, [nbytes], labels)
        except ChunkCorruptError as exc:
            found.append(Problem(run.name, labels, str(exc)))
    shard = f"chunk {name}/"  # (its shards, as either format names them)
    if found:
        report.problems[shard_problems:] = [
            p
            for p in report.problems[shard_problems:]
            if not (p.what.startswith(shard) and "is damaged" in p.what)
        ]
    report.problems.extend(found)
