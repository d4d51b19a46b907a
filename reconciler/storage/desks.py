"""The operator desk (``reconciler.core.operator_desk.OperatorDesk``) over the native
source, and what every source's desk shares: the bulk form's choice of jobs (their latest
decision, their kind, what their state allows now) and the count of outcomes.

Each action is one transaction that reads the job, swaps it fenced on what it read, and
records the action (applied or refused) beside it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Unpack

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.operator_desk import (
    ActionCounter,
    ActionReport,
    BulkFilter,
    not_counted,
)
from reconciler.core.policy import Refusal, operator_change
from reconciler.core.vocabulary import ActionOutcome, JobStatus, OperatorAction
from reconciler.storage.deadlocks import deadlock_retried
from reconciler.storage.engines import read_only
from reconciler.storage.operator import NATIVE, OperatorSql
from reconciler.storage.operator_bulk import Acted, act_on_chunk
from reconciler.storage.operator_record import latest_decisions
from reconciler.storage.sql import jobs

STATE_READ_CHUNK = 1000
"""Jobs whose states one read of the bulk form's choice reads."""

REFUSALS: dict[str, str] = {
    Refusal.NO_SUCH_JOB.value: "no such job",
    Refusal.JOB_TERMINAL.value: "the job has ended",
    Refusal.ALREADY_HELD.value: "it is held already",
    Refusal.NOT_HELD.value: "it is not held",
    Refusal.JOB_NOT_FAILED_OR_CANCELLED.value:
        "only a failed or cancelled job is retried (it is queued, running or completed)",
    Refusal.FENCE_LOST.value:
        "the job changed while the action was applied; nothing was changed, look again",
}
"""Each refusal code in words, for the line an operator reads."""


def allowed_now(status: JobStatus, held: bool) -> frozenset[OperatorAction]:
    """The actions the operator state machine allows a job in ``status``."""
    return frozenset(a for a in OperatorAction
                     if not isinstance(operator_change(a, status, held), Refusal))


class RecordedDesk:
    """What every source's desk shares; a source's desk gives ``allowed`` and ``act``."""

    source: str

    def __init__(self, engine: Engine, counted: ActionCounter) -> None:
        self._engine = engine
        self._counted = counted

    def allowed(self, job_id: str) -> frozenset[OperatorAction]:
        """The actions the job's current state allows (empty for an unknown job)."""
        raise NotImplementedError

    def act(self, action: OperatorAction, job_id: str, *, actor: str,
            note: str | None) -> ActionReport:
        """Apply one action, fenced on the job as read now, and record it either way."""
        raise NotImplementedError

    def act_on_chunk(self, action: OperatorAction, job_ids: Sequence[str], *, actor: str,
                     note: str | None) -> list[ActionReport]:
        """Each job's ``act``, one after the other (a source whose system takes no batch)."""
        return [self.act(action, job_id, actor=actor, note=note) for job_id in job_ids]

    def bulk_targets(self, action: OperatorAction, *, limit: int,
                     **filters: Unpack[BulkFilter]) -> list[str]:
        """The jobs whose latest decision matches ``filters`` and whose state allows
        ``action`` now, newest decision first, at most ``limit``."""
        keys = self._matching(filters)
        targets: list[str] = []
        for start in range(0, len(keys), STATE_READ_CHUNK):
            for key, allowed in self._allowed_among(keys[start:start + STATE_READ_CHUNK]):
                if len(targets) >= limit:
                    return targets
                if action in allowed:
                    targets.append(key)
        return targets

    def _allowed_among(self, keys: Sequence[str]
                       ) -> Iterable[tuple[str, frozenset[OperatorAction]]]:
        """What each of these jobs' states allows now (a job that no longer exists is left
        out): here each job read on its own, lazily, so a bulk capped by its limit reads
        no more than it needs; a desk that reads many jobs at once says so."""
        return ((key, self.allowed(key)) for key in keys)

    def _matching(self, filters: BulkFilter) -> list[str]:
        """The jobs whose latest decision matches ``filters``, newest decision first."""
        kind = filters.get("kind")
        with self._engine.connect() as conn:
            found = latest_decisions(
                read_only(conn), self.source, reason=filters.get("reason"),
                disposition=filters.get("disposition"), since=filters.get("since"),
                until=filters.get("until"))
            keys = [key for key, recorded_kind in found
                    if kind is None or fnmatch.fnmatchcase(recorded_kind or "", kind)]
            conn.rollback()
        return keys

    def report(self, action: OperatorAction, job_id: str, refusal: str | None,
               line: str) -> ActionReport:
        """The action's report, counted (an unknown job is neither counted nor recorded)."""
        if refusal != Refusal.NO_SUCH_JOB.value:
            self._counted(action, self.source,
                          ActionOutcome.REFUSED if refusal else ActionOutcome.APPLIED)
        return ActionReport(action, job_id, refusal is None, refusal, line)


def refused_line(action: OperatorAction, job_id: str, refusal: str) -> str:
    """The line of a refused action: what and why, in words."""
    return f"job {job_id}: {action} refused ({refusal}): {REFUSALS.get(refusal, refusal)}"


class NativeDesk(RecordedDesk):
    """This project's own jobs: ``storage.operator``'s fenced writes, recorded."""

    source = NATIVE

    def __init__(self, engine: Engine, store: OperatorSql,
                 counted: ActionCounter = not_counted) -> None:
        super().__init__(engine, counted)
        self._store = store

    def _state(self, job_id: str) -> tuple[JobStatus, bool] | None:
        if not (job_id.isascii() and job_id.isdigit()):
            return None
        with self._engine.connect() as conn:
            row = read_only(conn).execute(
                sa.select(jobs.c.job_status, jobs.c.operator_hold)
                .where(jobs.c.job_id == int(job_id))).one_or_none()
            conn.rollback()
        return None if row is None else (JobStatus(row.job_status), bool(row.operator_hold))

    def allowed(self, job_id: str) -> frozenset[OperatorAction]:
        """The actions the job's current state allows (empty for an unknown job)."""
        state = self._state(job_id)
        return frozenset() if state is None else allowed_now(*state)

    def _allowed_among(self, keys: Sequence[str]
                       ) -> Iterable[tuple[str, frozenset[OperatorAction]]]:
        """The chunk's job states in one read."""
        numeric = [int(k) for k in keys if k.isascii() and k.isdigit()]
        with self._engine.connect() as conn:
            states = {str(r.job_id): (JobStatus(r.job_status), bool(r.operator_hold))
                      for r in read_only(conn).execute(
                          sa.select(jobs.c.job_id, jobs.c.job_status, jobs.c.operator_hold)
                          .where(jobs.c.job_id.in_(numeric)))}
            conn.rollback()
        return [(k, allowed_now(*states[k])) for k in keys if k in states]

    def act_on_chunk(self, action: OperatorAction, job_ids: Sequence[str], *, actor: str,
                     note: str | None) -> list[ActionReport]:
        """The chunk in one transaction (``storage.operator_bulk``)."""
        numeric = [int(j) for j in job_ids if j.isascii() and j.isdigit()]
        done = {str(a.job_id): a.refusal
                for a in self._chunk(numeric, action, actor=actor, note=note)}
        reports = []
        for job_id in job_ids:
            refusal = done.get(job_id, Refusal.NO_SUCH_JOB.value)
            line = (f"job {job_id}: {action} applied" if refusal is None
                    else refused_line(action, job_id, refusal))
            reports.append(self.report(action, job_id, refusal, line))
        return reports

    @deadlock_retried
    def _chunk(self, job_ids: Sequence[int], action: OperatorAction, *, actor: str,
               note: str | None) -> list[Acted]:
        with self._engine.begin() as conn:
            return act_on_chunk(conn, job_ids, action, actor=actor, note=note)

    def act(self, action: OperatorAction, job_id: str, *, actor: str,
            note: str | None) -> ActionReport:
        """Apply one action, fenced on the job as read now, and record it either way."""
        if not (job_id.isascii() and job_id.isdigit()):
            return self.report(action, job_id, Refusal.NO_SUCH_JOB.value,
                               f"no job with id {job_id}")
        applied, refusal = self._store.operator_action(int(job_id), action.value,
                                                       actor=actor, note=note)
        if not applied:
            refusal = refusal or Refusal.FENCE_LOST.value
            return self.report(action, job_id, refusal,
                               refused_line(action, job_id, refusal))
        state = self._state(job_id)
        line = f"job {job_id}: {action} applied"
        if state is not None:
            line += f"; status {state[0].value}"
            if action is OperatorAction.RETRY and state[1]:
                # A retry never lifts a hold: the operator who held the job decides.
                line += (f"; it is still held and will not run until `reconciler jobs "
                         f"unhold {job_id}`")
        return self.report(action, job_id, None, line)
