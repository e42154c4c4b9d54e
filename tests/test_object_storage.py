"""Run arrays on object storage, against a real S3-compatible server (moto_server on a
free port, stopped by PID): the storage seam's conformance suite, a whole run's arrays
written and read back bitwise, and the bucket's layout read by plain zarr-python."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr
from hook_capture import assert_bitwise
from servers import WRITER_LOOP, kill_one_writer, make_bucket, moto_server, reader_loop, s3_options
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
    arrays = RunArrays(backend, "s3run", create=True, flat=True)
    writer = _write_run(arrays)
    for slot, tensor in enumerate(_tensors()):
        assert_bitwise(_read(arrays, writer, slot), tensor, f"slot {slot}")
    # the same run on disk: the same keys holding the same bytes
    from tracelake.store.local import LocalBackend

    local = LocalBackend(tmp_path / "run")
    _write_run(RunArrays(local, "l", create=True, flat=True))
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


# -- a whole store with its arrays in the bucket ---------------------------------------------

RUNS = ("r1", "r2", "r3", "r4")
ORDER = "order by run, step, idx"


def _objects(s3: str, prefix: str) -> list[str]:
    import obstore

    whole = open_object_store(f"s3://{BUCKET}", s3_options(s3))
    return [m["path"] for batch in obstore.list(whole, prefix) for m in batch]


@pytest.fixture(scope="module")
def remote_store(s3: str, tmp_path_factory: pytest.TempPathFactory):
    """Four runs of the Tower (packed and own arrays), two of them in a batch, arrays in
    the bucket, catalog in a local directory; and what a plain forward computed."""
    import torch
    from test_aggregate import Tower, _inputs, _plain

    catalog = tmp_path_factory.mktemp("remote") / "catalog"
    url = f"s3://{BUCKET}/e2e"
    store = tl.open(url, catalog=catalog, storage_options=s3_options(s3))
    torch.manual_seed(0)
    model = Tower()
    with torch.no_grad():
        for seed in (1, 2):
            store.record(model, *_inputs(seed), name=f"r{seed}")
        with store.batch():
            for seed in (3, 4):
                store.record(model, *_inputs(seed), name=f"r{seed}")
    plain = {f"r{seed}": _plain(model, seed) for seed in (1, 2, 3, 4)}
    return url, catalog, store, plain


def test_runs_round_trip_through_the_bucket(remote_store, s3: str, tmp_path: Path) -> None:
    """Record into the bucket, reopen in a new process (the URL from the catalog's
    directory, credentials passed again), query; compare with a plain forward."""
    _url, catalog, _store, plain = remote_store
    assert not list((catalog / "runs").glob("*/tensors")), "no arrays on the local disk"
    assert any(key.endswith("/zarr.json") for key in _objects(s3, "e2e/runs"))
    script = f"""
import numpy as np, tracelake as tl
store = tl.open({str(catalog)!r}, create=False, storage_options={s3_options(s3)!r})
for f in ("tanh", "relu"):
    res = store.query("select out from ops where func = :f {ORDER}", f=f)
    np.save({str(tmp_path)!r} + f"/{{f}}.npy", res.stack().numpy())
np.save({str(tmp_path)!r} + "/dask.npy", store.dask_array(
    "select out[0:4, 2] as s from ops where func = 'relu' {ORDER}").compute())
assert store.verify().ok, store.verify().problems
"""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    tanh = np.stack([t.numpy() for run in RUNS for t in plain[run]["tanh"]])
    relu = np.stack([plain[run]["relu"][0].numpy() for run in RUNS])
    assert np.array_equal(np.load(tmp_path / "tanh.npy").view(np.uint8), tanh.view(np.uint8))
    assert np.array_equal(np.load(tmp_path / "relu.npy").view(np.uint8), relu.view(np.uint8))
    assert np.array_equal(np.load(tmp_path / "dask.npy"), relu[:, 0:4, 2])


def test_verify_reads_the_objects(s3: str, tmp_path: Path) -> None:
    """A damaged object in the bucket is found by verify() and refused by a read."""
    import obstore
    import torch
    from test_aggregate import Tower, _inputs

    catalog = tmp_path / "cat"
    store = tl.open(f"s3://{BUCKET}/damaged", catalog=catalog, storage_options=s3_options(s3))
    with torch.no_grad():
        store.record(Tower(), *_inputs(1), name="d")
    assert store.verify().ok
    whole = open_object_store(f"s3://{BUCKET}", s3_options(s3))
    chunk = next(k for k in _objects(s3, "damaged/runs") if re.search("/pack_raw/[0-9]+$", k))
    data = bytearray(obstore.get(whole, chunk).bytes())
    data[100] ^= 0xFF
    obstore.put(whole, chunk, bytes(data))
    report = tl.open(catalog, create=False, storage_options=s3_options(s3)).verify()
    assert not report.ok and any(p.run == "d" for p in report.problems)
    with pytest.raises(tl.ChunkCorruptError):
        tl.open(catalog, storage_options=s3_options(s3)).query("select out from ops").tensors()


def test_delete_and_gc_remove_the_objects(s3: str, tmp_path: Path) -> None:
    import torch
    from test_aggregate import Tower, _inputs

    catalog = tmp_path / "cat"
    store = tl.open(f"s3://{BUCKET}/gc", catalog=catalog, storage_options=s3_options(s3))
    model = Tower()
    with torch.no_grad():
        store.record(model, *_inputs(1), name="keep")
        store.record(model, *_inputs(2), name="drop")
        with pytest.raises(RuntimeError, match="boom"), store.recording("failed", model) as rec:
            rec.record(model, *_inputs(3))
            raise RuntimeError("boom")
    prefixes = {key.split("/")[2] for key in _objects(s3, "gc/runs")}
    assert len(prefixes) == 3  # keep, drop, and the failed run's
    store.delete("drop")
    report = store.gc()
    assert report["runs"] == 2 and report["bytes"] > 4 << 20
    left = {key.split("/")[2] for key in _objects(s3, "gc/runs")}
    assert len(left) == 1 and left < prefixes
    assert store.verify().ok and list(store) == ["keep"]
    store.query("select out from ops where func = 'relu'").stack()


def test_a_killed_writer_leaves_nothing_visible_and_gc_collects_it(s3: str, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    catalog = tmp_path / "cat"
    options = s3_options(s3)
    tl.open(f"s3://{BUCKET}/killed", catalog=catalog, storage_options=options)
    script = f"""
import sys, time, torch, tracelake as tl
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_aggregate import Tower, _inputs
store = tl.open({str(catalog)!r}, create=False, storage_options={options!r})
model = Tower()
with torch.no_grad(), store.recording("victim", model) as rec:
    rec.record(model, *_inputs(1))
    rec.record(model, *_inputs(2))
    print("recorded", flush=True)
    time.sleep(120)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "recorded"
        assert _objects(s3, "killed/runs"), "the writer had written objects"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    store = tl.open(catalog, create=False, storage_options=options)
    assert list(store) == []
    with pytest.raises(tl.RunNotFoundError):
        store["victim"]
    store.gc()
    assert _objects(s3, "killed/runs") == []
    assert not [p for p in (catalog / "runs").iterdir() if not p.name.startswith(".")]


def test_open_errors(s3: str, tmp_path: Path) -> None:
    with pytest.raises(tl.StoreError, match="needs catalog=DIRECTORY"):
        tl.open(f"s3://{BUCKET}/x", storage_options=s3_options(s3))
    with pytest.raises(tl.StoreError, match="catalog= is for a store on object storage"):
        tl.open(tmp_path / "a", catalog=tmp_path / "b")
    tl.open(tmp_path / "local")
    with pytest.raises(tl.StoreError, match="keeps its arrays on disk"):
        tl.open(tmp_path / "local", storage_options=s3_options(s3))
    tl.open(f"s3://{BUCKET}/one", catalog=tmp_path / "c", storage_options=s3_options(s3))
    with pytest.raises(tl.StoreError, match="keeps its arrays at 's3://"):
        tl.open(f"s3://{BUCKET}/two", catalog=tmp_path / "c", storage_options=s3_options(s3))


def test_a_bucket_that_does_not_answer_fails_within_the_retries_given(tmp_path: Path) -> None:
    """obstore retries a failed request for up to three minutes by default: a user can
    bound that with ``retry_config`` in ``storage_options`` (durations in seconds, as
    JSON and the command line give them). Here the endpoint refuses every connection:
    the run fails with a ``StoreError`` after one retry, and nothing of it is listed."""
    import socket

    import torch

    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    options = {
        **s3_options(f"http://127.0.0.1:{port}"),
        "retry_config": {"max_retries": 1, "retry_timeout": 5, "backoff": {"init_backoff": 0.01}},
    }
    store = tl.open(f"s3://{BUCKET}/gone", catalog=tmp_path / "c", storage_options=options)
    with pytest.raises(tl.StoreError, match=r"127\.0\.0\.1") as failed:
        store.record(torch.nn.Linear(4, 4), torch.randn(2, 4), name="never")
    assert "retry_config" not in str(failed.value)
    assert len(store) == 0
    with pytest.raises(tl.StoreError, match="retry_config must be a dict"):
        open_object_store(f"s3://{BUCKET}/x", {**options, "retry_config": 3})


_WRITER = (
    """
import json, sys, time, torch, tracelake as tl
catalog, options, who = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
runs, victim = int(sys.argv[4]), sys.argv[5] == "1"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 2100), torch.nn.Tanh())
store = tl.open(catalog, create=False, storage_options=options)
"""
    + WRITER_LOOP
)

_READER = """
import json, os, sys, tracelake as tl
catalog, options, stop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
store = tl.open(catalog, create=False, storage_options=options)
""" + reader_loop('counts["n"].iloc[0]')


def test_concurrent_writers_one_killed(s3: str, tmp_path: Path) -> None:
    """Four writer processes and one reader on one store with its arrays in the bucket;
    a fifth writer SIGKILLed mid-run. The reader sees no partial or killed run and no
    error; every run is bitwise intact; gc() collects the killed run's objects."""
    import json
    import subprocess
    import sys

    import torch

    catalog = tmp_path / "cat"
    options = json.dumps(s3_options(s3))
    tl.open(f"s3://{BUCKET}/conc", catalog=catalog, storage_options=s3_options(s3))
    py = sys.executable
    stop = tmp_path / "stop"
    reader = subprocess.Popen(
        [py, "-c", _READER, str(catalog), options, str(stop)], stdout=subprocess.PIPE, text=True
    )
    victim = subprocess.Popen(
        [py, "-c", _WRITER, str(catalog), options, "v", "1", "1"], stdout=subprocess.PIPE, text=True
    )
    writers = [
        subprocess.Popen([py, "-c", _WRITER, str(catalog), options, f"w{i}", "3", "0"])
        for i in range(4)
    ]
    kill_one_writer(reader, victim, writers, stop)

    store = tl.open(catalog, create=False, storage_options=s3_options(s3))
    names = sorted(store)
    assert names == sorted([*(f"w{i}-{k}" for i in range(4) for k in range(3)), "v-0"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2100), torch.nn.Tanh())
    for name in names:
        who, k = name.rsplit("-", 1)
        x = torch.randn(
            520, 64, generator=torch.Generator().manual_seed(sum(map(ord, who)) * 100 + int(k))
        )
        with torch.no_grad():
            want = model(x)
        got = store.query("select out from ops where run = :r and func = 'tanh'", r=name)
        assert_bitwise(got.stack()[0], want, name)
    assert store.verify().ok
    before = {key.split("/")[2] for key in _objects(s3, "conc/runs")}
    assert len(before) == len(names) + 1  # the killed run's objects are still there
    store.gc()
    after = {key.split("/")[2] for key in _objects(s3, "conc/runs")}
    assert len(after) == len(names) and after < before


def test_the_command_line_takes_credentials_from_the_environment(remote_store, s3: str) -> None:
    """`tracelake verify CATALOG` on a store whose arrays are in the bucket: the URL
    from the catalog's directory, the credentials from the usual AWS_* variables."""
    import os
    import subprocess
    import sys

    _url, catalog, _store, _plain = remote_store
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL=s3,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        AWS_ALLOW_HTTP="true",
    )
    exe = str(Path(sys.executable).with_name("tracelake"))
    done = subprocess.run(
        [exe, "verify", str(catalog), "--json"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    import json

    report = json.loads(done.stdout)
    assert report["ok"] and report["runs"] == len(RUNS) and report["chunks"] > 0
