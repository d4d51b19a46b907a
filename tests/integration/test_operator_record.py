"""The operator actions' record on the native source, and the command line's single and
bulk forms (``--note``, ``--as``, ``--reason``...), on SQLite and PostgreSQL."""

from __future__ import annotations

import getpass
import json
import os
import pty
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import OperatorAction as ActionRow
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import downgrade, upgrade
from reconciler.worker import JobClient
from tests.cli_runner import ARGV0, REPO_ROOT, run_main, settings_env
from tests.conftest import run_cli
from tests.helpers import job_row
from tests.integration.test_operator_actions import (
    PLAN,
    claim_job,
    reconcile,
    wait_until_expired,
)

ACTIONS = cast(sa.Table, ActionRow.__table__)
DIED = "worker_died_mid_step"


@pytest.fixture
def empty_engine(empty_db_url: str) -> Iterator[Engine]:
    """An engine on a database with no schema at all."""
    engine = create_engine(empty_db_url)
    try:
        yield engine
    finally:
        engine.dispose()


def test_native_actions_recorded_before_are_migrated(empty_engine: Engine) -> None:
    """A row of the older record gets source ``native``, its job id as the key and its
    statuses as the states; going back down keeps it."""
    upgrade(empty_engine, "0009")
    with empty_engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO operator_actions (job_id, operator_action, action_outcome, acted_at, "
            "status_before, status_after, generation_before, generation_after) VALUES "
            "(5, 'retry', 'applied', :at, 'failed', 'queued', 2, 3)"),
            {"at": datetime(2026, 1, 1, tzinfo=UTC)})
    upgrade(empty_engine)
    with empty_engine.connect() as conn:
        migrated = conn.execute(sa.select(ACTIONS)).mappings().one()
    assert (migrated["job_source"], migrated["job_key"], migrated["job_id"],
            migrated["state_before"], migrated["state_after"], migrated["acted_by"]) == (
        "native", "5", 5, "failed", "queued", None)
    downgrade(empty_engine, "0009")
    with empty_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT job_id FROM operator_actions")).scalars().all() \
            == [5]


def terminalized(client: JobClient, engine: Engine, kind: str = "report") -> int:
    """A job whose worker died inside its effectful step, failed by a real pass."""
    job_id = client.enqueue(kind, steps=PLAN)
    claim = claim_job(client, job_id, lease_seconds=0.5)
    for index in (0, 1):
        claim.start_step(index)
        claim.finish_step(index)
    claim.start_step(2)
    wait_until_expired(engine, job_id)
    reconcile(engine)
    row = job_row(engine, job_id)
    assert (row["job_status"], row["status_reason"]) == ("failed", DIED)
    return job_id


def test_retry_and_cancel_need_a_note(db_url: str) -> None:
    """Without ``--note``: a usage error, one line, exit 2, before the database."""
    for action in ("retry", "cancel"):
        done = run_cli(db_url, "jobs", action, "1")
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1
        assert "--note" in done.stderr


def test_the_record_keeps_who_and_why_and_show_lists_it_with_the_decisions(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """``--as`` and ``--note`` are recorded (the OS user without ``--as``); ``jobs show``
    lists the pass's decision and the actions in time order, the note escaped."""
    job_id = terminalized(client, engine)
    note = "refund checked \x1b[31mnot charged"
    done = run_cli(db_url, "jobs", "retry", str(job_id), "--note", note, "--as", "alice")
    assert done.returncode == 0, done.stderr
    assert f"job {job_id}: retry applied; status queued" in done.stdout
    assert run_cli(db_url, "jobs", "hold", str(job_id)).returncode == 0
    shown = json.loads(run_cli(db_url, "jobs", "show", str(job_id), "--json").stdout)
    history = [(h["type"], h.get("reason") or h.get("action"), h.get("actor"))
               for h in shown["history"]]
    assert history == [("decision", DIED, None), ("action", "retry", "alice"),
                       ("action", "hold", getpass.getuser())]
    retry = shown["history"][1]
    assert (retry["note"], retry["state_before"], retry["state_after"]) == (
        note, "failed", "queued")
    human = run_cli(db_url, "jobs", "show", str(job_id)).stdout
    assert "\x1b" not in human
    assert "retry by alice: applied; failed -> queued; note: refund checked" in human


def test_an_action_typed_as_a_service_account_must_say_who_acts(
        client: JobClient, engine: Engine, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Typed into the image (its own OS user ``reconciler``, as through ``kubectl exec``)
    or as a uid with no name: refused, exit 2, one line saying how to name who acts, and
    nothing recorded; ``RECONCILER_OPERATOR`` names the person, ``--as`` wins over it."""
    job_id = client.enqueue("report.build", steps=PLAN)
    monkeypatch.setattr(getpass, "getuser", lambda: "reconciler")
    refused = run_cli(db_url, "jobs", "hold", str(job_id))
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert "'reconciler' is a service account" in line
    assert "--as NAME or set RECONCILER_OPERATOR" in line

    def no_name() -> str:
        raise KeyError("getpwuid(): uid not found: 10001")

    monkeypatch.setattr(getpass, "getuser", no_name)
    assert "the OS user has no name" in run_cli(db_url, "jobs", "hold", str(job_id)).stderr
    env = {**settings_env(db_url), "RECONCILER_OPERATOR": "carol"}
    held = run_main(["jobs", "hold", str(job_id)], env=env)
    assert held.returncode == 0, held.stderr
    lifted = run_main(["jobs", "unhold", str(job_id), "--as", "dave"], env=env)
    assert lifted.returncode == 0, lifted.stderr
    shown = json.loads(run_cli(db_url, "jobs", "show", str(job_id), "--json").stdout)
    assert [(h["action"], h["actor"]) for h in shown["history"] if h["type"] == "action"] == [
        ("hold", "carol"), ("unhold", "dave")]


def _bulk(db_url: str, *argv: str) -> Any:
    return run_cli(db_url, "jobs", "retry", "--reason", DIED, "--note", "bulk", *argv)


def test_the_bulk_form_counts_first_and_acts_only_when_told(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """It says how many match; without ``--yes`` (and no terminal) nothing changes;
    ``--dry-run`` lists them; ``--kind`` and ``--limit`` narrow them; with ``--yes`` each
    is retried and recorded on its own, and the counts end it."""
    reports = [terminalized(client, engine) for _ in range(2)]
    mail = terminalized(client, engine, kind="mail.send")

    asked = _bulk(db_url)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.splitlines()[0].startswith("3 native jobs match")
    assert "nothing changed: pass --yes" in asked.stdout
    listed = _bulk(db_url, "--dry-run", "--yes")
    assert [line.strip() for line in listed.stdout.splitlines()[1:]] == [
        f"job {job}" for job in (mail, *reversed(reports))]
    assert {job_row(engine, job)["job_status"] for job in (*reports, mail)} == {"failed"}

    by_kind = _bulk(db_url, "--kind", "mail.*", "--yes", "--as", "bob")
    assert by_kind.returncode == 0, by_kind.stderr
    assert by_kind.stdout.splitlines()[-1] == "retry: applied 1, refused 0"
    assert job_row(engine, mail)["job_status"] == "queued"

    capped = json.loads(_bulk(db_url, "--limit", "1", "--yes", "--json").stdout)
    assert capped == {"matched": [str(reports[1])], "applied": [str(reports[1])],
                      "refused": [], "dry_run": False,
                      "counts": {"matched": 1, "applied": 1, "refused": 0}}
    rest = _bulk(db_url, "--yes")
    assert rest.stdout.splitlines()[-1] == "retry: applied 1, refused 0"
    assert {job_row(engine, job)["job_status"] for job in (*reports, mail)} == {"queued"}
    with engine.connect() as conn:
        recorded = conn.execute(sa.select(ACTIONS.c.job_key, ACTIONS.c.acted_by)
                                .order_by(ACTIONS.c.action_id)).all()
    assert [tuple(r) for r in recorded] == [
        (str(mail), "bob"), (str(reports[1]), getpass.getuser()),
        (str(reports[0]), getpass.getuser())]


def test_a_hold_outlives_its_jobs_end_and_is_still_lifted(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """A held job cancelled by another operator ends cancelled and still held; ``unhold``
    lifts the hold (exit 0), which changes nothing else, and is recorded."""
    job_id = client.enqueue("report.build", steps=PLAN)
    assert run_cli(db_url, "jobs", "hold", str(job_id), "--as", "ann").returncode == 0
    cancelled = run_cli(db_url, "jobs", "cancel", str(job_id), "--note", "dup", "--as", "bo")
    assert cancelled.returncode == 0, cancelled.stderr
    assert (job_row(engine, job_id)["job_status"], job_row(engine, job_id)["operator_hold"]
            ) == ("cancelled", True)
    lifted = run_cli(db_url, "jobs", "unhold", str(job_id), "--as", "ann")
    assert lifted.returncode == 0, lifted.stderr
    row = job_row(engine, job_id)
    assert (row["job_status"], bool(row["operator_hold"])) == ("cancelled", False)
    assert run_cli(db_url, "jobs", "unhold", str(job_id), "--as", "ann").returncode == 6


def test_each_bulk_filter_stands_alone(client: JobClient, engine: Engine,
                                       db_url: str) -> None:
    """``--kind`` and ``--since`` without ``--reason`` (as the help lists them): a dry run
    lists the jobs of that kind decided in that window, then ``--yes`` retries them."""
    terminalized(client, engine)
    mails = [terminalized(client, engine, kind="mail.send") for _ in range(2)]
    argv = ("jobs", "retry", "--kind", "mail.*", "--since", "1h", "--note", "x")
    listed = run_cli(db_url, *argv, "--dry-run")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].startswith("2 native jobs match (kind mail.*, decided in the last 3600 s")
    assert sorted(line.strip() for line in lines[1:]) == sorted(f"job {j}" for j in mails)
    done = run_cli(db_url, *argv, "--yes", "--as", "erin")
    assert done.stdout.splitlines()[-1] == "retry: applied 2, refused 0", done.stderr
    assert {job_row(engine, job)["job_status"] for job in mails} == {"queued"}


def test_the_bulk_form_takes_no_job_id_and_hold_takes_no_filter(db_url: str) -> None:
    """One job or a filter, never both; hold has no bulk form: usage errors (exit 2)."""
    assert _bulk(db_url, "7").returncode == 2
    assert run_cli(db_url, "jobs", "hold", "--reason", DIED).returncode == 2
    assert run_cli(db_url, "jobs", "retry", "--note", "n").returncode == 2
    assert run_cli(db_url, "jobs", "retry", "7", "--kind", "x", "--note", "n").returncode == 2


def test_a_job_changed_between_the_bulk_preview_and_the_act_is_refused_exit_6(
        client: JobClient, engine: Engine, db_url: str) -> None:
    """Two real operators: the bulk form counts three failed jobs and asks on its terminal;
    meanwhile another operator's process retries one of them. Confirmed, the bulk form
    retries the two still failed, refuses the third (queued now: its line says why, the
    record keeps it refused and unchanged), ends with the counts, and exits 6."""
    jobs = [terminalized(client, engine) for _ in range(3)]
    controller, terminal = pty.openpty()
    bulk = subprocess.Popen(
        [*ARGV0, "jobs", "retry", "--reason", DIED, "--note", "bulk", "--as", "alice"],
        stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=settings_env(db_url), cwd=REPO_ROOT)
    os.close(terminal)
    try:
        assert bulk.stderr is not None
        prompt = ""
        while not prompt.endswith("type yes: "):  # counted, and asking
            char = bulk.stderr.read(1)
            assert char, f"the bulk form ended before asking: {bulk.communicate()}"
            prompt += char
        assert prompt == "retry these 3 jobs? type yes: "
        other = run_cli(db_url, "jobs", "retry", str(jobs[1]), "--note", "mine", "--as",
                        "bob", process=True)
        assert other.returncode == 0, other.stderr
        os.write(controller, b"yes\n")
        out, err = bulk.communicate(timeout=60)
    finally:
        os.close(controller)
        if bulk.poll() is None:
            bulk.kill()
            bulk.wait()
    assert bulk.returncode == 6, err
    lines = out.splitlines()
    assert lines[0] == f"3 native jobs match (latest decision {DIED}) and can be retried now"
    assert f"job {jobs[1]}: retry refused (job_not_failed_or_cancelled)" in out
    assert lines[-1] == "retry: applied 2, refused 1"
    assert {job_row(engine, job)["job_status"] for job in jobs} == {"queued"}
    with engine.connect() as conn:
        recorded = conn.execute(
            sa.select(ACTIONS.c.job_key, ACTIONS.c.acted_by, ACTIONS.c.action_outcome,
                      ACTIONS.c.generation_before, ACTIONS.c.generation_after)
            .where(ACTIONS.c.job_key == str(jobs[1])).order_by(ACTIONS.c.action_id)).all()
    [theirs, ours] = [tuple(r) for r in recorded]
    assert theirs[1:3] == ("bob", "applied")
    assert ours == (str(jobs[1]), "alice", "refused", theirs[4], theirs[4])
