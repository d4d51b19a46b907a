"""InnoDB's deadlocks as ``core.conflicts.TransactionConflict``, and store operations that
run again after one (MySQL and MariaDB; PostgreSQL's and SQLite's errors pass unchanged).

InnoDB rolls a deadlocked transaction back whole (error 1213), so running the operation
again is safe; a lock wait timeout (1205) is not a deadlock and is left to the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import sqlalchemy as sa

from reconciler.core.conflicts import TransactionConflict, retried

P = ParamSpec("P")
T = TypeVar("T")

MYSQL_DEADLOCK = 1213
"""ER_LOCK_DEADLOCK: the transaction was rolled back."""


def is_deadlock(exc: BaseException) -> bool:
    """True for MySQL's deadlock error, whose transaction InnoDB rolled back."""
    if not isinstance(exc, sa.exc.DBAPIError) or exc.orig is None:
        return False
    args = exc.orig.args
    return type(exc.orig).__module__.startswith("pymysql") and bool(args) and (
        args[0] == MYSQL_DEADLOCK)


@contextmanager
def conflicts_raised() -> Iterator[None]:
    """A deadlock inside becomes a ``TransactionConflict`` (its error kept as the cause)."""
    try:
        yield
    except sa.exc.DBAPIError as exc:
        if is_deadlock(exc):
            raise TransactionConflict(str(exc.orig)) from exc
        raise


def deadlock_retried(operation: Callable[P, T]) -> Callable[P, T]:
    """``operation`` (one whole transaction of its own) run again after a deadlock."""
    @functools.wraps(operation)
    def again(*args: P.args, **kwargs: P.kwargs) -> T:
        def once() -> T:
            with conflicts_raised():
                return operation(*args, **kwargs)
        return retried(once)
    return again
