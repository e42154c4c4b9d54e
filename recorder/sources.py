"""Source tensors that never reach a ``TorchFunctionMode``: ``torch.from_numpy(a)`` and
``torch.Tensor([...])`` (the legacy constructor).

Both are C functions that torch does not dispatch, so the interception mode would never
see them; TorchLens records them (``fromnumpy_1_1``, ``new_1_3``: it patches torch). While
at least one recording is active, ``torch.from_numpy`` and ``torch.Tensor.__new__`` are
replaced by Python functions that dispatch the call as torch's own Python functions do
(``handle_torch_function``) whenever a torch function mode is active on the calling
thread, and otherwise call torch's function at once: another thread, or the recorder's
own copies (which run with torch functions disabled), see torch's behaviour unchanged.
The mode then records the call as any other (its name: ``from_numpy``, ``new``) and
calls the replacement again with itself disabled, which calls torch's function.

:func:`hold` installs them for one holder (an interceptor), :func:`release` takes the
holder away and restores torch exactly when none is left (``torch.Tensor``'s
``__dict__`` gets no ``__new__`` entry back: it had none, and deleting the one set puts
back the C constructor). Both are idempotent and check the state they change rather
than count, so a Ctrl-C between any two lines leaves what a second ``release`` (which
the recorder's cleanup runs) restores. Only calls through ``torch.from_numpy`` /
``torch.Tensor`` looked up during the recording are seen: a ``from torch import
from_numpy`` bound before it keeps torch's function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import handle_torch_function

from .forks import fork_safe_lock

__all__ = ["hold", "release"]

_FROM_NUMPY = torch.from_numpy
_TENSOR = torch.Tensor
_TENSOR_NEW = torch.Tensor.__new__
_NO_ARGS: tuple = ()
#: Whether a torch function mode is active on this thread (false inside a mode's
#: handler and under ``DisableTorchFunction``).
_mode_active = torch._C._is_torch_function_mode_enabled


def from_numpy(ndarray: Any) -> torch.Tensor:
    """``torch.from_numpy``, dispatched to the torch function mode of this thread."""
    if _mode_active():
        return handle_torch_function(from_numpy, _NO_ARGS, ndarray)  # type: ignore[no-any-return]
    return _FROM_NUMPY(ndarray)


def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor(...)``, dispatched to the torch function mode of this thread (a
    subclass's construction is left alone)."""
    if cls is _TENSOR and _mode_active():
        return handle_torch_function(__new__, _NO_ARGS, cls, *args, **kwargs)
    return _TENSOR_NEW(cls, *args, **kwargs)


_lock = fork_safe_lock()
_holders: set[int] = set()


def hold(holder: object) -> None:
    """Install the replacements for ``holder`` (kept until :func:`release`)."""
    with _lock:
        _holders.add(id(holder))
        if torch.from_numpy is not from_numpy:
            torch.from_numpy = from_numpy
        if _TENSOR.__dict__.get("__new__") is not __new__:
            _TENSOR.__new__ = __new__  # type: ignore[method-assign,assignment]


def release(holder: object) -> None:
    """Forget ``holder``; restore torch when no holder is left (again is safe)."""
    with _lock:
        _holders.discard(id(holder))
        if _holders:
            return
        if _TENSOR.__dict__.get("__new__") is __new__:
            del _TENSOR.__new__
        if torch.from_numpy is from_numpy:
            torch.from_numpy = _FROM_NUMPY
