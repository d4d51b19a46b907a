"""A pass costs a fixed number of statements, whatever the size of its batch."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.settings import Settings
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step

THRESHOLDS = Thresholds(stale_after_seconds=0, wedged_after_seconds=3600)


@contextmanager
def counted(engine: Engine) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


@pytest.fixture
def sidecar_engine(db_url: str) -> Iterator[Engine]:
    """An engine as `reconciler run` opens it: its sessions carry the pass timeouts, so a
    pass issues no SET LOCAL of its own (an engine with the CLI's timeouts adds that one
    statement on PostgreSQL)."""
    eng = create_engine(db_url, timeouts=DatabaseTimeouts.for_passes(Settings()))
    yield eng
    eng.dispose()


def make_stale(client: JobClient, n: int) -> None:
    plan = [Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful")]
    for _ in range(n):
        client.enqueue("report", steps=plan)
    for i in range(n):
        claim = client.claim(worker="w", lease_seconds=0.05)
        assert claim is not None
        claim.start_step(0)
        if i % 2:
            claim.finish_step(0)
    time.sleep(0.1)


def test_statements_per_pass_do_not_grow_with_the_batch(
    sidecar_engine: Engine, client: JobClient
) -> None:
    """A pass over 5 stale jobs and a pass over 60 issue the same number of statements."""
    make_stale(client, 65)
    store = SqlStore(sidecar_engine, timeouts=DatabaseTimeouts.for_passes(Settings()))
    with counted(sidecar_engine) as small:
        report = run_pass(store, PassConfig(batch_size=5, thresholds=THRESHOLDS, instance="r1"))
    assert len(report.decisions) == 5
    with counted(sidecar_engine) as large:
        report = run_pass(store, PassConfig(batch_size=60, thresholds=THRESHOLDS, instance="r1"))
    assert len(report.decisions) == 60
    assert len(large) == len(small), (small, large)
    assert len(large) <= 11


def test_a_pass_with_nothing_stale_is_a_handful_of_statements(
    engine: Engine, store: SqlStore
) -> None:
    """With nothing to do, a pass leads, records itself and looks: no more."""
    with counted(engine) as statements:
        run_pass(store, PassConfig(batch_size=500, thresholds=THRESHOLDS))
    assert len(statements) <= 8, statements
