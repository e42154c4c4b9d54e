"""The switch for the recorder's compiled parts (``recorder/_hot.c``).

The extension is optional: where it could not be built, where it was built for another
row layout than ``record.py`` declares (reinstall to rebuild it), or with
``TRACELAKE_PURE_PYTHON=1`` in the environment, the recorder runs the same logic in
Python, slower. Python stays the reference; tests/test_compiled.py checks that both
give the same recordings. Read ``compiled.ENABLED`` at the moment of use (tests switch
it).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from tracelake.errors import TraceLakeWarning

from .record import ROW_FIELDS

try:
    from . import _hot  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - built wherever a C compiler is
    _hot = None

#: Whether the extension was built for another row layout than the op record declares
#: (recorder/_record.h was regenerated, the extension not rebuilt): then it is not used.
STALE = _hot is not None and getattr(_hot, "ROW_FIELDS", "") != ",".join(ROW_FIELDS)
if STALE:
    _hot = None
    warnings.warn(
        "tracelake's compiled recorder (recorder/_hot.c) was built for another op record "
        "than recorder/record.py declares: recording runs in Python, slower, until it is "
        "rebuilt (`make setup`, or `pip install -e .` again)",
        TraceLakeWarning,
        stacklevel=2,
    )

__all__ = ["AVAILABLE", "ENABLED", "hot"]

#: Whether the extension was built and imports.
AVAILABLE = _hot is not None
#: Whether recordings use it.
ENABLED = AVAILABLE and not os.environ.get("TRACELAKE_PURE_PYTHON")


def hot() -> Any:
    """The extension module when it is enabled, else ``None``."""
    return _hot if ENABLED else None
