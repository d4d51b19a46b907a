"""What an operator reads about RQ jobs: ``jobs list``, ``jobs show`` and ``jobs explain``
under an ``rq`` ``[source]``, as typed on the command line; ``reconciler pass --dry-run``
and a shadow pass over a dead worker's job, changing nothing in Redis; and the console's
job page; the reconciler's own tables on SQLite and PostgreSQL, a real Redis and real
``rq worker`` processes. Jobs get their statuses through RQ's own calls."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from reconciler.config.loader import Config, load_config, pass_config
from reconciler.config.settings import Settings
from reconciler.root.console import assemble_console
from reconciler.root.sidecar import assemble_sidecar
from reconciler.sidecar.service import Service
from tests.console_support import fetch, serving
from tests.integration.test_console_actions import csrf_of, offered, post, sign_in
from tests.sources.actions_support import forget_source
from tests.sources.rq_operator_support import HANG_ONCE, config_file, failed
from tests.sources.rq_support import (
    IDEMPOTENT,
    RqProject,
    rq_project,
    sigkill,
    start_worker,
    wait_started,
    wait_status,
)
from tests.sources.support import Markers, Processes
from tests.sources.test_operator_commands import cli, cli_json
from tests.sources.test_rq_workers import KINDS

__all__ = ["rq_project"]  # a fixture, found by name


@pytest.fixture
def project(rq_project: RqProject) -> RqProject:
    forget_source(rq_project.engine, "rq")
    return rq_project


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def every_status(project: RqProject, processes: Processes, markers: Markers) -> dict[str, str]:
    """A job in each status RQ keeps, by status: a real worker finished one and runs one
    (it takes no other meanwhile); the rest through RQ's own calls."""
    finished = project.enqueue(IDEMPOTENT, hang=[0])
    worker = start_worker(processes, project, markers, "worker-a")
    wait_status(project, finished, "finished", worker=worker)
    started = project.enqueue(HANG_ONCE)
    wait_started(markers, started, worker)
    queue = project.queue()
    queued = project.enqueue(IDEMPOTENT, hang=[0])
    deferred = queue.enqueue(IDEMPOTENT, depends_on=queued).id
    scheduled = queue.enqueue_in(timedelta(hours=1), IDEMPOTENT).id
    canceled = project.enqueue(IDEMPOTENT)
    project.job(canceled).cancel()
    failing = project.enqueue(IDEMPOTENT)
    failed(project, failing)
    return {"finished": finished, "started": started, "queued": queued,
            "deferred": deferred, "scheduled": scheduled, "canceled": canceled,
            "failed": failing}


def test_jobs_list_shows_every_status_in_this_projects_words(
        project: RqProject, processes: Processes, markers: Markers, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every status of the watched queue is listed newest first, in this project's words
    beside RQ's own; ``--status`` finds RQ's statuses by their word; ``jobs show`` reads
    one job with its kind, and ``jobs explain`` judges the running one live."""
    jobs = every_status(project, processes, markers)
    path = config_file(tmp_path, project)
    listed = cli_json(capsys, path, "jobs", "list")
    assert {j["job_id"]: j["status"] for j in listed} == {
        jobs["finished"]: "completed", jobs["started"]: "processing",
        jobs["queued"]: "queued", jobs["deferred"]: "queued", jobs["scheduled"]: "queued",
        jobs["canceled"]: "cancelled", jobs["failed"]: "failed"}
    order = [jobs[s] for s in ("failed", "canceled", "scheduled", "deferred", "queued",
                               "started", "finished")]
    assert [j["job_id"] for j in listed] == order  # newest created first
    waiting = cli_json(capsys, path, "jobs", "list", "--status", "queued")
    assert {j["job_id"] for j in waiting} == {jobs["queued"], jobs["deferred"],
                                             jobs["scheduled"]}
    code, out, _ = cli(capsys, path, "jobs", "show", jobs["deferred"])
    assert code == 0
    assert f"job {jobs['deferred']} ({IDEMPOTENT}): queued [deferred in rq]" in out
    code, out, err = cli(capsys, path, "jobs", "explain", jobs["started"])
    assert code == 0, err
    assert "lease_live" in out
    assert project.status(jobs["started"]) == "started"


def test_a_short_list_reads_few_jobs_of_a_long_queue(
        project: RqProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``jobs list --limit 5`` over 300 queued jobs reads 5 job hashes (Redis's own count
    of HMGET calls), and lists the 5 newest; ``jobs show`` of the oldest reads one."""
    queue = project.queue()
    with project.redis().pipeline() as pipe:
        ids = [queue.enqueue(IDEMPOTENT, hang=[0], pipeline=pipe).id for _ in range(300)]
        pipe.execute()
    path = config_file(tmp_path, project)
    redis = project.redis()

    def hmget_calls() -> int:
        stats: dict[str, Any] = redis.info("commandstats")
        return int(stats.get("cmdstat_hmget", {}).get("calls", 0))

    redis.config_resetstat()
    listed = cli_json(capsys, path, "jobs", "list", "--limit", "5")
    assert [j["job_id"] for j in listed] == list(reversed(ids[-5:]))
    assert hmget_calls() == 5
    redis.config_resetstat()
    assert cli_json(capsys, path, "jobs", "show", ids[0])["job_id"] == ids[0]
    assert hmget_calls() == 1


def test_dry_run_and_shadow_passes_change_nothing_in_redis(
        project: RqProject, processes: Processes, markers: Markers, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A dead worker's idempotent job: ``pass --dry-run`` says it would resume it and
    records nothing; ``pass --shadow`` records the decision as shadow; RQ reads the job
    started in its registry after both, and a real pass then resumes it."""
    job_id = project.enqueue(IDEMPOTENT, hang=[3600, 0])
    first = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, job_id, first)
    sigkill(first)
    project.expire_as_time_would(job_id, first)
    path = config_file(tmp_path, project)
    score = project.entry_score(job_id)
    preview = cli_json(capsys, path, "pass", "--dry-run")
    assert [(d["job_id"], d["disposition"]) for d in preview["decisions"]] == [
        (job_id, "resume")]
    shadow = cli_json(capsys, path, "pass", "--shadow")
    assert [(d["job_id"], d["disposition"]) for d in shadow["decisions"]] == [
        (job_id, "resume")]
    assert [d["shadow"] for d in cli_json(capsys, path, "decisions")
            if d["job_id"] == job_id] == [True]
    assert (project.status(job_id), project.entry_score(job_id)) == ("started", score)
    assert project.queue().job_ids == []
    real = cli_json(capsys, path, "pass")
    assert [(d["job_id"], d["disposition"]) for d in real["decisions"]] == [
        (job_id, "resume")]
    assert project.status(job_id) == "queued"


def page(path: Path, target: str) -> tuple[int, str]:
    """One console page as ``reconciler run --config path`` serves it."""
    config = load_config(path)
    console = assemble_console(config, pass_config(config.settings, "console-test",
                                                   config.kinds))
    try:
        reply = console.handle("GET", target, {})
    finally:
        console.close()
    return reply.status, reply.body.decode()


def test_the_console_shows_an_rq_job_and_its_decision(
        project: RqProject, processes: Processes, markers: Markers, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A job RQ keeps queued has a page (its function name, RQ's status); a dead
    worker's effectful job failed by a pass shows RQ's ``failed`` and the decision's
    reason, never the worker's name."""
    path = config_file(tmp_path, project)
    waiting = project.enqueue(IDEMPOTENT, queue="reports")
    status, body = page(path, f"/jobs/rq/{waiting}")
    assert status == 200
    assert f'<strong class="kind">{IDEMPOTENT}</strong>' in body
    assert '<span class="source-status">queued</span> in rq' in body
    job_id = project.enqueue(HANG_ONCE)
    first = start_worker(processes, project, markers, "worker-dead")
    wait_started(markers, job_id, first)
    sigkill(first)
    project.expire_as_time_would(job_id, first)
    decided = cli_json(capsys, path, "pass")["decisions"]
    assert [(d["job_id"], d["reason"]) for d in decided] == [(job_id, "worker_died_mid_step")]
    status, body = page(path, f"/jobs/rq/{job_id}")
    assert status == 200
    assert '<span class="source-status">failed</span> in rq' in body
    assert "worker_died_mid_step" in body
    assert "worker-dead" not in body
    status, listing = page(path, "/decisions?kind=tests.sources.*")
    assert f"/jobs/rq/{job_id}" in listing


def test_a_redis_that_does_not_answer_is_one_line_naming_it(
        project: RqProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``jobs list`` and an action with the app's Redis down: exit 3 and one line naming
    the store (its URL), no traceback; nothing recorded for the action."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = replace(project, redis_url=f"redis://127.0.0.1:{port}/0")
    path = config_file(tmp_path, down)
    code, out, err = cli(capsys, path, "jobs", "list")
    assert (code, out) == (3, "")
    assert err.strip() == (f"reconciler: error: source rq: its Redis at {down.redis_url} did "
                           "not answer (ConnectionError); no job of it can be listed")
    code, _, err = cli(capsys, path, "jobs", "cancel", "some-job", "--note", "n")
    assert code == 3
    assert "the action was not recorded" in err
    assert "Traceback" not in err


ALICE = "alice-token-0123456789"


def test_an_operator_cancels_and_retries_rq_jobs_from_their_pages(
        project: RqProject, tmp_path: Path) -> None:
    """Signed in as an operator on the console ``reconciler run`` serves: a queued job's
    page offers cancel, and cancelled RQ reads it canceled; a failed job's page offers
    retry, and retried it is back on its queue. Each page then says applied."""
    waiting = project.enqueue(IDEMPOTENT)
    failing = project.enqueue(IDEMPOTENT)
    failed(project, failing)
    tokens = tmp_path / "operators"
    tokens.write_text(f"alice {ALICE}\n")
    settings = Settings(
        database_url=project.engine.url.render_as_string(hide_password=False),
        metrics_port=0, console_operator_tokens_file=str(tokens))
    with serving(Service(assemble_sidecar(Config(settings=settings, source=project.config(),
                                                 kinds=KINDS)))) as base:
        cookie = sign_in(base, ALICE)
        for job_id, action in ((waiting, "cancel"), (failing, "retry")):
            page = fetch(base + f"/jobs/rq/{job_id}", headers={"Cookie": cookie})
            assert page.status == 200, page.body
            assert action in offered(page.body)
            acted = post(base, f"/jobs/rq/{job_id}", cookie,
                         f"csrf={csrf_of(page)}&action={action}&note=asked")
            assert acted.status == 303, acted.body
            shown = fetch(base + acted.headers["location"], headers={"Cookie": cookie})
            assert f'id="outcome">{action} applied' in shown.body
    assert (project.status(waiting), project.status(failing)) == ("canceled", "queued")
    assert project.queue().job_ids == [failing]


def test_a_one_shot_pass_that_cannot_read_liveness_says_so_and_fails(
        project: RqProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``reconciler pass`` (what cron runs) with the app's Redis down: its JSON says
    ``liveness_unknown`` with the code and the store, one line on stderr says the same,
    and it exits 7 (not 0: a cron job is not green while nothing can be decided)."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = replace(project, redis_url=f"redis://:secret@127.0.0.1:{port}/0")
    path = config_file(tmp_path, down)
    code, out, err = cli(capsys, path, "pass", "--json")
    assert code == 7
    report = json.loads(out)
    assert report["outcome"] == "liveness_unknown"
    assert report["liveness_unknown"]["code"] == "broker_unreachable"
    assert f"127.0.0.1:{port}" in report["liveness_unknown"]["where"]
    assert err.strip().startswith("reconciler: liveness unknown (broker_unreachable) at ")
    assert f"127.0.0.1:{port}" in err
    assert "secret" not in out + err
    code, out, _ = cli(capsys, path, "pass")
    assert code == 7
    assert "outcome=liveness_unknown" in out


def test_a_redis_of_another_app_is_one_line_and_an_empty_one_is_waiting(
        project: RqProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``redis_url`` on a database that holds others' keys but none of RQ's (a wrong
    database number): the read-only commands say so in one line (exit 2) instead of
    listing an empty system, and a pass is ``liveness_unknown`` (``queues_missing``, exit
    7). The same database empty, as before an app's first job: a quiet pass (exit 0) and
    no jobs listed (exit 0), nothing in doubt."""
    other = replace(project, redis_url=project.redis_url.rsplit("/", 1)[0] + "/5")
    other.redis().set("session:someone-else", "1")
    path = config_file(tmp_path, other)
    for argv in (("jobs", "list"), ("kinds",)):
        code, out, err = cli(capsys, path, *argv)
        assert (code, out) == (2, ""), argv
        assert err.strip() == (
            f"reconciler: error: source rq: the Redis at {other.redis_url} holds keys, but "
            "none of RQ's (no rq:queues, no rq:workers): not the app's Redis? Check the "
            "database number in redis_url; nothing was listed"), argv
    code, out, err = cli(capsys, path, "pass", "--dry-run", "--json")
    assert code == 7, err
    assert json.loads(out)["liveness_unknown"]["code"] == "queues_missing"
    assert "liveness unknown (queues_missing)" in err

    other.redis().flushdb()
    code, out, err = cli(capsys, path, "pass", "--json")
    assert code == 0, err
    assert (json.loads(out)["outcome"], err) == ("ok", "")
    assert cli(capsys, path, "jobs", "list") == (0, "no jobs\n", "")


def test_readyz_tells_an_empty_redis_waiting_from_another_apps(
        project: RqProject) -> None:
    """The sidecar's own answer (issue 41, finding 8): on a Redis database that holds
    others' keys but none of RQ's, a pass is ``liveness_unknown`` and ``/readyz`` 503
    naming ``queues_missing``; the same database empty (an app that has not run yet), the
    pass is ``ok`` and ``/readyz`` 200: a readiness probe does not hold back a sidecar
    that is only waiting for its app."""
    other = replace(project, redis_url=project.redis_url.rsplit("/", 1)[0] + "/5")
    other.redis().set("session:someone-else", "1")
    settings = Settings(
        database_url=project.engine.url.render_as_string(hide_password=False),
        metrics_port=0)
    for keys in ("others'", "none"):
        if keys == "none":
            other.redis().flushdb()
        service = Service(assemble_sidecar(Config(settings=settings, source=other.config(),
                                                  kinds=KINDS)))
        with serving(service) as base:
            report = service.run_one_pass()
            assert report is not None
            ready = fetch(base + "/readyz")
        if keys == "none":
            assert (report.outcome.value, report.liveness) == ("ok", None)
            assert (ready.status, ready.body) == (200, "ready\n")
        else:
            assert report.outcome.value == "liveness_unknown"
            assert ready.status == 503
            assert ready.body.startswith("liveness unknown (queues_missing) at "), ready.body


def test_an_rq_jobs_times_carry_their_offsets_and_name_what_they_are(
        project: RqProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``jobs show --json`` of jobs RQ failed (issue 41, finding 5), on every engine the
    reconciler's tables are on (the listing's temporary table gives SQLite's times back
    without an offset): every time with its UTC offset; a job RQ failed without writing
    when it ended (as RQ's cleanup of an abandoned job leaves it) has no ``finished_at``,
    never its ``started_at``; one with ``ended_at`` finished then, and was updated then."""
    started = "2026-12-01T12:00:00.000000Z"
    ended = "2026-12-01T12:00:07.500000Z"
    unended, finished = project.enqueue(IDEMPOTENT), project.enqueue(IDEMPOTENT)
    for job_id, fields in ((unended, {"started_at": started}),
                           (finished, {"started_at": started, "ended_at": ended})):
        failed(project, job_id)
        project.redis().hset(f"rq:job:{job_id}", mapping=fields)
    path = config_file(tmp_path, project)
    shown = {job_id: cli_json(capsys, path, "jobs", "show", job_id)
             for job_id in (unended, finished)}
    for view in shown.values():
        assert view["status"] == "failed"
        assert view["created_at"].endswith("+00:00"), view
        assert view["updated_at"].endswith("+00:00"), view
    assert (shown[unended]["updated_at"], shown[unended]["finished_at"]) == (
        "2026-12-01T12:00:00+00:00", None)
    assert (shown[finished]["updated_at"], shown[finished]["finished_at"]) == (
        "2026-12-01T12:00:07.500000+00:00", "2026-12-01T12:00:07.500000+00:00")
