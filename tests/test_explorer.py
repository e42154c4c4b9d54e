"""The web explorer (issue 14, item 7), in a real browser.

A store is recorded from the demo model (runs that differ in input, one whose head was
changed, one with a hostile name, meta and module name); ``tracelake serve`` serves it
from a subprocess on a free port; headless Chromium from the OS packages, driven by
Selenium through the OS's chromedriver, clicks through every view: the runs list, a
run's op table and its filter, an op with its statistics, parents, children, heatmap
and histogram, the op graph, and a comparison with its first divergence. The numbers
the pages show are checked against the store, and each view is saved as a screenshot
under ``test-artifacts/explorer/`` (git-ignored). ``.ci/run`` installs Chromium and
chromedriver: where they are missing these tests fail, they do not skip.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from browser import chromium
from png import png_pixels
from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait
from torch import nn

import tracelake as tl
from tracelake.demo import DemoNet, demo_inputs

HOSTILE = "<img src=x onerror=alert(1)>\"'&amp; run"
HOSTILE_META = {"note": "<script>document.title='pwned'</script>", "<b>key</b>": "&lt;"}
HOSTILE_MODULE = "<i>evil</i>"


def g6(value: Any) -> str:
    return f"{value:.6g}"  # how the pages show a float


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("explorer") / "runs.tl"
    store = tl.open(path)
    model = DemoNet().eval()
    with torch.no_grad():
        store.record(model, demo_inputs(), name="base", meta={"prompt": "Paris", "lr": 0.1})
        store.record(model, (demo_inputs() + 7) % 50, name="other", meta={"prompt": "Rome"})
        model.head.weight[0, 0] += 0.25  # the run differs from "base" from the head on
        store.record(model, demo_inputs(), name="tweaked", meta={"prompt": "Paris"})
        with store.recording("steps", model, save=tl.func("linear"), meta={"steps": 2}):
            model(demo_inputs())
            model(demo_inputs(seq=5))  # a shorter second step
        hostile = nn.Sequential(
            OrderedDict([(HOSTILE_MODULE, nn.Linear(4, 4)), ("act", nn.ReLU())])
        )
        store.record(hostile, torch.randn(3, 4), name=HOSTILE, meta=HOSTILE_META)
    store.close()
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def server(store_path: Path) -> Iterator[str]:
    """``tracelake serve STORE --port P`` in a subprocess; its base URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracelake.cli", "serve", str(store_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"tracelake serve exited: {proc.stdout and proc.stdout.read()}"
                )
            try:
                with urllib.request.urlopen(url + "/", timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
    assert proc.stdout is not None
    assert f"http://127.0.0.1:{port}/" in proc.stdout.read()  # it said where it serves


def test_serve_on_a_port_in_use_says_so_and_gives_no_url(store_path: Path) -> None:
    """``tracelake serve`` printed its URL before finding the port taken: a link to
    someone else's server, then the error. Now only the error, and a failed exit."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tracelake.cli", "serve", str(store_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert "pick another --port" in done.stderr
    assert "http://" not in done.stdout


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    try:
        driver = chromium()
    except RuntimeError as exc:  # fail, never skip: CI installs them
        pytest.fail(str(exc))
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def artifacts(pytestconfig: pytest.Config) -> Path:
    path = Path(pytestconfig.rootpath) / "test-artifacts" / "explorer"
    path.mkdir(parents=True, exist_ok=True)
    return path


def shot(driver: WebDriver, artifacts: Path, name: str) -> None:
    target = artifacts / f"{name}.png"
    driver.save_screenshot(str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def go(driver: WebDriver, element: WebElement) -> None:
    """Click ``element`` and wait for the page it leads to (a click returns before the
    next page has replaced this one)."""
    old = driver.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(driver, 60).until(lambda _: _replaced(old))
    driver.find_element(By.ID, "timing")  # the last element of every page


def _replaced(old: WebElement) -> bool:
    """Whether the page ``old`` belongs to is gone. (Selenium's ``staleness_of``, except
    that chromedriver may report a node of the old page as an inspector error, "does not
    belong to the document", rather than as a stale element, when the page is replaced
    while it asks.)"""
    try:
        old.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


def texts(driver: WebDriver, css: str) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def no_alert(driver: WebDriver) -> None:
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert  # noqa: B018


def test_runs_list(server: str, browser: WebDriver, store_path: Path, artifacts: Path) -> None:
    store = tl.open(store_path, create=False)
    browser.get(server + "/")
    shot(browser, artifacts, "runs")
    runs = store.runs()
    assert texts(browser, "tr.run td.name") == runs["name"].tolist()
    assert [int(t) for t in texts(browser, "tr.run td.ops")] == runs["ops"].tolist()
    assert [int(t) for t in texts(browser, "tr.run td.steps")] == runs["steps"].tolist()
    shown_meta = [json.loads(t) for t in texts(browser, "tr.run td.meta")]
    assert shown_meta == runs["meta"].tolist()
    assert runs["torch_version"][0] in browser.find_element(By.ID, "runs").text
    assert browser.find_element(By.ID, "total").text == str(len(store))

    # filtered with the query language
    box = browser.find_element(By.ID, "where")
    box.send_keys("meta.prompt = 'Paris'")
    go(browser, browser.find_element(By.ID, "filter"))
    want = [r["name"] for r in store.query("select name from runs where meta.prompt = 'Paris'")]
    assert texts(browser, "tr.run td.name") == want == ["base", "tweaked"]
    shot(browser, artifacts, "runs-filtered")

    # a mistake is shown with the caret, no rows
    box = browser.find_element(By.ID, "where")
    box.clear()
    box.send_keys("meta.prompt lik 'P%'")
    go(browser, browser.find_element(By.ID, "filter"))
    error = browser.find_element(By.ID, "query-error").text
    assert "Unexpected" in error and "^" in error
    assert texts(browser, "tr.run") == []


def test_run_ops_filter_and_op_detail(
    server: str, browser: WebDriver, store_path: Path, artifacts: Path
) -> None:
    store = tl.open(store_path, create=False)
    run = store["base"]
    browser.get(server + "/")
    go(browser, browser.find_element(By.LINK_TEXT, "base"))
    assert browser.find_element(By.ID, "run-name").text == "base"
    assert browser.find_element(By.ID, "op-count").text == str(len(run))
    assert json.loads(browser.find_element(By.ID, "meta").text) == run.meta
    shot(browser, artifacts, "run")
    assert texts(browser, "tr.op td.label") == run.labels
    for label, mean, absmax in zip(
        texts(browser, "tr.op td.label"),
        texts(browser, "tr.op td.mean"),
        texts(browser, "tr.op td.absmax"),
        strict=True,
    ):
        stats = run[label].stats
        assert stats is not None
        assert (mean, absmax) == (g6(stats.mean), g6(stats.absmax))

    # the filter: a condition of the query language, the run's rows only
    box = browser.find_element(By.ID, "where")
    box.send_keys("func = 'linear' and absmax > 1")
    go(browser, browser.find_element(By.ID, "filter"))
    want = [
        r["label"]
        for r in store.query(
            "select label from ops where run = 'base' and func = 'linear' and absmax > 1 "
            "order by idx"
        )
    ]
    assert want and texts(browser, "tr.op td.label") == want
    shot(browser, artifacts, "run-filtered")
    for attempt, message in (
        ("fnuc = 'linear'", "did you mean 'func'?"),
        ("func = 'relu') or (true", "Unexpected"),  # cannot escape its parentheses
        ("func = 'relu' order by idx", "one condition"),
    ):
        box = browser.find_element(By.ID, "where")
        box.clear()
        box.send_keys(attempt)
        go(browser, browser.find_element(By.ID, "filter"))
        assert message in browser.find_element(By.ID, "query-error").text
        assert texts(browser, "tr.op") == []
    shot(browser, artifacts, "run-query-error")

    # an op: its statistics, source, parents, children, tensor
    box = browser.find_element(By.ID, "where")
    box.clear()
    box.send_keys("func = 'relu'")
    go(browser, browser.find_element(By.ID, "filter"))
    (label,) = texts(browser, "tr.op td.label")
    go(browser, browser.find_element(By.LINK_TEXT, label))
    op = run[label]
    assert browser.find_element(By.ID, "label").text == label
    assert browser.find_element(By.ID, "func").text == "relu"
    for name in ("mean", "std", "min", "max", "absmax", "l2"):
        shown = browser.find_element(By.ID, f"stat-{name}").text
        assert shown == g6(getattr(op.stats, name)), name
    assert op.source is not None
    source = browser.find_element(By.ID, "source").text
    assert source == f"{op.source.file}:{op.source.line} in {op.source.function}"
    assert [t.split(" (")[0] for t in texts(browser, "#parents li")] == list(op.parents)
    assert [t.split(" (")[0] for t in texts(browser, "#children li")] == list(op.children)
    check_tensor_view(browser, op.out)
    shot(browser, artifacts, "op")

    # a parent, by its link; a 3-D tensor sliced at another leading index
    parent = op.parents[0]
    go(browser, browser.find_element(By.CSS_SELECTOR, "#parents a"))
    assert browser.find_element(By.ID, "label").text == parent
    assert label in texts(browser, "#children li")[0]
    at = browser.find_element(By.ID, "at")
    at.clear()
    at.send_keys("1")
    go(browser, browser.find_element(By.ID, "slice"))
    tensor = run[parent].out
    assert tensor is not None and tensor.ndim == 3
    check_tensor_view(browser, tensor, heatmap=tensor[1])
    shot(browser, artifacts, "op-slice")


def check_tensor_view(
    browser: WebDriver, tensor: torch.Tensor | None, heatmap: torch.Tensor | None = None
) -> None:
    """The histogram's bars count the tensor's values as numpy does; the heatmap shows
    the slice: red where positive, blue where negative."""
    assert tensor is not None
    values = tensor.double().numpy().reshape(-1)
    counts, edges = np.histogram(values, bins=40)
    bars = browser.find_elements(By.CSS_SELECTOR, "#histogram rect.bin")
    assert [int(b.get_attribute("data-count") or -1) for b in bars] == counts.tolist()
    assert float(bars[0].get_attribute("data-lo") or "nan") == edges[0]
    assert float(bars[-1].get_attribute("data-hi") or "nan") == edges[-1]
    assert browser.find_element(By.ID, "histogram").get_attribute("data-numel") == str(values.size)
    if heatmap is None:  # by default the heatmap is the first 2-D slice
        heatmap = tensor[(0,) * (tensor.ndim - 2)] if tensor.ndim > 2 else tensor
    grid = heatmap.double().numpy()
    grid = grid.reshape(1, -1) if grid.ndim == 1 else grid
    img = browser.find_element(By.ID, "heatmap")
    assert int(img.get_attribute("data-rows") or 0) == grid.shape[0]
    assert int(img.get_attribute("data-cols") or 0) == grid.shape[1]
    assert int(img.get_property("naturalWidth") or 0) > 0  # the browser decoded it
    pixels = png_pixels(base64.b64decode((img.get_attribute("src") or ",").split(",", 1)[1]))
    scale = pixels.shape[0] // grid.shape[0]
    cells = pixels[::scale, ::scale].astype(int)
    red, blue = cells[..., 0], cells[..., 2]
    assert (red[grid > 0] >= blue[grid > 0]).all() and (red[grid < 0] <= blue[grid < 0]).all()
    m = np.abs(grid).max()
    assert (red[grid > 0.5 * m] > blue[grid > 0.5 * m]).all()


def test_graph(server: str, browser: WebDriver, store_path: Path, artifacts: Path) -> None:
    store = tl.open(store_path, create=False)
    run = store["base"]
    browser.get(server + "/")
    go(browser, browser.find_element(By.LINK_TEXT, "base"))
    go(browser, browser.find_element(By.ID, "graph-link"))
    shot(browser, artifacts, "graph")
    nodes = browser.find_elements(By.CSS_SELECTOR, "#graph a.node")
    assert [n.get_attribute("data-label") for n in nodes] == run.labels
    edges = sum(len(op.parents) for op in run)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#graph .edge")) == edges
    assert browser.find_element(By.ID, "edges").text == str(edges)
    relu = next(op.label for op in run if op.func == "relu")
    target = next(n for n in nodes if n.get_attribute("data-label") == relu)
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", target)
    go(browser, target.find_element(By.CSS_SELECTOR, "text"))
    assert browser.find_element(By.ID, "label").text == relu


def test_compare(server: str, browser: WebDriver, store_path: Path, artifacts: Path) -> None:
    store = tl.open(store_path, create=False)
    comparison = store.compare("base", "tweaked")
    first = comparison.first_divergence()
    assert first is not None and first["func"] == "linear" and first["module"] == "head"
    browser.get(server + "/")
    go(browser, browser.find_element(By.LINK_TEXT, "base"))
    Select(browser.find_element(By.ID, "compare-with")).select_by_visible_text("tweaked")
    go(browser, browser.find_element(By.ID, "compare"))
    shot(browser, artifacts, "compare")
    assert browser.find_element(By.ID, "first-key").text == first["key"]
    assert browser.find_element(By.ID, "first-max").text == g6(first["max_abs_diff"])
    shown = {
        e.get_attribute("data-status"): int(e.text.split()[0])
        for e in browser.find_elements(By.CSS_SELECTOR, "#summary .status")
    }
    assert shown == comparison.summary()
    highlighted = browser.find_elements(By.CSS_SELECTOR, "tr.pair.first")
    assert len(highlighted) == 1 and first["key"] in highlighted[0].text
    go(browser, browser.find_element(By.ID, "first-link"))
    assert browser.find_element(By.ID, "label").text == first["label_a"]

    # runs that differ from their input on: the first divergence is the input
    browser.get(server + "/compare?a=base&b=other")
    assert browser.find_element(By.ID, "first-key").text == "input_1"


def test_hostile_names_are_text(
    server: str, browser: WebDriver, store_path: Path, artifacts: Path
) -> None:
    browser.get(server + "/")
    no_alert(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "img[src='x'], main b, main i, script") == []
    assert HOSTILE in texts(browser, "tr.run td.name")
    assert browser.title != "pwned"
    row_meta = texts(browser, "tr.run td.meta")[-1]
    assert json.loads(row_meta) == HOSTILE_META
    go(browser, browser.find_element(By.LINK_TEXT, HOSTILE))
    no_alert(browser)
    assert browser.find_element(By.ID, "run-name").text == HOSTILE
    assert f"{HOSTILE_MODULE}" in texts(browser, "tr.op td")
    assert browser.find_elements(By.CSS_SELECTOR, "img[src='x'], main b, main i, script") == []
    shot(browser, artifacts, "hostile")
    go(browser, browser.find_element(By.ID, "graph-link"))
    no_alert(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "#graph a.node")
    browser.get(server + "/")
    go(browser, browser.find_element(By.LINK_TEXT, HOSTILE))
    go(browser, browser.find_element(By.CSS_SELECTOR, "tr.op td.label a"))
    assert browser.find_element(By.ID, "run-link").text == HOSTILE


def test_steps_and_unsaved_ops(
    server: str, browser: WebDriver, store_path: Path, artifacts: Path
) -> None:
    """A run of two forward passes: each step's ops, graph and op pages; an op whose
    tensor was not saved has statistics only when they were taken (here: none)."""
    run = tl.open(store_path, create=False)["steps"]
    browser.get(server + "/")
    go(browser, browser.find_element(By.LINK_TEXT, "steps"))
    Select(browser.find_element(By.NAME, "step")).select_by_visible_text("1")
    go(browser, browser.find_element(By.ID, "filter"))
    step = run.step(1)
    assert texts(browser, "tr.op td.label") == step.labels
    assert browser.find_element(By.ID, "total").text == str(len(step))
    linear = step.find(func="linear")[0]
    go(browser, browser.find_element(By.LINK_TEXT, linear.label))
    assert linear.stats is not None and linear.out is not None
    assert linear.out.shape[1] == 5  # step 1's tensor (step 0's has 8 tokens)
    assert browser.find_element(By.ID, "stat-mean").text == g6(linear.stats.mean)
    assert browser.find_element(By.ID, "shape").text == "x".join(map(str, linear.out.shape))
    check_tensor_view(browser, linear.out)
    shot(browser, artifacts, "op-step-1")
    parent = step[linear.parents[0]]
    assert parent.func == "layer_norm" and not parent.saved
    go(browser, browser.find_element(By.LINK_TEXT, parent.label))
    assert browser.find_element(By.ID, "label").text == parent.label
    assert browser.find_element(By.ID, "saved").text == "no"
    assert browser.find_element(By.ID, "no-tensor").text.startswith("not saved")
    assert browser.find_element(By.ID, "stat-mean").text == ""
    browser.get(server + "/graph?run=steps&step=1")
    nodes = browser.find_elements(By.CSS_SELECTOR, "#graph a.node")
    assert [n.get_attribute("data-label") for n in nodes] == step.labels


def _request(url: str, method: str = "GET", host: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    if host is not None:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_read_only_and_local(server: str, store_path: Path) -> None:
    """Only GET; Host headers other than local names are refused (a page from elsewhere
    that rebinds its DNS name to 127.0.0.1 gets nothing); a wrong run name is a 404 with
    suggestions; the pages allow no script at all."""
    assert _request(server + "/", "POST")[0] == 405
    assert _request(server + "/", host="attacker.example")[0] == 400
    status, body = _request(server + "/run?run=bsae")
    assert status == 404 and "did you mean &#39;base&#39;" in body
    status, body = _request(server + "/graph?run=steps&step=2")
    assert status == 404 and "has steps 0..1; step 2 does not exist" in body
    with urllib.request.urlopen(server + "/") as response:
        policy = response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src" not in policy
    before = sorted(p.name for p in store_path.rglob("*"))
    _request(server + "/compare?a=base&b=tweaked")
    assert sorted(p.name for p in store_path.rglob("*")) == before


def test_serve_refuses_a_missing_store(tmp_path: Path) -> None:
    missing = tmp_path / "errz.tl"
    done = subprocess.run(
        [sys.executable, "-m", "tracelake.cli", "serve", str(missing), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "tracelake serve:" in done.stderr
    assert not missing.exists()


def test_a_first_comparison_reads_its_runs_from_the_catalog_file(store_path: Path) -> None:
    """Two runs no page read before are compared from the catalog file's rows, not
    copied into the reader's mirror first; the page says what ``store.compare`` says,
    and the runs, kept for later pages, then read through the mirror."""
    from tracelake.explorer import Explorer

    store = tl.open(store_path, create=False)
    explorer = Explorer(store)
    page = explorer.compare("base", "tweaked")
    assert store.catalog._loaded == set()  # no run's rows copied into the mirror
    want = tl.open(store_path, create=False).compare("base", "tweaked")
    assert page.values["summary"] == want.summary()
    first = want.first_divergence()
    assert first is not None and page.values["first"]["key"] == first["key"]
    assert page.values["first"]["max_abs_diff"] == first["max_abs_diff"]
    assert page.values["total"] == len(want)
    # the same runs again: kept, nothing read; a multi-step run's second step
    again = explorer.compare("base", "tweaked")
    assert again.values["summary"] == page.values["summary"]
    run = explorer._runs[store.catalog.run_ids["base"]]
    assert [op.label for op in run.step(0)] == [op.label for op in store["base"].step(0)]
    steps = explorer.compare("steps", "steps")
    assert steps.values["summary"] == store.compare("steps", "steps").summary()
    # a later page of a compared run reads through the mirror as any other
    assert explorer.op("tweaked", 0, first["label_b"], "").values["op"]["label"] == first["label_b"]
