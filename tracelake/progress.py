"""Progress bars for long work: recording, queries reading tensors, compare, gc,
verify, exports.

A bar appears only once the work has taken :data:`DELAY` seconds (quick calls print
nothing, and do not even import rich), only where someone watches: a terminal (stderr)
or a notebook. ``progress=False`` on the call, or ``TRACELAKE_PROGRESS=0`` in the
environment, turns it off; ``TRACELAKE_PROGRESS=1`` shows it even when stderr is not a
terminal.

Counting costs the work nothing it would notice: :meth:`Progress.advance` adds to a
number (drawing is rich's own thread's, a few times a second), and a recording's bar
reads the writer's byte count from a thread of its own (``poll=``), so the forward pass
never calls into it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DELAY", "Progress", "interactive"]

#: Seconds of work before a bar appears.
DELAY = 1.0
#: Seconds between polls of ``poll=``, and at least between two drawings of a bar (rich's
#: own refresh thread is off: drawing takes the GIL from the work).
_POLL = 0.25
_ENV = "TRACELAKE_PROGRESS"


def interactive() -> bool:
    """Whether progress is shown by default: ``TRACELAKE_PROGRESS`` when set (``0`` /
    ``1``), else in a notebook's kernel or when stderr is a terminal."""
    setting = os.environ.get(_ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    if "ipykernel" in sys.modules:
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        return False


class Progress:
    """One piece of long work, as a context manager::

        with Progress("verifying", total=n, unit="chunks", enabled=progress) as bar:
            for ...:
                bar.advance()

    ``total``: how much there is (None: unknown, a running count); ``unit``:
    ``"bytes"`` (shown as sizes) or any noun; ``enabled``: True, False, or None for
    :func:`interactive`; ``poll``: a function returning how much is done, read from a
    thread of the bar's own instead of calls to :meth:`advance`; ``describe``: a
    function returning the description, read with it."""

    def __init__(
        self,
        description: str,
        total: float | None = None,
        unit: str = "items",
        enabled: bool | None = None,
        poll: Callable[[], float] | None = None,
        describe: Callable[[], str] | None = None,
    ):
        self.description = description
        self.total = total
        self.unit = unit
        self.enabled = interactive() if enabled is None else bool(enabled)
        self.done = 0.0
        self._poll = poll
        self._describe = describe
        self._start = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._drawn = 0.0

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if self.enabled and self._poll is not None:
            self._thread = threading.Thread(
                target=self._polling, name="tracelake-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def advance(self, amount: float = 1) -> None:
        """Count ``amount`` more done (thread-safe)."""
        self.done += amount
        if self.enabled and (self._bar is not None or time.monotonic() - self._start >= DELAY):
            self._show()

    def _polling(self) -> None:
        while not self._stop.wait(_POLL):
            if time.monotonic() - self._start < DELAY:
                continue
            assert self._poll is not None
            try:
                self.done = float(self._poll())
                if self._describe is not None:
                    self.description = self._describe()
            except Exception:  # never the work's problem
                continue
            self._show()

    def _show(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            if self._bar is None:
                self._bar = _start_bar(self.unit, self.total is not None)
                self._task = self._bar.add_task(self.description, total=self.total)
            now = time.monotonic()
            if now - self._drawn < _POLL:
                return
            self._drawn = now
            self._bar.update(
                self._task, completed=self.done, total=self.total, description=self.description
            )
            self._bar.refresh()

    def close(self) -> None:
        """Stop showing (the bar disappears)."""
        with self._lock:
            self._stop.set()
            bar, self._bar = self._bar, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if bar is not None:
            bar.stop()


def _start_bar(unit: str, bounded: bool) -> Any:
    """A started rich progress display on stderr, for one task."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    count: Any
    if unit == "bytes":
        count = DownloadColumn(binary_units=True)
    elif bounded:
        count = MofNCompleteColumn()
    else:
        count = TextColumn("{task.completed:.0f}")
    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if bounded:
        columns.append(BarColumn())
    columns += [count, TextColumn("" if unit == "bytes" else unit), TimeElapsedColumn()]
    if bounded:
        columns.append(TimeRemainingColumn())
    forced = os.environ.get(_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    shown = Console(stderr=True, force_terminal=True if forced else None)
    bar = Progress(*columns, console=shown, transient=True, auto_refresh=False)
    bar.start()
    return bar
