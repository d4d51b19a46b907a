"""Artifacts staged per attempt, published only by the completing generation.

Every test runs on SQLite and on PostgreSQL, with files on a real disk under a temporary
artifact root. Layout: ``staging/<job_id>/<generation>/<name>`` while an attempt runs,
``published/<job_id>/<name>`` once its generation completed the job.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobArtifact, JobRun
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.sidecar.artifact_sweep import SweepResult, sweep_artifacts
from reconciler.storage.clock import db_now
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import Claim, JobClient, LeaseLost, Step, Worker
from reconciler.worker.artifacts import (
    check_name,
    move_published,
    published_path,
    staging_path,
    write_atomically,
)
from reconciler.worker.runtime import StepContext, WorkerStats
from tests.helpers import wait_for

JOBS = cast(sa.Table, JobRun.__table__)
ARTIFACTS = cast(sa.Table, JobArtifact.__table__)
RECONCILE_NOW = Thresholds(stale_after_seconds=0, wedged_after_seconds=3600)
DEADLINE_SECONDS = 15.0

BAD_NAMES = ("a/b", "../escape.txt", "..", ".", "/etc/passwd", "nested/../x", "a\\b",
             ".hidden", "", "x" * 101)


def artifact_rows(engine: Engine, job_id: int) -> list[dict[str, Any]]:
    """The job's ``job_artifacts`` rows by generation and name."""
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(
            sa.select(ARTIFACTS).where(ARTIFACTS.c.job_id == job_id)
            .order_by(ARTIFACTS.c.claim_generation, ARTIFACTS.c.artifact_name))]


def states(engine: Engine, job_id: int) -> dict[tuple[int, str], str]:
    """(generation, name) -> artifact_state."""
    return {(r["claim_generation"], r["artifact_name"]): r["artifact_state"]
            for r in artifact_rows(engine, job_id)}


def files_under(root: Path) -> dict[str, str]:
    """Every regular file below ``root`` (relative path -> content)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file()}


def others_in(folder: Path, jail: Path) -> list[str]:
    """Files below ``folder`` outside ``jail``, the SQLite database's own files left out."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if jail not in p.parents and p != jail and not p.name.startswith("jobs.db"))


def run_worker(worker: Worker, max_jobs: int) -> WorkerStats:
    """Run a worker in a thread until it has claimed ``max_jobs`` jobs and finished them."""
    stats: list[WorkerStats] = []
    thread = threading.Thread(target=lambda: stats.append(worker.run(max_jobs=max_jobs)),
                              daemon=True)
    thread.start()
    thread.join(DEADLINE_SECONDS)
    if thread.is_alive():
        worker.stop()
        worker.stop()
        pytest.fail(f"worker {worker.name} did not finish")
    return stats[0]


def stage(root: Path, claim: Claim, name: str, data: str) -> Path:
    """What the runtime's stage_artifact does: write the file, record it (fenced) or undo."""
    path = staging_path(root, claim.job_id, claim.generation, name)
    write_atomically(path, data.encode())
    try:
        claim.stage_artifact(name)
    except LeaseLost:
        path.unlink()
        raise
    return path


def test_completion_publishes_the_staged_set_and_moves_its_files_into_place(
    client: JobClient, engine: Engine, tmp_path: Path
) -> None:
    """Artifacts staged across steps land in published/<job_id>/ when the job completes."""
    root = tmp_path / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "pure"), Step("chart", "pure")])
    staged_paths: list[Path] = []

    def render(ctx: StepContext) -> None:
        staged_paths.append(ctx.stage_artifact("report.html", "<h1>report</h1>"))

    def chart(ctx: StepContext) -> None:
        staged_paths.append(ctx.stage_artifact("chart.png", "png-bytes"))
        # Before completion nothing is published.
        assert not (root / "published").exists()
        assert all(p.exists() for p in staged_paths)

    worker = Worker(client, "publisher", lease_seconds=5, poll_interval_seconds=0.05,
                    artifact_root=root)
    worker.register("report", {"render": render, "chart": chart})
    assert run_worker(worker, 1).outcomes == {"completed": 1}

    generation = cast(int, client.store.artifacts_of(job_id)[0][0])
    assert staged_paths == [staging_path(root, job_id, generation, "report.html"),
                            staging_path(root, job_id, generation, "chart.png")]
    assert files_under(root) == {
        f"published/{job_id}/report.html": "<h1>report</h1>",
        f"published/{job_id}/chart.png": "png-bytes",
    }
    assert published_path(root, job_id, "report.html") == (
        root / "published" / str(job_id) / "report.html")
    rows = artifact_rows(engine, job_id)
    assert [(r["artifact_name"], r["artifact_state"]) for r in rows] == [
        ("chart.png", "published"), ("report.html", "published")]
    assert all(r["settled_at"] is not None for r in rows)
    assert sweep_artifacts(client.store, root) == SweepResult(0, 0, 0)


def test_publication_commits_with_the_fenced_completion_and_an_interrupted_move_is_finished(
    client: JobClient, engine: Engine, tmp_path: Path
) -> None:
    """complete() publishes the set in its own transaction; a sweep finishes an unfinished move."""
    root = tmp_path / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "pure")])
    claim = cast(Claim, client.claim("host-a:1", lease_seconds=30))
    stage(root, claim, "a.txt", "A")
    stage(root, claim, "b.txt", "B")
    assert set(states(engine, job_id).values()) == {"staged"}

    generation = claim.complete()
    assert generation == claim.generation
    # Published in the completing transaction, before any file moved.
    with engine.connect() as conn:
        status = conn.execute(sa.select(JOBS.c.job_status).where(JOBS.c.job_id == job_id))
        assert status.scalar_one() == "completed"
    assert states(engine, job_id) == {(generation, "a.txt"): "published",
                                      (generation, "b.txt"): "published"}
    assert all(r["settled_at"] is None for r in artifact_rows(engine, job_id))
    assert set(files_under(root)) == {f"staging/{job_id}/{generation}/a.txt",
                                      f"staging/{job_id}/{generation}/b.txt"}

    # The worker died before moving the files: the sweep finishes the move.
    result = sweep_artifacts(client.store, root)
    assert (result.discarded, result.failures) == (0, 0)
    assert result.settled >= 1
    assert files_under(root) == {f"published/{job_id}/a.txt": "A",
                                 f"published/{job_id}/b.txt": "B"}
    assert all(r["settled_at"] is not None for r in artifact_rows(engine, job_id))
    # Moving again is harmless.
    move_published(client.store, root, job_id, generation)
    assert files_under(root) == {f"published/{job_id}/a.txt": "A",
                                 f"published/{job_id}/b.txt": "B"}


def test_failed_move_after_completion_leaves_the_job_completed_and_the_sweep_finishes_it(
    client: JobClient, engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The job completed before its files moved: a failed move is logged and counted apart,
    never turned into an error of the job, and the sidecar's sweep moves the files later."""
    root = tmp_path / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "pure")])
    blocker = root / "published" / str(job_id)

    def render(ctx: StepContext) -> None:
        ctx.stage_artifact("report.txt", "done")
        # A file where the job's published folder must go: the move after completion fails.
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("in the way")

    worker = Worker(client, "publisher", lease_seconds=5, poll_interval_seconds=0.05,
                    artifact_root=root)
    worker.register("report", {"render": render})
    with caplog.at_level(logging.WARNING, logger="reconciler.worker"):
        stats = run_worker(worker, 1)

    assert stats.outcomes == {"completed": 1}
    assert stats.artifact_move_failures == 1
    assert [r.getMessage() for r in caplog.records if "artifact_move" in r.getMessage()] == [
        f"event=artifact_move_failed job_id={job_id} generation=1 error=FileExistsError"]
    with engine.connect() as conn:
        status = conn.execute(sa.select(JOBS.c.job_status).where(JOBS.c.job_id == job_id))
        assert status.scalar_one() == "completed"
    assert states(engine, job_id) == {(1, "report.txt"): "published"}
    assert [r["settled_at"] for r in artifact_rows(engine, job_id)] == [None]
    assert files_under(root) == {f"staging/{job_id}/1/report.txt": "done",
                                 f"published/{job_id}": "in the way"}

    blocker.unlink()
    result = sweep_artifacts(client.store, root)
    assert (result.discarded, result.settled, result.failures) == (0, 1, 0)
    assert files_under(root) == {f"published/{job_id}/report.txt": "done"}
    assert all(r["settled_at"] is not None for r in artifact_rows(engine, job_id))


def test_only_the_completing_generations_set_is_published(
    client: JobClient, engine: Engine, tmp_path: Path
) -> None:
    """After a failed attempt and a successful retry, only the retry's artifacts are published."""
    root = tmp_path / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "idempotent")], max_attempts=3)

    class RenderError(Exception):
        """The first attempt fails after staging."""

    def render(ctx: StepContext) -> None:
        ctx.stage_artifact("out.txt", f"attempt {ctx.attempt}")
        if ctx.attempt == 1:
            ctx.stage_artifact("partial.txt", "half done")
            raise RenderError

    worker = Worker(client, "retrier", lease_seconds=5, poll_interval_seconds=0.05,
                    artifact_root=root)
    worker.register("report", {"render": render})
    assert run_worker(worker, 2).outcomes == {"retrying": 1, "completed": 1}

    (first, _, _), *_rest = client.store.artifacts_of(job_id)
    winner = first + 1
    assert states(engine, job_id) == {(first, "out.txt"): "staged",
                                      (first, "partial.txt"): "staged",
                                      (winner, "out.txt"): "published"}
    assert files_under(root / "published") == {f"{job_id}/out.txt": "attempt 2"}

    result = sweep_artifacts(client.store, root)
    assert (result.discarded, result.failures) == (2, 0)
    assert states(engine, job_id) == {(first, "out.txt"): "discarded",
                                      (first, "partial.txt"): "discarded",
                                      (winner, "out.txt"): "published"}
    assert files_under(root) == {f"published/{job_id}/out.txt": "attempt 2"}


def test_stale_claim_can_neither_stage_nor_publish_after_a_reclaim(
    client: JobClient, engine: Engine, tmp_path: Path
) -> None:
    """A reclaimed attempt's stage and complete raise LeaseLost; the new owner's set wins."""
    root = tmp_path / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "idempotent")], max_attempts=3)
    stale = cast(Claim, client.claim("host-a:1", lease_seconds=0.2))
    stale.start_step(0)
    stage(root, stale, "report.txt", "stale")

    def expired() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(sa.select(JOBS.c.lease_expires_at <= db_now())
                                     .where(JOBS.c.job_id == job_id)).scalar_one())
    wait_for(expired, "the stale lease to expire")
    run_pass(SqlStore(engine), PassConfig(batch_size=10, thresholds=RECONCILE_NOW))
    fresh = cast(Claim, client.claim("host-b:2", lease_seconds=30))
    assert fresh.job_id == job_id
    stage(root, fresh, "report.txt", "fresh")

    with pytest.raises(LeaseLost):
        stage(root, stale, "other.txt", "stale")
    with pytest.raises(LeaseLost):
        stale.complete()
    assert states(engine, job_id) == {(stale.generation, "report.txt"): "staged",
                                      (fresh.generation, "report.txt"): "staged"}
    move_published(client.store, root, job_id, fresh.complete())
    assert files_under(root / "published") == {f"{job_id}/report.txt": "fresh"}
    # Even a stale attempt asking to move its own set publishes nothing.
    move_published(client.store, root, job_id, stale.generation)
    assert files_under(root / "published") == {f"{job_id}/report.txt": "fresh"}
    assert sweep_artifacts(client.store, root).discarded == 1
    assert files_under(root) == {f"published/{job_id}/report.txt": "fresh"}
    assert states(engine, job_id) == {(stale.generation, "report.txt"): "discarded",
                                      (fresh.generation, "report.txt"): "published"}


def test_artifact_names_with_folders_or_dots_are_refused(
    client: JobClient, engine: Engine, tmp_path: Path
) -> None:
    """Names with '/', '..', a leading dot or no characters raise ValueError and write nothing."""
    for name in BAD_NAMES:
        with pytest.raises(ValueError, match="plain file names"):
            check_name(name)
    for name in ("report.txt", "a..b", "chart-2.png", "_data"):
        assert check_name(name) == name

    jail = tmp_path / "jail"
    root = jail / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "pure")])
    refused: list[str] = []

    def render(ctx: StepContext) -> None:
        for name in BAD_NAMES:
            try:
                ctx.stage_artifact(name, "nope")
            except ValueError:
                refused.append(name)

    worker = Worker(client, "namer", lease_seconds=5, poll_interval_seconds=0.05,
                    artifact_root=root)
    worker.register("report", {"render": render})
    outside_before = others_in(tmp_path, jail)
    assert run_worker(worker, 1).outcomes == {"completed": 1}
    assert refused == list(BAD_NAMES)

    job_id_2 = client.enqueue("report", steps=[Step("render", "pure")])
    claim = cast(Claim, client.claim("host-a:1", lease_seconds=30))
    assert claim.job_id == job_id_2
    for name in BAD_NAMES:
        with pytest.raises(ValueError, match="plain file names"):
            claim.stage_artifact(name)
    claim.heartbeat()  # a refused name does not cost the lease
    assert artifact_rows(engine, job_id) == []
    assert artifact_rows(engine, job_id_2) == []
    assert files_under(jail) == {}
    assert others_in(tmp_path, jail) == outside_before  # nothing escaped the root


def test_sweep_failure_is_reported_and_retried_by_the_next_sweep(
    client: JobClient, engine: Engine, tmp_path: Path
) -> None:
    """A staged file the sweep cannot delete counts as a failure and is discarded next time."""
    root = tmp_path / "artifacts"
    job_id = client.enqueue("report", steps=[Step("render", "idempotent")], max_attempts=1)
    claim = cast(Claim, client.claim("host-a:1", lease_seconds=30))
    path = stage(root, claim, "report.txt", "stale")
    assert claim.fail("Boom", retryable=False) is False
    # Something (here: a folder in the file's place) makes the delete fail.
    path.unlink()
    path.mkdir()
    (path / "pinned").write_text("x")

    first = sweep_artifacts(client.store, root)
    assert (first.discarded, first.failures) == (0, 1)
    assert states(engine, job_id) == {(claim.generation, "report.txt"): "staged"}

    (path / "pinned").unlink()
    path.rmdir()
    second = sweep_artifacts(client.store, root)
    assert (second.discarded, second.failures) == (1, 0)
    assert states(engine, job_id) == {(claim.generation, "report.txt"): "discarded"}
