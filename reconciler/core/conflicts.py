"""A transaction the database rolled back to break a deadlock: the operation runs again.

InnoDB (MySQL, MariaDB) detects a deadlock at once and rolls one transaction back; nothing
of it was applied, so the whole operation may simply run again. The store raises
``TransactionConflict`` for it and the operation (a pass, a claim, a fenced write) is run
again by ``retried``, so a deadlock is never a worker's failure or a pass's error.
PostgreSQL and SQLite raise none: their operations lock in one order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CONFLICT_ATTEMPTS = 5
"""How many times an operation runs before a deadlock is its error after all."""


class TransactionConflict(Exception):  # noqa: N818 - named for what happened, as LeaseLost
    """The database rolled this transaction back to break a deadlock; nothing of it stayed."""


def retried(operation: Callable[[], T]) -> T:
    """``operation()``, run again (up to ``CONFLICT_ATTEMPTS`` in all) while it ends in a
    ``TransactionConflict``."""
    for _ in range(CONFLICT_ATTEMPTS - 1):
        try:
            return operation()
        except TransactionConflict:
            continue
    return operation()
