"""The ``django-tasks`` source's fixture: django-tasks-db's own table, created by Django's
own ``migrate``, on SQLite and PostgreSQL.

Task results are written as the backend writes them (``enqueue``'s row, ``claim``'s
status, ``started_at`` and ``worker_ids``; tests/sources/django_tasks_support.py), steps
through the real step ledger, as a Django task recording its steps would. The kinds carry a
``max_run_seconds`` (the backend has no liveness: the lease is the claim's age).

Declared gaps, beside those every ledger-backed system shares (no hold, no gate, no
unreadable plan, no resume step or generation of its own): no owner liveness and so no
silent owner and no late heartbeat.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from reconciler.core.ports import JobKey
from reconciler.sources.django_tasks import DjangoTasksConfig
from reconciler.storage.clock import now_plus
from tests.conformance.fixtures import (
    TIMING,
    Capability,
    Interference,
    Outcome,
    RegisteredSource,
    Situation,
    SourceJob,
    State,
)
from tests.conformance.foreign import ForeignFixture, kind_for
from tests.conformance.systems import _common_gaps, _every, _no_reused_names, _specs
from tests.helpers import rows_of
from tests.sources.django_tasks_support import (
    LEDGER,
    LONG_AGO_SECONDS,
    DjangoDatabase,
    DjangoTasksFactory,
    open_django_db,
    record_steps,
    set_ledger,
)

OUTCOMES: dict[str, Outcome] = {"queued": "runnable", "running": "running",
                                "failed": "failed", "completed": "completed"}


class DjangoTasksFixture(ForeignFixture):
    """django-tasks-db's task results as a source under test (see ``SourceFixture``)."""

    source_name = "django-tasks"
    gaps: dict[Capability, str] = _common_gaps("django-tasks") | _no_reused_names(
        "django-tasks", "no owner") | {
        **_every(State.OWNER_GONE, "django-tasks-db has no worker liveness: only the "
                 "claim's age past max_run_seconds tells"),
        Interference.LATE_HEARTBEAT: "django-tasks-db has no heartbeat",
    }

    def __init__(self, db: DjangoDatabase) -> None:
        self.factory = DjangoTasksFactory(db, DjangoTasksConfig())
        super().__init__(db.engine, self.factory.config)
        self._serial = itertools.count(1)

    def key_of(self, text: str) -> JobKey:
        return text

    # -- making situations --------------------------------------------------------------------

    def make(self, situation: Situation) -> SourceJob:
        """A task claimed as the backend claims, its steps recorded through the ledger."""
        state, n = situation.state, situation.step
        kind = kind_for(situation.effect, next(self._serial))
        specs = _specs(situation)
        factory = self.factory
        if state in (State.LIVE, State.WEDGED):
            job = factory.live(kind)
            if state is State.WEDGED:
                record_steps(self.engine, self.source_name, job, 1, specs,
                             age=TIMING.wedged_after_seconds + 60)
        else:
            used = factory.default_max_attempts if state is State.OUT_OF_ATTEMPTS else 1
            job = factory.died(kind, attempts_used=used, steps=specs)
            if state is State.STEP_FAILED:
                set_ledger(self.engine, self.source_name, job, step=n, failure_retryable=False)
            elif state is State.RECENTLY_ACTIVE:
                set_ledger(self.engine, self.source_name, job,
                           updated_at=now_plus(-TIMING.recent_seconds))
        return SourceJob(job, factory.attempts_used(job))

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow worker's late write, or another replica and worker taking the job."""
        if change is Interference.LATE_PROGRESS:
            set_ledger(self.engine, self.source_name, job.key, updated_at=now_plus(0))
        elif change is Interference.LATE_COMPLETION:
            self.factory.complete(job.key)
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [d.job_id for d in recovered.decisions] == [job.key]
            assert self.status(job) == "runnable"
            # The backend's next worker claims it, then dies as well.
            self.factory.claim(job.key, age=LONG_AGO_SECONDS)
        else:  # pragma: no cover - LATE_HEARTBEAT is a declared gap
            raise AssertionError(change)

    # -- observing ----------------------------------------------------------------------------

    def status(self, job: SourceJob) -> Outcome:
        """The backend's status in neutral words."""
        return OUTCOMES[self.factory.status(job.key)]

    def reason(self, job: SourceJob) -> str | None:
        """Our reason code, from the traceback the reconciler wrote."""
        return self.factory.error_text(job.key)

    def resume_step(self, job: SourceJob) -> int | None:
        """Never asked (declared): the backend keeps no resume step."""
        return None

    def generation(self, job: SourceJob) -> int | None:
        """Never asked (declared)."""
        return None

    def snapshot(self, job: SourceJob) -> object:
        """The task's row and its ledger rows."""
        return (self.factory.row(job.key), rows_of(
            self.engine, LEDGER, LEDGER.c.source_name == self.source_name,
            LEDGER.c.job_key == str(job.key), order=LEDGER.c.step_index))


@contextmanager
def open_django_tasks(request: pytest.FixtureRequest) -> Iterator[DjangoTasksFixture]:
    """The fixture on the test's engine: a copy of the migrated SQLite template, or the
    session's PostgreSQL database with the task table emptied."""
    engine_name = request.param[1]
    folder = request.getfixturevalue("tmp_path")
    opened = open_django_db(request, engine_name, folder)
    db = next(opened)
    try:
        yield DjangoTasksFixture(db)
    finally:
        opened.close()


DJANGO_TASKS = RegisteredSource("django-tasks", ("sqlite", "postgresql", "mysql"),
                                open_django_tasks,
                                shared=True)

__all__ = ["DJANGO_TASKS", "sa"]
