"""Pictures (issue 14 item 2): the op graph drawn with Graphviz (clusters, collapsing,
colouring, a 10,000-op model, ``tracelake graph``), matplotlib plots, and the HTML reprs
a notebook shows. Graphviz's ``dot`` and matplotlib are installed by ``.ci/run`` and the
dev extra: these tests fail, not skip, where they are missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch
from model_zoo import gpt2, mlp
from torch import nn

import tracelake as tl
from tracelake.cli import main
from tracelake.graph import MAX_NODES

matplotlib.use("Agg")
torch.set_num_threads(1)

RAMP_DARKEST = "#b10026"
RAMP_PALEST = "#ffffcc"


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tl.Store:
    """GPT-2 recorded twice: ``base``, and ``ft`` with block 1's MLP weights scaled."""
    store = tl.open(tmp_path_factory.mktemp("pictures") / "runs.tl")
    model, inputs = gpt2()
    store.record(model, *inputs, name="base", save=tl.all(), meta={"note": "<script>x</script>"})
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1.5)
    store.record(model, *inputs, name="ft", save=tl.all())
    return store


def _fills(source: str) -> dict[str, str]:
    """Node name -> fill colour, from a graph's dot source."""
    return dict(re.findall(r"^\s*(\w+) \[.*?fillcolor=\"(#[0-9a-f]{6})\"", source, re.M))


def test_graph_draws_modules_as_clusters_in_svg(stored: tl.Store) -> None:
    drawn = stored["base"].graph()
    svg = drawn.svg()
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    assert drawn.ops == len(stored["base"]) == drawn.nodes  # small: every op drawn
    assert svg.count('class="cluster"') == len(stored["base"].modules)
    for title in ("transformer.h.0: GPT2Block", "transformer.h.1.attn: GPT2Attention"):
        assert title in svg
    assert svg.count('class="node"') == drawn.nodes
    assert svg.count('class="edge"') == drawn.edges


def test_stored_run_and_in_memory_trace_draw_the_same_graph(stored: tl.Store) -> None:
    model, inputs = gpt2()
    trace = tl.trace(model, *inputs, save=tl.all())
    assert trace.graph(color="absmax").source == stored["base"].graph(color="absmax").source


def test_graph_collapses_by_depth_and_by_name(stored: tl.Store) -> None:
    run = stored["base"]
    collapsed = run.graph(depth=1)
    source = collapsed.source
    blocks = [m for m in run.modules if m.path.count(".") == 2 and ".h." in m.path]
    assert {m.path for m in blocks} == {"transformer.h.0", "transformer.h.1"}
    for block in blocks:
        count = block.op_range[1] - block.op_range[0]
        assert re.search(rf"{re.escape(block.path)}\\nGPT2Block\\n{count} ops", source)
    assert collapsed.nodes < len(run) and "box3d" in source
    named = run.graph(collapse=["transformer.h.0"]).source
    assert "transformer.h.0\\nGPT2Block" in named and "transformer.h.1\\nGPT2Block" not in named
    # a module the run lacks (a typo) is said, not drawn as if nothing were asked
    with pytest.raises(ValueError, match=r"no module 'transformer\.h\.O'.*'transformer\.h\.0'"):
        run.graph(collapse=["transformer.h.O"])
    # edges between collapsed nodes stay: the graph is still connected end to end
    assert collapsed.edges >= collapsed.nodes - 1


def test_graph_colours_by_a_statistic(stored: tl.Store) -> None:
    run = stored["base"]
    source = run.graph(color="absmax", log=False).source
    fills = _fills(source)
    valued = [op for op in run if op.stats is not None and op.stats.absmax is not None]
    biggest = max(valued, key=lambda op: op.stats.absmax)
    smallest = min(valued, key=lambda op: op.stats.absmax)
    assert fills[f"op{biggest.index}"] == RAMP_DARKEST
    assert fills[f"op{smallest.index}"] == RAMP_PALEST
    for op in run:
        if op not in valued and op.kind == "op":
            assert fills[f"op{op.index}"] == "#eeeeee"  # no value: grey
    assert "colour: absmax" in source
    with pytest.raises(ValueError, match="did you mean 'absmax'"):
        run.graph(color="absmx")


def test_graph_colours_by_a_comparisons_difference(stored: tl.Store) -> None:
    comparison = stored.compare("base", "ft")
    run = stored["base"]
    fills = _fills(run.graph(diff=comparison).source)
    by_label = {row["label_a"]: row["max_abs_diff"] for row in comparison.rows()}
    for op in run:
        diff = by_label.get(op.label)
        if op.module.startswith("transformer.h.0") or op.kind == "input":
            assert diff == 0 and fills[f"op{op.index}"] == RAMP_PALEST, op.label
    worst = max(by_label, key=lambda label: by_label[label] or 0)
    assert fills[f"op{run[worst].index}"] == RAMP_DARKEST
    assert run[worst].module.startswith(("transformer.h.1", "transformer.ln_f", "lm_head", ""))


def _deep_model() -> nn.Module:
    class Leaf(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(5):
                x = torch.relu(x * 1.5 + 0.1)
            return x

    return nn.Sequential(*[nn.Sequential(*[Leaf() for _ in range(10)]) for _ in range(67)])


def test_a_ten_thousand_op_model_renders_collapsed() -> None:
    trace = tl.trace(_deep_model(), torch.randn(2, 4))
    assert len(trace) >= 10_000
    drawn = trace.graph()
    assert drawn.nodes <= MAX_NODES and drawn.ops == len(trace)
    svg = drawn.svg()
    assert svg.count('class="node"') == drawn.nodes


def test_missing_dot_is_a_clear_error(stored: tl.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    drawn = stored["base"].graph()
    with pytest.raises(tl.RenderError, match="apt-get install graphviz"):
        drawn.svg()
    assert "digraph" in drawn.source  # the source needs no dot


def test_cli_graph_writes_svg(stored: tl.Store, tmp_path: Path) -> None:
    out = tmp_path / "ops.svg"
    assert main(["graph", stored.path, "base", "-o", str(out), "--diff", "ft"]) == 0
    assert "</svg>" in out.read_text() and "colour: max_abs_diff" in out.read_text()
    assert main(["graph", stored.path, "base", "-o", str(out), "--color", "absmx"]) == 2
    assert main(["graph", stored.path, "bsae", "-o", str(out)]) == 1
    # a file type Graphviz cannot write, or a module to collapse that is not there: a
    # usage error saying so, not a traceback
    text = tmp_path / "ops.txt"
    for args in (["-o", str(text)], ["-o", str(out), "--collapse", "transfomer"]):
        done = subprocess.run(
            [sys.executable, "-m", "tracelake.cli", "graph", stored.path, "base", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("tracelake graph: ")
    assert not text.exists()
    with pytest.raises(ValueError, match=r"'\.txt'.*\.svg"):
        stored["base"].graph().save(text)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))  # no dot on it
    done = subprocess.run(
        [sys.executable, "-m", "tracelake.cli", "graph", stored.path, "base", "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1 and "install Graphviz" in done.stderr


# -- plots ------------------------------------------------------------------------------


def test_result_plot_draws_a_column_across_layers_and_runs(stored: tl.Store) -> None:
    result = stored.query("select run, label, absmax from ops where func = 'addmm' order by idx")
    ax = result.plot("absmax", x="label")
    lines = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()}
    assert set(lines) == {"base", "ft"}
    for run, values in lines.items():
        assert values == [r["absmax"] for r in result if r["run"] == run]
    with pytest.raises(ValueError, match="did you mean 'absmax'"):
        result.plot("absmx")
    with pytest.raises(ValueError, match=r"result\.hist"):
        stored.query("select out from ops where label = 'output_1'").plot("out")


def test_tensor_histogram_and_heatmap(stored: tl.Store) -> None:
    result = stored.query("select label, out from ops where run = 'base' and label = 'output_1'")
    tensor = result.tensors()[0]
    ax = result.hist(bins=20)
    assert sum(p.get_height() for p in ax.patches) == tensor.numel()
    ax = result.heatmap()
    assert ax.images[0].get_array().shape == (tensor.shape[0] * tensor.shape[1], tensor.shape[2])
    assert ax.get_title() == "output_1"


def test_comparison_plot_shows_difference_by_block(stored: tl.Store) -> None:
    comparison = stored.compare("base", "ft")
    ax = comparison.plot()
    expected = comparison.by_block()["max_abs_diff"].tolist()
    assert ax.get_lines()[0].get_ydata().tolist() == expected
    assert expected[0] == 0 and expected[1] > 0  # block 0 untouched, block 1 scaled


# -- HTML reprs -------------------------------------------------------------------------


def test_reprs_escape_what_a_store_holds(stored: tl.Store) -> None:
    store_html = stored._repr_html_()
    assert "base" in store_html and "ft" in store_html and "2 runs" in store_html
    run_html = stored["base"]._repr_html_()
    for part in (stored["base"]._repr_html_(), store_html):
        assert "<script>" not in part and "&lt;script&gt;" in part
    for shown in ("GPT2LMHeadModel", "steps", "112", "KiB", "provenance", "torch_version"):
        assert shown in run_html


def test_result_html_and_df_summarise_tensors(stored: tl.Store) -> None:
    result = stored.query("select run, label, out, absmax from ops where func = 'addmm'")
    html = result._repr_html_()
    assert html.count("<svg") == len(result)  # a histogram per tensor
    assert "tensor(" not in html and "float32" in html
    frame = result.df()
    assert "tensor(" not in repr(frame) and "float32" in repr(frame)
    assert "tensor(" not in frame._repr_html_()
    assert isinstance(frame["out"][0], torch.Tensor)  # the cells still hold tensors
    assert "tensor(" not in repr(frame[frame["run"] == "ft"])


def test_trace_and_comparison_html() -> None:
    model, inputs = mlp()
    trace = tl.trace(model, *inputs, save=tl.all())
    html = trace._repr_html_()
    assert "Sequential: 7 ops" in html and "relu_1_2" in html and "absmax" in html
    changed, _ = mlp()
    with torch.no_grad():
        changed[2].weight.add_(0.1)
    comparison = tl.compare(trace, tl.trace(changed, *inputs, save=tl.all()))
    html = comparison._repr_html_()
    first = comparison.first_divergence()
    assert first is not None and f"first divergence: {first['key']}" in html


def test_the_readme_pictures_script_draws_them(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "docs" / "pictures.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    diff = (tmp_path / "op-graph-diff.svg").read_text()
    assert "</svg>" in diff and "colour: max_abs_diff" in diff and "GPT2Block" in diff
    assert "colour: absmax" in (tmp_path / "op-graph.svg").read_text()
    assert (tmp_path / "by-block.png").read_bytes()[:4] == b"\x89PNG"


def test_markup_in_run_names_and_meta_is_shown_as_text(tmp_path: Path) -> None:
    store = tl.open(tmp_path / "runs.tl")
    model, inputs = mlp()
    name = "<img src=x onerror=alert(1)>"
    store.record(model, *inputs, name=name, meta={"<b>key</b>": "<i>value</i>"})
    run = store[name]
    for html in (store._repr_html_(), run._repr_html_(), run.step(0)._repr_html_()):
        assert "<img" not in html and "<b>" not in html and "<i>" not in html
        assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "&lt;b&gt;key&lt;/b&gt;" in run._repr_html_()
    assert "&lt;i&gt;value&lt;/i&gt;" in store._repr_html_()


def test_a_graph_too_large_even_collapsed_warns() -> None:
    class Flat(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(40):
                x = x + 1
            return x

    trace = tl.trace(Flat(), torch.zeros(2))
    with pytest.warns(tl.TraceLakeWarning, match="42 nodes even with every module call"):
        drawn = trace.graph(max_nodes=20)
    assert drawn.nodes == len(trace) == 42  # input, 40 adds, output


def test_statistics_comparison_plots_a_line_per_run(stored: tl.Store) -> None:
    comparison = stored.compare("base", ["ft", "base"], tensors=False)
    ax = comparison.plot()
    assert ax.get_ylabel() == "max_abs_d_mean"
    lines = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()}
    frame = comparison.by_block()["max_abs_d_mean"]
    assert lines == {run: frame[run].tolist() for run in ("ft", "base")}
    assert lines["base"] == [0.0, 0.0] and lines["ft"][1] > 0
    assert "Comparison base vs ft, base on key" in comparison._repr_html_()
