"""Random number generators around a recorded forward pass, so that a replay draws what
the recording drew (dropout in training mode, ``torch.randn_like`` in a forward).

:class:`RngWatch` takes torch's generator states (the CPU one, and each CUDA device's
once CUDA is initialised) as a forward begins and keeps them only if the forward moved
one of them: a forward that draws nothing keeps nothing, so its recorded call is as
before. The states travel in the recorded call's JSON as base64 bytes (no pickle);
:func:`drawing_as_recorded` sets them for the replayed forward and gives the user's own
states back afterwards (``torch.random.fork_rng``), so a replay changes no one's stream.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["RngWatch", "drawing_as_recorded"]


def _states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # (never initialises CUDA itself)
        for device in range(torch.cuda.device_count()):
            states[f"cuda:{device}"] = torch.cuda.get_rng_state(device)
    return states


class RngWatch:
    """The generator states as a forward began (:meth:`start`), kept by :meth:`stop`
    only if the forward drew from one of them."""

    def __init__(self) -> None:
        self._before: dict[str, torch.Tensor] = {}
        self.drawn: dict[str, str] | None = None

    def start(self) -> None:
        self._before = _states()
        self.drawn = None

    def stop(self) -> None:
        after = _states()
        moved = any(
            name not in after or not torch.equal(state, after[name])
            for name, state in self._before.items()
        )
        if moved:
            self.drawn = {
                name: base64.b64encode(state.numpy().tobytes()).decode("ascii")
                for name, state in self._before.items()
            }


@contextlib.contextmanager
def drawing_as_recorded(drawn: Any) -> Iterator[None]:
    """Within the block, torch's generators start where a recorded forward's did
    (``drawn``: :attr:`RngWatch.drawn`, as its call keeps it; None: left alone); on
    leaving, the caller's states come back. A CUDA device this machine lacks is skipped."""
    if not drawn:
        yield
        return
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = {
        int(name[5:]): text
        for name, text in drawn.items()
        if name.startswith("cuda:") and int(name[5:]) < here
    }
    with torch.random.fork_rng(devices=list(cuda)):
        if "cpu" in drawn:
            torch.set_rng_state(_state(drawn["cpu"]))
        for device, text in cuda.items():
            torch.cuda.set_rng_state(_state(text), device)
        yield


def _state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
