"""Durable write and read throughput of three Zarr v3 writers, against the disk's own limit.

Run: ``python benchmarks/zarr_pipelines.py [--size-mib 128] [--repeats 5] [--markdown]``.
Numpy only (no torch). Writers, all producing standard Zarr v3 arrays whose codecs are
``bytes`` [-> ``zstd`` level 1] -> ``crc32c`` (every chunk checksummed):

* ``zarr-python``: zarr-python 3, default ``BatchedCodecPipeline`` (set explicitly).
* ``zarrs``: zarr-python with ``codec_pipeline.path = zarrs.ZarrsCodecPipeline`` and
  ``codec_pipeline.strict = True``, so an operation zarrs cannot do raises instead of
  quietly falling back to the default pipeline (which would be measured as "zarrs").
* ``tensorstore``: driver ``zarr3``, ``file`` kvstore, one shared ``ts.Context``.

A writer whose package does not import is reported "not installed" and skipped.

Layouts (``S`` = ``--size-mib``):

* ``packed``: 1-D uint8 array of S MiB, 4 MiB chunks, written one whole aligned chunk per
  call and read back the same way (the store packs thousands of small tensors into such
  chunks). The bytes are small float32 tensors of random sizes, alternately dense normal
  and ReLU'd (half zeros).
* ``large``: float32 array ``(S/4, 1024, 1024)``, chunks ``(1, 1024, 1024)`` = 4 MiB,
  written and read in one call. ``dense``: standard normal (zstd barely helps);
  ``relu``: the same with negatives zeroed.
* ``raw``: the same S MiB written sequentially to one file in 4 MiB ``write`` calls, then
  fsync'd: the disk's limit, and the denominator of every "x raw".

Method: a write sample is create-array + write + fsync of every file and directory under
the sample's fresh temp directory, so every number is durable. Then, untimed, the page
cache is dropped for those files (``posix_fadvise(DONTNEED)``, which works on clean pages
without root), and a read sample times open + read of everything; the data read is
compared bitwise (untimed). One warm-up round, then ``--repeats`` rounds; in each, every
condition takes one sample, in an order rotated by one per round, so drift on this noisy
shared machine hits all alike. Time is wall time (this is I/O). Reported: median MiB/s of
logical (uncompressed) bytes; "x raw" = median over rounds of that round's
raw-time / condition-time (paired; 1.0 = as fast as the disk); "stored" = bytes on disk /
logical bytes.

Also measured: arrays created (+ one 1 KiB chunk written, all fsync'd) per second; 1 vs 2
Python threads writing disjoint chunks through the default pipeline (to a MemoryStore and
to disk), and crc32c / zstd on 4 MiB buffers in 1 vs 2 threads (is the GIL released?);
that arrays written by zarrs and tensorstore read back bitwise with plain zarr-python,
and which exception each reader raises for a chunk file with one flipped byte.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore, MemoryStore

zarrs: Any
ts: Any
try:  # optional writers; the benchmark runs without them
    import zarrs
except ImportError:
    zarrs = None
try:
    import tensorstore as ts
except ImportError:
    ts = None

MIB = 1 << 20
CHUNK = 4 * MIB
DEFAULT_PIPELINE = "zarr.core.codec_pipeline.BatchedCodecPipeline"
ZARRS_PIPELINE = "zarrs.ZarrsCodecPipeline"


# ---------------------------------------------------------------------------- writers


class Writer(Protocol):
    name: str

    def create(
        self, path: Path, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, zstd: bool
    ) -> Any: ...
    def write(self, arr: Any, sel: tuple[slice, ...], data: np.ndarray) -> None: ...
    def open(self, path: Path) -> Any: ...
    def read(self, arr: Any, sel: tuple[slice, ...]) -> np.ndarray: ...


class ZarrPython:
    """zarr-python 3 with a given codec pipeline; the config is set around every call
    because the pipeline is picked when an array object is built and ``strict`` is read
    per operation."""

    def __init__(self, name: str, pipeline: str, extra: dict[str, Any] | None = None) -> None:
        self.name = name
        self.pipeline = pipeline
        self.config = {"codec_pipeline.path": pipeline, **(extra or {})}

    def _cfg(self) -> contextlib.AbstractContextManager[Any]:
        return zarr.config.set(self.config)

    def _check(self, arr: zarr.Array) -> zarr.Array:
        got = type(arr._async_array.codec_pipeline)
        if f"{got.__module__}.{got.__qualname__}" != self.pipeline and not (
            self.pipeline == ZARRS_PIPELINE and got.__module__.startswith("zarrs")
        ):
            raise RuntimeError(f"{self.name}: array built with {got}, wanted {self.pipeline}")
        return arr

    def create(
        self,
        path: Path | Any,
        shape: tuple[int, ...],
        chunks: tuple[int, ...],
        dtype: str,
        zstd: bool,
    ) -> zarr.Array:
        store = LocalStore(path) if isinstance(path, Path) else path
        with self._cfg():
            return self._check(
                zarr.create_array(
                    store=store,
                    shape=shape,
                    chunks=chunks,
                    dtype=dtype,
                    fill_value=0,
                    filters=None,
                    compressors=codecs(zstd),
                )
            )

    def write(self, arr: zarr.Array, sel: tuple[slice, ...], data: np.ndarray) -> None:
        with self._cfg():
            arr[sel] = data

    def open(self, path: Path) -> zarr.Array:
        with self._cfg():
            return self._check(zarr.open_array(LocalStore(path, read_only=True), mode="r"))

    def read(self, arr: zarr.Array, sel: tuple[slice, ...]) -> np.ndarray:
        with self._cfg():
            return np.asarray(arr[sel])


def codecs(zstd: bool) -> list[Any]:
    return [ZstdCodec(level=1), Crc32cCodec()] if zstd else [Crc32cCodec()]


class TensorStore:
    """tensorstore ``zarr3``. Its ``file`` kvstore fsyncs on commit by default
    (``file_io_sync``), and a write future's ``result()`` waits for the commit."""

    name = "tensorstore"

    def __init__(self) -> None:
        assert ts is not None
        self.context = ts.Context()

    def create(
        self, path: Path, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, zstd: bool
    ) -> Any:
        codec_list: list[dict[str, Any]] = [
            {"name": "bytes", "configuration": {"endian": "little"}}
        ]
        if zstd:
            codec_list.append({"name": "zstd", "configuration": {"level": 1, "checksum": False}})
        codec_list.append({"name": "crc32c"})
        metadata = {
            "shape": list(shape),
            "data_type": dtype,
            "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codec_list,
        }
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(path)},
            "metadata": metadata,
        }
        return ts.open(spec, create=True, context=self.context).result()

    def write(self, arr: Any, sel: tuple[slice, ...], data: np.ndarray) -> None:
        arr[sel].write(data).result()

    def open(self, path: Path) -> Any:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
        return ts.open(spec, read=True, context=self.context).result()

    def read(self, arr: Any, sel: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(arr[sel].read().result())


def writers() -> tuple[list[Writer], dict[str, str]]:
    """Available writers, and a version (or "not installed") for every one."""
    found: list[Writer] = [ZarrPython("zarr-python", DEFAULT_PIPELINE)]
    versions = {"zarr-python": zarr.__version__, "numpy": np.__version__}
    if zarrs is None:
        versions["zarrs"] = "not installed"
    else:
        found.append(ZarrPython("zarrs", ZARRS_PIPELINE, {"codec_pipeline.strict": True}))
        versions["zarrs"] = dist_version("zarrs")
    if ts is None:
        versions["tensorstore"] = "not installed"
    else:
        found.append(TensorStore())
        versions["tensorstore"] = dist_version("tensorstore")
    return found, versions


def dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# ---------------------------------------------------------------------------- disk helpers


def walk_fds(root: Path, flags: int = os.O_RDONLY) -> Iterator[tuple[int, bool]]:
    """Every file and directory under ``root`` as an open fd (closed after the yield)."""
    for dirpath, _, filenames in os.walk(root):
        for name in [*filenames, None]:
            fd = os.open(os.path.join(dirpath, name) if name else dirpath, flags)
            try:
                yield fd, name is None
            finally:
                os.close(fd)


def fsync_tree(root: Path) -> None:
    for fd, _ in walk_fds(root):
        os.fsync(fd)


def drop_cache(root: Path) -> int:
    """Evict ``root``'s (clean, fsync'd) pages; return the stored file bytes."""
    total = 0
    for fd, is_dir in walk_fds(root):
        if not is_dir:
            total += os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return total


@contextlib.contextmanager
def fresh_dir(base: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="zb-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- data


def make_data(size_mib: int) -> dict[str, np.ndarray]:
    """``packed`` (uint8), ``dense`` and ``relu`` (float32, (S/4, 1024, 1024))."""
    rng = np.random.default_rng(0)
    n = size_mib * MIB // 4
    dense = rng.standard_normal(n, dtype=np.float32)
    relu = np.maximum(dense, 0)
    small = rng.standard_normal(n, dtype=np.float32)
    sizes = rng.integers(256, 65536, size=n // 256 + 1)  # tensors of 1 KiB .. 256 KiB
    is_relu = np.repeat(np.arange(sizes.size) % 2 == 1, sizes)[:n]
    packed = np.where(is_relu, np.maximum(small, 0), small).view(np.uint8)
    shape = (size_mib // 4, 1024, 1024)
    return {"packed": packed, "dense": dense.reshape(shape), "relu": relu.reshape(shape)}


# ---------------------------------------------------------------------------- conditions


@dataclass
class Condition:
    layout: str  # raw | packed | large
    data: str  # key into make_data()
    writer: Writer | None  # None: raw
    zstd: bool = False
    write_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    stored: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        name = self.writer.name if self.writer else "raw file + fsync"
        return f"{self.layout}/{self.data}/{'zstd1' if self.zstd else 'none'}/{name}"


def chunk_slices(n_bytes: int) -> list[tuple[slice, ...]]:
    return [(slice(i, i + CHUNK),) for i in range(0, n_bytes, CHUNK)]


def write_raw(path: Path, data: np.ndarray) -> Path:
    buf = memoryview(data.reshape(-1).view(np.uint8).data)
    file = path / "raw.bin"
    with open(file, "wb", buffering=0) as f:
        for (s,) in chunk_slices(len(buf)):
            f.write(buf[s])
        os.fsync(f.fileno())
    return file


def write_array(cond: Condition, path: Path, data: np.ndarray) -> None:
    assert cond.writer is not None
    chunks = (CHUNK,) if cond.layout == "packed" else (1, *data.shape[1:])
    arr = cond.writer.create(path / "a", data.shape, chunks, str(data.dtype), cond.zstd)
    if cond.layout == "packed":
        for sel in chunk_slices(data.size):
            cond.writer.write(arr, sel, data[sel])
    else:
        cond.writer.write(arr, (slice(None),) * data.ndim, data)


def read_array(cond: Condition, path: Path, data: np.ndarray) -> np.ndarray:
    assert cond.writer is not None
    arr = cond.writer.open(path / "a")
    if cond.layout == "packed":
        out = np.empty_like(data)
        for sel in chunk_slices(data.size):
            out[sel] = cond.writer.read(arr, sel)
        return out
    return cond.writer.read(arr, (slice(None),) * data.ndim)


def sample(cond: Condition, base: Path, data: np.ndarray) -> None:
    """One durable write then one cold read of ``cond``; appends to its lists."""
    with fresh_dir(base) as path:
        t0 = time.perf_counter()
        if cond.writer is None:
            file = write_raw(path, data)
        else:
            write_array(cond, path, data)
        fsync_tree(path)
        t1 = time.perf_counter()
        stored = drop_cache(path)
        t2 = time.perf_counter()
        got = np.fromfile(file, np.uint8) if cond.writer is None else read_array(cond, path, data)
        t3 = time.perf_counter()
        if not np.array_equal(got.reshape(-1).view(np.uint8), data.reshape(-1).view(np.uint8)):
            raise RuntimeError(f"{cond.label}: read back differs from what was written")
    cond.write_s.append(t1 - t0)
    cond.read_s.append(t3 - t2)
    cond.stored.append(stored / data.nbytes)


def run_rounds(
    conds: list[Any],
    repeats: int,
    step: Callable[[Any], None],
    on_round: Callable[[int], None] | None = None,
) -> None:
    """One warm-up round (results dropped by the caller's ``step``) then ``repeats``
    rounds, each visiting every condition once in an order rotated by the round."""
    for r in range(repeats + 1):
        k = r % len(conds)
        for cond in conds[k:] + conds[:k]:
            step(cond)
        if r == 0:
            for cond in conds:
                for values in vars(cond).values():
                    if isinstance(values, list):
                        values.clear()
        if on_round:
            on_round(r)


def throughput_conditions(avail: list[Writer]) -> list[Condition]:
    conds = [Condition("raw", "packed", None)]
    for w in avail:
        for zstd in (False, True):
            conds.append(Condition("packed", "packed", w, zstd))
            for kind in ("dense", "relu"):
                conds.append(Condition("large", kind, w, zstd))
    return conds


def summarize_throughput(conds: list[Condition], size_mib: int) -> list[list[str]]:
    raw = conds[0]
    rows = []
    for c in conds:
        w_ratio = statistics.median(r / s for r, s in zip(raw.write_s, c.write_s, strict=True))
        r_ratio = statistics.median(r / s for r, s in zip(raw.read_s, c.read_s, strict=True))
        rows.append(
            [
                c.layout,
                c.data if c.layout != "raw" else "-",
                "zstd 1" if c.zstd else "none",
                c.writer.name if c.writer else "raw + fsync",
                f"{size_mib / statistics.median(c.write_s):.0f}",
                f"{w_ratio:.2f}",
                f"{size_mib / statistics.median(c.read_s):.0f}",
                f"{r_ratio:.2f}",
                f"{statistics.median(c.stored):.3f}",
            ]
        )
    return rows


# ---------------------------------------------------------------------------- creation rate


@dataclass
class Creation:
    writer: Writer | None
    n: int
    seconds: list[float] = field(default_factory=list)


def creation_sample(cond: Creation, base: Path) -> None:
    """``n`` arrays of 256 float32 (one 1 KiB chunk, crc32c) created, written, fsync'd."""
    data = np.arange(256, dtype=np.float32)
    with fresh_dir(base) as path:
        t0 = time.perf_counter()
        for i in range(cond.n):
            if cond.writer is None:
                (path / f"a{i}").write_bytes(data.tobytes())
            else:
                arr = cond.writer.create(path / f"a{i}", (256,), (256,), "float32", False)
                cond.writer.write(arr, (slice(None),), data)
        fsync_tree(path)
        cond.seconds.append(time.perf_counter() - t0)


# ---------------------------------------------------------------------------- threads


@dataclass
class ThreadCase:
    store: str  # memory | disk
    zstd: bool
    threads: int
    seconds: list[float] = field(default_factory=list)


def thread_sample(case: ThreadCase, base: Path, data: np.ndarray) -> None:
    """Default pipeline, packed layout; ``threads`` threads write disjoint chunks."""
    writer = ZarrPython("zarr-python", DEFAULT_PIPELINE)
    sels = chunk_slices(data.size)
    with fresh_dir(base) as path:
        store = MemoryStore() if case.store == "memory" else LocalStore(path / "a")
        t0 = time.perf_counter()
        arr = writer.create(store, data.shape, (CHUNK,), "uint8", case.zstd)

        def part(k: int) -> None:
            for sel in sels[k :: case.threads]:
                writer.write(arr, sel, data[sel])

        with ThreadPoolExecutor(case.threads) as pool:
            list(pool.map(part, range(case.threads)))
        if case.store == "disk":
            fsync_tree(path)
        case.seconds.append(time.perf_counter() - t0)


def codec_scaling(data: np.ndarray) -> list[list[str]]:
    """crc32c / zstd-1 encode of 4 MiB buffers, 1 vs 2 threads (median of 5)."""
    import google_crc32c
    from numcodecs import Zstd

    bufs = [data[s].tobytes() for s in chunk_slices(min(data.size, 16 * CHUNK))]
    zstd = Zstd(level=1)
    funcs: dict[str, Callable[[bytes], object]] = {
        "crc32c (google_crc32c)": google_crc32c.value,
        "zstd 1 (numcodecs)": zstd.encode,
    }
    rows = []
    for name, fn in funcs.items():
        rates = {}

        def work(_k: int, fn: Callable[[bytes], object] = fn) -> None:
            for b in bufs:
                fn(b)

        for threads in (1, 2):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    # every thread encodes the whole list: 2 threads do twice the work
                    list(pool.map(work, range(threads)))
                times.append(time.perf_counter() - t0)
            rates[threads] = threads * len(bufs) * 4 / statistics.median(times)
        rows.append([name, f"{rates[1]:.0f}", f"{rates[2]:.0f}", f"{rates[2] / rates[1]:.2f}"])
    return rows


# ---------------------------------------------------------------------------- interop


def flip_byte(root: Path) -> Path:
    chunk = sorted(p for p in (root / "c").rglob("*") if p.is_file())[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # in the payload, not in the trailing checksum
    chunk.write_bytes(bytes(raw))
    return chunk


def describe(exc: BaseException) -> str:
    kind = type(exc)
    text = " ".join(str(exc).split())
    return f"{kind.__module__}.{kind.__qualname__}: {text[:160]}"


def interop(avail: list[Writer], base: Path) -> list[list[str]]:
    """Each writer's arrays read by plain zarr-python bitwise; a flipped byte read by
    every reader."""
    plain = avail[0]
    data = make_data(8)["relu"]
    rows = []
    for w in avail:
        for zstd in (False, True):
            with fresh_dir(base) as path:
                arr = w.create(path / "a", data.shape, (1, *data.shape[1:]), "float32", zstd)
                w.write(arr, (slice(None),) * 3, data)
                got = plain.read(plain.open(path / "a"), (slice(None),) * 3)
                same = np.array_equal(got.view(np.uint8), data.view(np.uint8))
                meta = zarr.open_array(path / "a", mode="r").metadata
                has_crc = any(isinstance(c, Crc32cCodec) for c in getattr(meta, "codecs", ()))
                flip_byte(path / "a")
                for reader in avail:
                    try:
                        reader.read(reader.open(path / "a"), (slice(None),) * 3)
                        outcome = "no error (corruption NOT detected)"
                    except Exception as exc:
                        outcome = describe(exc)
                    rows.append(
                        [
                            w.name,
                            "zstd 1" if zstd else "none",
                            f"{'yes' if same else 'NO'} (crc32c in metadata: {has_crc})",
                            reader.name,
                            outcome,
                        ]
                    )
    return rows


# ---------------------------------------------------------------------------- output


def render(title: str, header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [
            f"### {title}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*header), *(fmt.format(*r) for r in rows)]) + "\n"


def section_throughput(
    avail: list[Writer], args: argparse.Namespace, data: dict[str, np.ndarray]
) -> str:
    conds = throughput_conditions(avail)
    run_rounds(
        conds,
        args.repeats,
        lambda c: sample(c, args.dir, data[c.data]),
        lambda r: print(f"  throughput round {r}/{args.repeats} done", flush=True),
    )
    return render(
        f"Durable write / cold read, {args.size_mib} MiB (MiB/s of logical bytes)",
        [
            "layout",
            "data",
            "codec",
            "writer",
            "write MiB/s",
            "write x raw",
            "read MiB/s",
            "read x raw",
            "stored",
        ],
        summarize_throughput(conds, args.size_mib),
        args.markdown,
    )


def section_creation(avail: list[Writer], args: argparse.Namespace) -> str:
    creations = [Creation(None, args.arrays)] + [Creation(w, args.arrays) for w in avail]
    run_rounds(creations, args.repeats, lambda c: creation_sample(c, args.dir))
    rows = [
        [
            c.writer.name if c.writer else "raw: one file each",
            f"{c.n / statistics.median(c.seconds):.0f}",
        ]
        for c in creations
    ]
    return render(
        f"Array creation (+1 KiB chunk, crc32c, fsync), {args.arrays} per sample",
        ["writer", "arrays/s"],
        rows,
        args.markdown,
    )


def section_threads(args: argparse.Namespace, packed: np.ndarray) -> str:
    mib = min(args.size_mib, 32)  # enough chunks to share out; keeps the run short
    data = packed[: mib * MIB]
    cases = [ThreadCase(s, z, t) for s in ("memory", "disk") for z in (False, True) for t in (1, 2)]
    run_rounds(cases, args.repeats, lambda c: thread_sample(c, args.dir, data))
    rows = []
    for one, two in zip(cases[::2], cases[1::2], strict=True):
        speedup = statistics.median(a / b for a, b in zip(one.seconds, two.seconds, strict=True))
        rows.append(
            [
                one.store,
                "zstd 1" if one.zstd else "none",
                f"{mib / statistics.median(one.seconds):.0f}",
                f"{mib / statistics.median(two.seconds):.0f}",
                f"{speedup:.2f}",
            ]
        )
    return (
        render(
            f"Default pipeline, {mib} MiB packed, chunks from 1 vs 2 Python threads "
            "(MiB/s; 'speedup' = paired median 1-thread time / 2-thread time)",
            ["store", "codec", "1 thread", "2 threads", "speedup"],
            rows,
            args.markdown,
        )
        + "\n"
        + render(
            "Codec alone on 4 MiB buffers, 1 vs 2 threads (MiB/s, total)",
            ["codec", "1 thread", "2 threads", "speedup"],
            codec_scaling(data),
            args.markdown,
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mib", type=int, default=64, help="logical MiB per array (multiple of 4; default 64)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument(
        "--arrays", type=int, default=50, help="arrays per creation-rate sample (default 50)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where temp dirs go (the disk under test)",
    )
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args(argv)
    if args.size_mib % 4 or args.size_mib <= 0:
        parser.error("--size-mib must be a positive multiple of 4")
    avail, versions = writers()
    print(
        f"{platform.platform()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, python {platform.python_version()}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    print(f"size {args.size_mib} MiB, {args.repeats} rounds after 1 warm-up, dir {args.dir}\n")
    data = make_data(args.size_mib)
    sections: list[tuple[str, Callable[[], str]]] = [
        (
            "interop",
            lambda: render(
                "Read-back by plain zarr-python, and a flipped byte in a chunk",
                ["writer", "codec", "plain zarr reads bitwise", "reader", "on corrupt chunk"],
                interop(avail, args.dir),
                args.markdown,
            ),
        ),
        ("throughput", lambda: section_throughput(avail, args, data)),
        ("creation", lambda: section_creation(avail, args)),
        ("threads", lambda: section_threads(args, data["packed"])),
    ]
    for name, run in sections:
        t0 = time.perf_counter()
        text = run()
        print(
            f"\n{text}({name}: {time.perf_counter() - t0:.0f} s, load average "
            f"{os.getloadavg()[0]:.1f})\n",
            flush=True,
        )


if __name__ == "__main__":
    main()
