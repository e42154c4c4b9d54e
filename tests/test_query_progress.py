"""``store.query(..., progress=...)``: the bar of a query reading or comparing tensors is
the command line's (``tracelake.progress.Progress``), shown where someone watches (a
terminal, here a pseudo-terminal; a notebook's kernel) and silent when stderr is a pipe,
unless asked for; ``progress=False`` turns it off everywhere. Each case is a new Python
process, as a user's script would be, whose stderr is a terminal or a pipe."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_zoo import mlp

import tracelake as tl

_SCRIPT = r"""
import sys
import tracelake as tl
from tracelake import progress

progress.DELAY = 0.0  # (a bar after the first byte, not after a second: a small store)
store = tl.open(sys.argv[1], create=False)
flag = {"none": None, "true": True, "false": False}[sys.argv[2]]
result = store.query(sys.argv[3], progress=flag, **({"r": "b"} if ":r" in sys.argv[3] else {}))
print("rows", len(result), flush=True)
"""

_READ = "select run, label, out from ops"
_PAIRS = "select a.label, max_abs_diff(a.out, b.out) as d from ops a join ops b using (key) \
where a.run = 'a' and b.run = :r"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("progress") / "runs.tl"
    store = tl.open(root)
    model, (x,) = mlp()
    with torch.no_grad():
        store.record(model, x, name="a", progress=False)
        store.record(model, x * 2, name="b", progress=False)
    return root


def _run(store: Path, flag: str, text: str, terminal: bool) -> tuple[str, str]:
    """The script's stdout and stderr, its stderr a pseudo-terminal or a pipe."""
    env = {k: v for k, v in os.environ.items() if k != "TRACELAKE_PROGRESS"}
    argv = [sys.executable, "-c", _SCRIPT, str(store), flag, text]
    if not terminal:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr
    leader, follower = pty.openpty()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    while True:  # read the terminal until the child closes it
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child exited
            break
        if not chunk:
            break
        seen += chunk
    out = child.communicate(timeout=300)[0].decode()
    os.close(leader)
    assert child.returncode == 0, seen.decode(errors="replace")
    return out, seen.decode(errors="replace")


@pytest.mark.parametrize(("text", "shown"), [(_READ, "reading tensors"), (_PAIRS, "comparing")])
def test_query_shows_the_progress_bar_in_a_terminal_only(
    store_path: Path, text: str, shown: str
) -> None:
    out, terminal = _run(store_path, "none", text, terminal=True)
    assert out.startswith("rows ") and int(out.split()[1]) > 0
    assert shown in terminal, terminal  # the default: a terminal watches
    out_off, terminal_off = _run(store_path, "false", text, terminal=True)
    assert out_off == out and shown not in terminal_off, terminal_off
    out_piped, piped = _run(store_path, "none", text, terminal=False)
    assert out_piped == out and piped == ""  # a pipe: nobody watches


def test_the_magics_still_bind_a_notebook_variable_named_progress(store_path: Path) -> None:
    from tracelake.magics import run_magic

    store = tl.open(store_path, create=False)
    label = next(iter(store.query("select label from ops where run = 'a' limit 1")))["label"]
    namespace = {"store": store, "progress": label}
    result = run_magic("store", "select label from ops where label = :progress", namespace)
    assert [row["label"] for row in result] == [label, label]
