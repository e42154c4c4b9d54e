"""docs/backward.md's snippets run and give their expected results (the rows of the
seed's translation table for backward hooks and validation)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "backward.md"
MARK = re.compile(r"^# migration-test: tool=tracelake expected=(.+)$")


def snippets() -> list[tuple[str, str]]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    found = []
    for block in blocks:
        first, _, code = block.partition("\n")
        match = MARK.match(first)
        assert match, f"a python block of {DOC.name} lacks its migration-test line"
        found.append((match.group(1), code))
    return found


def test_the_doc_has_both_snippets() -> None:
    assert len(snippets()) == 2


@pytest.mark.parametrize(("expected", "code"), snippets())
def test_snippet(expected: str, code: str) -> None:
    namespace: dict = {"__name__": "backward_doc_snippet"}
    exec(compile(code, str(DOC), "exec"), namespace)
    assert namespace["RESULT"] == ast.literal_eval(expected)


def test_sql_blocks_run_on_a_store_with_gradients(tmp_path: Path) -> None:
    import torch

    import tracelake as tl

    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)
    queries = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    assert queries
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    store = tl.open(tmp_path / "runs.tl")
    store.record(model, torch.randn(2, 4), name="r", backward=lambda out: out.sum())
    for query in queries:
        assert len(store.query(query).df()) > 0, query
