"""Locks a forked child can take.

``os.fork`` copies a lock as it is: one that another thread held at that instant stays
held in the child for ever, because the thread that would release it was not copied.
The recorder's module-level locks are taken in a child (a ``DataLoader`` worker forked
inside a recorded forward closes its copy of the recording, which releases the source
replacements and may classify new code; a child that records takes the store's spare
buffers' lock), so each is held across the fork: the forking
thread waits for the lock (its holders keep it for a few dictionary operations and never
fork inside), forks, and both processes release their copy, the child's state being
the consistent one the last holder left.
"""

from __future__ import annotations

import os
import threading

__all__ = ["fork_safe_lock"]


def fork_safe_lock() -> threading.Lock:
    """A new lock that is free in a child forked from any thread."""
    lock = threading.Lock()
    os.register_at_fork(
        before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release
    )
    return lock
