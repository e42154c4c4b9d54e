"""No silent typos: what names nothing says so, with the names closest to it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from model_zoo import mlp

import tracelake as tl


def test_a_selector_that_matched_nothing_warns_with_the_names_that_ran(tmp_path: Path) -> None:
    model, (x,) = mlp()
    with pytest.warns(tl.TraceLakeWarning, match=r"tl\.func\('reul'\).*did you mean 'relu'"):
        log = tl.trace(model, x, save=tl.func("reul"))
    assert not any(op.saved for op in log)
    with pytest.warns(tl.TraceLakeWarning, match=r"tl\.in_module\('9'\) matched nothing"):
        tl.trace(model, x, save=tl.in_module("9") | tl.func("relu"))
    with pytest.warns(tl.TraceLakeWarning, match=r"tl\.label\('relu_1_3'\).*'relu_1_2'"):
        tl.trace(model, x, save=tl.label("relu_1_3"))
    store = tl.open(tmp_path / "s")
    with pytest.warns(tl.TraceLakeWarning, match=r"tl\.func\('linaer'\).*did you mean 'linear'"):
        store.record(model, x, name="a", save=tl.func("relu", "linaer"))
    with warnings.catch_warnings():  # names that all ran: nothing to say
        warnings.simplefilter("error")
        tl.trace(model, x, save=tl.func("relu") & tl.in_module("1") | tl.module("0"))
        store.record(model, x, name="b", save=tl.func("linear"))


def test_a_run_name_written_in_a_query_that_names_no_run_raises(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s")
    with torch.no_grad():
        store.record(model, x, name="base")
        store.record(model, x, name="finetuned")
    with pytest.raises(tl.RunNotFoundError, match="did you mean 'base'"):
        store.query("select label from ops where run = 'bsae'")
    with pytest.raises(tl.RunNotFoundError, match="did you mean 'finetuned'"):
        store.query("select label from ops where run in ('base', 'finetund')")
    # bound as a parameter, an unknown name is a value like any other: it matches nothing
    assert len(store.query("select label from ops where run = :r", r="other")) == 0
    assert len(store.query("select label from ops where run = 'base'")) == 7


def test_a_meta_key_no_run_has_warns(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s")
    with torch.no_grad():
        store.record(model, x, name="a", meta={"variant": "x", "opt": {"lr": 0.1}})
    with pytest.warns(tl.TraceLakeWarning, match=r"meta\.variantt.*did you mean 'variant'"):
        assert len(store.query("select name from runs where meta.variantt = 'x'")) == 0
    with pytest.warns(tl.TraceLakeWarning, match=r"meta\.opt\.lrr.*did you mean 'lr'"):
        store.query("select name from runs where meta.opt.lrr > 0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(store.query("select name, meta.opt.lr from runs where meta.variant = 'x'")) == 1


def test_opening_a_path_that_is_no_store(tmp_path: Path) -> None:
    with pytest.raises(tl.StoreNotFoundError, match="no tracelake store"):
        tl.open(tmp_path / "errz.tl", create=False)
    assert not (tmp_path / "errz.tl").exists()
    with pytest.warns(tl.TraceLakeWarning, match="created a new, empty store"):
        tl.open(tmp_path / "new.tl")
    with warnings.catch_warnings():  # opening it again: nothing new
        warnings.simplefilter("error")
        tl.open(tmp_path / "new.tl")


def test_a_failed_run_keeps_its_reason(tmp_path: Path) -> None:
    model, (x,) = mlp()
    store = tl.open(tmp_path / "s")
    with pytest.raises(RuntimeError), store.recording("oom", model):
        model(x)
        raise RuntimeError("CUDA out of memory (pretend)")
    runs = store.runs(all=True)
    row = runs[runs["name"] == "oom"].iloc[0]
    assert (
        row["status"] == "failed" and row["error"] == "RuntimeError: CUDA out of memory (pretend)"
    )
    assert "error" not in store.runs().columns  # complete runs have none
