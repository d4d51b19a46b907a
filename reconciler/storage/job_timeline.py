"""The records a job's timeline is drawn from (``reconciler.core.timeline``), each one
indexed read: this project's attempts and step runs of its own jobs, the step ledger of a
foreign job, and the audit's decisions with their evidence. Never a worker's identity:
``lease_owner`` is not read."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.config.registry import DEFAULT_SOURCE
from reconciler.core.timeline import timeline
from reconciler.core.vocabulary import JobKey
from reconciler.storage.operator_record import actions_about
from reconciler.storage.sql import attempts, decisions, steps
from reconciler.storage.step_ledger import ENTRIES


def native_attempts(conn: Connection, job_id: int) -> list[dict[str, Any]]:
    """A job's attempts, oldest first: number, claim, end, outcome and who ended it."""
    return [dict(r._mapping) for r in conn.execute(
        sa.select(attempts.c.attempt_number, attempts.c.claimed_at, attempts.c.ended_at,
                  attempts.c.attempt_outcome, attempts.c.ended_by)
        .where(attempts.c.job_id == job_id).order_by(attempts.c.claim_generation))]


def native_steps(conn: Connection, job_id: int) -> list[dict[str, Any]]:
    """Each step's latest run (the table keeps no older one), with its attempt's number."""
    return [dict(r._mapping) for r in conn.execute(
        sa.select(steps.c.step_index, steps.c.step_name, steps.c.effect_kind,
                  steps.c.step_state, steps.c.started_at, steps.c.finished_at,
                  steps.c.error_code, attempts.c.attempt_number)
        .select_from(steps.outerjoin(attempts, sa.and_(
            attempts.c.job_id == steps.c.job_id,
            attempts.c.claim_generation == steps.c.claim_generation)))
        .where(steps.c.job_id == job_id).order_by(steps.c.step_index))]


def ledger_steps(conn: Connection, source: str, job_key: JobKey) -> list[dict[str, Any]]:
    """A foreign job's steps as its step ledger keeps them (each one's latest run)."""
    return [dict(r._mapping) for r in conn.execute(
        sa.select(ENTRIES.c.step_index, ENTRIES.c.step_name, ENTRIES.c.effect_kind,
                  ENTRIES.c.step_state, ENTRIES.c.attempt_number, ENTRIES.c.started_at,
                  ENTRIES.c.finished_at)
        .where(ENTRIES.c.source_name == source, ENTRIES.c.job_key == str(job_key))
        .order_by(ENTRIES.c.step_index))]


def decided(conn: Connection, source: str, job_key: JobKey, limit: int
            ) -> list[dict[str, Any]]:
    """The audit's newest ``limit`` decisions about a job, with their evidence."""
    return [dict(r._mapping) for r in conn.execute(
        sa.select(decisions.c.decided_at, decisions.c.pass_id, decisions.c.disposition,
                  decisions.c.decision_reason, decisions.c.resume_step_index,
                  decisions.c.decision_evidence, decisions.c.shadow_mode)
        .where(decisions.c.job_source == source, decisions.c.job_id == str(job_key))
        .order_by(decisions.c.decision_id.desc()).limit(limit))]


def native_timeline(conn: Connection, job_id: int, limit: int) -> list[dict[str, Any]]:
    """One of this project's jobs: its attempts, its steps' latest runs, the audit's
    newest ``limit`` decisions and as many operator actions, oldest first."""
    return timeline(attempts=native_attempts(conn, job_id), steps=native_steps(conn, job_id),
                    decisions=decided(conn, DEFAULT_SOURCE, job_id, limit),
                    actions=actions_about(conn, DEFAULT_SOURCE, job_id, limit))


def foreign_timeline(conn: Connection, source: str, job_key: JobKey, limit: int
                     ) -> list[dict[str, Any]]:
    """A foreign job: its step ledger, the audit's decisions and the operators' actions
    (its attempts are its system's own history)."""
    return timeline(steps=ledger_steps(conn, source, job_key),
                    decisions=decided(conn, source, job_key, limit),
                    actions=actions_about(conn, source, job_key, limit))
