"""`reconciler jobs explain`: the decision table's verdict on one processing job, read only."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.worker import JobClient, Step
from tests.conftest import run_cli


def _snapshot(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        return [
            list(conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY 1")))
            for table in ("job_runs", "step_runs", "job_attempts", "reconciliation_passes",
                          "reconciliation_decisions", "reconciler_leases")
        ]


def test_a_live_claim_is_explained_as_lease_live_and_nothing_is_written(
    db_url: str, engine: Engine, client: JobClient
) -> None:
    """A job under a live lease is explained by rule 3 (lease_live); nothing changes."""
    job_id = client.enqueue("report", steps=[Step("fetch", "idempotent"),
                                             Step("publish", "effectful")],
                            payload={"secret": "payload-marker-77"})
    claim = client.claim(worker="worker-marker-77", lease_seconds=60)
    assert claim is not None
    claim.start_step(0)
    before = _snapshot(engine)
    out = run_cli(db_url, "jobs", "explain", str(job_id), "--json")
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)
    assert (verdict["disposition"], verdict["reason"], verdict["rule"]) == ("skip",
                                                                            "lease_live", 3)
    assert verdict["evidence"]["step_states"] == ["started", "not_started"]
    assert "marker-77" not in out.stdout
    assert _snapshot(engine) == before
    claim.heartbeat()  # the claim is untouched: still this worker's


def test_explaining_a_job_that_is_not_processing_is_refused_in_one_line(
    db_url: str, client: JobClient
) -> None:
    """Only processing jobs are judged; a queued or unknown job gets one clear line."""
    job_id = client.enqueue("report", steps=[Step("fetch", "pure")])
    queued = run_cli(db_url, "jobs", "explain", str(job_id))
    assert queued.returncode != 0
    assert queued.stderr.strip().count("\n") == 0
    assert "queued" in queued.stderr
    missing = run_cli(db_url, "jobs", "explain", "999999")
    assert missing.returncode != 0
    assert "no job" in missing.stderr
