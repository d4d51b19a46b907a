"""The step ledger around a foreign swap: read (and locked) before it, fenced after it.

A job whose task records its steps in the ledger carries its last write in its fence
snapshot; the swap leaves it out when a step was recorded since, and moves the ledger of
each job it changed past the attempt just ended, so that attempt's late writes record
nothing. Both are one statement per batch on PostgreSQL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.ports import Candidate, Fence, FenceSnapshot
from reconciler.sources.batches import unnest
from reconciler.sources.common import LEDGER, key_in


@dataclass(frozen=True, slots=True)
class LedgerMark:
    """A job's step ledger as its decision read it: the newest write (None: no records)."""

    last_write: datetime | None


@dataclass(frozen=True, slots=True)
class ForeignFence(FenceSnapshot):
    """The base of a foreign source's fence snapshot. ``ledger``: the step ledger as read,
    which the swap checks is unchanged (None: the source's steps are not in the ledger)."""

    ledger: LedgerMark | None = field(default=None, kw_only=True)

FENCE_LEDGER = (LEDGER.update()
                .where(LEDGER.c.source_name == sa.bindparam("source"),
                       LEDGER.c.job_key == sa.bindparam("key"),
                       LEDGER.c.attempt_number < sa.bindparam("attempt"))
                .values(attempt_number=sa.bindparam("attempt")))
"""Moves a job's ledger past the attempt just ended (SQLite: executed once per job)."""


def ledger_now(conn: Connection, source_name: str, keys: Sequence[str]) -> dict[str, Any]:
    """The newest ledger write of each job about to change (absent: none), in one read
    for the batch; the rows stay locked (on PostgreSQL) until the pass commits, by when
    the swaps have fenced their attempts out."""
    if not keys:
        return {}
    rows = (sa.select(LEDGER.c.job_key, LEDGER.c.updated_at)
            .where(LEDGER.c.source_name == source_name, key_in(conn, LEDGER.c.job_key, keys)))
    if conn.dialect.name == "postgresql":
        rows = rows.with_for_update()
    newest: dict[str, Any] = {}
    for key, updated_at in conn.execute(rows):
        newest[key] = max(newest.get(key, updated_at), updated_at)
    return newest


def fence_ledgers(conn: Connection, source_name: str, fences: Sequence[tuple[str, int]]
                  ) -> None:
    """Each job's ledger (key text, next attempt) moved past its attempt just ended: one
    statement over the batch's keys on PostgreSQL (``unnest``), one per job on SQLite."""
    if not fences:
        return
    if conn.dialect.name != "postgresql":
        conn.execute(FENCE_LEDGER, [{"source": source_name, "key": key, "attempt": attempt}
                                    for key, attempt in fences])
        return
    moved = unnest("moved", [("job_key", sa.String(), [key for key, _ in fences]),
                             ("attempt", sa.BigInteger(), [attempt for _, attempt in fences])])
    conn.execute(LEDGER.update()
                 .where(LEDGER.c.source_name == source_name,
                        LEDGER.c.job_key == moved.c.job_key,
                        LEDGER.c.attempt_number < moved.c.attempt)
                 .values(attempt_number=moved.c.attempt))


def with_ledger(candidate: Candidate, mark: LedgerMark) -> Candidate:
    """The candidate with the ledger as read composed into its fence snapshot."""
    fence = candidate.fence
    snapshot = fence.snapshot
    if not isinstance(snapshot, ForeignFence):  # pragma: no cover - every foreign source's
        raise TypeError(f"{type(snapshot).__name__} is not a foreign fence")
    return dataclasses.replace(candidate, fence=Fence(
        fence.generation, dataclasses.replace(snapshot, ledger=mark)))
