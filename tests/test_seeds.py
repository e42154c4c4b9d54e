"""The seed's TorchLens snippets run unchanged but for the import line.

The seed page (a copy lives in tests/data) carries runnable snippets marked
``# migration-test: tool=... expected=...`` that set ``RESULT``; every ``tool=torchlens``
one must give its expected result with ``import tracelake as tl``, and every ``tool=hooks``
one keeps working beside it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SEED = Path(__file__).parent / "data" / "seed_000_coming_from_hooks.txt"
MARK = re.compile(r"^# migration-test: tool=(\w+) expected=(.+)$")


def snippets() -> list[tuple[str, str, str]]:
    """(tool, expected, code) for each marked snippet: the code runs until the line that
    sets RESULT (and a following ``log.cleanup()``)."""
    lines = SEED.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        match = MARK.match(line.strip())
        if not match:
            continue
        body = []
        for code in lines[i + 1 :]:
            body.append(code)
            if code.startswith("RESULT"):
                break
        rest = lines[i + 1 + len(body) :]
        if rest and rest[0].strip() == "log.cleanup()":
            body.append(rest[0])
        found.append((match.group(1), match.group(2), "\n".join(body)))
    return found


def test_seed_has_both_kinds_of_snippets() -> None:
    tools = [tool for tool, _, _ in snippets()]
    assert tools.count("torchlens") == 2
    assert tools.count("hooks") == 1


@pytest.mark.parametrize(
    ("tool", "expected", "code"),
    snippets(),
    ids=[f"{tool}-{n}" for n, (tool, _, _) in enumerate(snippets())],
)
def test_seed_snippet(tool: str, expected: str, code: str) -> None:
    if tool == "torchlens":
        assert "import torchlens as tl" in code
        code = code.replace("import torchlens as tl", "import tracelake as tl")
    namespace: dict = {"__name__": f"seed_snippet_{tool}"}
    exec(compile(code, f"<seed {tool}>", "exec"), namespace)
    assert namespace["RESULT"] == ast.literal_eval(expected)
