"""The operator desk over a foreign source: what every system shares, once.

A system gives its ``SystemActions`` (``reconciler/sources/<system>/actions.py``): how it
reads one job (its own status, that status in this project's words, and what a swap must
repeat), and its retry and cancel in its own terms, each one statement fenced on the job
as read. Everything else is here: the operator state machine (``core.policy``), the
reconciler's own hold (a row of ``operator_holds``: the system's workers are not stopped,
a pass leaves the job undecided), the record, and the count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.core.kinds import KindRules
from reconciler.core.operator_desk import ActionCounter, ActionReport, not_counted
from reconciler.core.policy import Refusal, operator_change
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction
from reconciler.storage.desks import RecordedDesk, allowed_now, refused_line
from reconciler.storage.engines import read_only
from reconciler.storage.operator_record import (
    ActionRecord,
    held_among,
    is_held,
    lift_hold,
    record_action,
    record_actions,
    set_hold,
)
from reconciler.storage.sql import SQLITE
from reconciler.storage.step_ledger import restart_attempts

UNMAPPED_STATUS = "status_not_mapped"
"""The refusal of a job in a status its system's actions cannot read or write back."""

HOLD_LIMIT = ("the reconciler leaves it undecided while held; the system's own workers "
              "are not stopped by a hold")
"""What a hold on a foreign job does not do, said on every hold (with what the system's
own recovery does meanwhile: its actions' ``limits`` for ``hold``)."""


class SystemRefusal(Exception):  # noqa: N818 - a refusal, not a failure
    """A system's retry or cancel found its own reason not to apply (a code); the swap
    changed nothing."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


@dataclass(frozen=True, slots=True)
class ForeignJob:
    """One job as its system's actions read it."""

    state: str
    """Its status as the system spells it (what the record keeps)."""
    word: JobStatus | None
    """That status in this project's words; None for one the actions cannot take."""
    fence: Any
    """What a swap repeats (the system's own columns as read)."""


class SystemActions(Protocol):
    """One system's retry and cancel, bound to a transaction's connection."""

    limits: Mapping[OperatorAction, str]
    """What an action cannot do on this system, said on the line it prints."""

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The job, or None when the system has no such job; its row locked for the swap
        with ``lock`` (an action), read as it is without (a look: what ``allowed`` offers
        waits behind no worker and writes no lock)."""

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """Why the system cannot take ``action`` on the job in its shape (a code), before
        the operator state machine is asked; None: nothing of its own against it."""

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """Queue the job again, runnable now, fenced on ``job``; its state after, or None
        when the swap missed (the job moved meanwhile: nothing changed). ``SystemRefusal``
        when the system's own rules refuse it."""

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """End the job cancelled (or failed ``operator_cancel``), fenced like ``retry``."""


@runtime_checkable
class BatchActions(Protocol):
    """A system whose retry and cancel take a chunk of jobs in one statement each (the
    bulk form's): the chunk read and locked in one, swapped in one, every job fenced on
    what was read inside it."""

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The jobs the system has of these, in one read (``lock``: locked for the swap,
        as ``SystemActions.read``)."""

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """``retry`` or ``cancel`` of each job, fenced on it as read; the state after of
        each job changed (one that moved meanwhile is absent: nothing changed; one the
        system's own rules refused is absent and its code put in ``refused``)."""


@runtime_checkable
class HoldsOwnRecovery(Protocol):
    """A system whose own recovery of a job (an expiry, a sweep) can be held back in its
    own shape while an operator holds the job (pg-boss: the job's expiry pushed back)."""

    def hold_recovery(self, job_key: JobKey, job: ForeignJob, *, held: bool) -> None:
        """Hold back (``held``) or give back the system's own recovery of the job."""


ActionsOpener = Callable[[Connection, Any, KindRules], SystemActions]
"""Opens a system's actions on a connection, with its ``[source]`` config and kinds."""


def locked(query: sa.Select[Any], lock: bool) -> sa.Select[Any]:
    """``query`` locking the rows it reads (``FOR UPDATE``) when ``lock``."""
    return query.with_for_update() if lock else query


def read_locked(conn: Connection, query: sa.Select[Any], status: str,
                words: Mapping[str, JobStatus], *, lock: bool) -> ForeignJob | None:
    """The one job ``query`` finds, with ``lock`` its row locked for the action's swap on
    PostgreSQL and MySQL (SQLite's write lock is the transaction's), in our words by its
    ``status`` column; None when the system has no such job."""
    row = conn.execute(locked(query, lock and conn.dialect.name != SQLITE)).first()
    if row is None:
        return None
    state = str(row._mapping[status])
    return ForeignJob(state, words.get(state), dict(row._mapping))


def held_state(state: str, held: bool) -> str:
    """A state as the record keeps it, with the reconciler's own hold."""
    return f"{state} (held)" if held else state


class ForeignDesk(RecordedDesk):
    """The desk over a foreign source (see the module's docstring)."""

    def __init__(self, engine: Engine, source: str, config: Any, kinds: KindRules, *,
                 opener: ActionsOpener, parse_key: Callable[[str], JobKey],
                 counted: ActionCounter = not_counted) -> None:
        super().__init__(engine, counted)
        self.source = source
        self._config = config
        self._kinds = kinds
        self._open = opener
        self._parse = parse_key

    def _key(self, job_id: str) -> JobKey | None:
        try:
            return self._parse(job_id)
        except ValueError:
            return None

    def allowed(self, job_id: str) -> frozenset[OperatorAction]:
        """The actions the job's current state allows (empty for an unknown job)."""
        key = self._key(job_id)
        if key is None:
            return frozenset()
        with self._engine.connect() as conn:
            reading = read_only(conn)
            job = self._open(reading, self._config, self._kinds).read(key, lock=False)
            held = job is not None and is_held(reading, self.source, key)
            conn.rollback()
        return frozenset() if job is None else _allowed_for(job, held=held)

    def act(self, action: OperatorAction, job_id: str, *, actor: str,
            note: str | None) -> ActionReport:
        """Apply one action, fenced on the job as read now, and record it either way."""
        key = self._key(job_id)
        if key is None:
            return self.report(action, job_id, Refusal.NO_SUCH_JOB.value,
                               f"no {self.source} job with id {job_id}")
        with self._engine.begin() as conn:
            system = self._open(conn, self._config, self._kinds)
            job = system.read(key, lock=True)
            if job is None:
                return self.report(action, job_id, Refusal.NO_SUCH_JOB.value,
                                   f"no {self.source} job with id {job_id}")
            held = is_held(conn, self.source, key)
            refusal, after, held_after = self._apply(conn, system, action, key, job,
                                                     held=held, actor=actor)
            before_text = held_state(job.state, held)
            after_text = held_state(after, held_after)
            record_action(conn, ActionRecord(
                source=self.source, job_key=key, action=action, actor=actor, note=note,
                refusal=refusal, state_before=before_text, state_after=after_text))
        if refusal is not None:
            line = refused_line(action, job_id, refusal)
            if refusal == UNMAPPED_STATUS:
                line = (f"job {job_id}: {action} refused ({refusal}): its status "
                        f"{job.state!r} is not one the {self.source} actions can take back")
            return self.report(action, job_id, refusal, line)
        line = f"job {job_id}: {action} applied; {before_text} -> {after_text}"
        limit = system.limits.get(action)
        if action is OperatorAction.HOLD:
            limit = HOLD_LIMIT + (f"; {limit}" if limit else "")
        return self.report(action, job_id, None, line + (f" ({limit})" if limit else ""))

    def _apply(self, conn: Connection, system: SystemActions, action: OperatorAction,
               key: JobKey, job: ForeignJob, *, held: bool, actor: str
               ) -> tuple[str | None, str, bool]:
        """(refusal, state after, held after) of one action on a job as read."""
        if action is OperatorAction.UNHOLD:
            # A hold is lifted whatever the job's state now, one the actions cannot map
            # included (its system ended it meanwhile): lifting changes nothing else.
            if not held or not lift_hold(conn, self.source, key):
                return Refusal.NOT_HELD.value, job.state, held
            if isinstance(system, HoldsOwnRecovery):
                system.hold_recovery(key, job, held=False)
            return None, job.state, False
        refusal = _refusal(system, action, job, held=held)
        if refusal is not None:
            return refusal, job.state, held
        if action is OperatorAction.HOLD:
            if not set_hold(conn, self.source, key, actor):
                return Refusal.ALREADY_HELD.value, job.state, held
            if isinstance(system, HoldsOwnRecovery):
                system.hold_recovery(key, job, held=True)
            return None, job.state, True
        swap = system.retry if action is OperatorAction.RETRY else system.cancel
        try:
            after = swap(key, job)
        except SystemRefusal as refused:
            return refused.code, job.state, held
        if after is None:
            return Refusal.FENCE_LOST.value, job.state, held
        if action is OperatorAction.RETRY:
            # A fresh attempt budget: the system counts from the start again, and so does
            # the step ledger, whose finished steps are kept (the run resumes after them).
            restart_attempts(conn, self.source, [key])
        return None, after, held

    def _allowed_among(self, keys: Sequence[str]
                       ) -> Iterable[tuple[str, frozenset[OperatorAction]]]:
        """Where the system reads a batch, the chunk's jobs and holds in one read each,
        unlocked; else each job on its own."""
        parsed = {job_id: key for job_id in keys if (key := self._key(job_id)) is not None}
        with self._engine.connect() as conn:
            reading = read_only(conn)
            system = self._open(reading, self._config, self._kinds)
            if not isinstance(system, BatchActions):
                conn.rollback()
                return super()._allowed_among(keys)
            found = system.read_many(list(parsed.values()), lock=False)
            held = held_among(reading, self.source, list(found))
            conn.rollback()
        return [(job_id, _allowed_for(found[key], held=str(key) in held))
                for job_id, key in parsed.items() if key in found]

    def act_on_chunk(self, action: OperatorAction, job_ids: Sequence[str], *, actor: str,
                     note: str | None) -> list[ActionReport]:
        """A retry or cancel of a chunk in one transaction: read and swapped in one
        statement each where the system takes a batch (``BatchActions``), else job by
        job inside it; the holds read, the ledgers restarted and the actions recorded
        once for the chunk. A hold or unhold goes job by job."""
        if action not in (OperatorAction.RETRY, OperatorAction.CANCEL):
            return super().act_on_chunk(action, job_ids, actor=actor, note=note)
        keys = {job_id: self._key(job_id) for job_id in job_ids}
        wanted = [key for key in keys.values() if key is not None]
        with self._engine.begin() as conn:
            system = self._open(conn, self._config, self._kinds)
            found = (system.read_many(wanted, lock=True) if isinstance(system, BatchActions)
                     else {k: j for k in wanted if (j := system.read(k, lock=True))})
            held = held_among(conn, self.source, list(found))
            refused = {key: refusal for key, job in found.items()
                       if (refusal := _refusal(system, action, job,
                                               held=str(key) in held)) is not None}
            chosen = {key: job for key, job in found.items() if key not in refused}
            after = self._swapped(system, action, chosen, refused)
            refused.update({key: Refusal.FENCE_LOST.value for key in chosen
                            if key not in after and key not in refused})
            if action is OperatorAction.RETRY:
                restart_attempts(conn, self.source, list(after))
            record_actions(conn, [ActionRecord(
                source=self.source, job_key=key, action=action, actor=actor, note=note,
                refusal=refused.get(key),
                state_before=held_state(job.state, str(key) in held),
                state_after=held_state(after.get(key, job.state), str(key) in held))
                for key, job in found.items()])
        reports = []
        for job_id, key in keys.items():
            if key is None or key not in found:
                reports.append(self.report(action, job_id, Refusal.NO_SUCH_JOB.value,
                                           f"no {self.source} job with id {job_id}"))
            elif key in refused:
                reports.append(self.report(action, job_id, refused[key],
                                           refused_line(action, job_id, refused[key])))
            else:
                reports.append(self.report(
                    action, job_id, None, f"job {job_id}: {action} applied; "
                    f"{found[key].state} -> {after[key]}"))
        return reports

    @staticmethod
    def _swapped(system: SystemActions, action: OperatorAction,
                 jobs: Mapping[JobKey, ForeignJob], refused: dict[JobKey, str]
                 ) -> dict[JobKey, str]:
        """Each job's state after its swap (a job that moved is absent; one the system
        refused is absent and its code put in ``refused``)."""
        if not jobs:
            return {}
        if isinstance(system, BatchActions):
            return system.swap_many(action, jobs, refused)
        return one_by_one(system, action, jobs, refused)


def one_by_one(system: SystemActions, action: OperatorAction,
               jobs: Mapping[JobKey, ForeignJob], refused: dict[JobKey, str]
               ) -> dict[JobKey, str]:
    """Each job's retry or cancel on its own swap (a system that takes no batch, or a
    batch that must fall back): the state after of each job changed; one the system
    refused is absent and its code put in ``refused``."""
    swap = system.retry if action is OperatorAction.RETRY else system.cancel
    after: dict[JobKey, str] = {}
    for key, job in jobs.items():
        try:
            state = swap(key, job)
        except SystemRefusal as refusal:
            refused[key] = refusal.code
            continue
        if state is not None:
            after[key] = state
    return after


def _allowed_for(job: ForeignJob, *, held: bool) -> frozenset[OperatorAction]:
    """The actions the job's state allows now."""
    if job.word is None:  # a status the actions cannot take: only a hold is lifted
        return frozenset({OperatorAction.UNHOLD}) if held else frozenset()
    return allowed_now(job.word, held)


def _refusal(system: SystemActions, action: OperatorAction, job: ForeignJob, *,
             held: bool) -> str | None:
    """Why ``action`` cannot apply to the job as read (a code): a status the system's
    actions cannot take, the system's own reason, or the operator state machine's."""
    if job.word is None:
        return UNMAPPED_STATUS
    own = system.refuses(action, job)
    if own is not None:
        return own
    change = operator_change(action, job.word, held)
    return change.value if isinstance(change, Refusal) else None
