"""Whose Celery task lost its worker: the broker's answers, judged once per pass.

A ``STARTED`` row names its worker, but a name is not a process: a worker restarted under
its old node name answers for it without holding its predecessor's tasks. So a task is
judged by whether some worker process holds it (``CeleryBroker.answers``: Celery's own
``query_task``), and it is gone once no worker has held it for ``session_timeout_seconds``
across passes (remembered in the broker, on its clock), whether its worker is silent or
a later process answers under the name. What is not held is evidence only where the
answers can be trusted:

- the broker answers, holds the app's queues and some worker answers: a task is gone once
  no worker has held it for the timeout (and, for a kind with ``max_run_seconds``, the
  reconciler first saw the task that long ago);
- it answers and holds the app's queues, but no worker answers at all (a fleet down or
  unable to answer): only ``max_run_seconds`` decides, and what was noted so far is
  forgotten;
- it does not answer, or holds none of the app's queues (a wrong URL or database
  number): nothing is gone, and nothing is written to it.

``CeleryLiveness`` is the source's declared liveness: one per process (its broker's
client and app kept across passes; the memory itself is in the broker), whose verdict,
a ``Judgement``, the kit reads once per transaction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.ports import LivenessUnknown, StuckCount, StuckWork
from reconciler.core.vocabulary import LivenessDoubt, StuckReason
from reconciler.errors import ConfigError
from reconciler.sources.celery.broker import CeleryBroker
from reconciler.sources.celery.holders import Holding
from reconciler.sources.celery.tables import ResultRows, queue_for
from reconciler.sources.kit.shapes import constant
from reconciler.sources.kit.system import NOT_LOADED, Loaded, Silent

log = logging.getLogger("reconciler.sources.celery")
_WARNED: set[str] = set()
"""Result tables already reported for rows lacking ``result_extended`` (once a process)."""

UNEXTENDED_WHY = ("Celery wrote the row without result_extended, so a STARTED row has no "
                  "task name, args, queue or worker to judge or re-run it by")
UNEXTENDED_FIX = ("set result_extended = True (and task_track_started = True, without "
                  "which a running task has no row at all) in the Celery app's config")


@dataclass(frozen=True, slots=True)
class Running:
    """A ``STARTED`` row with a task name, as the judgement reads it."""

    task_id: str
    name: str
    worker: str | None
    queue: str
    """Where the task was sent (the row's queue, else where the app routes its name)."""


@dataclass(frozen=True, slots=True)
class Judgement:
    """One pass's view of the broker: tasks whose owner is gone (seconds past), why its
    liveness evidence was not trusted (None: it was), and how many running rows could not
    be judged (without ``result_extended``; by unknown liveness). ``holding`` and
    ``unheld``: who was seen holding what, and for how long each task was held by none
    (``owner``), on the broker's clock at ``now``."""

    gone: dict[str, float]
    doubt: LivenessDoubt | None
    unextended: int = 0
    unknown: int = 0
    holding: Holding | None = None
    unheld: Mapping[str, float] = field(default_factory=dict)
    now: float = 0.0

    def owner(self, task_id: str, worker: str | None) -> tuple[tuple[str, bool | float | None],
                                                               ...]:
        """What was seen of a task's owner, for its evidence (no name, no pid): whether its
        named worker answered, whether a worker process holds the task, how long the
        process answering under that name has been up, and how long none has held it;
        nothing when the answers were doubted."""
        found = self.holding
        if found is None or self.doubt is not None:
            return ()
        process = found.answering.get(worker or "")
        unheld = self.unheld.get(task_id)
        return (("worker_answers", process is not None),
                ("a_process_holds_it", task_id in found.held),
                ("answering_process_up_seconds",
                 None if process is None else round(self.now - process.started)),
                ("held_by_none_seconds", None if unheld is None else round(unheld, 3)))

    @property
    def may_swap(self) -> bool:
        """Whether the broker may be written to: it answers and is the app's (a doubt
        about the workers alone still lets a task be failed or re-published on time)."""
        return self.doubt in (None, LivenessDoubt.NO_WORKER_ANSWERS)


def judge(broker: CeleryBroker, rows: Sequence[Running], kinds: KindRules,
          session_timeout_seconds: float, *, unextended: int = 0) -> Judgement:
    """Ask who holds the tasks of ``rows`` and judge each (the module's table), and say
    what was seen of each task's owner (the evidence's ``owner``)."""
    owners = {r.task_id: r.worker for r in rows if r.worker}
    judged = list(owners)
    answers = (broker.answers((), {r.queue for r in rows}, owners) if rows
               else broker.answers_at_all())
    doubt = answers.doubt
    gone: dict[str, float] = {}
    unheld: dict[str, float] = {}
    if rows and doubt in (None, LivenessDoubt.NO_WORKER_ANSWERS):
        try:
            if answers.holding is not None:
                unheld = broker.remember(answers.holding, judged)
            else:
                broker.forget_holders()
            gone = _gone(broker, rows, kinds, unheld if doubt is None else None,
                         session_timeout_seconds)
        except ConfigError:
            raise
        except Exception:  # the broker went away between two calls: nothing is known
            gone, doubt = {}, LivenessDoubt.BROKER_UNREACHABLE
    return Judgement(gone, doubt, unextended, 0 if doubt is None else len(rows) - len(gone),
                     answers.holding, unheld, answers.now)


def _gone(broker: CeleryBroker, rows: Sequence[Running], kinds: KindRules,
          unheld: dict[str, float] | None, timeout: float) -> dict[str, float]:
    """The tasks whose owner is gone, seconds past it. ``unheld``: how long no worker has
    held each task (None: the answers prove nothing this pass, and only
    ``max_run_seconds`` decides)."""
    max_runs = {r.task_id: kinds.resolve(r.name).max_run_seconds for r in rows}
    # Only a kind with max_run_seconds is judged by when its task was first seen.
    seen = broker.first_seen([t for t, m in max_runs.items() if m is not None])
    gone: dict[str, float] = {}
    for row in rows:
        max_run = max_runs[row.task_id]
        over = -1.0
        if unheld is not None and row.worker:
            over = unheld.get(row.task_id, -1.0 - timeout) - timeout
        if max_run is not None:
            ran_over = seen.get(row.task_id, 0.0) - max_run
            over = ran_over if unheld is None else min(over, ran_over)
        if over >= 0:
            gone[row.task_id] = over
    return gone


@dataclass(frozen=True, slots=True)
class CeleryLiveness:
    """Whose task lost its worker, as the app's broker answers: the celery source's
    declared liveness, made once per process from its config."""

    broker: CeleryBroker
    result: ResultRows
    session_timeout_seconds: float
    task_routes: Mapping[str, str]
    task_default_queue: str

    def queue_of(self, name: str, row: sa.Row[Any]) -> str:
        """The queue a task was sent to: the row's (selected as ``queue`` where the table
        keeps one), else where the app routes its name."""
        queue = row.queue if self.result.queue is not None else None
        return queue or queue_for(name, self.task_routes, self.task_default_queue)

    def judge(self, conn: Connection, kinds: KindRules, *, every: bool,
              silent: Silent | None) -> Judgement:
        """The broker's view of the STARTED rows (``judge``), every one alike (``every``
        and ``silent`` change nothing: the rows are in SQL already). The same read finds
        the rows written without ``result_extended``."""
        result, rows = self.result, self.result.sql_table
        started = conn.execute(
            sa.select(rows.c.task_id, result.name.label("name"), rows.c.worker,
                      *([result.queue.label("queue")] if result.queue is not None else []))
            .where(rows.c.status == constant("STARTED"))
        ).all()
        named = [Running(r.task_id, r.name, r.worker, self.queue_of(r.name, r))
                 for r in started if r.name is not None]
        if len(named) < len(started):
            self._report_unextended(len(started) - len(named))
        return judge(self.broker, named, kinds, self.session_timeout_seconds,
                     unextended=len(started) - len(named))

    def loaded(self, verdict: Judgement) -> Loaded:
        """Nothing: the running tasks are the result table's rows, read by its SQL."""
        return NOT_LOADED

    def unknown(self, verdict: Judgement) -> LivenessUnknown | None:
        """Why the broker's answers were not trusted this transaction (None: they were)."""
        doubt = verdict.doubt
        return None if doubt is None else LivenessUnknown(doubt, self.broker.where())

    def stuck(self, verdict: Judgement) -> StuckWork:
        """The rows written without ``result_extended`` (never decided) and, while the
        broker's answers are doubted, the running tasks whose worker's liveness is
        unknown."""
        return {StuckReason.UNDECIDABLE: StuckCount(verdict.unextended),
                StuckReason.LIVENESS_UNKNOWN: StuckCount(verdict.unknown)}

    def check(self) -> None:
        """The broker's URL is a Redis one."""
        self.broker.check()

    def _report_unextended(self, count: int) -> None:
        """STARTED rows without a name were written without ``result_extended``: left
        alone, and said once a process, naming the setting (not which tasks)."""
        table = self.result.sql_table.name
        if table in _WARNED:
            return
        _WARNED.add(table)
        log.warning("event=celery_rows_skipped count=%d missing_setting=result_extended "
                    "detail=%s", count, json.dumps(
                        f"STARTED rows without a task name are left alone: {UNEXTENDED_FIX}"))
