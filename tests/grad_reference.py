"""Gradients as plain PyTorch hooks see them: the reference backward capture is compared
with, bit for bit. A ``TorchFunctionMode`` registers ``tensor.register_hook`` on every
tensor each torch call returns (one list per call, in call order), and
``register_full_backward_hook`` on every named submodule gives each module's
``grad_output``."""

from __future__ import annotations

from types import FunctionType
from typing import Any

import torch
from hook_capture import flatten
from torch.overrides import TorchFunctionMode

from tracelake.recorder.intercept import body_of

__all__ = ["GradHookMode", "module_grad_outputs"]


class GradHookMode(TorchFunctionMode):
    """``calls``: one entry per torch call that returned tensors: its name and, per
    returned tensor, the list of gradients its tensor hook received."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[list[torch.Tensor]]]] = []
        self._opening: list[Any] = []
        self._made: set[int] = set()  # id() of the tensors calls returned

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # A torch function written in Python (F.normalize, Tensor.__contains__) is
        # opened, as the recorder opens it (TorchLens's granularity): the calls in its
        # body are the calls, and it is one itself only where none of them made its
        # output.
        body = (
            body_of(func)
            if isinstance(func, FunctionType)
            and (func.__module__ or "").startswith("torch")
            and func not in self._opening
            else None
        )
        opened = body is not None
        if opened:
            self._opening.append(func)
            torch._C._push_on_torch_function_stack(self)
            try:
                out = body(*args, **(kwargs or {}))
            finally:
                torch._C._pop_torch_function_stack()
                self._opening.pop()
        else:
            out = func(*args, **(kwargs or {}))
        if out is None and func is torch.Tensor.__setitem__:
            tensors = [args[0]]
        elif isinstance(out, (torch.Tensor, tuple, list)):
            tensors = flatten(out)
        else:
            return out
        if not tensors or (opened and all(id(t) in self._made for t in tensors)):
            return out
        self._made.update(id(t) for t in tensors)
        seen: list[list[torch.Tensor]] = []
        for tensor in tensors:
            got: list[torch.Tensor] = []
            seen.append(got)
            if tensor.requires_grad:
                tensor.register_hook(got.append)
        self.calls.append((getattr(func, "__name__", str(func)), seen))
        return out


def module_grad_outputs(
    model: torch.nn.Module, run: Any
) -> dict[str, list[tuple[torch.Tensor | None, ...]]]:
    """``run()`` (a forward and backward) with a full backward hook on every named
    submodule; each module path -> the ``grad_output`` tuples its hook received."""
    got: dict[str, list[tuple[torch.Tensor | None, ...]]] = {}
    handles = []
    for path, module in model.named_modules():
        if not path:
            continue

        def hook(module: Any, grad_input: Any, grad_output: Any, path: str = path) -> None:
            got.setdefault(path, []).append(tuple(grad_output))

        handles.append(module.register_full_backward_hook(hook))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return got
