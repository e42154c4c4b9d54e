"""The compiled hot path (recorder/_hot.c) records exactly what the Python recorder does.

Every model is recorded twice in one process, with ``compiled.ENABLED`` on and off, and
the two traces must agree on every row field, label, edge, module entry, saved tensor
(bitwise) and statistic. The models reach both paths: the common call the compiled code
records itself, and the calls it hands to Python (in-place writes, ``out=``, tensors in
lists, several outputs, non-tensor outputs, repeated module calls, errors).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import BUILDERS
from torch import nn

import tracelake as tl
from tracelake.recorder import compiled, intercept
from tracelake.recorder.entries import SITE, ModuleEntry, OpTable
from tracelake.recorder.labels import Labeller

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("TRACELAKE_PURE_PYTHON")), reason="the compiled path is turned off"
)


class Mixed(nn.Module):
    """One of every kind of call the two paths split between them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.fc(x)  # common call, inside a module
        h = h @ self.w + self.scale  # parameter and buffer arguments
        h = torch.add(h, other=bias, alpha=2)  # a tensor keyword argument
        h = F.layer_norm(h, (8,), weight=self.scale)  # keyword parameter
        a, b = h.chunk(2, dim=-1)  # several outputs
        h = torch.cat([a, b, a], dim=-1)[:, :8]  # tensors inside a list
        values, idx = torch.max(h, dim=0)  # a named tuple of outputs
        n = h.size(0) + h.dim()  # no tensor out: not ops
        h = h * n
        h.add_(1)  # in place
        F.relu(h, inplace=True)  # inplace=True
        out = torch.zeros_like(h)
        torch.mul(h, 2, out=out)  # out=
        out[0] = values  # setitem
        for _ in range(3):  # repeated module calls
            out = self.block(out) + out
        g = torch.where(out > 0, out, bias)  # three arguments, two parents
        g = g.sum(-1, keepdim=True).expand(-1, 8).contiguous()
        return g, idx, torch.stack([g, out])


def _mixed() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Mixed().eval(), (torch.randn(4, 8), torch.randn(4, 8))


class Chain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(40):
            x = torch.sin(torch.relu(x * 0.5 + 1))
        return x


def _chain() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Chain(), (torch.randn(3, 3),)


class Arguments(nn.Module):
    """Non-tensor arguments of every kind the two paths keep (the rows' arg_values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            x = (x * 0.5 + i).clamp(min=-1.0, max=float(i + 1))  # scalars, keywords
        y = x.to(torch.float64).to(x.device).view(x.shape).view(-1, x.shape[-1])  # Size
        y = y.permute(1, 0).permute([1, 0]).sum(dim=[0], keepdim=True)  # tuple, list
        y = y.view((1, -1)).flip((0,)) + torch.layer_norm(y, (y.shape[-1],), eps=1e-5)
        y = y.reshape((1, -1, 1)).squeeze((2,))  # tuples of plain values
        e = torch.tensor([], dtype=torch.float64)  # an empty list
        z = torch.where(y > 0, y, 0.0)[..., :] + torch.cat([y, e.view(0, y.shape[1])])
        return z.float() * np.float32(2.0)  # an object the compiled path hands over


def _arguments() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Arguments(), (torch.randn(3, 4),)


MODELS = {**BUILDERS, "mixed": _mixed, "chain": _chain, "arguments": _arguments}


def _record(monkeypatch: pytest.MonkeyPatch, enabled: bool, build, **options) -> tl.Trace:
    monkeypatch.setattr(compiled, "ENABLED", enabled)
    model, args = build()
    with torch.no_grad():
        return tl.trace(model, *args, **options)


def _same_stats(a, b) -> bool:
    if a is None or b is None:
        return a is b
    for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True):
        if not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
            return False
    return True


def _assert_same(fast: tl.Trace, slow: tl.Trace) -> None:
    assert fast.labels == slow.labels
    rows_fast, rows_slow = fast._table.rows, slow._table.rows
    assert len(rows_fast) == len(rows_slow)
    for i, (r, s) in enumerate(zip(rows_fast, rows_slow, strict=True)):
        assert r == s, f"row {i} ({fast.labels[i]}) differs:\n{r}\n{s}"
        assert (r[SITE] is None) == (s[SITE] is None)
    assert fast._table.passes == slow._table.passes
    for e, f in zip(fast, slow, strict=True):
        assert (e.label, e.parents, e.children, str(e.source), e.module, e.modules) == (
            f.label,
            f.parents,
            f.children,
            str(f.source),
            f.module,
            f.modules,
        )
        if f.out is None:
            assert e.out is None
        else:
            assert e.out is not None and e.out.dtype == f.out.dtype
            assert torch.equal(e.out, f.out) or torch.equal(e.out.isnan(), f.out.isnan())
        assert _same_stats(e.stats, f.stats), (e.label, e.stats, f.stats)
    assert [_module_fields(m) for m in fast.modules] == [_module_fields(m) for m in slow.modules]


def _module_fields(entry: ModuleEntry) -> tuple:
    """A module entry's fields, but for the objects it points at (its tensors' source)."""
    return tuple(
        getattr(entry, f.name)
        for f in dataclasses.fields(entry)
        if f.name not in ("tensor_source", "structure")
    )


def test_extension_is_built() -> None:
    """CI and `make setup` compile recorder/_hot.c; a silent fallback would hide it."""
    assert compiled.AVAILABLE, "tracelake.recorder._hot did not build; see pip's output"


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "options",
    [{"save": tl.none()}, {"save": tl.all(), "stats": "all"}],
    ids=["metadata", "save-all"],
)
def test_same_trace_both_paths(monkeypatch: pytest.MonkeyPatch, name: str, options: dict) -> None:
    # Python first: it names every function, so the compiled run takes its own path for
    # every common call (a function's first call ever goes through Python).
    slow = _record(monkeypatch, False, MODELS[name], **options)
    fast = _record(monkeypatch, True, MODELS[name], **options)
    _assert_same(fast, slow)


def test_selective_save_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    save = tl.func("linear", "relu") | tl.in_module("block")
    slow = _record(monkeypatch, False, _mixed, save=save)
    fast = _record(monkeypatch, True, _mixed, save=save)
    _assert_same(fast, slow)
    assert any(e.out is not None for e in fast) and any(e.out is None for e in fast)


def test_common_calls_do_not_reach_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled path is really taken: the Python mode sees only what it must."""
    seen: list[str] = []
    python_mode = intercept._Mode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        seen.append(intercept.func_name(func))
        return python_mode(self, func, types, args, kwargs)

    monkeypatch.setattr(intercept._Mode, "__torch_function__", counting)
    log = _record(monkeypatch, True, MODELS["chain"], save=tl.none())
    assert len(log) == 162
    assert len(seen) < 10, seen  # at most the first call of each function
    seen.clear()
    _record(monkeypatch, False, MODELS["chain"], save=tl.none())
    assert len(seen) == 160
    # a tuple of plain values is kept by the compiled path too (x.view((b, -1)))
    _record(monkeypatch, True, MODELS["arguments"], save=tl.none())
    seen.clear()
    _record(monkeypatch, True, MODELS["arguments"], save=tl.none())
    assert not {"flip", "reshape", "squeeze", "getitem"} & set(seen), seen  # ([..., :] too)


def test_common_module_calls_do_not_reach_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module call's entry is made by the compiled path (ModuleEvents), keyword
    arguments too; Python's methods see only what they must: an output handed back from
    the call's inputs (its identity op), an output in a dict."""
    seen: list[str] = []
    enter, leave = Labeller.on_module_enter, Labeller.on_module_exit

    def entering(self, module, args, kwargs=None):  # type: ignore[no-untyped-def]
        seen.append(f"enter {type(module).__name__}")
        return enter(self, module, args, kwargs)

    def leaving(self, module, output):  # type: ignore[no-untyped-def]
        seen.append(f"exit {type(module).__name__}")
        return leave(self, module, output)

    monkeypatch.setattr(Labeller, "on_module_enter", entering)
    monkeypatch.setattr(Labeller, "on_module_exit", leaving)

    class Keywords(nn.Module):
        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict:
            return {"y": x * scale}

    class HandBack(nn.Module):  # returns a keyword argument: an identity op inside it
        def forward(self, x: torch.Tensor, *, other: torch.Tensor, flag: bool) -> torch.Tensor:
            return other if flag else x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
            self.skip = nn.Identity()
            self.keywords = Keywords()
            self.hand_back = HandBack()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.keywords(self.skip(self.body(x)), scale=x)["y"]
            return self.hand_back(x, other=y + 1, flag=True)

    fast = _record(monkeypatch, True, lambda: (Model(), (torch.randn(2, 4),)), save=tl.none())
    assert sorted(seen) == ["exit HandBack", "exit Identity", "exit Keywords"], seen
    seen.clear()
    slow = _record(monkeypatch, False, lambda: (Model(), (torch.randn(2, 4),)), save=tl.none())
    assert len(seen) == 2 * 8  # (the model itself too, which is not one of its modules)
    assert "identity" in [e.func for e in fast]
    _assert_same(fast, slow)


#: Where a type object keeps ``tp_getattr`` (CPython 3.11+, 64-bit, release build: eight
#: pointer-sized fields before it), the char * look-up torch's C++ uses where a type has
#: one (torch/csrc/utils/python_strings.h: ``PyObject_FastGetAttrString``).
_TP_GETATTR = 8 * ctypes.sizeof(ctypes.c_void_p)
_GETATTR = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object, ctypes.c_char_p)


def _c_getattr(type_: type, obj: object, name: str) -> object:
    """``type_``'s tp_getattr called on ``obj``, as torch calls it."""
    slot = ctypes.c_void_p.from_address(id(type_) + _TP_GETATTR).value
    assert slot, f"{type_.__name__} has no tp_getattr"
    return _GETATTR(slot)(obj, name.encode())


def test_torch_lookups_answer_as_python_does() -> None:
    """For every call, torch looks up the mode's ``__torch_function__``, then that bound
    method's ``__self__``, by name as char *. The compiled mode answers both from one
    object it keeps (no look-up of a new str, no bound method made); any other name, and
    a subclass that defines its own ``__torch_function__``, as Python's look-up does."""
    hot = compiled.hot()
    seen: list[object] = []

    class Grab(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.extend(torch.overrides._get_current_function_mode_stack())
            return torch.relu(x) + 1

    tl.trace(Grab(), torch.randn(3)).cleanup()
    (mode,) = seen
    assert isinstance(mode, hot.Fused)
    kind = type(mode)
    call = _c_getattr(kind, mode, "__torch_function__")
    assert call is _c_getattr(kind, mode, "__torch_function__")  # kept, not made again
    assert _c_getattr(type(call), call, "__self__") is mode and call.__self__ is mode
    assert callable(call)
    assert _c_getattr(kind, mode, "_funcs") is mode._funcs
    with pytest.raises(AttributeError):
        _c_getattr(kind, mode, "no_such_attribute")

    class Own(hot.Fused):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return "own"

    own = Own()
    found = _c_getattr(hot.Fused, own, "__torch_function__")
    assert found.__func__ is Own.__torch_function__ and found.__self__ is own


def test_forward_that_raises_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(x + 1)
            return x @ torch.ones(5, 5)  # shapes do not match

    for enabled in (True, False):
        monkeypatch.setattr(compiled, "ENABLED", enabled)
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            tl.trace(Fails(), torch.randn(2, 3))
        assert not intercept._get_current_function_mode_stack()
        y = torch.relu(torch.randn(2) + 1)  # nothing left recording
        assert y.shape == (2,)


def test_recording_error_is_a_warning_in_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside the recorder is reported, and the forward goes on unchanged."""

    class Broken:
        wants_ops = True

        def on_entry(self, index: int, tensor: torch.Tensor, same_as: int) -> None:
            raise ValueError("emitter broke")

    for enabled in (True, False):
        monkeypatch.setattr(compiled, "ENABLED", enabled)
        model, (x,) = MODELS["chain"]()
        labeller = Labeller(model, Broken(), OpTable())  # type: ignore[arg-type]
        warnings_seen: list[str] = []

        def on_error(what: str, exc: BaseException, seen: list[str] = warnings_seen) -> None:
            seen.append(f"{what}: {exc}")

        with intercept.Interceptor(labeller, on_error):
            y = model(x)
        assert torch.equal(y, model(x))
        assert warnings_seen and all(w.endswith("emitter broke") for w in warnings_seen)


_FIELD = st.one_of(
    st.integers(-3, 300),
    st.floats(allow_nan=True),
    st.sampled_from(["add", "mul", ""]),
    st.none(),
    st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
_ROWS = st.lists(
    st.one_of(st.tuples(_FIELD, _FIELD, _FIELD), st.tuples(_FIELD), _FIELD), max_size=6
)


def _fresh(value: object) -> object:
    """An equal value made of new objects."""
    if isinstance(value, tuple):
        return tuple([_fresh(v) for v in value])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value)(repr(value)) if isinstance(value, float) else int(str(value))
    return value


@settings(max_examples=300, deadline=None)
@given(_ROWS, _ROWS, st.booleans())
def test_same_rows_is_tuple_equality(a: list, b: list, copy: bool) -> None:
    """``_hot.same_rows`` (OpTable.finish's graph-seen-before check) answers exactly what
    ``==`` on the two tuples answers: for equal rows rebuilt from new objects, rows that
    differ in a field or a length, and NaN fields (equal to themselves by identity only)."""
    hot = compiled.hot()
    assert hot is not None
    first = tuple(a)
    # copy: the same rows rebuilt field by field (equal values, other objects; a NaN
    # rebuilt is another NaN, unequal)
    second = tuple(_fresh(r) for r in a) if copy else tuple(b)
    assert hot.same_rows(first, second) == (first == second)
    assert hot.same_rows(first, first)


def _count_python_entries(monkeypatch: pytest.MonkeyPatch, emitter: type) -> list[int]:
    """The op entries ``emitter``'s Python ``on_entry`` is handed from now on (what a
    compiled entry passes over to it)."""
    python_entry = emitter.on_entry  # type: ignore[attr-defined]
    handed: list[int] = []

    def counting(self, index, tensor, same_as):  # type: ignore[no-untyped-def]
        handed.append(index)
        return python_entry(self, index, tensor, same_as)

    monkeypatch.setattr(emitter, "on_entry", counting)
    return handed


class Packs(nn.Module):
    """Outputs of every kind a save-all recording packs, for the compiled ``on_entry``
    (``_hot.Packer``) and the Python one to agree on: small tensors of plain dtypes (the
    compiled path), others it hands over (bool's first use, a conjugate or negative view,
    complex, a strided view, an empty tensor, a mid-size tensor, a chunk-sized one), and
    enough small ones to fill the 4 MiB open chunk of their pack and start another."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        for dtype in (torch.float64, torch.int64, torch.uint8, torch.float16, torch.bfloat16):
            h = h + (x.to(dtype) * 3).float()
        flags = (h > 0) & (x < 1)  # bool
        h = torch.where(flags, h, -h)
        z = torch.complex(h, x)  # complex: not a plain byte copy
        h = h + z.conj().imag + torch._neg_view(h).clone()  # conj and neg views
        h = h + h.t().t() + h[:, ::2].sum()  # strided views
        h = h + (x[:0] * 2).sum()  # an empty output
        big = torch.ones(256, 256).mul(h.mean())  # mid-size: 256 KiB
        h = h + big.mean() + torch.ones(1024, 1024).mul(2).mean()  # 4 MiB: its own array
        for _ in range(300):  # 300 x 16 KiB past the open chunk's 4 MiB
            h = (torch.ones(64, 64) * h.mean()).mean() + h
        return h


def _packs() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Packs(), (torch.randn(6, 6),)


def _tensor_files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted((run_dir / "tensors").rglob("*"))
        if path.is_file()
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", ["packs", "mixed", "chain", "arguments", "mlp", "cnn"])
def test_same_store_both_paths(
    monkeypatch: pytest.MonkeyPatch, tmp_path, name: str, inference: bool
) -> None:
    """A save-all recording of three steps stores the same bytes, tensor table and values
    with the compiled ``on_entry`` (``_hot.Packer``) as with the Python one, and the
    compiled one really saves the common small tensor itself."""
    build = {**MODELS, "packs": _packs}[name]
    from tracelake.store.writer import StoreEmitter

    handed = _count_python_entries(monkeypatch, StoreEmitter)
    stored = {}
    for enabled, where in ((False, "python"), (True, "compiled")):
        monkeypatch.setattr(compiled, "ENABLED", enabled)
        handed.clear()
        store = tl.open(tmp_path / where)
        model, args = build()
        mode = torch.inference_mode() if inference else torch.no_grad()
        with mode, store.recording("r", model):
            for _ in range(3):
                model(*args)
        run = store["r"]
        stored[where] = (
            store.sql("select * exclude (run_id) from tensors order by slot"),
            [(op.label, op.out) for step in run.steps for op in step.ops],
            len(handed),
            _tensor_files(tmp_path / where / "runs" / f"{run.id:08d}"),
        )
    (table, outs, python_calls, files), (table_c, outs_c, compiled_calls, files_c) = (
        stored["python"],
        stored["compiled"],
    )
    # the same files, byte for byte (the padding between packed tensors zeroed by both:
    # never what a reused buffer held, another run's bytes), the tensors where they were
    # (array, byte offset, nbytes, shape, dtype, step), each op's value read back
    assert files.keys() == files_c.keys() and files
    for name in files:
        assert files[name] == files_c[name], name
    assert table.equals(table_c)
    assert len(outs) == len(outs_c) and any(out is not None for _, out in outs)
    for (label, out), (label_c, out_c) in zip(outs, outs_c, strict=True):
        assert label == label_c
        assert (out is None) == (out_c is None)
        if out is not None:
            assert out.dtype == out_c.dtype and out.shape == out_c.shape
            assert _bits(out).equal(_bits(out_c)), label
    if not inference:  # (an inference tensor tracks no version: Python saves it)
        assert compiled_calls < python_calls / 4, (compiled_calls, python_calls)


class Reductions(nn.Module):
    """Outputs of every kind ``stats="all"`` reduces, for the compiled ``on_entry``
    (``_hot.Reducer``) and the Python one to agree on: large float32 tensors, contiguous
    or in rows (the compiled path), views of one reduced before (the same statistics,
    found), the same memory after an in-place write (reduced again), the allocator
    handing a dead tensor's memory to a new one, and what it hands over: a mean that
    dwarfs the spread, a constant, NaN and Inf, float64, a tensor small enough to gather."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # (64, 256) float32: 64 KiB, past the gatherer's 16 KiB
        total = h.view(256, 64).sum() + h.reshape(-1).sum()  # views: found
        h.add_(1)  # written in place: its layout again, at a new version
        total = total + h.view(-1).sum() + h.t().sum() + h[:, ::2].sum()  # strided views
        total = total + (h.t() * 1.5).sum() + h[:, 8:200].sum()  # new strided, a slice
        for k in range(3):  # each product dies at once: its memory comes back
            total = total + (h * (0.5 + k)).mean()
        shifted = h + 1e4  # the mean dwarfs the spread: a second pass (Python)
        const = torch.full_like(h, 3.0) * 1  # no spread at all
        zeros = torch.zeros_like(h) + 0  # all zeros
        odd = torch.sqrt(h) + 1 / (h - h[0, 0])  # NaN, Inf: counted (Python)
        wide = h.double() * 2  # float64 (Python)
        small = x[:4] * 3  # 4 KiB: gathered
        total = total + shifted.sum() + const.sum() + zeros.sum() + odd.nansum()
        return total + wide.sum().float() + small.sum()


def _reductions() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Reductions(), (torch.randn(64, 256),)


def _stat_bits(stats) -> bytes | None:  # type: ignore[no-untyped-def]
    if stats is None:
        return None
    return np.array([math.nan if v is None else v for v in dataclasses.astuple(stats)]).tobytes()


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_same_statistics_both_paths(monkeypatch: pytest.MonkeyPatch, tmp_path, inference) -> None:
    """``stats="all"`` with nothing saved gives every op the same statistics, to the bit,
    with the compiled ``on_entry`` (``_hot.Reducer``) as with the Python one (the same
    compiled pass under both), in a trace and in a store; and the compiled one really
    reduces the large float32 tensors itself (an inference tensor has no version to
    check a view by: Python takes it)."""
    from tracelake.recorder.emit import SelectingEmitter

    hot = compiled.hot()
    assert hot is not None and hasattr(hot, "Reducer"), "the extension is missing"
    handed = _count_python_entries(monkeypatch, SelectingEmitter)
    got = {}
    for with_reducer in (False, True):
        if with_reducer:
            monkeypatch.undo()  # (the Reducer back)
            handed = _count_python_entries(monkeypatch, SelectingEmitter)
        else:
            monkeypatch.delattr(hot, "Reducer")
        handed.clear()
        model, args = _reductions()
        mode = torch.inference_mode() if inference else torch.no_grad()
        with mode:
            trace = tl.trace(model, *args, save=tl.none(), stats="all")
        store = tl.open(tmp_path / str(with_reducer))
        with mode, store.recording("r", model, save=tl.none(), stats="all"):
            model(*args)
        stored = store.sql(
            "select label, mean, std, min, max, absmax, l2, frac_zero, nan_count, inf_count "
            "from ops order by idx"
        )
        got[with_reducer] = (trace, len(handed), stored)
    (slow, python_calls, stored), (fast, compiled_calls, stored_c) = got[False], got[True]
    _assert_same(fast, slow)
    for e, f in zip(fast, slow, strict=True):
        assert _stat_bits(e.stats) == _stat_bits(f.stats), (e.label, e.stats, f.stats)
    assert stored.equals(stored_c)
    assert any(e.stats is not None and e.stats.nan_count > 0 for e in fast)
    if not inference:
        assert compiled_calls <= python_calls - 10, (compiled_calls, python_calls)


def test_an_interrupt_inside_the_compiled_statistics_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt raised in Python code the compiled ``on_entry`` calls (the
    ``Stats`` it makes: a signal is handled there) reaches the user, as the Python
    path's would: the compiled entry hands over what fails, but never an interrupt."""
    from tracelake.recorder import emit

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(emit, "Stats", interrupted)  # (what the Reducer is given)
    model, args = _reductions()
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        tl.trace(model, *args, save=tl.none(), stats="all")
