"""Run arrays on object storage, against a real S3-compatible server (moto_server on a
free port, stopped by PID): the storage seam's conformance suite, a whole run's arrays
written and read back bitwise, and the bucket's layout read by plain zarr-python."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr
from hook_capture import assert_bitwise
from servers import make_bucket, moto_server, s3_options
from test_storage import ByteStoreTests, _read, _tensors, _write_run

import tracelake as tl
from tracelake.store.objstore import ObjectBackend, is_url, open_object_store
from tracelake.store.tensors import RunArrays

BUCKET = "tracelake-test"
_ENDPOINT: list[str] = []
_PREFIXES = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def s3() -> Iterator[str]:
    with moto_server() as endpoint:
        make_bucket(endpoint, BUCKET)
        _ENDPOINT[:] = [endpoint]
        yield endpoint


def _backend(path: Path) -> ObjectBackend:
    """A backend under a prefix of its own (the path's name, made unique)."""
    url = f"s3://{BUCKET}/t{next(_PREFIXES)}-{path.name}"
    return ObjectBackend(open_object_store(url, s3_options(_ENDPOINT[0])), url=url)


class TestObjectBackend(ByteStoreTests):
    make = staticmethod(_backend)

    def test_objects_are_where_the_keys_say(self, s3: str) -> None:
        url = f"s3://{BUCKET}/deep/prefix"
        backend = ObjectBackend(open_object_store(url, s3_options(s3)), "runs/7", url)
        backend.put("a/c/0", [b"xyz"])
        whole = open_object_store(f"s3://{BUCKET}", s3_options(s3))
        import obstore

        assert bytes(obstore.get(whole, "deep/prefix/runs/7/a/c/0").bytes()) == b"xyz"


def test_a_run_written_to_the_bucket_reads_back_and_matches_disk(s3: str, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/run-roundtrip"
    backend = ObjectBackend(open_object_store(url, s3_options(s3)), url=url)
    arrays = RunArrays(backend, "s3run", create=True)
    writer = _write_run(arrays)
    for slot, tensor in enumerate(_tensors()):
        assert_bitwise(_read(arrays, writer, slot), tensor, f"slot {slot}")
    # the same run on disk: the same keys holding the same bytes
    from tracelake.store.local import LocalBackend

    local = LocalBackend(tmp_path / "run")
    _write_run(RunArrays(local, "l", create=True))
    assert backend.list() == local.list()
    for key in local.list():
        assert backend.get(key) == local.get(key), key
    assert arrays.commit() == local.commit()

    # plain zarr-python, from the bucket, with its own ObjectStore: every array opens,
    # every checksum checks, and the bytes are the tensors' own
    from obstore.store import from_url
    from zarr.storage import ObjectStore

    plain = ObjectStore(
        from_url(
            url,
            config={k: v for k, v in s3_options(s3).items() if k != "allow_http"},
            client_options={"allow_http": True},
        ),
        read_only=True,
    )
    group = zarr.open_group(plain, mode="r")
    names = sorted(group.array_keys())
    assert names == sorted(arrays.names())
    own = [n for n in names if n.startswith("t")]
    assert own, "some tensors have arrays of their own"
    for name in names:
        np.asarray(group[name][:])  # checksums: zarr-python's crc32c codec
    big = _tensors()[5]
    loc = next(loc for loc in writer.locations if loc.array in own and loc.shape == big.shape)
    assert np.array_equal(np.asarray(group[loc.array][:]), big.numpy())


def test_urls_and_a_clear_error_for_bad_options(s3: str) -> None:
    assert is_url("s3://b/p") and is_url("gs://b") and not is_url("/tmp/x")
    assert not is_url("relative/dir") and not is_url(Path("s3:/x"))
    with pytest.raises(tl.StoreError, match="cannot open the object store"):
        open_object_store("s3://b/p", {"no_such_option": 1})
