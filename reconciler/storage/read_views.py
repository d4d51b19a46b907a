"""Read views for operators: jobs with their step states, and the audit trail.

These return every column a public view may draw from; the CLI's views module decides
what is shown, so privacy lives in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.core.job_story import JobDetail, aware, resume_step
from reconciler.storage.clock import now_plus
from reconciler.storage.engines import read_only
from reconciler.storage.sql import PLAN_TEXT, decisions, jobs, steps

EXPORT_PAGE_ROWS = 1000
"""Decisions per page of an export (one short read each)."""

_DETAIL_COLUMNS = (
    jobs.c.job_id, jobs.c.job_kind, jobs.c.job_status, jobs.c.status_reason,
    jobs.c.attempt_count, jobs.c.max_attempts, jobs.c.resume_step_index, PLAN_TEXT,
    jobs.c.operator_hold, jobs.c.last_error_code, jobs.c.created_at, jobs.c.updated_at,
    jobs.c.finished_at,
)


def _detail(row: sa.Row[Any], states: dict[int, str]) -> JobDetail:
    """The row as every view reads a job: its own reason, budget and resume step (kept
    on the row, which every transition writes), a resume step only while it will run,
    times with their offsets."""
    return JobDetail(
        job_id=int(row.job_id), job_kind=row.job_kind, job_status=row.job_status,
        status_reason=row.status_reason, attempt_count=row.attempt_count,
        max_attempts=row.max_attempts,
        resume_step_index=resume_step(row.job_status, None, {}, row.resume_step_index),
        plan=row.plan_text, operator_hold=bool(row.operator_hold),
        last_error_code=row.last_error_code, created_at=aware(row.created_at),
        updated_at=aware(row.updated_at), finished_at=aware(row.finished_at),
        step_states=states,
    )


def _step_states(conn: Connection, job_ids: list[int]) -> dict[int, dict[int, str]]:
    out: dict[int, dict[int, str]] = {}
    if job_ids:
        for job_id, index, state in conn.execute(
            sa.select(steps.c.job_id, steps.c.step_index, steps.c.step_state)
            .where(steps.c.job_id.in_(job_ids))
        ):
            out.setdefault(job_id, {})[index] = state
    return out


class ReadViewsSql:
    """Read-only queries for the CLI, on one engine."""

    engine: Engine

    def list_jobs(self, status: str | None, limit: int) -> list[JobDetail]:
        """Newest first, optionally of one status."""
        query = sa.select(*_DETAIL_COLUMNS).order_by(jobs.c.job_id.desc()).limit(limit)
        if status is not None:
            query = query.where(jobs.c.job_status == status)
        with self.engine.connect() as conn:
            rows = list(read_only(conn).execute(query))
            states = _step_states(conn, [r.job_id for r in rows])
        return [_detail(r, states.get(r.job_id, {})) for r in rows]

    def get_job(self, job_id: int) -> JobDetail | None:
        """One job with its step states, or None."""
        with self.engine.connect() as conn:
            row = read_only(conn).execute(
                sa.select(*_DETAIL_COLUMNS).where(jobs.c.job_id == job_id)
            ).one_or_none()
            if row is None:
                return None
            states = _step_states(conn, [job_id])
        return _detail(row, states.get(job_id, {}))

    def list_decisions(
        self, reason: str | None, since_seconds: float | None, limit: int, *,
        shadow_only: bool = False,
    ) -> list[dict[str, Any]]:
        """Decision records as stored, newest first; ``shadow_only``: only those recorded
        by shadow passes."""
        return [record for page in self.decision_pages(reason, since_seconds, limit,
                                                       shadow_only=shadow_only)
                for record in page]

    def decision_pages(
        self, reason: str | None, since_seconds: float | None, limit: int, *,
        shadow_only: bool = False, page_size: int = EXPORT_PAGE_ROWS,
    ) -> Iterator[list[dict[str, Any]]]:
        """``list_decisions``, a page at a time (an export's): each page one short
        read-only transaction, the next one after the last id read (the audit's index),
        the time window fixed once, so that a long export holds no transaction open
        while its reader is slow, and sees each decision once."""
        query = sa.select(decisions).order_by(decisions.c.decision_id.desc())
        if shadow_only:
            query = query.where(decisions.c.shadow_mode == sa.true())
        if reason is not None:
            query = query.where(decisions.c.decision_reason == reason)
        if since_seconds is not None:
            with self.engine.connect() as conn:
                cutoff = read_only(conn).execute(sa.select(now_plus(-since_seconds))).scalar()
            query = query.where(decisions.c.decided_at >= cutoff)
        left = limit
        while left > 0:
            size = min(page_size, left)
            with self.engine.connect() as conn:
                page = [dict(r._mapping)
                        for r in read_only(conn).execute(query.limit(size))]
            if page:
                yield page
            if len(page) < size:
                return
            left -= len(page)
            query = query.where(decisions.c.decision_id < page[-1]["decision_id"])
