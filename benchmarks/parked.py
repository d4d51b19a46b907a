"""Held and gated jobs (docs/operating.md): recorded once, then parked out of the scans.

    python -m benchmarks --measure parked [--jobs N] [--parked P] [--smoke]

One database of N jobs in which P processing jobs have expired leases and will stay that
way: half held by an operator, half waiting on a gate. Measured in the same run:

- the first tick: passes back to back until a batch comes back short, as the service
  runs them; it records each held or gated job once and parks it;
- the quiet pass with the P jobs parked, beside the quiet pass of the same database with
  none of them (the baseline, measured first);
- what a pass cost before parking: the same P jobs unparked before every pass (untimed),
  so each pass reads a full batch of skips and records nothing new;
- the audit's decision rows before, after the first tick and after every later pass:
  flat after the first tick.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from benchmarks.dataset import Shape, analyze, build, lease_token_sql
from benchmarks.harness import store_on
from reconciler.core.passes import PassConfig, run_pass

BATCH_SIZE = 500
PASSES = 50


def hold_and_gate(engine: Engine, parked: int) -> None:
    """Turn the dataset's ``parked`` stale jobs into held (odd ids) and gated (even ids)
    jobs: a gated job's first step succeeded and its second waits on the gate."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            f"UPDATE job_runs SET operator_hold = true WHERE job_id <= {parked} "
            "AND job_id % 2 = 1"))
        conn.execute(sa.text(
            f"DELETE FROM step_runs WHERE job_id <= {parked} AND job_id % 2 = 0"))
        for index, name, kind, state, finished in (
                (0, "fetch", "idempotent", "succeeded", "last_activity_at"),
                (1, "render", "pure", "waiting", "NULL")):
            conn.execute(sa.text(f"""
                INSERT INTO step_runs (job_id, step_index, step_name, effect_kind, step_state,
                    claim_generation, started_at, finished_at)
                SELECT job_id, {index}, '{name}', '{kind}', '{state}', 1, last_activity_at,
                    {finished}
                FROM job_runs WHERE job_id <= {parked} AND job_id % 2 = 0"""))
    analyze(engine)


def decision_rows(engine: Engine) -> int:
    """Rows in the audit's decisions table."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM reconciliation_decisions")).scalar_one())


def _median_ms(run: Callable[[], Any], before: Callable[[], None] | None = None) -> float:
    samples = []
    for _ in range(PASSES):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def unpark_all(engine: Engine) -> None:
    """Undo every park (untimed): each pass then meets a full batch of skips again."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE job_runs SET reconcile_parked = false "
                             "WHERE reconcile_parked"))


def measure(engine: Engine, config: PassConfig, jobs: int, parked: int) -> dict[str, Any]:
    """The figures of the module docstring, on a migrated, empty database."""
    build(engine, Shape(jobs=jobs, stale=parked))
    store = store_on(engine)
    # The baseline: the same table with those jobs finished, so no pass meets them.
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE job_runs SET job_status = 'completed', "
                             f"lease_token = NULL, lease_expires_at = NULL "
                             f"WHERE job_id <= {parked}"))
    analyze(engine)  # the flip leaves dead row versions on PostgreSQL; measure a clean table
    run_pass(store, config)
    baseline_ms = _median_ms(lambda: run_pass(store, config))
    with engine.begin() as conn:
        conn.execute(sa.text(
            f"UPDATE job_runs SET job_status = 'processing', lease_token = "
            f"{lease_token_sql(conn, 'job_id')}, lease_expires_at = last_activity_at "
            f"WHERE job_id <= {parked}"))
    hold_and_gate(engine, parked)

    rows_before = decision_rows(engine)
    started = time.perf_counter()
    tick_passes = 0
    while True:
        report = run_pass(store, config)
        tick_passes += 1
        if len(report.decisions) < config.batch_size:
            break
    tick_seconds = time.perf_counter() - started
    rows_after_tick = decision_rows(engine)

    parked_ms = _median_ms(lambda: run_pass(store, config))
    rows_after_quiet = decision_rows(engine)
    unparked_ms = _median_ms(lambda: run_pass(store, config), lambda: unpark_all(engine))
    return {
        "baseline_quiet_ms": round(baseline_ms, 3), "parked_quiet_ms": round(parked_ms, 3),
        "unparked_pass_ms": round(unparked_ms, 3),
        "ratio_to_baseline": round(parked_ms / baseline_ms, 2),
        "first_tick_passes": tick_passes, "first_tick_seconds": round(tick_seconds, 3),
        "audit_rows_before": rows_before, "audit_rows_after_first_tick": rows_after_tick,
        f"audit_rows_after_{PASSES}_more_passes": rows_after_quiet,
        f"audit_rows_after_{PASSES}_unparked_passes": decision_rows(engine),
    }
