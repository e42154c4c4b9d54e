"""The storage seam: one conformance suite run against every ByteStore implementation
(in the spirit of zarr-python's ``StoreTests``), codecs as objects, and a whole run's
arrays written and read through the memory backend."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hook_capture import assert_bitwise
from hypothesis import given, settings
from hypothesis import strategies as st

from tracelake.errors import ChunkCorruptError, InvalidKeyError, ObjectNotFoundError, StoreError
from tracelake.store import local
from tracelake.store.backend import ByteStore, MemoryBackend
from tracelake.store.catalog import FileChangeToken
from tracelake.store.codecs import CHAINS, RAW, ZSTD, choose_codec, codec_named
from tracelake.store.format import CHUNK_BYTES, chunk_key
from tracelake.store.layout import StorePaths
from tracelake.store.local import LocalBackend
from tracelake.store.tensors import RunArrays
from tracelake.store.writer import TensorWriter

ESCAPING = ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "a\\..\\b", "a\x00b"]


class ByteStoreTests:
    """What every backend must do. Subclasses provide ``make``."""

    make: Callable[[Path], ByteStore]

    @pytest.fixture
    def store(self, tmp_path: Path) -> ByteStore:
        return type(self).make(tmp_path / "objects")

    def test_put_get_round_trip(self, store: ByteStore) -> None:
        store.put("a/c/0", [b"hello ", np.frombuffer(b"world", dtype=np.uint8), memoryview(b"!")])
        assert store.get("a/c/0") == b"hello world!"
        assert store.size("a/c/0") == 12 and store.exists("a/c/0")
        store.put("a/c/0", [b"new"])  # overwrite: the whole object
        assert store.get("a/c/0") == b"new"
        store.put("empty", [])
        assert store.get("empty") == b"" and store.size("empty") == 0

    def test_ranges(self, store: ByteStore) -> None:
        data = bytes(range(100))
        store.put("k", [data])
        assert store.get("k", 10, 20) == data[10:20]
        assert store.get("k", 90) == data[90:]
        assert store.get_suffix("k", 7) == data[-7:]
        assert store.get("k", 95, 200) == data[95:]  # past the end: clipped
        assert store.get("k", 150, 160) == b""
        assert store.get_suffix("k", 1000) == data  # longer than the object: all of it
        assert store.get_suffix("k", 0) == b""
        for bad in ((-1, 5), (10, 5)):
            with pytest.raises(ValueError):
                store.get("k", *bad)
        with pytest.raises(ValueError):
            store.get_suffix("k", -1)

    def test_missing_keys_raise_a_tracelake_error(self, store: ByteStore) -> None:
        for call in (store.get, store.size, store.version, lambda k: store.get_suffix(k, 4)):
            with pytest.raises(ObjectNotFoundError, match="no stored object 'nope/c/0'") as err:
                call("nope/c/0")
            assert isinstance(err.value, KeyError) and isinstance(err.value, StoreError)
        assert not store.exists("nope/c/0")
        store.put("dir/x", [b"1"])
        with pytest.raises(ObjectNotFoundError):
            store.get("dir")  # a "directory" of keys is not an object

    def test_list_by_prefix_and_list_dir(self, store: ByteStore) -> None:
        assert store.list() == [] and store.list_dir() == []
        for key in ("zarr.json", "a/zarr.json", "a/c/0", "a/c/1", "ab/c/0"):
            store.put(key, [key.encode()])
        assert store.list() == ["a/c/0", "a/c/1", "a/zarr.json", "ab/c/0", "zarr.json"]
        assert store.list("a") == ["a/c/0", "a/c/1", "a/zarr.json"]  # not "ab/..."
        assert store.list("a/") == store.list("a")
        assert store.list("a/c/0") == ["a/c/0"]
        assert store.list("missing") == []
        assert store.list_dir() == ["a", "ab", "zarr.json"]
        assert store.list_dir("a") == ["c", "zarr.json"]
        assert store.list_dir("a/c") == ["0", "1"]

    def test_delete_object_and_prefix(self, store: ByteStore) -> None:
        for key in ("a/zarr.json", "a/c/0", "a/c/1", "ab/c/0"):
            store.put(key, [b"x"])
        store.delete("a/c/0")
        store.delete("a/c/0")  # missing: nothing to do
        assert store.list("a") == ["a/c/1", "a/zarr.json"]
        store.delete_prefix("a")
        assert store.list() == ["ab/c/0"]
        store.delete_prefix("nothing/here")
        store.delete_prefix("")
        assert store.list() == []

    def test_durable_commit(self, store: ByteStore) -> None:
        pending = store.pending(window=2)
        for k in range(5):
            store.put(f"p/{k}", [bytes([k]) * 100], pending)
        pending.close()
        assert [store.get(f"p/{k}") for k in range(5)] == [bytes([k]) * 100 for k in range(5)]
        store.put("q", [b"abc"])
        assert store.commit() == 503

    def test_unsynced_puts_read_back_and_commit_durable(self, store: ByteStore) -> None:
        # (a run's Zarr metadata: written as it goes, made durable with the run)
        store.put_unsynced("g/zarr.json", b'{"zarr_format": 3}')
        store.put_unsynced("g/a/zarr.json", b"{}")
        store.put_unsynced("g/a/zarr.json", b'{"shape": [4]}')  # rewritten whole
        assert store.get("g/zarr.json") == b'{"zarr_format": 3}'
        assert store.get("g/a/zarr.json") == b'{"shape": [4]}'
        assert store.commit() == 18 + 14

    def test_version_moves_when_the_object_does(self, store: ByteStore) -> None:
        store.put("v", [b"one"])
        first = store.version("v")
        assert store.version("v") == first and hash(first) == hash(store.version("v"))
        store.put("v", [b"two, longer"])
        assert store.version("v") != first
        other = type(self).make(Path(str(getattr(store, "root", "/nonexistent")) + "-other"))
        other.put("v", [b"one"])
        assert other.version("v") != store.version("v")  # unique in the process

    @pytest.mark.parametrize("key", ESCAPING)
    def test_keys_cannot_escape(self, store: ByteStore, key: str) -> None:
        for call in (
            lambda: store.put(key, [b"x"]),
            lambda: store.get(key),
            lambda: store.exists(key),
            lambda: store.delete(key),
        ):
            with pytest.raises(InvalidKeyError):
                call()
        if key:  # "" is the whole store as a prefix
            with pytest.raises(InvalidKeyError):
                store.delete_prefix(key)
            with pytest.raises(InvalidKeyError):
                store.list(key)

    def test_zarr_reads_and_writes_the_same_bytes(self, store: ByteStore) -> None:
        zarr.create_group(store.zarr_store(), zarr_format=3)
        values = np.arange(24, dtype=np.float32).reshape(4, 6)
        array = zarr.create_array(
            store.zarr_store("x"), shape=(4, 6), chunks=(2, 6), dtype="float32", fill_value=0
        )
        array[:] = values
        assert sorted(store.list("x")) == ["x/c/0/0", "x/c/1/0", "x/zarr.json"]
        assert json.loads(store.get("x/zarr.json"))["shape"] == [4, 6]
        assert_bitwise(
            torch.from_numpy(np.asarray(zarr.open_array(store.zarr_store("x"), mode="r")[:])),
            torch.from_numpy(values),
            "zarr round trip",
        )


class TestLocalBackend(ByteStoreTests):
    make = LocalBackend

    def test_files_are_where_the_keys_say(self, tmp_path: Path) -> None:
        store = LocalBackend(tmp_path / "r")
        store.put("a/c/0", [b"xyz"])
        assert (tmp_path / "r" / "a" / "c" / "0").read_bytes() == b"xyz"
        for key in ESCAPING[1:]:
            with pytest.raises(InvalidKeyError):
                store.put(key, [b"escaped"])
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
            "r",
            "r/a",
            "r/a/c",
            "r/a/c/0",
        ]

    def test_write_failures_are_store_errors(self, tmp_path: Path) -> None:
        store = LocalBackend(tmp_path)
        store.put("a", [b"x"])
        for put in (lambda: store.put("a/b", [b"y"]), lambda: store.put_unsynced("a/b", b"y")):
            with pytest.raises(StoreError, match="cannot write a/b") as err:
                put()  # its "directory" is a file
            assert isinstance(err.value.__cause__, OSError)

    @pytest.mark.parametrize("refusal", ["at the open", "at the first write"])
    def test_filesystems_refusing_direct_writes_get_the_same_bytes(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
    ) -> None:
        """Where ``O_DIRECT`` is refused (tmpfs at the open, and the backend asks no
        more; some filesystems at the first write), large files are written through the
        page cache instead, byte for byte, and left to the caller's durability they are
        written back as any such file."""
        import errno

        if not local.DIRECT:
            pytest.skip("no O_DIRECT here")
        create, write = local._create, os.write
        asked: list[int] = []
        if refusal == "at the open":

            def refused(path: Path, extra: int = 0) -> int:
                if extra:
                    asked.append(extra)
                    raise OSError(errno.EINVAL, "Invalid argument")
                return create(path, extra)

            monkeypatch.setattr(local, "_create", refused)
        else:
            import fcntl

            def refusing(fd: int, data: object) -> int:
                if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                    raise OSError(errno.EINVAL, "Invalid argument")
                return write(fd, data)  # type: ignore[arg-type]

            monkeypatch.setattr(local.os, "write", refusing)
        backs: list[int] = []
        monkeypatch.setattr(local, "_SYNC_FILE_RANGE", lambda fd, *a: backs.append(fd) or 0)
        store = LocalBackend(tmp_path)
        data = np.random.default_rng(0).integers(0, 256, 3 * local.STAGE_BYTES // 2, np.uint8)
        pending = store.pending(sync=False)
        store.put("big", [data[:5], data[5:], b"end"], pending)
        store.put("again", [data], pending)
        pending.close()
        assert store.get("big") == data.tobytes() + b"end" and store.get("again") == data.tobytes()
        assert len(backs) == 2, "written through the page cache: written back"
        assert len(asked) == (1 if refusal == "at the open" else 0)

    def test_writes_are_fdatasynced(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        synced: list[int] = []
        real = os.fdatasync
        monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
        store = LocalBackend(tmp_path)
        store.put("now", [b"1"])
        assert len(synced) == 1
        pending = store.pending(window=1, background=False)
        store.put("later/0", [b"2"], pending)
        store.put("later/1", [b"3"], pending)  # one too many: the oldest is synced
        assert len(synced) == 2
        pending.close()
        assert len(synced) == 3


class TestMemoryBackend(ByteStoreTests):
    make = staticmethod(lambda _path: MemoryBackend())


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=300),
    start=st.integers(0, 400),
    length=st.integers(0, 400),
)
def test_ranges_are_slices_in_every_backend(data: bytes, start: int, length: int) -> None:
    memory = MemoryBackend()
    memory.put("k", [data])
    assert memory.get("k", start, start + length) == data[start : start + length]
    assert memory.get_suffix("k", length) == data[max(len(data) - length, 0) :]


# -- codecs ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=70_000), start=st.integers(0, 7))
def test_the_compiled_crc32c_is_google_crc32c(data: bytes, start: int) -> None:
    """The writer's compiled CRC32C (three interleaved streams of the crc32 instruction,
    joined by multiplying by x^8n; or a byte table) gives the value Zarr's crc32c codec
    checks, at any address and length."""
    import google_crc32c

    from tracelake.recorder import compiled

    hot = compiled.hot()
    assert hot is not None and hasattr(hot, "crc32c"), "the compiled extension is missing"
    buffer = np.zeros(len(data) + 8, dtype=np.uint8)
    buffer[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
    address = buffer.ctypes.data + start
    want = google_crc32c.value(data)
    assert hot.crc32c(address, len(data)) == want
    assert hot.crc32c(address, len(data), False) == want


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.integers(0, 6),
    block=st.sampled_from([8 << 10, 64 << 10]),  # one stream; three
    skip=st.integers(0, 40),
    tail=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
)
def test_checksums_with_statistics_are_each_alone(
    chunks: int, block: int, skip: int, tail: int, seed: int
) -> None:
    """One pass for both (``crc_moments_f32``, what a store's worker runs over a packed
    tensor's whole inner chunks): each block's CRC32C is google_crc32c's, and the moments
    are moments_f32's to the bit, wherever the blocks start."""
    import google_crc32c

    from tracelake.recorder import compiled

    hot = compiled.hot()
    assert hot is not None and hasattr(hot, "crc_moments_f32"), "the extension is missing"
    skip_bytes = skip * hot.MOMENT_LANES * 4  # (blocks start where the lanes do)
    count = (skip_bytes + chunks * block) // 4 + tail + 1
    values = np.random.default_rng(seed).standard_normal(count).astype(np.float32)
    values[:: 7 + seed % 5] = 0.0
    crcs = np.zeros(chunks + 1, dtype=np.uint32)
    moments = hot.crc_moments_f32(
        values.ctypes.data, count, skip_bytes, chunks, block, crcs.ctypes.data
    )
    assert moments == hot.moments_f32(values.ctypes.data, count, 1, count)
    raw = values.view(np.uint8)
    for k in range(chunks):
        at = skip_bytes + k * block
        assert int(crcs[k]) == google_crc32c.value(raw[at : at + block].tobytes()), k
    assert crcs[chunks] == 0, "a checksum past the blocks"


def test_packed_tensors_start_where_the_statistics_lanes_do() -> None:
    """A store's worker reduces a packed float32 tensor's whole inner chunks from the
    tensor's first one on (``crc_moments_f32``), which gives the tensor's own bits only
    where that offset is a whole number of the pass's lanes: the packing's alignment and
    the inner chunks' size must both be, whatever either is changed to."""
    from tracelake.recorder import compiled
    from tracelake.store.format import ALIGN, INNER_BYTES

    hot = compiled.hot()
    assert hot is not None, "the extension is missing"
    unit = hot.MOMENT_LANES * 4
    assert ALIGN % unit == 0 and INNER_BYTES % unit == 0, (ALIGN, INNER_BYTES, unit)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 7 * (64 << 10)),
    refs=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 3), st.booleans()), max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_raw_shard_written_in_one_call_is_the_encoded_shard(
    tmp_path_factory: pytest.TempPathFactory,
    size: int,
    refs: list[tuple[int, int, bool]],
    seed: int,
) -> None:
    """``format.shard_writer`` (one compiled call: checksums, index, writev) writes the
    bytes ``encode_shard`` makes, whatever the shard's length (a last inner chunk padded)
    and wherever whole inner chunks come from elsewhere, with their checksums given or
    not."""
    import google_crc32c

    from tracelake.store.format import INNER_BYTES, encode_shard, shard_writer

    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    whole = size // INNER_BYTES
    sources, taken = [], set()
    for first, count, with_crcs in refs:
        span = set(range(first, first + count))
        if first + count > whole or span & taken:
            continue
        taken |= span
        own = rng.integers(0, 256, count * INNER_BYTES, dtype=np.uint8)
        crcs = None
        if with_crcs:
            parts = own.reshape(count, INNER_BYTES)
            crcs = np.array([google_crc32c.value(p.tobytes()) for p in parts], dtype=np.uint32)
        sources.append((first * INNER_BYTES, own, crcs))
    want = b"".join(bytes(memoryview(p).cast("B")) for p in encode_shard(data, RAW, sources))
    write = shard_writer(data, RAW, sources)
    assert write is not None, "the compiled extension is missing"
    assert shard_writer(data, ZSTD, sources) is None  # (compressed: encode_shard's)
    path = tmp_path_factory.mktemp("shard") / "0"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert write(fd) == len(want)
    finally:
        os.close(fd)
    assert path.read_bytes() == want
    # staged: gathered into an aligned buffer, written with O_DIRECT where it is taken
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # (a filesystem refusing O_DIRECT: the stage is written buffered)
        fd = os.open(path, flags & ~getattr(os, "O_DIRECT", 0))
    try:
        with local._staging() as stage:
            assert write.staged(fd, stage)[0] == len(want)
    finally:
        os.close(fd)
    assert path.read_bytes() == want


def test_a_whole_shard_fits_a_staging_buffer() -> None:
    from tracelake.store.format import INNER_PER_SHARD, SHARD_INDEX_BYTES

    assert CHUNK_BYTES + 4 * INNER_PER_SHARD + SHARD_INDEX_BYTES <= local.STAGE_BYTES
    assert local.STAGE_BYTES % local.DIRECT_ALIGN == 0


def test_codecs_are_objects_that_know_their_metadata() -> None:
    assert codec_named("raw") is RAW and codec_named("zstd") is ZSTD
    assert set(CHAINS) == {"raw", "zstd"}
    with pytest.raises(StoreError, match="'lz4'"):
        codec_named("lz4")
    names = {c: [z.to_dict() for z in c.zarr_codecs()] for c in (RAW, ZSTD)}
    assert names[RAW] == [{"name": "crc32c"}]
    assert names[ZSTD] == [
        {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
        {"name": "crc32c"},
    ]
    data = np.frombuffer(b"abc" * 1000, dtype=np.uint8)
    for chain in (RAW, ZSTD):
        stored = b"".join(bytes(memoryview(p).cast("B")) for p in chain.encode(data))
        decoded = chain.decode(stored)
        assert decoded is not None and decoded.tobytes() == data.tobytes()
        damaged = bytearray(stored)
        damaged[0] ^= 1
        assert chain.decode(bytes(damaged)) is None
        assert chain.decode(b"ab") is None
    assert choose_codec(data) is ZSTD
    assert choose_codec(np.random.default_rng(0).integers(0, 255, 10_000, dtype=np.uint8)) is RAW


# -- a whole run through a backend ----------------------------------------------------------


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.arange(10, dtype=torch.int64),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.randn(CHUNK_BYTES // 4 + 1000, generator=g),  # its own array, an edge chunk
        (torch.arange(CHUNK_BYTES // 2 + 64) % 5).to(torch.int16),  # its own, zstd
        torch.randn(300, generator=g),
    ]


def _write_run(arrays: RunArrays) -> TensorWriter:
    writer = TensorWriter(arrays, max_inflight=4 * CHUNK_BYTES)
    for tensor in _tensors():
        writer.save(tensor)
    writer.close()
    return writer


def _read(arrays: RunArrays, writer: TensorWriter, slot: int) -> torch.Tensor:
    loc = writer.location(slot)
    if loc.offset >= 0:
        return arrays.read_packed(loc.array, loc.offset, loc.nbytes, loc.dtype, loc.shape, "x")
    return arrays.read_array(loc.array, loc.dtype, loc.shape, "x")


@pytest.mark.parametrize("flat", [True, False], ids=["format 2", "format 1"])
def test_a_run_written_to_memory_reads_back_and_matches_disk(tmp_path: Path, flat: bool) -> None:
    """In either format's layout (format 1: chunk keys under c/, as a format 1 store's
    runs are still written): read back bitwise, by zarr-python too, byte for byte as on
    disk."""
    memory = MemoryBackend()
    arrays = RunArrays(memory, "m", create=True, flat=flat)
    writer = _write_run(arrays)
    assert all(("/c/" in key) != flat for key in memory.list() if "zarr.json" not in key)
    for slot, tensor in enumerate(_tensors()):
        assert_bitwise(_read(arrays, writer, slot), tensor, f"slot {slot}")
    assert {writer.codec(loc.array) for loc in writer.locations} == {"raw", "zstd"}
    # zarr-python reads the same objects, checksums included
    for name in arrays.names():
        np.asarray(arrays.array(name)[:])
    # the same run on disk: the same keys holding the same bytes
    local = LocalBackend(tmp_path / "run")
    _write_run(RunArrays(local, "l", create=True, flat=flat))
    assert local.list() == memory.list()
    for key in memory.list():
        assert local.get(key) == memory.get(key), key
    assert arrays.commit() == local.commit()


def test_a_changed_shard_is_never_read_from_the_cache() -> None:
    memory = MemoryBackend()
    arrays = RunArrays(memory, "m", create=True, flat=True)
    writer = _write_run(arrays)
    loc = writer.location(0)
    _read(arrays, writer, 0)  # cached now
    key = chunk_key(loc.array, (0,))
    damaged = bytearray(memory.get(key))
    damaged[loc.offset + 1] ^= 0xFF
    memory.put(key, [bytes(damaged)])
    with pytest.raises(ChunkCorruptError, match="checksum"):
        _read(arrays, writer, 0)
    memory.delete(key)
    with pytest.raises(ChunkCorruptError, match="missing"):
        _read(arrays, writer, 0)


def test_lost_arrays_are_deleted_through_the_backend() -> None:
    memory = MemoryBackend()
    arrays = RunArrays(memory, "m", create=True, flat=True)
    _write_run(arrays)
    name = next(n for n in arrays.names() if n.startswith("t"))
    arrays.delete(name)
    assert memory.list(name) == [] and name not in arrays.names()


def test_the_catalog_change_token_moves_with_the_catalog(tmp_path: Path) -> None:
    paths = StorePaths(tmp_path)
    token = FileChangeToken(paths)
    assert token.token() is None  # nothing committed yet
    paths.gen.write_text("1")
    first = token.token()
    assert first is not None and token.token() == first
    paths.catalog.write_bytes(b"changed without a bump")
    assert token.token() != first


class _ManySmall(torch.nn.Module):
    """200 tensors of 32 KiB: a pack that grows past its first 4 MiB shard, so its
    metadata is written again, with the grown length, at the end of the run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(200):
            x = x + 1
        return x


def test_runs_share_their_identical_metadata_files_and_never_change_each_others(
    tmp_path: Path,
) -> None:
    """A run's Zarr metadata that is byte for byte an earlier run's of the batch is a
    hard link to that file (an inode fewer); a file written again later (the metadata of
    a pack that grew) is replaced, not written into, so the runs it was shared with keep
    their own bytes; a source collected away is not needed by the runs after."""
    import tracelake as tl

    store = tl.open(tmp_path / "s")
    tiny, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    first = store.record(tiny, x, name="first")
    with store.batch():
        second = store.record(tiny, x, name="second")
        third = store.record(tiny, x, name="third")
        grown = store.record(_ManySmall(), torch.zeros(8192), name="grown")

    def meta(run: object, key: str) -> Path:
        return tmp_path / "s" / "runs" / f"{run.id:08d}" / "tensors" / key  # type: ignore[attr-defined]

    for key in ("zarr.json", "pack_raw/zarr.json"):
        assert meta(second, key).samefile(meta(third, key)), key
    assert meta(grown, "zarr.json").samefile(meta(third, "zarr.json"))
    pack = meta(third, "pack_raw/zarr.json")
    assert json.loads(pack.read_bytes())["shape"][0] == CHUNK_BYTES
    assert json.loads(meta(first, "pack_raw/zarr.json").read_bytes()) == json.loads(
        pack.read_bytes()
    )
    length = json.loads(meta(grown, "pack_raw/zarr.json").read_bytes())["shape"][0]
    assert length > CHUNK_BYTES
    assert not meta(grown, "pack_raw/zarr.json").samefile(pack)

    with store.batch():  # a pack grows after its first metadata was shared from it
        again = store.record(_ManySmall(), torch.zeros(8192), name="again")
        after = store.record(tiny, x, name="after")
    assert json.loads(meta(after, "pack_raw/zarr.json").read_bytes())["shape"][0] == CHUNK_BYTES
    assert json.loads(meta(again, "pack_raw/zarr.json").read_bytes())["shape"][0] == length

    for name in ("first", "second", "third"):
        store.delete(name)
    store.gc()
    with store.batch():
        last = store.record(tiny, x, name="last")
    assert meta(last, "zarr.json").is_file()
    reopened = tl.open(tmp_path / "s", create=False)
    assert_bitwise(reopened["last"]["output_1"].out, tiny(x), "a run after its source went")
    assert_bitwise(reopened["grown"]["output_1"].out, torch.zeros(8192) + 200, "grown")
    group = zarr.open_group(str(meta(reopened["grown"], "")), mode="r")
    assert group["pack_raw"].shape == (length,)
    assert reopened.verify().ok


def test_a_shared_metadata_source_swapped_for_another_file_is_not_linked(
    tmp_path: Path,
) -> None:
    """A file remembered as holding some bytes, then replaced behind the writer's back
    (another file at its name, same size), is not what a later file of those bytes
    links to: the link is checked to be the remembered file (its inode)."""
    data = b'{"zarr_format": 3, "node_type": "group"}'
    first, second = LocalBackend(tmp_path / "a"), LocalBackend(tmp_path / "b")
    first.put_unsynced("g/zarr.json", data)
    source = tmp_path / "a" / "g" / "zarr.json"
    source.unlink()
    source.write_bytes(b"x" * len(data))  # another file, not written through the store
    second.put_unsynced("g/zarr.json", data)
    assert (tmp_path / "b" / "g" / "zarr.json").read_bytes() == data
    third = LocalBackend(tmp_path / "c")
    third.put_unsynced("g/zarr.json", data)  # (linked to the second's: that one is right)
    assert (tmp_path / "c" / "g" / "zarr.json").samefile(tmp_path / "b" / "g" / "zarr.json")


def test_a_shared_metadata_file_someone_wrote_into_is_never_linked_again(
    tmp_path: Path,
) -> None:
    """A run's metadata file edited in place, outside tracelake (a user's script fixing
    one run), changes only the runs already linked to it: a later file of the bytes it
    held is a new file holding them, not a link to the edited one."""
    data = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'
    first, second = LocalBackend(tmp_path / "a"), LocalBackend(tmp_path / "b")
    first.put_unsynced("g/zarr.json", data)
    source = tmp_path / "a" / "g" / "zarr.json"
    with open(source, "r+b") as f:  # in place: the inode the writer keeps open
        f.write(b'{"zarr_format": 3, "node_type": "array"')
    second.put_unsynced("g/zarr.json", data)
    made = tmp_path / "b" / "g" / "zarr.json"
    assert made.read_bytes() == data and not made.samefile(source)
    third = LocalBackend(tmp_path / "c")
    third.put_unsynced("g/zarr.json", data)  # (linked to the second's: that one is right)
    assert (tmp_path / "c" / "g" / "zarr.json").samefile(made)
