"""The public surface: a small, explicit namespace and one exception tree."""

from __future__ import annotations

import re
import subprocess
import sys

import tracelake as tl
from tracelake import errors


def test_public_names_are_pinned() -> None:
    assert sorted(tl.__all__) == sorted(
        [
            "AmbiguousLabelError",
            "ArgumentClashError",
            "CatalogError",
            "ChunkCorruptError",
            "Comparison",
            "ConcurrentRecordingError",
            "InvalidMetaError",
            "InvalidRunNameError",
            "LabelError",
            "LazyTensor",
            "MissingExtraError",
            "ModuleEntry",
            "NestedTraceError",
            "OpEntry",
            "Problem",
            "QueryCompileError",
            "QueryError",
            "QueryLimitError",
            "QueryResultError",
            "QuerySyntaxError",
            "Recording",
            "QueryTypeError",
            "RecorderError",
            "RenderError",
            "Result",
            "Run",
            "RunExistsError",
            "RunNotFoundError",
            "Selector",
            "SourceLocation",
            "Stats",
            "StepView",
            "Store",
            "StoreError",
            "StoreFormatError",
            "StoreNotFoundError",
            "Trace",
            "TraceLakeError",
            "TraceLakeWarning",
            "ValidationReport",
            "VerifyReport",
            "__version__",
            "all",
            "compare",
            "func",
            "in_module",
            "label",
            "module",
            "none",
            "open",
            "options",
            "validate",
            "set_query_limits",
            "trace",
            # interventions and replay (issue 13)
            "InterventionError",
            "ReplayError",
            "add",
            "clamp",
            "mean_ablate",
            "noise",
            "patch_from",
            "project_off",
            "replace_with",
            "scale",
            "steer",
            "when",
            "zero_ablate",
        ]
    )
    for name in tl.__all__:
        assert hasattr(tl, name), name


def test_every_error_is_a_tracelake_error() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        if issubclass(cls, Exception) and not issubclass(cls, Warning):
            assert issubclass(cls, tl.TraceLakeError), name
    assert issubclass(tl.LabelError, KeyError)
    assert issubclass(tl.AmbiguousLabelError, tl.LabelError)
    assert issubclass(tl.TraceLakeWarning, UserWarning)
    assert issubclass(tl.RunNotFoundError, KeyError)
    assert issubclass(tl.InvalidRunNameError, ValueError)
    assert issubclass(tl.ChunkCorruptError, tl.StoreError)
    assert issubclass(tl.CatalogError, tl.StoreError)
    assert issubclass(tl.InvalidMetaError, ValueError)
    assert issubclass(tl.QueryTypeError, TypeError)
    assert issubclass(tl.QueryLimitError, tl.QueryError)


def test_import_defines_names_and_does_nothing_else() -> None:
    code = (
        "import torch\n"
        "from torch.nn.modules import module as m\n"
        "from torch.overrides import _get_current_function_mode_stack as modes\n"
        "import tracelake, tracelake.recorder, tracelake.store, tracelake.query\n"
        "assert not m._global_forward_hooks and not m._global_forward_pre_hooks\n"
        "assert not modes()\n"
        "import sys\n"
        "assert not {'recorder', 'store', 'query'} & set(sys.modules), 'top-level names'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_cli_demo_runs(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tracelake.cli", "demo", "--store", "demo.tl"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert "scaled_dot_product_attention" in done.stdout
    assert "relu_1_20" in done.stdout
    assert "encoder passes: encoder:1, encoder:2" in done.stdout
    # the saved relu output survived the in-place mul_ (one line, however long the paths)
    assert re.search(r"in place on the same tensor\): True$", done.stdout, re.M)
    # the store half: three runs recorded, every example query answered, all verified
    assert (tmp_path / "demo.tl" / "tracelake.json").exists()
    assert done.stdout.count(">>> select") == 5
    # each example query finds something (a label renumbered once left one answering nothing)
    assert " 0 rows" not in done.stdout
    assert "linear_1_3:2" in done.stdout
    # it ends with words, not a Python repr
    last = done.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("verify: ok (3 runs, ") and last[1].startswith("next: tracelake")
    assert "<" not in "".join(last) and "VerifyReport" not in done.stdout
