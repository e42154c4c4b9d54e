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
