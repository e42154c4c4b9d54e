"""The %tlq / %%tlq magics in a real IPython shell (issue 14 item 3): variables bound as
``:name`` parameters, the Result returned and stored with ``-o``, the store by path
(never created) or by variable, and every error raised so the cell fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from model_zoo import mlp

import tracelake as tl
from tracelake.magics import parameters
from tracelake.query.results import Result


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    store = tl.open(tmp_path_factory.mktemp("magics") / "runs.tl")
    model, inputs = mlp()
    store.record(model, *inputs, name="base", save=tl.all())
    ip = start_ipython() or get_ipython()  # None once started in this process
    ip.run_line_magic("load_ext", "tracelake")
    ip.user_ns.update(st=store, path=store.path)
    return ip


def test_parameters_are_bound_from_the_notebooks_variables(shell: Any) -> None:
    shell.user_ns.update(lbl="relu_1_2", fn="relu", n=1)
    result = shell.run_line_magic(
        "tlq", "st select label from ops where func = :fn and label != :lbl limit :n"
    )
    assert [row["label"] for row in result] == ["relu_2_4"]
    assert parameters("select label from ops where func = :fn limit :n") == ["fn", "n"]
    assert parameters("select label from ops where label = ':not_a_param'") == []


def test_assignment_and_output_variable_get_the_result(shell: Any) -> None:
    shell.user_ns["lbl"] = "relu_1_2"
    ran = shell.run_cell("r = %tlq st select label, out from ops where label = :lbl")
    assert ran.success and isinstance(shell.user_ns["r"], Result)
    assert shell.user_ns["r"].tensors()[0].shape == (4, 16)
    result = shell.run_cell_magic("tlq", "st -o picked", "select label\nfrom ops\nlimit 2")
    assert shell.user_ns["picked"] is result and len(result) == 2


def test_store_by_path_or_variable(shell: Any, tmp_path: Path) -> None:
    path = shell.user_ns["path"]
    by_path = shell.run_line_magic("tlq", f"{path} select label from ops")
    by_name = shell.run_cell_magic("tlq", "st", "select label from ops")
    assert len(by_path) == len(by_name) == 7
    missing = tmp_path / "runz.tl"
    with pytest.raises(tl.StoreNotFoundError, match="no tracelake store"):
        shell.run_line_magic("tlq", f"{missing} select label from ops")
    assert not missing.exists()  # a mistyped path creates nothing
    shell.user_ns["not_a_store"] = 3
    with pytest.raises(tl.StoreError, match="is a int, not a tracelake Store"):
        shell.run_cell_magic("tlq", "not_a_store", "select label from ops")


@pytest.mark.parametrize(
    ("line", "cell", "error", "match"),
    [
        ("st select nope from ops", None, tl.QueryCompileError, "unknown column 'nope'"),
        ("st select label frm ops", None, tl.QuerySyntaxError, r"\^"),
        ("st select label from ops where label = :unset", None, tl.QueryError, "unset = "),
        ("st", None, tl.QueryError, "no query given"),
        ("st -o", "select label from ops", tl.QueryError, "-o takes a variable name"),
        ("st other", "select label from ops", tl.QueryError, "name one store"),
    ],
)
def test_errors_fail_the_cell(
    shell: Any, line: str, cell: str | None, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        if cell is None:
            shell.run_line_magic("tlq", line)
        else:
            shell.run_cell_magic("tlq", line, cell)
    source = f"%tlq {line}" if cell is None else f"%%tlq {line}\n{cell}"
    ran = shell.run_cell(source)
    assert not ran.success and isinstance(ran.error_in_exec, error)
