"""A home-grown job table as a job source, column by column (``kind = "table"``), on SQLite,
PostgreSQL and MySQL/MariaDB.

- **Running**: ``status_column = processing``; the kind is ``kind_column`` (else, and where
  it is NULL, the table's name), matched by ``[kinds]``. The mapped status values are
  checked against the column (``table_checks``).
- **Lease**: ``lease_expires_column`` (live while in the future); where it is not mapped or
  empty, ``activity_column`` plus the kind's ``max_run_seconds``; with neither, a job is
  never reclaimed on time alone.
- **Activity**: ``activity_column``; rule 2 (``worker_wedged``: live lease, no activity for
  ``wedged_after_seconds``) and rule 4 (recent activity protects an expired lease) read it.
- **Attempts**: ``attempts_column`` (the attempts the job system counted, the running one
  included); ``max_attempts_column``, else the kind's ``max_attempts``.
- **Steps**: ``plan_column`` and ``steps_column`` (JSON) when mapped: the full decision
  table, resume at the first unfinished step. Otherwise step ledger records under source
  ``table`` when the job's task keeps them, else one step named after the kind.
- **Fence**: status, and each mapped column of (``owner_column``, ``attempts_column``,
  ``generation_column``, ``lease_expires_column``, ``activity_column``) as read, and the
  rule's time predicate, all in the UPDATE's WHERE clause: on PostgreSQL one UPDATE per
  batch over the snapshots as rows of the table's own type (``jsonb_populate_recordset``),
  on SQLite and MySQL one per change (judged by its affected rows).
- **Resume**: ``status = queued``, ``resume_column`` = the step to start at,
  ``generation_column + 1``, ``reason_column`` = our reason code.
- **Terminalize**: ``status = failed``, ``generation_column + 1``, ``reason_column``.
  No other column is written: the owner, the lease and the attempts stay the job system's.

Timestamps are compared by the database's clock: ``timestamptz`` or ``timestamp`` (read
as UTC) on PostgreSQL, ``DATETIME`` or ``TIMESTAMP`` holding UTC on MySQL, ISO-8601 text
on SQLite. A time SQLite cannot read makes the job a ``reconcile_error`` naming the
column.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.evidence import StepFacts, StepRows
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence, PlannedChange
from reconciler.core.vocabulary import Disposition, JobStatus
from reconciler.sources.kit.batches import Batch, fence_of
from reconciler.sources.kit.checks import require_columns
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.kit.rows import rows_as_read
from reconciler.sources.kit.shapes import Shape, by_kind, candidate, constant, step_results
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.sources.table.checks import (
    TIME_KEYS,
    UNREADABLE_TIMESTAMP,
    check_status_values,
    unreadable_time,
)
from reconciler.sources.table.config import TableConfig
from reconciler.storage.clock import db_now, now_plus, seconds_since

UNREADABLE_STEPS = "unreadable_step_results"
"""The ``error_code`` of step results that are not a JSON object of index -> state: the job
is a ``reconcile_error`` instead of a guess."""


@dataclass(frozen=True, slots=True)
class TableFence(ForeignFence):
    """What a mapped table's swap repeats: each fenced column as read (by its key), and the
    kind's ``max_run_seconds`` the lease was judged with."""

    columns: tuple[tuple[str, Any], ...]
    max_run_seconds: float | None


@dataclass(frozen=True, slots=True)
class TableSql:
    """A mapped table's SQL, column by column as the config maps them."""

    config: TableConfig
    columns: Mapping[str, str]
    """Every mapped column by the key that maps it."""
    table: sa.TableClause
    kind: sa.ColumnElement[Any]

    @classmethod
    def of(cls, config: TableConfig) -> TableSql:
        """The mapped table and its kind (a NULL kind is the table's name, as with no
        kind column: never an invisible job)."""
        columns = config.mapped_columns()
        table = sa.table(config.table, *(sa.column(c) for c in columns.values()),
                         schema=config.schema)
        kind: sa.ColumnElement[Any] = sa.literal(config.table)
        if "kind_column" in columns:
            kind = sa.func.coalesce(table.c[columns["kind_column"]], kind)
        return cls(config, columns, table, kind)

    def _col(self, key: str) -> sa.ColumnElement[Any]:
        return self.table.c[self.columns[key]]

    def _has(self, key: str) -> bool:
        return key in self.columns

    @property
    def key(self) -> sa.ColumnElement[Any]:
        """The job's id column."""
        return self._col("id_column")

    def check_schema(self, conn: Connection) -> None:
        """The table and every mapped column, or one line naming the first missing; the
        mapped status values, or one line naming the one the column refuses."""
        found = require_columns(conn, TableConfig.kind, self.config.table,
                                self.config.schema, self.columns)
        check_status_values(conn, TableConfig.kind, self.config,
                            found[self.config.status_column])

    # -- SQL pieces ---------------------------------------------------------- #

    def _unreadable_times(self, conn: Connection) -> list[tuple[str, sa.ColumnElement[bool]]]:
        """Each mapped time column with its "holds what is not a time" test: SQLite only, as
        PostgreSQL's time columns hold nothing else."""
        if conn.dialect.name != "sqlite":
            return []
        return [(key, unreadable_time(self._col(key))) for key in TIME_KEYS if self._has(key)]

    def _lease_over(self, policies: Policies) -> sa.ColumnElement[Any]:
        """Seconds past the lease's end (negative while it runs); NULL with no lease."""
        return self._lease_over_by(by_kind(self.kind, policies,
                                           lambda p: p.max_run_seconds))

    def _lease_over_by(self, max_run: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        by_activity: sa.ColumnElement[Any] = sa.null()
        if self._has("activity_column"):
            by_activity = seconds_since(self._col("activity_column")) - max_run
        if self._has("lease_expires_column"):
            return sa.func.coalesce(seconds_since(self._col("lease_expires_column")),
                                    by_activity)
        return by_activity

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every job in the processing status, with each mapped column the facts read."""
        fields = [self.key.label("job_id"), self.kind.label("job_kind"),
                  self._lease_over(policies).label("lease_expired_seconds")]
        for key in ("owner_column", "attempts_column", "max_attempts_column",
                    "generation_column", "lease_expires_column", "activity_column",
                    "plan_column", "steps_column"):
            if self._has(key):
                fields.append(self._col(key).label(key))
        if self._has("activity_column"):
            fields.append(seconds_since(self._col("activity_column")).label("activity_age"))
        fields += [test.label(f"unreadable_{key}")
                   for key, test in self._unreadable_times(scope.conn)]
        return sa.select(*fields).where(
            self._col("status_column") == constant(self.config.processing))

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Its lease ended (or, on SQLite, a time that cannot be read)."""
        if scope.postgres:
            return sa.func.coalesce(self._ended(policies), False)
        # An unreadable time is a candidate too: judged reconcile_error, never left unseen.
        return sa.or_(sa.func.coalesce(self._lease_over(policies) >= 0, False),
                      *(test for _, test in self._unreadable_times(scope.conn)))

    def _ended(self, policies: Policies) -> sa.ColumnElement[Any]:
        """``_lease_over >= 0`` as comparisons of times (PostgreSQL): a scan's filter on
        every running row, where the seconds as a number cost a numeric EXTRACT each."""
        by_activity: sa.ColumnElement[Any] = sa.null()
        if self._has("activity_column"):
            max_run = by_kind(self.kind, policies, lambda p: p.max_run_seconds)
            by_activity = (self._col("activity_column")
                           <= now_plus(-sa.cast(max_run, sa.Float())))
        if not self._has("lease_expires_column"):
            return by_activity
        lease = self._col("lease_expires_column")
        return sa.case((lease.is_not(None), lease <= db_now()), else_=by_activity)

    def wedge_guard(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Only under a known live lease: a job with no lease at all is never reclaimed
        on time alone, not even as wedged."""
        return self._lease_over(policies).is_not(None)

    # -- evidence ------------------------------------------------------------ #

    def candidate(self, scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One row's facts: its own plan where mapped; each fenced column as read."""
        values = row._mapping
        over = values["lease_expired_seconds"]
        attempts = int(values.get("attempts_column") or 0) if self._has("attempts_column") \
            else 1
        max_attempts = values.get("max_attempts_column")
        generation = values.get("generation_column")
        activity = values.get("activity_age")
        own_plan: tuple[str | None, StepRows] | None = None
        unreadable: tuple[tuple[str, str | int], ...] = next(
            ((("error_code", UNREADABLE_TIMESTAMP), ("column", self.columns[key]))
             for key, _ in self._unreadable_times(scope.conn) if values[f"unreadable_{key}"]), ())
        if self._has("plan_column"):
            # The table's own plan and results: a NULL plan is unresumable, not one step.
            raw = values["plan_column"]
            results = step_results(values["steps_column"])
            if results is None:
                results = ()
                unreadable = unreadable or (("error_code", UNREADABLE_STEPS),
                                            ("column", self.columns["steps_column"]))
            own_plan = (raw if raw is None or isinstance(raw, str) else json.dumps(raw),
                        results)
        found = candidate(
            job_id=row.job_id, kind=str(row.job_kind), policy=policy,
            # The kind's max_run_seconds rides along: the swap repeats the lease it judged.
            fence=Fence(int(generation) if generation is not None else (
                attempts if self._has("attempts_column") else None),
                TableFence(self._snapshot(values), policy.max_run_seconds)),
            attempt_count=attempts,
            max_attempts=int(max_attempts) if max_attempts is not None else policy.max_attempts,
            lease_live=over is None or float(over) < 0,
            lease_expired_seconds=None if over is None or float(over) < 0 else float(over),
            steps=steps, position=position, own_plan=own_plan,
            activity_age_seconds=None if activity is None else float(activity),
        )
        return dataclasses.replace(found, unreadable=unreadable) if unreadable else found

    def _fence_keys(self) -> list[str]:
        # The activity time too: the decision relied on it (recent activity protects a job,
        # no activity wedges one), so a late worker's progress must make the swap miss.
        return [k for k in ("owner_column", "attempts_column", "generation_column",
                            "lease_expires_column", "activity_column") if self._has(k)]

    def _snapshot(self, values: Mapping[Any, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple((key, values[key]) for key in self._fence_keys())

    # -- for operators ------------------------------------------------------ #

    def listing(self, conn: Connection) -> sa.Select[Any]:
        """Every row of the mapped table (times are not mapped, so none are shown)."""
        def mapped(key: str) -> sa.ColumnElement[Any]:
            return self._col(key) if self._has(key) else sa.null()

        attempts = self._col("attempts_column") if self._has("attempts_column") else \
            sa.literal(0)
        return sa.select(
            self.key.label("job_id"), self.kind.label("job_kind"),
            sa.cast(self._col("status_column"), sa.String()).label("source_status"),
            attempts.label("attempts"), mapped("max_attempts_column").label("max_attempts"),
            mapped("reason_column").label("reason"), sa.null().label("created_at"),
            sa.null().label("updated_at"), sa.null().label("finished_at"),
            mapped("resume_column").label("resume_step"),
            # Its own plan and step results where mapped: what ``jobs show`` lists, as
            # the pass reads them (the ledger holds none of this table's steps then).
            *([self._col("plan_column").label("own_plan"),
               self._col("steps_column").label("own_steps")]
              if self._has("plan_column") else []))

    # -- applying ------------------------------------------------------------ #

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """The batch's changes, each row only as read: one statement per kind's lease
        on PostgreSQL, one per change on SQLite and MySQL."""
        if not scope.postgres:
            # SQLite runs in process: a statement per change costs no round trip. MySQL
            # has no row type to read the snapshots back as (each fenced column compared
            # with its own type, whatever the user's): a statement per change, judged by
            # its affected rows, on rows the scan already locked.
            return {change.decision.job_id: generation for change in batch.changes
                    for swapped, generation in [self._apply_one(scope.conn, batch, change)]
                    if swapped}
        by_lease: dict[float | None, list[PlannedChange]] = {}
        for change in batch.changes:
            by_lease.setdefault(fence_of(change, TableFence).max_run_seconds,
                                []).append(change)
        changed: Changed = {}
        for max_run, changes in by_lease.items():
            changed.update(self._swap_set(scope.conn, batch, max_run, changes))
        return changed

    def _swap_set(self, conn: Connection, batch: Batch, max_run: float | None,
                  changes: Sequence[PlannedChange]) -> Changed:
        """One ``UPDATE ... FROM jsonb_populate_recordset(NULL::<table>, :rows)`` for the
        changes of one kind's lease (PostgreSQL): the snapshots as rows of the table's own
        type, so each fenced column compares with its own type, whatever the user's."""
        names = self.columns
        key_name = names["id_column"]
        resume = batch.disposition is Disposition.RESUME and self._has("resume_column")
        rows = []
        for change in changes:
            row = {names[key]: value for key, value in fence_of(change, TableFence).columns}
            row[key_name] = change.decision.job_id
            if resume:
                row[names["resume_column"]] = change.decision.resume_step_index or 0
            rows.append(row)
        seen, params = rows_as_read(conn, self.table, list(rows[0]), rows)
        where = [self.key == seen.c[key_name],
                 self._col("status_column") == constant(self.config.processing)]
        where += [self._col(key).is_not_distinct_from(seen.c[names[key]])
                  for key in self._fence_keys()]
        where.append(self._still(batch, max_run))
        values = self._swap_values(batch)
        if resume:
            values[names["resume_column"]] = seen.c[names["resume_column"]]
        done = {str(key) for key in conn.execute(
            self.table.update().where(*where).values(values)
            .returning(self.key), params).scalars()}
        changed: Changed = {}
        for change in changes:
            if str(change.decision.job_id) in done:
                changed[change.decision.job_id] = self._swapped(batch, change)
        return changed

    def _still(self, batch: Batch, max_run: float | None) -> sa.ColumnElement[bool]:
        """The rule's time predicate, repeated in the swap."""
        if batch.stalled is not None:
            return batch.stalled
        run_limit = sa.null() if max_run is None else sa.literal(float(max_run), sa.Float())
        return sa.func.coalesce(self._lease_over_by(run_limit) >= 0, False)

    def _swap_values(self, batch: Batch) -> dict[str, Any]:
        """What a swap writes besides the resume step: status, reason, generation."""
        values: dict[str, Any] = {}
        if batch.disposition is Disposition.RESUME:
            values[self.columns["status_column"]] = constant(self.config.queued)
        else:
            values[self.columns["status_column"]] = constant(self.config.failed)
        if self._has("reason_column"):
            values[self.columns["reason_column"]] = constant(batch.reason)
        if self._has("generation_column"):
            values[self.columns["generation_column"]] = self._col("generation_column") + 1
        return values

    def _swapped(self, batch: Batch, change: PlannedChange) -> int | None:
        """After a change swapped in: its ledger fenced; the generation after."""
        snapshot = dict(fence_of(change, TableFence).columns)
        if not self._has("plan_column") and self._has("attempts_column"):
            batch.ledger.fence(change.decision.job_id, int(snapshot["attempts_column"] or 0) + 1)
        if self._has("generation_column"):
            return int(snapshot["generation_column"] or 0) + 1
        if self._has("attempts_column"):
            return int(snapshot["attempts_column"] or 0)
        return None

    def _apply_one(self, conn: Connection, batch: Batch, change: PlannedChange
                   ) -> tuple[bool, int | None]:
        """One change swapped in alone (SQLite, MySQL); (changed, generation after)."""
        decision = change.decision
        fence = fence_of(change, TableFence)
        where = [self.key == decision.job_id,
                 self._col("status_column") == constant(self.config.processing)]
        where += [self._col(key).is_not_distinct_from(value) for key, value in fence.columns]
        where.append(self._still(batch, fence.max_run_seconds))
        values = self._swap_values(batch)
        if decision.disposition is Disposition.RESUME and self._has("resume_column"):
            values[self.columns["resume_column"]] = decision.resume_step_index or 0
        done = conn.execute(self.table.update().where(*where).values(values))
        if done.rowcount != 1:
            return False, None
        return True, self._swapped(batch, change)


def declare(config: TableConfig) -> System:
    """A mapped home-grown job table."""
    sql = TableSql.of(config)
    has = config.mapped_columns()
    return System(
        shape=Shape(
            key=sql.key, kind=sql.kind, locks=sql.table,
            activity=sql.table.c[has["activity_column"]] if "activity_column" in has
            else None,
            # Plans and step results live in the table when mapped: the ledger is not read.
            steps_in_ledger="plan_column" not in has,
            counts_attempts="attempts_column" in has, scans_all_kinds=True,
            leases_own="lease_expires_column" in has,
            # A ``timestamp`` (without time zone) column is UTC: read it so.
            naive_utc="scan"),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=sql.listing,
        # The three mapped statuses; any other value is shown as the table holds it.
        status_words={config.processing: JobStatus.PROCESSING,
                      config.queued: JobStatus.QUEUED, config.failed: JobStatus.FAILED},
        wedge_guard=sql.wedge_guard)


DECLARATION = Declaration(TableConfig, declare)
