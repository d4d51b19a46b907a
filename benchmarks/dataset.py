"""Build N jobs with S stale claims in bulk SQL, fast, on SQLite, PostgreSQL or MariaDB.

The shape, for every measurement: S jobs ``processing`` with a lease expired 5 minutes ago
and no activity for 10 (one tenth of them out of attempts), N/100 jobs processing under a
live lease, the rest half queued and half completed. Stale jobs have three-step plans
(idempotent, pure, effectful) in a mix of step states: none started; the first done; the
first done and the second started; the first two done and the third started.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.storage.engines import is_postgresql


def _is_mysql(conn: Connection | Engine) -> bool:
    return conn.dialect.name == "mysql"

PLAN = ('[{"step_name": "fetch", "effect_kind": "idempotent"}, '
        '{"step_name": "render", "effect_kind": "pure"}, '
        '{"step_name": "publish", "effect_kind": "effectful"}]')


@dataclass(frozen=True)
class Shape:
    """How many jobs of each kind a dataset holds."""

    jobs: int
    stale: int

    @property
    def live(self) -> int:
        return max(self.jobs // 100, 0)


def _ts(conn: Connection, offset_seconds: int) -> str:
    if is_postgresql(conn):
        return f"(statement_timestamp() + make_interval(secs => {offset_seconds}))"
    if _is_mysql(conn):
        return f"TIMESTAMPADD(SECOND, {offset_seconds}, UTC_TIMESTAMP(6))"
    return f"(strftime('%Y-%m-%d %H:%M:%f', 'now', '{offset_seconds:+d} seconds') || '000')"


def _series(conn: Connection, first: int, last: int) -> str:
    """A FROM clause yielding n = first..last."""
    if is_postgresql(conn):
        return f"generate_series({first}, {last}) AS s(n)"
    if _is_mysql(conn):
        # MariaDB's Sequence engine: a virtual table seq_FIRST_to_LAST of one column, seq.
        return f"(SELECT seq AS n FROM seq_{first}_to_{last}) AS s"
    return (f"(WITH RECURSIVE seq(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM seq "
            f"WHERE n < {last}) SELECT n FROM seq) AS s")


def lease_token_sql(conn: Connection, column: str) -> str:
    """'bench-token-' followed by ``column`` (MySQL's ``||`` is a logical OR)."""
    if _is_mysql(conn):
        return f"CONCAT('bench-token-', {column})"
    return f"'bench-token-' || {column}"


def _insert_jobs(conn: Connection, first: int, last: int, status: str, *, lease: str | None,
                 activity: str | None, attempts: str, finished: bool) -> None:
    if last < first:
        return
    now = _ts(conn, 0)
    conn.execute(sa.text(f"""
        INSERT INTO job_runs (job_id, job_kind, job_status, step_plan, resume_step_index,
            attempt_count, max_attempts, claim_generation, lease_token, lease_owner,
            lease_expires_at, claimed_at, last_activity_at, available_at, operator_hold,
            created_at, updated_at, finished_at)
        SELECT n, 'report', '{status}', '{PLAN}', 0, {attempts}, 3,
            {'1' if lease else '0'}, {lease_token_sql(conn, 'n') if lease else 'NULL'},
            {"'bench-worker'" if lease else 'NULL'}, {lease or 'NULL'}, {activity or 'NULL'},
            {activity or 'NULL'}, {now}, false, {now}, {now}, {now if finished else 'NULL'}
        FROM {_series(conn, first, last)}
    """))


def build(engine: Engine, shape: Shape, *, stale_lease_seconds: int = -300) -> None:
    """Fill an empty, migrated database with the shape's jobs, steps and attempts.

    ``stale_lease_seconds``: when the S stale claims' leases run out, from now (expired
    five minutes ago by default; a positive value makes the backlog appear later, at once).
    """
    stale, live = shape.stale, shape.live
    rest = shape.jobs - stale - live
    with engine.begin() as conn:
        expired, quiet = _ts(conn, stale_lease_seconds), _ts(conn, -600)
        _insert_jobs(conn, 1, stale, "processing", lease=expired, activity=quiet,
                     attempts="CASE WHEN n % 10 = 0 THEN 3 ELSE 1 END", finished=False)
        _insert_jobs(conn, stale + 1, stale + live, "processing", lease=_ts(conn, 3600),
                     activity=_ts(conn, 0), attempts="1", finished=False)
        _insert_jobs(conn, stale + live + 1, stale + live + rest // 2, "queued", lease=None,
                     activity=None, attempts="0", finished=False)
        _insert_jobs(conn, stale + live + rest // 2 + 1, shape.jobs, "completed", lease=None,
                     activity=None, attempts="1", finished=True)
        started = f"""
            INSERT INTO step_runs (job_id, step_index, step_name, effect_kind, step_state,
                claim_generation, started_at, finished_at)
            SELECT job_id, {{index}}, '{{name}}', '{{kind}}', {{state}}, 1, {quiet},
                {{finished}} FROM job_runs
            WHERE job_id <= {stale} AND job_id % 4 IN ({{which}})"""
        conn.execute(sa.text(started.format(
            index=0, name="fetch", kind="idempotent", state="'succeeded'", finished=quiet,
            which="1, 2, 3")))
        conn.execute(sa.text(started.format(
            index=1, name="render", kind="pure",
            state="CASE WHEN job_id % 4 = 2 THEN 'started' ELSE 'succeeded' END",
            finished=f"CASE WHEN job_id % 4 = 2 THEN NULL ELSE {quiet} END", which="2, 3")))
        conn.execute(sa.text(started.format(
            index=2, name="publish", kind="effectful", state="'started'", finished="NULL",
            which="3")))
        conn.execute(sa.text(f"""
            INSERT INTO job_attempts (job_id, claim_generation, attempt_number, lease_owner,
                claimed_at)
            SELECT job_id, 1, attempt_count, 'bench-worker', {quiet} FROM job_runs
            WHERE job_status = 'processing'"""))
        if is_postgresql(conn):
            # Explicit ids were inserted: move the sequence past them for later inserts.
            conn.execute(sa.text(
                "SELECT setval(pg_get_serial_sequence('job_runs', 'job_id'), "
                f"{max(shape.jobs, 1)})"))
    analyze(engine)


def analyze(engine: Engine) -> None:
    """Refresh planner statistics, as a production database would have them.

    On PostgreSQL also VACUUM: a floor and its undoing leave dead row versions behind, and
    every measurement should meet the table as clean as the first one did.
    """
    if is_postgresql(engine):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE"))
        return
    if _is_mysql(engine):
        with engine.connect() as conn:
            conn.execute(sa.text("ANALYZE TABLE job_runs, step_runs, job_attempts, "
                                 "reconciliation_decisions"))
        return
    with engine.connect() as conn:
        conn.execute(sa.text("ANALYZE"))
        conn.commit()


def floor_update(engine: Engine) -> int:
    """The set-based floor: one plain UPDATE requeueing every expired claim; rows changed."""
    with engine.begin() as conn:
        now = _ts(conn, 0)
        return int(conn.execute(sa.text(f"""
            UPDATE job_runs SET job_status = 'queued', claim_generation = claim_generation + 1,
                lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL,
                available_at = {now}, updated_at = {now}
            WHERE job_status = 'processing' AND lease_expires_at <= {now}""")).rowcount)


# An audit row's evidence as the pass records it for a three-step plan (same size).
EVIDENCE = ('{"attempts_used":1,"max_attempts":3,"operator_hold":false,"lease_live":false,'
            '"session_gone":false,"lease_expired_seconds":313.916,'
            '"activity_age_seconds":613.916,"plan_readable":true,"plan_length":3,'
            '"step_states":["succeeded","started","not_started"],'
            '"effect_kinds":["idempotent","pure","effectful"],"first_unfinished_step":1}')


def writes_floor(engine: Engine) -> int:
    """The pass's three writes per job, set-based, with no decision made: rows changed.

    One INSERT of an audit row per expired claim (evidence of the real size), one UPDATE
    closing their attempts, then the floor's UPDATE: the database work of a pass without
    its reads, its decision table or its compare-and-swap predicates. How close the pass
    gets to this is how much its Python and its fences cost.
    """
    with engine.begin() as conn:
        now = _ts(conn, 0)
        evidence = "CAST(:evidence AS json)" if is_postgresql(conn) else ":evidence"
        expired = f"job_status = 'processing' AND lease_expires_at <= {now}"
        insert_pass = ("INSERT INTO reconciliation_passes (reconciler_instance, started_at) "
                       f"VALUES ('writes-floor', {now})")
        if _is_mysql(conn):
            # No RETURNING on MySQL 8: the new key is the cursor's lastrowid.
            pass_id = conn.execute(sa.text(insert_pass)).lastrowid
        else:
            pass_id = conn.execute(sa.text(f"{insert_pass} RETURNING pass_id")).scalar_one()
        conn.execute(sa.text(f"""
            INSERT INTO reconciliation_decisions (pass_id, job_id, decided_at, disposition,
                decision_reason, generation_before, generation_after, resume_step_index,
                decision_evidence)
            SELECT {pass_id}, job_id, {now}, 'resume', 'resumed_idempotent_step',
                claim_generation, claim_generation + 1, 1, {evidence}
            FROM job_runs WHERE {expired}"""), {"evidence": EVIDENCE})
        conn.execute(sa.text(f"""
            UPDATE job_attempts SET ended_at = {now}, attempt_outcome = 'lost',
                ended_by = 'reconciler'
            WHERE ended_at IS NULL AND (job_id, claim_generation) IN (
                SELECT job_id, claim_generation FROM job_runs WHERE {expired})"""))
        return int(conn.execute(sa.text(f"""
            UPDATE job_runs SET job_status = 'queued', claim_generation = claim_generation + 1,
                lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL,
                available_at = {now}, updated_at = {now}
            WHERE {expired}""")).rowcount)


def restore_stale(engine: Engine, shape: Shape) -> None:
    """Put the floors' rows back as they were built (not timed)."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"""
            UPDATE job_runs SET job_status = 'processing', claim_generation = 1,
                lease_token = {lease_token_sql(conn, 'job_id')}, lease_owner = 'bench-worker',
                lease_expires_at = {_ts(conn, -300)}, available_at = created_at
            WHERE job_id <= {shape.stale}"""))
        conn.execute(sa.text(f"""
            UPDATE job_attempts SET ended_at = NULL, attempt_outcome = NULL, ended_by = NULL
            WHERE job_id <= {shape.stale}"""))
        conn.execute(sa.text("DELETE FROM reconciliation_decisions"))
        conn.execute(sa.text("DELETE FROM reconciliation_passes"))
    analyze(engine)
