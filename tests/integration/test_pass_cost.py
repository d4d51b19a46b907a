"""A pass costs a fixed number of statements, whatever the size of its batch."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.engine.interfaces import CacheStats

from reconciler.config.settings import Settings
from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
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
    # MySQL's swap is three statements (no UPDATE ... RETURNING: lock, update, read back).
    assert len(large) <= 9 + (2 if sidecar_engine.dialect.name == "mysql" else 0), large


def test_a_pass_with_nothing_stale_is_a_handful_of_statements(
    engine: Engine, store: SqlStore
) -> None:
    """With nothing to do, a pass leads, records itself and looks: no more."""
    with counted(engine) as statements:
        run_pass(store, PassConfig(batch_size=500, thresholds=THRESHOLDS))
    assert len(statements) <= 8, statements


def test_a_pass_compiles_its_statements_once(sidecar_engine: Engine, client: JobClient) -> None:
    """Once one pass has recovered jobs, the next finds every statement it sends already
    compiled: compiling them anew each pass cost as much as executing them."""
    make_stale(client, 20)
    store = SqlStore(sidecar_engine)
    config = PassConfig(batch_size=10, thresholds=THRESHOLDS, instance="r1")
    assert len(run_pass(store, config).decisions) == 10
    misses: list[str] = []

    def note(*args: Any) -> None:
        statement, context = args[2], args[4]
        # Text sent as it is (SQLite's BEGIN IMMEDIATE) has nothing to compile.
        compiled = getattr(context, "compiled", None) is not None
        if compiled and getattr(context, "cache_hit", None) is not CacheStats.CACHE_HIT:
            misses.append(statement)

    sa.event.listen(sidecar_engine, "before_cursor_execute", note)
    try:
        report = run_pass(store, config)
    finally:
        sa.event.remove(sidecar_engine, "before_cursor_execute", note)
    assert len(report.decisions) == 10
    assert misses == []


def test_a_brake_without_hold_costs_no_count(sidecar_engine: Engine, client: JobClient) -> None:
    """``brake_hold_seconds = 0`` never brakes, so a pass under it issues no more statements
    than a pass without a brake (no running or stale count per batch)."""
    make_stale(client, 20)
    store = SqlStore(sidecar_engine)
    unbraked = PassConfig(batch_size=10, thresholds=THRESHOLDS, instance="r1")
    no_hold = replace(unbraked, brake=BrakeLimits(min_jobs=1, stale_fraction=0.1,
                                                  hold_seconds=0))
    with counted(sidecar_engine) as without:
        assert len(run_pass(store, unbraked).decisions) == 10
    with counted(sidecar_engine) as with_no_hold:
        report = run_pass(store, no_hold)
    assert (len(report.decisions), report.braked) == (10, False)
    assert len(with_no_hold) == len(without), (without, with_no_hold)


@pytest.mark.parametrize("collecting", [True, False], ids=["gc-on", "gc-off"])
def test_a_pass_leaves_the_garbage_collector_as_it_found_it(
    sidecar_engine: Engine, client: JobClient, collecting: bool
) -> None:
    """A pass defers cyclic collection while it runs (its batch's objects die with it) and
    hands the process back its collector as it was, also after a pass that failed."""
    make_stale(client, 5)
    time.sleep(0.1)
    store = SqlStore(sidecar_engine)
    config = PassConfig(batch_size=10, thresholds=THRESHOLDS)
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        assert len(run_pass(store, config).decisions) == 5
        assert gc.isenabled() is collecting
        with pytest.raises(sa.exc.SQLAlchemyError):
            run_pass(SqlStore(create_engine("sqlite:////nonexistent/dir/x.db")), config)
        assert gc.isenabled() is collecting
    finally:
        (gc.enable if was else gc.disable)()
