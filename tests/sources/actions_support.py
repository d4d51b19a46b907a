"""What every source's operator-action tests share: the desk the composition root builds,
a clean slate of this project's records of the source, and the race every source is
tested for: the job moves between the action's read and its swap (a worker's claim, its
end, another operator), on the same transaction, as a write that committed just before
the swap looks to the fence."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from models import OperatorAction as ActionRow
from models import OperatorHold, ReconciliationDecision
from reconciler.config.registry import entry_for
from reconciler.core.kinds import KindRules
from reconciler.core.operator_desk import ActionReport, OperatorDesk
from reconciler.core.vocabulary import JobKey, OperatorAction
from reconciler.root.cli import assemble_cli
from reconciler.sources.kit.actions import (
    BatchActions,
    ForeignDesk,
    ForeignJob,
    SystemActions,
)
from tests.sources.support import config_for

Move = Callable[[Connection, JobKey], object]
"""The system's own write on the job, run right after the action read it."""


class MovedAfterRead:
    """A system's actions whose every read is followed by ``move``."""

    def __init__(self, actions: SystemActions, conn: Connection, move: Move) -> None:
        self._actions = actions
        self._conn = conn
        self._move = move
        self.limits: Mapping[OperatorAction, str] = actions.limits

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        job = self._actions.read(job_key, lock=lock)
        self._move(self._conn, job_key)
        return job

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        return self._actions.refuses(action, job)

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        return self._actions.retry(job_key, job)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        return self._actions.cancel(job_key, job)


class MovedAfterReadMany(MovedAfterRead):
    """A batch system's actions whose chunk read is followed by ``move`` of each job it
    found (``move`` picks the ones it moves), between the chunk's read and its swap."""

    def __init__(self, actions: SystemActions, batch: BatchActions, conn: Connection,
                 move: Move) -> None:
        super().__init__(actions, conn, move)
        self._batch = batch

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        found = self._batch.read_many(job_keys, lock=lock)
        for key in found:
            self._move(self._conn, key)
        return found

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        return self._batch.swap_many(action, jobs, refused)


def desk_moving_after_read(engine: Engine, source: str, config: Any, kinds: KindRules, *,
                           actions: Callable[[Connection, Any, KindRules], SystemActions],
                           move: Move) -> ForeignDesk:
    """The source's desk over ``actions``, with ``move`` landing after each read (a
    chunk's read too, where the system reads one: ``move`` then runs on each job read)."""
    def opener(conn: Connection, config: Any, kinds: KindRules) -> SystemActions:
        system = actions(conn, config, kinds)
        if isinstance(system, BatchActions):  # a chunk's read and swap stay set-based
            return MovedAfterReadMany(system, system, conn, move)
        return MovedAfterRead(system, conn, move)

    return ForeignDesk(engine, source, config, kinds, opener=opener,
                       parse_key=entry_for(source).parse_job_key)


def desk_for(engine: Engine, source_config: Any, kinds: KindRules) -> OperatorDesk:
    """The desk the composition root builds for ``source_config``'s source."""
    desk = assemble_cli(config_for(engine, source_config, kinds), engine=engine).desk
    assert desk is not None
    return desk


def forget_source(engine: Engine, source: str) -> None:
    """This project's records of ``source``'s jobs (actions, holds, decisions) removed, so
    a test starts with none of an earlier test's."""
    with engine.begin() as conn:
        for model in (ActionRow, OperatorHold, ReconciliationDecision):
            table = cast(sa.Table, model.__table__)
            conn.execute(table.delete().where(table.c.job_source == source))


def chunk_with_statements(desk: OperatorDesk, action: OperatorAction, job_ids: Sequence[str]
                          ) -> tuple[list[ActionReport], list[str]]:
    """``desk``'s chunk ``action`` on ``job_ids`` (as alice, note "bulk"), and the text of
    every statement any engine sent meanwhile."""
    statements: list[str] = []

    def statement(*args: object) -> None:
        statements.append(str(args[2]))

    sa.event.listen(Engine, "before_cursor_execute", statement)
    try:
        reports = desk.act_on_chunk(action, job_ids, actor="alice", note="bulk")
    finally:
        sa.event.remove(Engine, "before_cursor_execute", statement)
    return reports, statements
