"""The catalog's shadow sync (``store/duckfile.py``) on files shaped as DuckDB's: after
every sync the shadow is the source, byte for byte, whatever happened to the source
between syncs (blocks rewritten, the file grown, trimmed, replaced by another file,
another writer), and a writer that syncs again finds the changed blocks through the
memory maps it keeps rather than a read of every block's checksum; a writer SIGKILLed
in a sync through its maps loses nothing."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import BUILDERS

import tracelake as tl
from tracelake.store import catalog, duckfile

#: A block size DuckDB's header may state (the smallest), to keep the files small.
BLOCK = 4096


def _headers(iteration: int, size: int = BLOCK) -> bytes:
    """A DuckDB file's three 4 KiB headers: the magic, then two database headers (the
    newer one by its checkpoint iteration) stating the block size."""
    data = bytearray(duckfile.HEADER_BYTES)
    data[8:12] = b"DUCK"
    for at, it in ((4096, iteration), (8192, iteration - 1)):
        data[at + 8 : at + 16] = it.to_bytes(8, "little")
        data[at + 40 : at + 48] = size.to_bytes(8, "little")
    return bytes(data)


def _block(seed: int, size: int = BLOCK) -> bytes:
    """A block as DuckDB writes one: a checksum of the rest first (here the seed: a
    block written anew gets a new one), then the contents."""
    body = seed.to_bytes(8, "little") * ((size - 8) // 8)
    return seed.to_bytes(8, "little") + body


class Source:
    """A DuckDB-shaped file whose blocks each test rewrites, grows, trims or replaces."""

    def __init__(self, path: Path) -> None:
        self.path, self.iteration, self.seed = path, 2, 0
        path.write_bytes(_headers(self.iteration))

    def _next(self) -> int:
        self.seed += 1
        return self.seed

    def blocks(self) -> int:
        return (self.path.stat().st_size - duckfile.HEADER_BYTES) // BLOCK

    def checkpoint(self, writes: list[int], grow: int, trim: int) -> None:
        """DuckDB's checkpoint: some blocks (indices modulo the file's) written anew,
        blocks added at the end or free ones trimmed off it, the headers last."""
        with self.path.open("r+b") as f:
            n = self.blocks()
            for k in writes:
                if n:
                    f.seek(duckfile.HEADER_BYTES + (k % n) * BLOCK)
                    f.write(_block(self._next()))
            f.seek(duckfile.HEADER_BYTES + n * BLOCK)
            for _ in range(grow):
                f.write(_block(self._next()))
            f.truncate(duckfile.HEADER_BYTES + max(0, n + grow - trim) * BLOCK)
            self.iteration += 1
            f.seek(0)
            f.write(_headers(self.iteration))

    def replace(self) -> None:
        """Another file in its place (as a restore puts one): same bytes, new inode."""
        temp = self.path.with_name("replacement")
        temp.write_bytes(self.path.read_bytes())
        os.replace(temp, self.path)


@pytest.fixture(autouse=True)
def small_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Maps of two blocks (8 KiB), so files of a few blocks have several (three at most
    before they are made one); none kept from another test."""
    monkeypatch.setattr(duckfile, "SEGMENT_BLOCKS", 2)
    monkeypatch.setattr(duckfile, "_MAPS_EACH", 3)
    for path in list(duckfile._MAPPED):
        duckfile._forget_maps(Path(path))


_step = st.tuples(
    st.lists(st.integers(0, 60), max_size=6),  # blocks written
    st.integers(0, 9),  # blocks added
    st.integers(0, 6),  # blocks trimmed
    st.sampled_from(["same writer", "another writer", "no heads", "replaced", "no change"]),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(_step, min_size=1, max_size=12))
def test_the_shadow_is_the_source_after_every_sync(tmp_path_factory, steps) -> None:  # type: ignore[no-untyped-def]
    where = tmp_path_factory.mktemp("sync")
    source, shadow = Source(where / "catalog.duckdb"), where / "catalog.shadow"
    heads = duckfile.Heads()
    for writes, grow, trim, how in steps:
        if how != "no change":
            source.checkpoint(writes, grow, trim)
        if how == "replaced":
            source.replace()
        if how == "another writer":  # (the caller forgets what its last sync left)
            heads.state = None
        duckfile.sync_shadow(source.path, shadow, None if how == "no heads" else heads)
        assert shadow.read_bytes() == source.path.read_bytes()


@pytest.mark.parametrize("kernel", ["refuses copy_file_range", "copies 100 bytes a call"])
def test_blocks_are_copied_where_the_kernel_copies_little_or_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """A filesystem without ``copy_file_range`` (read and write instead), or one that
    copies less than asked each call: the shadow is the source all the same."""
    copy_file_range = os.copy_file_range

    def limited(src: int, dst: int, n: int, at: int, to: int) -> int:
        if kernel == "refuses copy_file_range":
            raise OSError(errno.EOPNOTSUPP, "not here")
        return copy_file_range(src, dst, min(n, 100), at, to)

    monkeypatch.setattr(os, "copy_file_range", limited)
    source, shadow = Source(tmp_path / "catalog.duckdb"), tmp_path / "catalog.shadow"
    heads = duckfile.Heads()
    for writes, grow, trim in (([], 5, 0), ([1, 3], 2, 0), ([0], 0, 3), ([2], 4, 0)):
        source.checkpoint(writes, grow, trim)
        duckfile.sync_shadow(source.path, shadow, heads)
        assert shadow.read_bytes() == source.path.read_bytes()


def test_a_shadow_spoilt_or_cut_short_is_brought_back_by_a_sync_without_heads(
    tmp_path: Path,
) -> None:
    """Without the writer's memory of it, the shadow's own checksums are read (through
    its maps too): a block of it spoilt, or a shadow cut short, is copied again."""
    source, shadow = Source(tmp_path / "catalog.duckdb"), tmp_path / "catalog.shadow"
    source.checkpoint([], grow=9, trim=0)
    duckfile.sync_shadow(source.path, shadow)
    with shadow.open("r+b") as f:
        f.seek(duckfile.HEADER_BYTES + 3 * BLOCK)
        f.write(b"spoilt!!")
    duckfile.sync_shadow(source.path, shadow, duckfile.Heads())
    assert shadow.read_bytes() == source.path.read_bytes()
    os.truncate(shadow, duckfile.HEADER_BYTES + 4 * BLOCK + 100)
    duckfile.sync_shadow(source.path, shadow)
    assert shadow.read_bytes() == source.path.read_bytes()


def test_a_writer_syncing_again_reads_no_checksum_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What made the commit grow with the catalog: a ``pread`` of every block's
    checksum at every sync. A process that synced before (twice: one that syncs once
    or twice does not map the file) reads them through its maps: the reads left are the
    changed blocks' copies and the blocks past the last map."""
    source, shadow = Source(tmp_path / "catalog.duckdb"), tmp_path / "catalog.shadow"
    heads = duckfile.Heads()
    for k in range(duckfile._PREAD_READS):
        source.checkpoint([], grow=0 if k else 201, trim=0)
        duckfile.sync_shadow(source.path, shadow, heads)
    reads: list[int] = []
    pread = os.pread

    def counted(fd: int, n: int, at: int) -> bytes:
        reads.append(n)
        return pread(fd, n, at)

    monkeypatch.setattr(os, "pread", counted)
    source.checkpoint([5, 150], grow=0, trim=0)
    duckfile.sync_shadow(source.path, shadow, heads)
    assert shadow.read_bytes() == source.path.read_bytes()
    # the headers, and the one block past the last map (blocks are copied in the kernel)
    assert sorted(reads) == [8, duckfile.HEADER_BYTES]


def test_a_map_holds_one_page_a_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel maps the pages around a faulting one (64 KiB); a map gives them back,
    so a writer's resident set does not grow by a quarter of the catalog it syncs."""
    size = 1 << 16
    monkeypatch.setattr(duckfile, "SEGMENT_BLOCKS", 8)
    source = tmp_path / "catalog.duckdb"
    source.write_bytes(_headers(2, size) + b"".join(_block(k, size) for k in range(1, 17)))
    shadow = tmp_path / "catalog.shadow"
    for _ in range(duckfile._PREAD_READS + 2):  # (the shadow's read too: mapped)
        duckfile.sync_shadow(source, shadow, duckfile.Heads())
    assert shadow.read_bytes() == source.read_bytes()
    resident: dict[str, int] = {}
    name = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line.split()[-1].startswith(str(tmp_path)):
            name = line.split()[-1]
        elif line.startswith("Rss:") and name is not None:
            resident[name] = resident.get(name, 0) + int(line.split()[1])
            name = None
        elif not line[0].isupper():
            name = None
    # two maps of 8 blocks of each file, one 4 KiB page a block
    assert resident == {str(source): 16 * 4, str(shadow): 16 * 4}


def test_a_growing_catalog_holds_a_bounded_number_of_descriptors(tmp_path: Path) -> None:
    """Each map holds a file descriptor: a file that grows by a map's worth at every
    checkpoint still has a few, not one per growth."""
    source, shadow = Source(tmp_path / "catalog.duckdb"), tmp_path / "catalog.shadow"
    heads = duckfile.Heads()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(40):
        source.checkpoint([0], grow=2, trim=0)
        duckfile.sync_shadow(source.path, shadow, heads)
        duckfile.sync_shadow(source.path, shadow, duckfile.Heads())  # (the shadow's too)
    assert shadow.read_bytes() == source.path.read_bytes()
    assert len(os.listdir("/proc/self/fd")) <= before + 2 * duckfile._MAPS_EACH


# A child that records runs "a" and "b", then "c", with every transaction checkpointed
# and the catalog mapped from its first sync, and SIGKILLs itself half way through a
# block's copy into the shadow during "c" (its body written, its checksum not).
_DIE_IN_SYNC = """
import os, signal, sys
import tracelake as tl
from tracelake.store import catalog, duckfile
from model_zoo import BUILDERS

catalog.LOG_BYTES = 0
duckfile.SEGMENT_BLOCKS, duckfile._PREAD_READS = 1, 0
store = tl.open(sys.argv[1])
for name, builder in (("a", "mlp"), ("b", "repeated_block")):
    model, inputs = BUILDERS[builder]()
    store.record(model, *inputs, name=name)
    store.flush()  # (its rows inserted now: a transaction, and a sync, a run)
assert duckfile._MAPPED[str(store.paths.catalog)].maps  # (the sync reads through maps)
copy, copies = duckfile._copy_range, []

def dying(src, dst, at, n):
    copies.append(at)
    if len(copies) == 2:  # the second copy: a block's checksum, after its body
        os.kill(os.getpid(), signal.SIGKILL)
    return copy(src, dst, at, n)

duckfile._copy_range = dying
model, inputs = BUILDERS["cnn"]()
store.record(model, *inputs, name="c")
store.flush()
"""


def test_a_writer_killed_in_the_shadows_sync_through_its_maps_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL half way through the sync that reads the catalog through memory maps:
    the catalog holds every committed run, the next writer brings the shadow up to the
    file, and a catalog spoilt after that is restored from the shadow with every run."""
    root = tmp_path / "s"
    done = subprocess.run(
        [sys.executable, "-c", _DIE_IN_SYNC, str(root)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    catalog_file, shadow = root / "catalog.duckdb", root / "catalog.shadow"
    assert shadow.read_bytes() != catalog_file.read_bytes()  # (the sync was cut short)
    names = set(tl.open(root).runs()["name"])
    assert names == {"a", "b", "c"}  # ("c": sealed, so complete, whatever its fold did)
    monkeypatch.setattr(catalog, "LOG_BYTES", 0)  # (the next run checkpointed too)
    model, inputs = BUILDERS["mlp"]()
    tl.open(root).record(model, *inputs, name="d")
    assert shadow.read_bytes() == catalog_file.read_bytes()
    with catalog_file.open("r+b") as f:  # a metadata block spoilt, as a killed writer did
        f.seek(3 * 4096 + 5000)
        f.write(b"\x00killed\x00" * 8)
    with pytest.warns(tl.TraceLakeWarning, match="restored from catalog.shadow"):
        tl.open(root).record(model, *inputs, name="e")
    assert set(tl.open(root).runs()["name"]) == names | {"d", "e"}
