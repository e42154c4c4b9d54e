"""Discoverability: type checkers see the real types of a user's calls, and every public
member says what it is."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import tracelake as tl

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = """
import torch
import tracelake as tl

model = torch.nn.Linear(4, 4)
log = tl.trace(model, torch.randn(2, 4), save=tl.func("linear"))
reveal_type(log)
reveal_type(log.ops[0])
reveal_type(log.ops[0].out)
store = tl.open("runs.tl", create=False)
reveal_type(store)
run = store.record(model, torch.randn(2, 4), name="a")
reveal_type(run)
reveal_type(store["a"])
reveal_type(run.labels)
reveal_type(run.find(func="linear"))
reveal_type(run.step(0))
result = store.query("select run, out from ops")
reveal_type(result)
reveal_type(result.stack())
reveal_type(store.compare("a", "b"))
reveal_type(store.verify())
"""

EXPECTED = [
    "tracelake.recorder.trace.Trace",
    "tracelake.recorder.entries.OpEntry",
    "torch._tensor.Tensor | None",
    "tracelake.store.store.Store",
    "tracelake.store.run.Run",
    "tracelake.store.run.Run",
    "list[str]",
    "list[tracelake.recorder.entries.OpEntry]",
    "tracelake.store.run.StepView",
    "tracelake.query.results.Result",
    "torch._tensor.Tensor",
    "tracelake.store.compare.Comparison",
    "tracelake.store.verify.VerifyReport",
]


def _installed_tree(root: Path) -> Path:
    """The package laid out as it installs (tracelake/, tracelake/recorder, ...), as the
    Makefile's lint does: mypy does not follow the editable install's import hook."""
    package = root / "tracelake"
    package.mkdir(parents=True)
    for item in (ROOT / "tracelake").iterdir():
        if item.suffix in (".py", ".typed"):
            (package / item.name).symlink_to(item)
    for room in ("recorder", "store", "query"):
        (package / room).symlink_to(ROOT / room)
    return root


def test_mypy_on_a_users_script_sees_the_real_types(tmp_path: Path) -> None:
    tree = _installed_tree(tmp_path / "site")
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    cache = ROOT / ".mypy-tree" / ".mypy_user_cache"  # (ignored by git; torch's types cost)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--cache-dir",
            str(cache),
            "--python-version",
            "3.11",
            # (pandas and pyarrow ship no types: the package's own imports of them, which
            # mypy reports for a package reached through MYPYPATH and not for an installed
            # one, as the project's own mypy configuration says)
            "--ignore-missing-imports",
            str(script),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(tree)},
        timeout=900,
    )
    revealed = re.findall(r'Revealed type is "([^"]+)"', done.stdout)
    assert revealed == EXPECTED, done.stdout + done.stderr
    assert "error:" not in done.stdout, done.stdout


def _public_members(cls: type) -> list[tuple[str, object]]:
    members = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith("tracelake"):
            continue
        raw = vars(owner)[name]
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, property) or callable(raw):
            members.append((f"{owner.__module__}.{owner.__qualname__}.{name}", raw))
    return members


def test_every_public_member_has_a_docstring() -> None:
    missing = []
    for name in tl.__all__:
        obj = getattr(tl, name)
        if not (inspect.isclass(obj) or callable(obj)) or name == "__version__":
            continue
        if not obj.__doc__:
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for qualified, member in _public_members(obj):
                if not (member.__doc__ or "").strip():
                    missing.append(qualified)
    assert not missing, f"public members without a docstring: {sorted(set(missing))}"


def test_no_public_class_forwards_attributes() -> None:
    """Tab completion and type checkers see only real members: no __getattr__."""
    for name in tl.__all__:
        obj = getattr(tl, name)
        if inspect.isclass(obj):
            assert not any("__getattr__" in vars(k) for k in obj.__mro__ if k is not object), name
    run_members = set(dir(tl.Run))
    assert {"labels", "ops", "modules", "find", "df", "step", "steps"} <= run_members
