"""Real servers for the tests of the scale deployment, each on a free port of the
loopback, started as a child process and stopped by its PID. A server that cannot
start fails the test (``pytest.fail``): never a silent skip."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Credentials moto accepts (any); what the tests pass as storage_options.
ACCESS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited at start (status {proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"{what} did not listen on port {port} within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop ``proc`` by its PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A real S3-compatible server (moto's ``moto_server``); yields its endpoint URL."""
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        pytest.fail(f"moto_server is missing beside {sys.executable}: pip install 'moto[server]'")
    port = free_port()
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(port, proc, "moto_server")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def make_bucket(endpoint: str, bucket: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")).read()


def s3_options(endpoint: str) -> dict[str, object]:
    """``storage_options`` for a store on the server at ``endpoint``."""
    return {**ACCESS, "endpoint": endpoint, "allow_http": True}


def _postgres_bin(name: str) -> str:
    """A PostgreSQL program: on PATH, else the newest of the OS packages' versions."""
    import shutil

    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not versions:
        pytest.fail(f"PostgreSQL's {name} is missing: apt-get install postgresql (.ci/run does)")
    return str(versions[-1])


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL server (``initdb`` into a new temporary directory,
    ``pg_ctl start`` on a free port of the loopback, trust authentication); yields a
    libpq URL of its ``postgres`` database. Stopped by its postmaster's PID (SIGINT: fast
    shutdown; SIGKILL after 20 s), its directory removed. As root, the server runs as the
    ``postgres`` user (PostgreSQL refuses root), in a directory that user owns."""
    import shutil
    import tempfile

    as_user: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="tracelake-pg-"))
    data = tmp / "pgdata"
    sockets = tmp / "pgsock"
    sockets.mkdir()
    if os.geteuid() == 0:
        import pwd

        as_user = ["runuser", "-u", "postgres", "--"]
        user = pwd.getpwnam("postgres")
        for path in (tmp, sockets):
            shutil.chown(path, user.pw_uid, user.pw_gid)
    port = free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    init = subprocess.run(
        [*as_user, _postgres_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
        check=False,
        **quiet,
    )
    if init.returncode:
        pytest.fail(f"initdb failed: {init.stderr.decode(errors='replace')[-2000:]}")
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c max_connections=200"
    start = subprocess.run(
        [
            *as_user,
            _postgres_bin("pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "-l",
            str(tmp / "postgres.log"),
            "start",
        ],
        check=False,
        **quiet,
    )
    if start.returncode:
        log = (tmp / "postgres.log").read_text(errors="replace")[-2000:]
        pytest.fail(f"PostgreSQL did not start: {start.stderr.decode(errors='replace')} {log}")
    pid = int((data / "postmaster.pid").read_text().split()[0])
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def new_database(dsn: str, name: str) -> str:
    """Create database ``name`` on the server of ``dsn`` (``createdb``); its DSN."""
    parts = dsn.rsplit("/", 1)[0]
    host, port = parts.split("@", 1)[1].split(":")
    done = subprocess.run(
        [_postgres_bin("createdb"), "-h", host, "-p", port, "-U", "postgres", name],
        check=False,
        capture_output=True,
    )
    if done.returncode:
        pytest.fail(f"createdb {name} failed: {done.stderr.decode(errors='replace')}")
    return f"{parts}/{name}"


def kill_one_writer(
    reader: subprocess.Popen, victim: subprocess.Popen, writers: list[subprocess.Popen], stop: Path
) -> None:
    """The concurrent-writers scenario the store suites share: SIGKILL ``victim`` once it
    printed ``ready``, wait for ``writers`` to succeed, then tell the reader to stop
    (``stop`` touched) and check its last line (``reader <queries> <errors>``): it
    queried and saw no error. Whatever is still running at the end is killed."""
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        for proc in writers:
            assert proc.wait(timeout=600) == 0
    finally:
        stop.touch()
        for proc in [*writers, victim]:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        out, _ = reader.communicate(timeout=120)
    summary = out.strip().splitlines()[-1].split()
    assert summary[0] == "reader" and int(summary[1]) > 0, out
    assert int(summary[2]) == 0, out  # no error seen by the reader


#: The loop of a writer process of the concurrency tests, after its script's own header
#: bound ``store``, ``model``, ``who``, ``runs`` and ``victim`` (the victim records one
#: run more and is killed in the middle of it).
WRITER_LOOP = """
def x(k):
    return torch.randn(520, 64, generator=torch.Generator().manual_seed(k))
with torch.no_grad():
    for k in range(runs):
        store.record(model, x(sum(map(ord, who)) * 100 + k), name=f"{who}-{k}")
    if victim:  # after its runs: a run it is killed in the middle of
        with store.recording(f"{who}-killed", model) as rec:
            rec.record(model, x(1))
            print("ready", flush=True)
            time.sleep(600)
print("done", flush=True)
"""

#: The loop of a reader process, after its header bound ``store`` and ``stop``: it
#: queries until ``stop`` exists, checking that no run is partial (``OPS_PER_RUN``: the
#: ops a complete run holds, an expression) and the killed one is never visible.
_READER_LOOP = """
queries = errors = 0
while not os.path.exists(stop):
    try:
        counts = store.query("select run, count(*) as n from ops group by run").df()
        for run, n in zip(counts["run"], counts["n"]):
            assert n == OPS_PER_RUN, f"run {run} has {n} ops: partial"
            assert not run.endswith("-killed"), "the killed run is visible"
        if len(counts):
            run = counts["run"].iloc[-1]
            store.query("select out from ops where run = :r", r=run).tensors()
        queries += 1
    except Exception as exc:
        errors += 1
        print("error", repr(exc), flush=True)
print("reader", queries, errors, flush=True)
"""


def reader_loop(ops_per_run: str) -> str:
    """:data:`_READER_LOOP` checking that each run holds ``ops_per_run`` ops."""
    return _READER_LOOP.replace("OPS_PER_RUN", ops_per_run)
