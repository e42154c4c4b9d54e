"""The one exception hierarchy of tracelake.

Every error a public call raises on purpose is a ``TraceLakeError``; exceptions of the
libraries underneath are converted at one edge each, with ``raise ... from exc`` (the
original is the error's ``__cause__``), so that callers only ever need to catch this tree:

- DuckDB: ``store/boundary.py`` (``duckdb_errors``), around every DuckDB call of the
  catalog (the only other module that imports DuckDB): ``CatalogError``, or
  ``QueryError`` where the statement that failed is the user's (``store.sql``, a query);
- Zarr and the chunk files: ``store/tensors.py``, as ``ChunkCorruptError``;
- Lark: ``query/parser.py``, as ``QuerySyntaxError``;
- the filesystem: the store's files (``store/layout.py``, the catalog's locks) as
  ``StoreError`` subclasses.

::

    TraceLakeError
    ├── RecorderError              capture could not start or a trace was misused
    │   ├── NestedTraceError       a recording is already active in this thread
    │   ├── InterventionError      an intervention rule cannot apply (names the op and rule)
    │   ├── ReplayError            a run cannot be replayed (says why, before running)
    │   ├── ArgumentClashError (TypeError)   a keyword both tracelake's and the model's
    │   └── ConcurrentRecordingError   a recording block's model called from a second
    │                              thread while the first one's forward is recorded
    ├── LabelError (KeyError)      no entry has that label
    │   └── AmbiguousLabelError    a bare label names a layer or module with several passes
    ├── StoreError                 a store could not be opened, written or read
    │   ├── StoreNotFoundError     no store at that path (``tl.open(path, create=False)``)
    │   ├── StoreFormatError       the store was written by a newer tracelake, or is damaged
    │   ├── CatalogError           the catalog (DuckDB) could not be read or changed; the
    │   │                          change, if any, was rolled back
    │   ├── RunNotFoundError (KeyError)   no complete run has that name
    │   ├── RunExistsError         a run of that name exists (pass ``overwrite=True``)
    │   ├── InvalidRunNameError (ValueError)   a run name tracelake refuses
    │   ├── InvalidMetaError (ValueError)   a run's ``meta=`` that cannot be stored
    │   ├── ObjectNotFoundError (KeyError)   no stored object has that key (array bytes)
    │   ├── InvalidKeyError (ValueError)   a storage key that could leave its store
    │   └── ChunkCorruptError      a stored chunk failed its checksum (names run and label)
    ├── RenderError                a picture could not be drawn (Graphviz's ``dot`` or
    │                              matplotlib missing, or ``dot`` failed)
    ├── MissingExtraError (ImportError)   a feature's optional extra is not installed
    │                              (``result.to_dask()`` without ``tracelake[scale]``)
    └── QueryError                 a query could not be parsed, compiled or run
        ├── QuerySyntaxError       not in the language (line, column, expected tokens, caret)
        ├── QueryCompileError      an unknown table, column, function or parameter, or a
        │                          construct that cannot stand where it is (did-you-mean)
        │   └── QueryRunNotFoundError (RunNotFoundError)   `run = 'bsae'`: no such run
        ├── QueryTypeError (TypeError)   a query or parameter value of a type not taken
        ├── QueryLimitError        a query ran past its time or memory limit
        └── QueryResultError       a row's tensor cannot serve what the query asks of it
                                   (an index past its shape)

Warnings the recorder emits instead of breaking a user's forward pass are
``TraceLakeWarning`` (a ``UserWarning``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AmbiguousLabelError",
    "ArgumentClashError",
    "CatalogError",
    "ChunkCorruptError",
    "ConcurrentRecordingError",
    "InterventionError",
    "InvalidKeyError",
    "InvalidMetaError",
    "InvalidRunNameError",
    "LabelError",
    "MissingExtraError",
    "NestedTraceError",
    "ObjectNotFoundError",
    "QueryCompileError",
    "QueryError",
    "QueryLimitError",
    "QueryResultError",
    "QueryRunNotFoundError",
    "QuerySyntaxError",
    "QueryTypeError",
    "RecorderError",
    "RenderError",
    "ReplayError",
    "RunExistsError",
    "RunNotFoundError",
    "StoreError",
    "StoreFormatError",
    "StoreNotFoundError",
    "TraceLakeError",
    "TraceLakeWarning",
]


class TraceLakeError(Exception):
    """Base class of every error tracelake raises on purpose."""


class RecorderError(TraceLakeError):
    """Capture could not start, or a trace was used in a way it cannot serve."""


class NestedTraceError(RecorderError):
    """A tracelake recording is already active in this thread."""


class InterventionError(RecorderError):
    """An intervention rule cannot apply: a patch source lacks the op or its value has
    another shape, an action returned a tensor of another shape, a helper got a bad
    argument. Names the op and the rule."""


class ReplayError(RecorderError):
    """A run cannot be replayed: its inputs were not saved, a rule is a user callable or
    patches from an in-memory trace, its stored inputs do not match their fingerprint."""


class ArgumentClashError(RecorderError, TypeError):
    """A keyword given to a recording entry point (``tl.trace``, ``store.record``) is
    both one of its own options and a keyword of the model's ``forward``: pass the
    model's keyword inputs as ``kwargs={...}``."""


class ConcurrentRecordingError(RecorderError):
    """A recording block's model was called from a second thread while the forward of
    another thread was being recorded (that thread's recording goes on)."""


class LabelError(TraceLakeError, KeyError):
    """No entry of a trace has the label asked for.

    A ``KeyError`` too, so ``label in trace`` idioms and ``dict``-style handling work.
    """

    def __init__(self, label: object, known: Iterable[str] = (), *, message: str | None = None):
        self.label = label
        if message is None:
            close = difflib.get_close_matches(str(label), list(known), n=5, cutoff=0.6)
            message = f"no entry labelled {label!r}"
            if close:
                message += "; did you mean " + ", ".join(repr(c) for c in close) + "?"
            else:
                message += "; trace.labels lists every op label and trace.modules every module"
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.message


class AmbiguousLabelError(LabelError):
    """A bare label was asked for, but that layer or module ran several passes."""

    def __init__(self, label: str, passes: Iterable[str]):
        self.passes = tuple(passes)
        listed = ", ".join(repr(p) for p in self.passes)
        super().__init__(
            label,
            message=f"{label!r} ran {len(self.passes)} passes; ask for one of them: {listed}",
        )


class StoreError(TraceLakeError):
    """A store could not be opened, written or read."""


class StoreNotFoundError(StoreError):
    """There is no store at the path given (and ``create=False`` was asked for)."""


class StoreFormatError(StoreError):
    """The store's format is newer than this tracelake understands, or its files are not
    a tracelake store."""


class CatalogError(StoreError):
    """The catalog could not be read or changed: DuckDB failed (an I/O error, a damaged
    or locked file, an internal error). A change that failed was rolled back, so the
    store is as it was; the DuckDB exception is the ``__cause__``."""


class RunNotFoundError(StoreError, LabelError):
    """No complete run of the store has the name asked for (a ``KeyError`` too)."""

    def __init__(self, name: object, known: Iterable[str] = ()):
        close = difflib.get_close_matches(str(name), list(known), n=5, cutoff=0.6)
        hint = (
            ("; did you mean " + ", ".join(repr(c) for c in close) + "?")
            if close
            else "; store.runs() (or `tracelake runs STORE`) lists the runs"
        )
        super().__init__(name, message=f"no complete run named {name!r}{hint}")


class RunExistsError(StoreError):
    """A run of that name already exists; record with ``overwrite=True`` to replace it."""


class InvalidRunNameError(StoreError, ValueError):
    """A run name tracelake refuses (empty, too long, or with control characters)."""


class InvalidMetaError(StoreError, ValueError):
    """A run's ``meta=`` tracelake cannot store (not a dict with string keys, not JSON,
    nested too deeply, or text that is not Unicode)."""


class ObjectNotFoundError(StoreError, KeyError):
    """A storage backend holds no object under the key asked for (a ``KeyError`` too)."""

    def __init__(self, key: str, where: str = ""):
        self.key = key
        self.message = f"no stored object {key!r}" + (f" in {where}" if where else "")
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.message


class InvalidKeyError(StoreError, ValueError):
    """A storage key refused: empty, absolute, or with ``.``/``..``/empty segments, so
    that no key can name a file outside its store."""


class ChunkCorruptError(StoreError):
    """A stored chunk failed its checksum, or its file is missing or unreadable.

    ``run``, ``label`` and ``chunk`` name what was damaged.
    """

    def __init__(self, run: str, label: str, chunk: str, detail: str = ""):
        self.run, self.label, self.chunk = run, label, chunk
        message = f"run {run!r}, {label}: stored chunk {chunk} is damaged"
        super().__init__(f"{message} ({detail})" if detail else message)


class RenderError(TraceLakeError):
    """A picture (an op graph, a plot) could not be drawn: a tool it needs is missing
    (the message says how to install it) or the tool failed."""


class MissingExtraError(TraceLakeError, ImportError):
    """A feature needs an optional extra that is not installed; the message names the
    extra and the ``pip install`` line that adds it."""

    def __init__(self, feature: str, extra: str, missing: str):
        self.extra = extra
        super().__init__(
            f"{feature} needs the `{extra}` extra ({missing} is not installed): "
            f"pip install 'tracelake[{extra}]'",
            name=missing,
        )


class TraceLakeWarning(UserWarning):
    """Something was recorded only partly, so that the user's forward pass could go on."""


class QueryError(TraceLakeError):
    """A query could not be parsed, compiled or run.

    ``line`` and ``column`` (1-based) point at the culprit when it has a place in the
    query text, and ``excerpt`` is that query line with a caret under it (else ``""``).
    """

    def __init__(
        self, message: str, *, line: int | None = None, column: int | None = None, excerpt: str = ""
    ):
        self.message = message
        self.line = line
        self.column = column
        self.excerpt = excerpt
        super().__init__(f"{message}\n{excerpt}" if excerpt else message)


class QuerySyntaxError(QueryError):
    """The text is not in the query language. ``expected`` names what could have stood
    at ``line``, ``column`` (keywords as written, other tokens described)."""

    def __init__(
        self, message: str, line: int, column: int, expected: Iterable[str] = (), excerpt: str = ""
    ):
        self.expected = tuple(expected)
        super().__init__(message, line=line, column=column, excerpt=excerpt)


class QueryTypeError(QueryError, TypeError):
    """A query (or a parameter's value) of a type the language does not take."""


class QueryLimitError(QueryError):
    """A query ran past its time or memory limit (``tl.set_query_limits`` raises them)."""


class QueryResultError(QueryError):
    """A returned row's tensor cannot give what the query asks of it (an index past its
    shape, more indices than it has dimensions)."""


class QueryCompileError(QueryError):
    """The query parses but asks for something unknown (a table, column, function or
    parameter; the message suggests the closest known name) or puts a construct where it
    cannot stand (an aggregate in ``where``, a tensor slice in ``order by``)."""


class QueryRunNotFoundError(QueryCompileError, RunNotFoundError):
    """A query names, as written text, a run that is not a complete run of the store
    (``run = 'bsae'``): a ``QueryError`` (the query is at fault) and a
    ``RunNotFoundError`` (with the closest names), so either ``except`` catches it."""

    def __init__(self, name: object, known: Iterable[str] = ()):
        RunNotFoundError.__init__(self, name, known)
        self.line, self.column, self.excerpt = None, None, ""
