"""What the RQ operator tests share: a job that hangs on its first run only, a failure
written through RQ's own calls, and a config file as the docs' RQ example."""

from __future__ import annotations

from pathlib import Path

from tests.sources.rq_support import RqProject

HANG_ONCE = "tests.sources.rq_operator_tasks.hang_once"
"""Effectful by the tests' ``[kinds]`` (only ``idem_*`` is idempotent)."""


def failed(project: RqProject, job_id: str) -> None:
    """The queued job failed as a worker's ``handle_job_failure`` writes it, through
    RQ's own calls."""
    from rq.job import JobStatus  # noqa: PLC0415

    queue, job = project.queue(), project.job(job_id)
    queue.remove(job)
    with project.redis().pipeline() as pipe:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        queue.failed_job_registry.add(job, exc_string="boom", pipeline=pipe)
        pipe.execute()


def config_file(tmp_path: Path, project: RqProject) -> Path:
    """A config file as the docs' RQ example, the test jobs' idempotent kind declared."""
    url = project.engine.url.render_as_string(hide_password=False)
    path = tmp_path / "reconciler.toml"
    path.write_text(f"database_url = {url!r}\nstale_after_seconds = 0.5\n"
                    f'[source]\nkind = "rq"\nredis_url = {project.redis_url!r}\n'
                    '[kinds."tests.sources.rq_tasks.idem_*"]\neffect = "idempotent"\n')
    return path
