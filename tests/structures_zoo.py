"""Types for tests/test_structures.py that a second process can import by name."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch


class Pair(NamedTuple):
    """A module output type that a reading process can find once it imports this module."""

    first: torch.Tensor
    second: Any


@dataclasses.dataclass
class Scored:
    """A model's own output type: a plain dataclass, not registered with pytree."""

    logits: torch.Tensor
    hidden: list[torch.Tensor]
    note: str = "scored"
