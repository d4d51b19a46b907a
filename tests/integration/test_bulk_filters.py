"""The bulk form's filters and its ``--json`` progress, through the real command line on
SQLite and PostgreSQL: ``--disposition`` acts only on the jobs whose latest decision had
that disposition (the console's filter), a bad one is one line and exit 2, and a bulk of
two chunks writes one progress object per chunk on stderr while stdout keeps its one JSON
document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.decisions import Thresholds
from reconciler.core.operator_desk import BULK_CHUNK
from reconciler.core.passes import PassConfig, run_pass
from reconciler.core.vocabulary import Disposition
from reconciler.storage.clock import now_plus
from reconciler.storage.sql import jobs
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.cli_runner import run_main, settings_env
from tests.conftest import run_cli
from tests.integration.test_bulk_chunks import DIED, died_in_bulk

pytestmark = pytest.mark.integration


def resumed_then_failed(client: JobClient, engine: Engine, count: int) -> list[int]:
    """``count`` jobs whose worker died inside an idempotent step, resumed by a real pass,
    then claimed again and failed for good by their next worker: failed (a retry applies),
    their latest decision a ``resume``."""
    ids = [client.enqueue("mail.send", steps=[Step("render", "idempotent")])
           for _ in range(count)]
    for _ in ids:
        claim = client.claim("w-dead", lease_seconds=60)
        assert claim is not None
        claim.start_step(0)
    with engine.begin() as conn:  # the worker is gone: its lease ran out 5 minutes ago
        conn.execute(jobs.update().where(jobs.c.job_id.in_(ids)).values(
            lease_expires_at=now_plus(-300), last_activity_at=now_plus(-300)))
    report = run_pass(SqlStore(engine), PassConfig(batch_size=count,
                                                   thresholds=Thresholds(0.0, 3600.0),
                                                   instance="bulk-filters"))
    assert {d.disposition for d in report.decisions} == {Disposition.RESUME}
    for _ in ids:
        claim = client.claim("w-live", lease_seconds=60)
        assert claim is not None
        assert not claim.fail("bad_input", retryable=False)  # failed for good
    return ids


def failed(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(jobs.c.job_id)
                                .where(jobs.c.job_status == "failed")).scalars())


def test_disposition_selects_only_the_jobs_whose_latest_decision_had_it(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """Five failed jobs a retry applies to: three a pass terminalized, two it resumed that
    their next worker failed. ``--disposition`` alone (a filter of its own) picks each
    set; the other is left failed."""
    resumed = resumed_then_failed(client, engine, 2)
    terminalized = died_in_bulk(client, engine, 3)
    assert failed(engine) == {*resumed, *terminalized}
    counted = run_cli(db_url, "jobs", "retry", "--disposition", "resume", "--dry-run",
                      "--note", "n", "--json")
    assert counted.returncode == 0, counted.stderr
    assert sorted(int(j) for j in json.loads(counted.stdout)["matched"]) == sorted(resumed)
    assert "(disposition resume)" in counted.stderr

    done = run_cli(db_url, "jobs", "retry", "--disposition", "terminalize", "--note",
                   "checked", "--yes", "--json", "--as", "alice")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(int(j) for j in report["applied"]) == sorted(terminalized)
    assert failed(engine) == set(resumed)
    # With a reason too, both apply: no resumed job was worker_died_mid_step.
    both = run_cli(db_url, "jobs", "retry", "--disposition", "resume", "--reason", DIED,
                   "--note", "n", "--dry-run", "--json")
    assert json.loads(both.stdout)["matched"] == []
    # Nothing matched, nothing acted on: the same document, counts included.
    none = run_cli(db_url, "jobs", "retry", "--disposition", "resume", "--reason", DIED,
                   "--note", "n", "--yes", "--json")
    assert none.returncode == 0, none.stderr
    assert json.loads(none.stdout)["counts"] == {"matched": 0, "applied": 0, "refused": 0}


def test_a_bad_disposition_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = run_main(("jobs", "retry", "--disposition", "terminalized", "--note", "n",
                     "--yes"), env=settings_env(f"sqlite:///{tmp_path / 'none.db'}"))
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "--disposition" in lines[0]
    assert "terminalized" in lines[0]


def test_json_progress_is_a_line_per_chunk_on_stderr_and_stdout_one_document(
        client: JobClient, engine: Engine, db_url: str) -> None:
    ids = died_in_bulk(client, engine, BULK_CHUNK + 200)
    done = run_cli(db_url, "jobs", "retry", "--reason", DIED, "--note", "checked", "--yes",
                   "--json", "--as", "alice")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # one document, the shape docs/cli.md gives
    assert report["counts"] == {"matched": len(ids), "applied": len(ids), "refused": 0}
    progress = [json.loads(line) for line in done.stderr.splitlines()
                if line.startswith("{")]
    assert progress == [
        {"event": "progress", "done": BULK_CHUNK, "applied": BULK_CHUNK, "refused": 0,
         "total": len(ids)},
        {"event": "progress", "done": len(ids), "applied": len(ids), "refused": 0,
         "total": len(ids)}]
    assert all(p["applied"] + p["refused"] == p["done"] for p in progress)
