"""The README's translation table from forward hooks, row by row: every ```python block
that starts with ``# readme-test: expected=VALUE`` runs and sets ``RESULT`` to VALUE.
"""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARK = re.compile(r"^# readme-test: expected=(.+)$")


def snippets() -> list[tuple[str, str]]:
    """(expected, code) for each marked block, in order."""
    found = []
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S):
        first, _, code = block.partition("\n")
        match = MARK.match(first.strip())
        if match:
            found.append((match.group(1), code))
    return found


def test_every_row_of_the_table_has_a_snippet() -> None:
    text = README.read_text()
    start = text.index("## Coming from forward hooks")
    section = text[start : text.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 7  # a header and the seed's seven rows
    assert len(snippets()) == 8  # one per row; replay and validation one each


@pytest.mark.parametrize(
    ("expected", "code"),
    snippets(),
    ids=[f"row-{n}" for n in range(len(snippets()))],
)
def test_readme_snippet(
    expected: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a snippet's tempfile.mkdtemp() (the replay row's store) under tmp_path, not /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(code, "<README snippet>", "exec"), namespace)
    assert namespace["RESULT"] == ast.literal_eval(expected)
