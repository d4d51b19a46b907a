"""The audit log (passes, decisions) and the leader lease, in this project's own tables.

Every source's decisions land here, with the job id as that source spells it, so the
trail, ``reconciler decisions`` and the metrics read the same for every source.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.job_story import LastMove
from reconciler.core.ports import RecordedDecision
from reconciler.core.vocabulary import (
    RECORDED_KIND_MAX_LENGTH,
    Disposition,
    JobKey,
    PassOutcome,
)
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.operator import NATIVE
from reconciler.storage.operator_record import held_among
from reconciler.storage.sql import (
    MYSQL,
    decisions,
    encode_rows,
    insert_id,
    insert_into,
    json_rows,
    key_in,
    leases,
    passes,
    seconds_param,
    unindexed,
)

DECISION_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_source", sa.String()), ("job_id", sa.String()), ("job_kind", sa.String()),
    ("disposition", sa.String()),
    ("decision_reason", sa.String()), ("generation_before", sa.BigInteger()),
    ("generation_after", sa.BigInteger()), ("resume_step_index", sa.Integer()),
    ("decision_evidence", sa.JSON()), ("shadow_mode", sa.Boolean()),
)

FETCHED_ONLY = "fetched_only"
"""The evidence's ``owner`` fact of a job its owner had only fetched, never started (a
source that puts such a job back, as Dramatiq's prefetch: ``True``)."""


@dataclass(frozen=True, slots=True)
class _Statements:
    """The audit's statements, built once per engine kind (see native_source._Statements)."""

    start_pass: Any
    quiet_pass: Any
    record_decisions: Any
    finish_pass: Any
    lead: Any


@functools.cache
def _statements(dialect: str) -> _Statements:
    finished = {"started_at": db_now(), "finished_at": db_now()}
    source = json_rows(dialect, "recorded", DECISION_COLUMNS)
    names = [name for name, _ in DECISION_COLUMNS]
    earlier = decisions.alias("earlier")
    # A skip for the same job, reason and generation (and mode) was recorded by an earlier
    # pass: a held or gated job is recorded once, not on every pass.
    repeated_skip = sa.and_(
        source.c.disposition == Disposition.SKIP.value,
        sa.exists().where(
            earlier.c.job_source == source.c.job_source,
            earlier.c.job_id == source.c.job_id,
            # Only (job_source, job_id) may lead the lookup: SQLite without statistics would
            # pick the shadow index and walk every decision, for every row recorded.
            unindexed(earlier.c.decision_reason) == source.c.decision_reason,
            earlier.c.generation_before.is_not_distinct_from(source.c.generation_before),
            unindexed(earlier.c.shadow_mode) == source.c.shadow_mode,
        ),
    )
    return _Statements(
        # Their ids come back as the inserted primary key: RETURNING on PostgreSQL, the
        # insert id on SQLite and MySQL (MySQL 8 has no RETURNING at all).
        start_pass=passes.insert()
        .values(reconciler_instance=sa.bindparam("pass_instance"), started_at=db_now()),
        quiet_pass=passes.insert()
        .values(reconciler_instance=sa.bindparam("pass_instance"),
                pass_outcome=sa.bindparam("outcome_value"), **finished),
        record_decisions=decisions.insert().from_select(
            ["pass_id", "decided_at", *names],
            sa.select(sa.bindparam("recording_pass_id", type_=sa.BigInteger()), db_now(),
                      *(source.c[name] for name in names)).where(~repeated_skip),
        ),
        finish_pass=passes.update()
        .where(passes.c.pass_id == sa.bindparam("finished_pass_id"))
        .values(candidates_seen=sa.bindparam("n_candidates"),
                resumed_count=sa.bindparam("n_resumed"),
                terminalized_count=sa.bindparam("n_terminalized"),
                skipped_count=sa.bindparam("n_skipped"),
                finished_at=db_now(), pass_outcome=sa.bindparam("outcome_value")),
        lead=_leadership_statement(dialect),
    )


def _leadership_statement(dialect: str) -> Any:
    """Acquire or renew the leader lease (fenced by holder and expiry); the token or no row
    (on MySQL, the upsert alone: ``SqlLease.take`` reads the token after it)."""
    if dialect == MYSQL:
        return _mysql_leadership()
    stmt = insert_into(dialect, leases).values(
        lease_name=sa.bindparam("lead_name"), holder_id=sa.bindparam("lead_holder"),
        fencing_token=1, lease_expires_at=now_plus(seconds_param("lead_ttl_seconds")),
    )
    excluded = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[leases.c.lease_name],
        set_={
            "holder_id": excluded.holder_id,
            # A new holder gets a new token; a renewal keeps its own.
            "fencing_token": sa.case(
                (leases.c.holder_id == excluded.holder_id, leases.c.fencing_token),
                else_=leases.c.fencing_token + 1,
            ),
            "lease_expires_at": excluded.lease_expires_at,
        },
        where=sa.or_(leases.c.holder_id == excluded.holder_id,
                     leases.c.lease_expires_at <= db_now()),
    ).returning(leases.c.fencing_token)


def _mysql_leadership() -> Any:
    """The leadership upsert on MySQL, which has no conditional ON DUPLICATE KEY UPDATE:
    each column changes only where the lease is this holder's or has expired. Assignments
    run left to right, each seeing those before it, so the token is judged on the old
    holder, and the expiry last, when the holder is the new one exactly where it was taken.
    """
    stmt = insert_into(MYSQL, leases).values(
        lease_name=sa.bindparam("lead_name"), holder_id=sa.bindparam("lead_holder"),
        fencing_token=1, lease_expires_at=now_plus(seconds_param("lead_ttl_seconds")),
    )
    new = stmt.inserted
    mine = leases.c.holder_id == new.holder_id
    takes = sa.or_(mine, leases.c.lease_expires_at <= db_now())
    return stmt.on_duplicate_key_update([
        ("fencing_token", sa.case((mine, leases.c.fencing_token),
                                  (takes, leases.c.fencing_token + 1),
                                  else_=leases.c.fencing_token)),
        ("holder_id", sa.case((takes, new.holder_id), else_=leases.c.holder_id)),
        ("lease_expires_at", sa.case((mine, new.lease_expires_at),
                                     else_=leases.c.lease_expires_at)),
    ])


KindOf = Callable[[JobKey], str | None]
"""A job's kind as its source read it in the pass (None: unknown)."""


def _no_kind(job_id: JobKey) -> None:
    return None


def decision_rows(source_name: str,
                  recorded: Sequence[tuple[RecordedDecision, dict[str, Any]]], *,
                  shadow: bool = False, kind_of: KindOf = _no_kind) -> list[dict[str, Any]]:
    """The audit rows of a batch's decisions, the job id as text, the kind as read (cut to
    the column's length: a foreign system's kinds may be longer)."""
    return [
        {
            # Plain text (str() of a StrEnum member): the JSON encoder takes a member at twice
            # a str's cost.
            "job_source": source_name, "job_id": str(r.job_id),
            "job_kind": _cut(kind_of(r.job_id)),
            "disposition": str(r.disposition), "decision_reason": str(r.reason),
            "generation_before": r.generation_before, "generation_after": r.generation_after,
            "resume_step_index": r.resume_step_index, "decision_evidence": evidence,
            "shadow_mode": shadow,
        }
        for r, evidence in recorded
    ]


def _cut(kind: str | None) -> str | None:
    return None if kind is None else kind[:RECORDED_KIND_MAX_LENGTH]


class SqlAudit:
    """Passes and decisions on the pass's connection (see ``ports.AuditLog``); ``kind_of``
    names each decided job's kind (the pass's source, which read it)."""

    def __init__(self, conn: Connection, kind_of: KindOf = _no_kind) -> None:
        self.conn = conn
        self.sql = _statements(conn.dialect.name)
        self.kind_of = kind_of

    def start_pass(self, instance: str) -> int:
        """Insert this pass's row; outcome and counts are filled in by ``finish_pass``."""
        return insert_id(self.conn, self.sql.start_pass, {"pass_instance": instance})

    def record_quiet_pass(self, instance: str, outcome: PassOutcome) -> int:
        """Insert a pass that decided nothing (not leader, or nothing stale) in one statement."""
        return insert_id(self.conn, self.sql.quiet_pass, {
            "pass_instance": instance, "outcome_value": outcome.value})

    def held_among(self, source_name: str, job_ids: Sequence[JobKey]) -> set[str]:
        """Those of ``job_ids`` (as text) an operator holds by the reconciler's own hold;
        none for the native source, whose holds are its job rows' (no statement)."""
        if source_name == NATIVE:
            return set()
        return held_among(self.conn, source_name, job_ids)

    def finish_pass(self, pass_id: int, source_name: str,
                    recorded: Sequence[tuple[RecordedDecision, dict[str, Any]]], *,
                    shadow: bool = False, outcome: PassOutcome = PassOutcome.OK
                    ) -> set[tuple[str, str]]:
        """Insert every decision in one statement (a skip already on record for the same
        job, reason and generation is left out), then the pass's counts and outcome; the
        skips left out, as (job id as text, reason)."""
        repeated: set[tuple[str, str]] = set()
        if recorded:
            self.conn.execute(self.sql.record_decisions, {
                "recording_pass_id": pass_id,
                "recorded_rows": encode_rows(decision_rows(
                    source_name, recorded, shadow=shadow, kind_of=self.kind_of))})
            skips = {(str(r.job_id), r.reason.value) for r, _ in recorded
                     if r.disposition is Disposition.SKIP}
            if skips:
                # What this pass's insert kept, read back by its pass id (its own index).
                kept = {(str(job), str(reason)) for job, reason in self.conn.execute(
                    sa.select(decisions.c.job_id, decisions.c.decision_reason).where(
                        decisions.c.pass_id == pass_id,
                        decisions.c.disposition == Disposition.SKIP.value))}
                repeated = skips - kept
        counts = dict.fromkeys(Disposition, 0)
        for r, _ in recorded:
            counts[r.disposition] += 1
        self.conn.execute(self.sql.finish_pass, {
            "finished_pass_id": pass_id, "n_candidates": len(recorded),
            "n_resumed": counts[Disposition.RESUME],
            "n_terminalized": counts[Disposition.TERMINALIZE],
            "n_skipped": counts[Disposition.SKIP], "outcome_value": outcome.value,
        })
        return repeated


class SqlLease:
    """The leader lease on one connection (see ``ports.Lease``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sql = _statements(conn.dialect.name)

    def take(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew the leader lease in this transaction (fenced by holder and expiry)."""
        params = {"lead_name": lease_name, "lead_holder": holder_id,
                  "lead_ttl_seconds": ttl_seconds}
        if self.conn.dialect.name != MYSQL:
            token = self.conn.execute(self.sql.lead, params).scalar_one_or_none()
        else:
            self.conn.execute(self.sql.lead, params)
            token = self.conn.execute(sa.select(leases.c.fencing_token).where(
                leases.c.lease_name == lease_name, leases.c.holder_id == holder_id)
            ).scalar_one_or_none()
        return None if token is None else int(token)

    def release(self, lease_name: str, holder_id: str) -> None:
        """Expire the lease now if this holder has it, so a successor need not wait."""
        self.conn.execute(
            leases.update()
            .where(leases.c.lease_name == lease_name, leases.c.holder_id == holder_id)
            .values(lease_expires_at=db_now())
        )

    def brake_state(self) -> tuple[datetime | None, datetime]:
        """When the current event's brake engaged (None: no event), and the database's now."""
        return read_brake(self.conn)

    def keep_brake(self, engaged_since: datetime | None) -> None:
        """Remember (or forget) when the current event's brake engaged."""
        write_brake(self.conn, engaged_since)


BRAKE_LEASE_NAME = "mass_staleness_brake"


def _brake_row() -> Any:
    return leases.c.lease_name == BRAKE_LEASE_NAME


def read_brake(conn: Connection) -> tuple[datetime | None, datetime]:
    """When the current event's brake engaged (kept as the ``mass_staleness_brake`` row of
    reconciler_leases, its expiry column holding that instant) and the database's now."""
    row = conn.execute(
        sa.select(sa.select(leases.c.lease_expires_at).where(_brake_row())
                  .scalar_subquery(), db_now())
    ).one()
    return row[0], row[1]


def write_brake(conn: Connection, engaged_since: datetime | None) -> None:
    """Remember when the current event's brake engaged, or forget the event."""
    conn.execute(leases.delete().where(_brake_row()))
    if engaged_since is not None:
        conn.execute(leases.insert().values(
            lease_name=BRAKE_LEASE_NAME, holder_id="every-replica", fencing_token=0,
            lease_expires_at=engaged_since))


def record_failed_pass(conn: Connection, instance: str, error_code: str) -> int:
    """Insert a pass that failed before it could record itself."""
    return insert_id(conn, passes.insert().values(
        reconciler_instance=instance, started_at=db_now(), finished_at=db_now(),
        pass_outcome=PassOutcome.ERROR.value, error_code=error_code))


def delete_audit_before(conn: Connection, days: float, limit: int) -> int:
    """Delete finished passes older than ``days`` with their decisions, at most ``limit``."""
    old = [int(i) for i in conn.execute(
        sa.select(passes.c.pass_id)
        .where(passes.c.started_at < now_plus(-days * 86400.0),
               passes.c.finished_at.is_not(None))
        .order_by(passes.c.pass_id).limit(limit)
    ).scalars()]
    if not old:
        return 0
    # Explicit, not ON DELETE CASCADE: SQLite enforces that only with foreign_keys on.
    deleted = conn.execute(decisions.delete().where(decisions.c.pass_id.in_(old))).rowcount
    conn.execute(passes.delete().where(passes.c.pass_id.in_(old)))
    return int(deleted) + len(old)


class AuditHistory:
    """The audit's past decisions about one source's jobs, as a pass's transaction (or an
    operator's read) sees them: what a foreign system keeps no record of."""

    __slots__ = ("_conn", "_source")

    def __init__(self, conn: Connection, source_name: str) -> None:
        self._conn = conn
        self._source = source_name

    def applied_resumes(self, keys: Sequence[str]) -> dict[str, list[tuple[str, Any]]]:
        """Each job's applied (not shadow) resumes, newest first, as (reason, recorded
        ``attempts_used``), in one indexed read for the batch; jobs with none absent. A
        resume whose evidence says its owner had only fetched the job (``FETCHED_ONLY``:
        a Dramatiq message prefetched, put back as it was) is left out: no attempt of it
        ran, so none was lost."""
        if not keys:
            return {}
        history: dict[str, list[tuple[str, Any]]] = {}
        for job_id, reason, evidence in self._conn.execute(
                sa.select(decisions.c.job_id, decisions.c.decision_reason,
                          decisions.c.decision_evidence)
                .where(decisions.c.job_source == self._source,
                       key_in(self._conn, decisions.c.job_id, keys),
                       decisions.c.disposition == Disposition.RESUME.value,
                       decisions.c.shadow_mode.is_(False))
                .order_by(decisions.c.job_id, decisions.c.decision_id.desc())):
            facts = evidence if isinstance(evidence, dict) else {}
            owner = facts.get("owner")
            if isinstance(owner, dict) and owner.get(FETCHED_ONLY) is True:
                continue  # put back as it was: no attempt of it ran, none was lost
            history.setdefault(str(job_id), []).append((str(reason),
                                                        facts.get("attempts_used")))
        return history

    def resumes_counted(self, key: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
        """How many applied resumes the job whose key text is ``key`` had, in SQL: the
        attempts of a system that counts none, read with its row."""
        return (sa.select(sa.func.count())
                .where(decisions.c.job_source == self._source, decisions.c.job_id == key,
                       decisions.c.disposition == sa.literal(Disposition.RESUME.value,
                                                             literal_execute=True),
                       decisions.c.shadow_mode.is_(False))
                .scalar_subquery())

    def last_moves(self, keys: Sequence[str]) -> dict[str, LastMove]:
        """Each job's newest applied (not shadow) resume or terminalization, in one
        indexed read; jobs with none absent."""
        if not keys:
            return {}
        moved = (decisions.c.job_source == self._source,
                 key_in(self._conn, decisions.c.job_id, list(keys)),
                 decisions.c.disposition.in_([Disposition.RESUME.value,
                                              Disposition.TERMINALIZE.value]),
                 decisions.c.shadow_mode.is_(False))
        newest = (sa.select(sa.func.max(decisions.c.decision_id).label("decision_id"))
                  .where(*moved).group_by(decisions.c.job_id).subquery())
        rows = self._conn.execute(
            sa.select(decisions.c.job_id, decisions.c.decided_at, decisions.c.disposition,
                      decisions.c.decision_reason)
            .join(newest, newest.c.decision_id == decisions.c.decision_id))
        return {str(r.job_id): LastMove(r.decided_at, str(r.decision_reason),
                                        r.disposition == Disposition.TERMINALIZE.value)
                for r in rows}

    def about(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """The decisions about one job, newest first, as an operator reads them."""
        rows = self._conn.execute(
            sa.select(decisions.c.decided_at, decisions.c.pass_id, decisions.c.disposition,
                      decisions.c.decision_reason, decisions.c.resume_step_index,
                      decisions.c.shadow_mode)
            .where(decisions.c.job_source == self._source,
                   decisions.c.job_id == str(job_id))
            .order_by(decisions.c.decision_id.desc()).limit(limit))
        return [{"decided_at": r.decided_at, "pass_id": r.pass_id,
                 "disposition": r.disposition, "reason": r.decision_reason,
                 "resume_step_index": r.resume_step_index, "shadow": bool(r.shadow_mode)}
                for r in rows]
