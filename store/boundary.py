"""tracelake's one boundary with DuckDB: what a DuckDB failure becomes.

Every DuckDB call of the store runs behind it (:func:`duckdb_errors`, or a catalog
method decorated with ``guarded``), and only this module and ``catalog.py`` import
DuckDB. A ``duckdb.Error`` leaves as ``CatalogError``, or as the error class the caller
names for a statement that is the caller's (the query room names ``QueryError``); an
``OSError`` of the catalog's files leaves as ``CatalogError``. The original is the
``__cause__``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import duckdb

from tracelake.errors import CatalogError, TraceLakeError

from .layout import full_hint

__all__ = ["CatalogCursor", "duckdb_errors", "guarded"]


@contextmanager
def duckdb_errors(what: str, error: type[TraceLakeError] = CatalogError) -> Iterator[None]:
    """The DuckDB boundary: a ``duckdb.Error`` raised in the block leaves it as ``error``
    (``CatalogError`` unless the failed statement is the caller's to answer for: the
    query room names ``QueryError``), an ``OSError`` of the catalog's files as
    ``CatalogError``; ``what`` opens the message, the original is the ``__cause__``."""
    try:
        yield
    except (duckdb.Error, OSError, RuntimeError) as exc:
        converted = _converted(exc, what, error)
        if converted is exc:
            raise
        raise converted from exc


def _converted(exc: BaseException, what: str, error: type[TraceLakeError]) -> BaseException:
    """What ``exc`` leaves the boundary as. DuckDB turns a Ctrl-C that came while it ran
    into an error of its own (``InterruptException``, or ``RuntimeError: Query
    interrupted`` while fetching): it leaves as the ``KeyboardInterrupt`` it was. Other
    ``RuntimeError``s are not DuckDB's to convert and leave unchanged."""
    if (
        isinstance(exc, duckdb.InterruptException)
        or (isinstance(exc, RuntimeError) and "interrupted" in str(exc).lower())
        # a Ctrl-C while DuckDB called back into Python (reading a registered Arrow
        # table) comes back wrapped in the statement's error
        or (isinstance(exc, duckdb.Error) and "KeyboardInterrupt" in str(exc))
    ):
        return KeyboardInterrupt()
    if isinstance(exc, RuntimeError) and not isinstance(exc, duckdb.Error):
        return exc
    kind = error if isinstance(exc, duckdb.Error) else CatalogError
    return kind(f"{what}: {exc}{full_hint(exc)}")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def guarded(
    what: str,
) -> Callable[[Callable[Concatenate[Any, _P], _R]], Callable[Concatenate[Any, _P], _R]]:
    """A method of a catalog object (one with ``paths``) behind the DuckDB boundary
    (as :func:`duckdb_errors`); the message names the catalog file."""

    def decorate(method: Callable[Concatenate[Any, _P], _R]) -> Callable[Concatenate[Any, _P], _R]:
        @functools.wraps(method)
        def guarded(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return method(self, *args, **kwargs)
            except (duckdb.Error, OSError, RuntimeError) as exc:
                converted = _converted(exc, f"{what} {self.paths.catalog}", CatalogError)
                if converted is exc:
                    raise
                raise converted from exc

        return guarded

    return decorate


class CatalogCursor:
    """The result of :meth:`CatalogMirror.query`: DuckDB's cursor with its reads behind
    the DuckDB boundary (rows are fetched lazily, so a failure can come at the fetch)."""

    __slots__ = ("_cursor", "_error", "_what")

    def __init__(
        self, cursor: duckdb.DuckDBPyConnection, what: str, error: type[TraceLakeError]
    ) -> None:
        self._cursor = cursor
        self._what = what
        self._error = error

    @property
    def description(self) -> Any:
        """The result's columns, as DB-API describes them (name first)."""
        return self._cursor.description

    def fetchone(self) -> tuple[Any, ...] | None:
        with duckdb_errors(self._what, self._error):
            return self._cursor.fetchone()

    def fetchmany(self, size: int = 1) -> list[tuple[Any, ...]]:
        with duckdb_errors(self._what, self._error):
            return self._cursor.fetchmany(size)

    def fetchall(self) -> list[tuple[Any, ...]]:
        with duckdb_errors(self._what, self._error):
            return self._cursor.fetchall()

    def df(self) -> Any:
        """The (rest of the) result as a pandas DataFrame."""
        with duckdb_errors(self._what, self._error):
            return self._cursor.df()

    def to_arrow_table(self) -> Any:
        """The (rest of the) result as an Arrow table."""
        with duckdb_errors(self._what, self._error):
            return self._cursor.to_arrow_table()
