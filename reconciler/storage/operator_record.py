"""The operator actions' record and the reconciler's own holds, for every source, in this
project's tables: ``operator_actions`` (who did what to which job, why, and the state it
moved) and ``operator_holds`` (a foreign job an operator holds, which its system has no
place for). Native holds stay the job row's own ``operator_hold``.

Everything here runs on the caller's connection, inside the transaction that read and
changed the job, so an action and its record commit together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.job_story import LastMove
from reconciler.core.vocabulary import (
    ACTOR_MAX_LENGTH,
    NOTE_MAX_LENGTH,
    STATE_MAX_LENGTH,
    ActionOutcome,
    JobKey,
    OperatorAction,
    OperatorStatusReason,
)
from reconciler.storage.clock import db_now
from reconciler.storage.sql import MYSQL, actions, decisions, holds, insert_into, key_in

DUPLICATE_KEY = 1062
"""MySQL's ER_DUP_ENTRY."""


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One operator action as recorded."""

    source: str
    job_key: JobKey
    action: OperatorAction
    actor: str | None
    note: str | None
    refusal: str | None
    state_before: str | None
    state_after: str | None
    job_id: int | None = None
    """The native job's id (None for a foreign job)."""
    status_before: str | None = None
    status_after: str | None = None
    generation_before: int | None = None
    generation_after: int | None = None


def _cut(text: str | None, length: int) -> str | None:
    return None if text is None else text[:length]


def record_action(conn: Connection, record: ActionRecord) -> None:
    """Insert the action's row, applied or refused, stamped by the database's clock."""
    record_actions(conn, [record])


def record_actions(conn: Connection, records: Sequence[ActionRecord]) -> None:
    """Insert each action's row, applied or refused, in one statement, stamped by the
    database's clock."""
    if not records:
        return
    conn.execute(actions.insert().values(acted_at=db_now()), [{
        "job_id": record.job_id, "job_source": record.source, "job_key": str(record.job_key),
        "operator_action": record.action.value,
        "action_outcome": (ActionOutcome.REFUSED if record.refusal
                           else ActionOutcome.APPLIED).value,
        "refusal_reason": record.refusal, "acted_by": _cut(record.actor, ACTOR_MAX_LENGTH),
        "operator_note": _cut(record.note, NOTE_MAX_LENGTH),
        "status_before": record.status_before, "status_after": record.status_after,
        "state_before": _cut(record.state_before, STATE_MAX_LENGTH),
        "state_after": _cut(record.state_after, STATE_MAX_LENGTH),
        "generation_before": record.generation_before,
        "generation_after": record.generation_after,
    } for record in records])


def actions_about(conn: Connection, source: str, job_key: JobKey,
                  limit: int) -> list[dict[str, Any]]:
    """The actions on one job, newest first, as an operator reads them (the note as the
    operator wrote it: every view shows it escaped)."""
    rows = conn.execute(
        sa.select(actions).where(actions.c.job_source == source,
                                 actions.c.job_key == str(job_key))
        .order_by(actions.c.action_id.desc()).limit(limit))
    return [{"acted_at": r.acted_at, "action": r.operator_action,
             "outcome": r.action_outcome, "refusal": r.refusal_reason, "actor": r.acted_by,
             "note": r.operator_note, "state_before": r.state_before, "state_after": r.state_after}
            for r in rows]


def last_moves(conn: Connection, source: str, job_keys: Sequence[str]
               ) -> dict[str, LastMove]:
    """Each job's newest applied retry or cancel, in one indexed read; jobs with none
    absent. (A hold moves nothing: a pass skips the job, its state stays.)"""
    if not job_keys:
        return {}
    newest = (sa.select(sa.func.max(actions.c.action_id).label("action_id"))
              .where(actions.c.job_source == source,
                     key_in(conn, actions.c.job_key, list(job_keys)),
                     actions.c.operator_action.in_([OperatorAction.RETRY.value,
                                                    OperatorAction.CANCEL.value]),
                     actions.c.action_outcome == ActionOutcome.APPLIED.value)
              .group_by(actions.c.job_key).subquery())
    rows = conn.execute(
        sa.select(actions.c.job_key, actions.c.acted_at, actions.c.operator_action)
        .join(newest, newest.c.action_id == actions.c.action_id))
    return {str(r.job_key): LastMove(
        r.acted_at, OperatorStatusReason.OPERATOR_CANCEL.value
        if r.operator_action == OperatorAction.CANCEL.value
        else OperatorStatusReason.OPERATOR_RETRY.value,
        r.operator_action == OperatorAction.CANCEL.value) for r in rows}


def is_held(conn: Connection, source: str, job_key: JobKey) -> bool:
    """Whether an operator holds this foreign job."""
    return conn.execute(sa.select(holds.c.job_key).where(
        holds.c.job_source == source, holds.c.job_key == str(job_key))).first() is not None


def not_held(source: str, job_key: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """True where no operator holds the foreign job whose key is ``job_key`` (a column of
    the system's table): one probe of ``operator_holds``' key per row it is asked of."""
    return ~sa.exists().where(holds.c.job_source == source,
                              holds.c.job_key == sa.cast(job_key, sa.String()))


def held_among(conn: Connection, source: str, job_keys: Sequence[JobKey]) -> set[str]:
    """Those of ``job_keys`` (as text) an operator holds: one statement per batch."""
    if not job_keys:
        return set()
    texts = [str(key) for key in job_keys]
    return {str(key) for key in conn.execute(sa.select(holds.c.job_key).where(
        holds.c.job_source == source, key_in(conn, holds.c.job_key, texts))).scalars()}


def set_hold(conn: Connection, source: str, job_key: JobKey, actor: str | None) -> bool:
    """Hold the job; False when it was held already (another operator's hold stands)."""
    hold = {"job_source": source, "job_key": str(job_key),
            "held_by": _cut(actor, ACTOR_MAX_LENGTH), "held_at": db_now()}
    if conn.dialect.name == MYSQL:
        # Neither RETURNING nor an affected-rows count that tells an insert from a kept
        # row on MySQL: the insert is tried in a savepoint, a duplicate key its refusal.
        try:
            with conn.begin_nested():
                conn.execute(holds.insert().values(hold))
        except sa.exc.IntegrityError as exc:
            if exc.orig is None or exc.orig.args[0] != DUPLICATE_KEY:
                raise
            return False
        return True
    insert = insert_into(conn.dialect.name, holds).values(
        hold).on_conflict_do_nothing().returning(holds.c.job_key)
    # Whether a row came back, not the rowcount: a skipped conflict may report -1.
    return conn.execute(insert).first() is not None


def lift_hold(conn: Connection, source: str, job_key: JobKey) -> bool:
    """Lift the job's hold; False when it was not held."""
    return conn.execute(holds.delete().where(
        holds.c.job_source == source, holds.c.job_key == str(job_key))).rowcount == 1


def latest_decisions(conn: Connection, source: str, *, reason: str | None,
                     disposition: str | None, since: datetime | None,
                     until: datetime | None) -> Iterator[tuple[str, str | None]]:
    """(job key, recorded kind) of every job of ``source`` whose latest real decision has
    ``reason`` and ``disposition`` (None: any) and was made since ``since`` and no later
    than ``until``, newest decision first. The bulk form's candidates: the caller filters
    by kind and by what each job's state allows."""
    # Each job's newest real decision by grouping on the (source, job) index: a NOT EXISTS
    # of a later decision took SQLite through the shadow index once per row (10 s for
    # 10,000 jobs, where this takes a fraction of one).
    newest = (sa.select(sa.func.max(decisions.c.decision_id).label("decision_id"))
              .where(decisions.c.job_source == source, decisions.c.shadow_mode == sa.false())
              .group_by(decisions.c.job_id).subquery())
    query = (sa.select(decisions.c.job_id, decisions.c.job_kind)
             .join(newest, newest.c.decision_id == decisions.c.decision_id)
             .order_by(decisions.c.decision_id.desc()))
    if reason is not None:
        query = query.where(decisions.c.decision_reason == reason)
    if disposition is not None:
        query = query.where(decisions.c.disposition == disposition)
    if since is not None:
        query = query.where(decisions.c.decided_at >= since)
    if until is not None:
        query = query.where(decisions.c.decided_at <= until)
    for row in conn.execute(query):
        yield str(row.job_id), row.job_kind
