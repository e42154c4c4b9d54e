"""Types for tests/test_structures.py that a second process can import by name."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Pair(NamedTuple):
    """A module output type that a reading process can find once it imports this module."""

    first: torch.Tensor
    second: Any
