"""The ``reconciler`` command line as an operator uses it: JSON shapes, redaction, errors."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobRun, ReconcilerLease, ReconciliationDecision, ReconciliationPass
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.engines import create_engine, read_only
from reconciler.storage.schema import current_revision, head_revision, upgrade
from reconciler.worker import Claim, JobClient, Step
from tests.conftest import PostgresForTests, run_cli, run_python
from tests.helpers import job_row

jobs: sa.Table = cast(sa.Table, JobRun.__table__)
passes: sa.Table = cast(sa.Table, ReconciliationPass.__table__)
decisions: sa.Table = cast(sa.Table, ReconciliationDecision.__table__)
leader_leases: sa.Table = cast(sa.Table, ReconcilerLease.__table__)

# The JSON shapes of docs/cli.md.
JOB_KEYS = {"job_id", "job_kind", "status", "reason", "attempts_used", "max_attempts",
            "resume_step_index", "steps", "created_at", "updated_at"}
# Public, harmless fields the view adds beyond the documented ones (see the report).
JOB_EXTRA_KEYS = {"operator_hold", "last_error_code", "finished_at", "decisions", "actions",
                  "history", "max_attempts_from", "timeline"}
STEP_KEYS = {"name", "state"}
STEP_EXTRA_KEYS = {"index", "effect_kind"}
PASS_KEYS = {"pass_id", "candidates", "resumed", "terminalized", "skipped", "decisions"}
PASS_EXTRA_KEYS = {"outcome", "dry_run", "shadow", "braked", "liveness_unknown"}
PASS_DECISION_KEYS = {"job_id", "disposition", "reason", "resume_step_index"}
# "decision records as stored": the reconciliation_decisions columns (shadow_mode is
# shown as "shadow").
STORED_DECISION_KEYS = {"decision_id", "pass_id", "job_source", "job_id", "job_kind",
                        "decided_at",
                        "disposition", "decision_reason", "generation_before",
                        "generation_after", "resume_step_index", "decision_evidence",
                        "shadow"}
# The decision table's reasons, in table order, then the pass's own outcomes.
TABLE_REASONS = ("operator_hold", "worker_wedged", "lease_live", "recent_activity",
                 "unresumable_plan", "waiting_on_gate", "completion_recovered",
                 "completion_unrecorded", "step_failed", "worker_died_mid_step", "crash_loop",
                 "resume_exhausted", "resumed_idempotent_step", "resumed_from_unstarted_step")
PASS_OUTCOME_REASONS = ("fence_lost", "reconcile_error", "mass_staleness_brake")

STEPS = [Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful")]
SHORT_LEASE_SECONDS = 0.3
UNREACHABLE_URL = "postgresql+psycopg://postgres@127.0.0.1:1/nope"

CliCall = tuple[Sequence[str], dict[str, Any]]


def run_many(db: str, calls: Sequence[CliCall]) -> list[subprocess.CompletedProcess[str]]:
    """Run independent CLI invocations one after the other (each a call of ``main()``)."""
    return [run_cli(db, *args, **settings) for args, settings in calls]


def ok_json(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


def cli_json(db: str, *args: str, **settings: Any) -> Any:
    return ok_json(run_cli(db, *args, "--json", **settings))


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Non-zero exit, nothing on stdout, exactly one line on stderr, no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.stdout == ""
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def wait_until(check: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def leases_expired(engine: Engine, job_ids: Sequence[int]) -> bool:
    """True once every listed job's lease is expired by the database's clock."""
    with engine.connect() as conn:
        live = read_only(conn).execute(
            sa.select(sa.func.count()).select_from(jobs)
            .where(jobs.c.job_id.in_(list(job_ids)), jobs.c.lease_expires_at > db_now())
        ).scalar_one()
    return live == 0


def count_rows(engine: Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(read_only(conn).execute(
            sa.select(sa.func.count()).select_from(table)).scalar_one())


def job_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in read_only(conn).execute(
            sa.select(jobs.c.job_id, jobs.c.job_status, jobs.c.claim_generation,
                      jobs.c.lease_token, jobs.c.lease_expires_at, jobs.c.updated_at,
                      jobs.c.resume_step_index)
            .order_by(jobs.c.job_id))]


def claim_next(client: JobClient, worker: str, lease_seconds: float,
               kind: str | None = None) -> Claim:
    claim = client.claim(worker=worker, lease_seconds=lease_seconds,
                         kinds=None if kind is None else [kind])
    assert claim is not None
    return claim


def crashed_after_step_zero(client: JobClient, worker: str = "w-cli", kind: str = "report",
                            **enqueue: Any) -> int:
    """A job whose worker finished step 0 and vanished: resumable at step 1."""
    job_id = client.enqueue(kind, steps=STEPS, **enqueue)
    claim = claim_next(client, worker, SHORT_LEASE_SECONDS, kind)
    assert claim.job_id == job_id
    claim.start_step(0)
    claim.finish_step(0)
    return job_id


def crashed_in_effectful_step(client: JobClient, worker: str = "w-cli", **enqueue: Any) -> int:
    """A job whose worker died inside its effectful step: must be terminalized."""
    job_id = client.enqueue("publish", steps=[Step("publish", "effectful")], **enqueue)
    claim = claim_next(client, worker, SHORT_LEASE_SECONDS, "publish")
    assert claim.job_id == job_id
    claim.start_step(0)
    return job_id


# -- jobs show / jobs list ----------------------------------------------------------------


def test_jobs_show_json_has_the_documented_keys(db_url: str, client: JobClient) -> None:
    """`jobs show --json` gives the documented keys; a step never started is not_started."""
    job_id = client.enqueue("report", steps=STEPS, max_attempts=4)
    claim = claim_next(client, "w-show", 30)
    claim.start_step(0)
    claim.finish_step(0)
    claim.start_step(1)

    shown = cli_json(db_url, "jobs", "show", str(job_id))

    assert JOB_KEYS <= set(shown) <= JOB_KEYS | JOB_EXTRA_KEYS, sorted(shown)
    assert shown["job_id"] == job_id
    assert shown["job_kind"] == "report"
    assert shown["status"] == "processing"
    assert shown["reason"] is None
    assert (shown["attempts_used"], shown["max_attempts"]) == (1, 4)
    assert shown["resume_step_index"] == 0
    for step in shown["steps"]:
        assert STEP_KEYS <= set(step) <= STEP_KEYS | STEP_EXTRA_KEYS, sorted(step)
    assert [(s["name"], s["state"]) for s in shown["steps"]] == [
        ("fetch", "succeeded"), ("render", "started"), ("publish", "not_started")]
    for stamp in ("created_at", "updated_at"):
        assert isinstance(shown[stamp], str)
        assert shown[stamp]


def test_no_output_ever_shows_payload_worker_or_lease_token(
    db_url: str, client: JobClient, engine: Engine
) -> None:
    """Every listing, in JSON and human form, is redacted: no payload, worker or token."""
    payload_marker = f"payload-marker-{uuid.uuid4().hex}"
    worker_marker = f"worker-marker-{uuid.uuid4().hex}"
    payload = {"secret": payload_marker, payload_marker: [payload_marker], "n": 12345}
    resumable = crashed_after_step_zero(client, worker_marker, payload=payload)
    doomed = crashed_in_effectful_step(client, worker_marker, payload=payload)
    live = client.enqueue("live", steps=STEPS, payload=payload)
    live_claim = claim_next(client, worker_marker, 60, "live")
    assert live_claim.job_id == live
    live_claim.start_step(0)
    with engine.connect() as conn:
        tokens = [t for t in read_only(conn).execute(
            sa.select(jobs.c.lease_token).where(jobs.c.lease_token.is_not(None))).scalars()]
    assert len(tokens) == 3
    secrets = [payload_marker, worker_marker, *tokens]
    wait_until(lambda: leases_expired(engine, [resumable, doomed]), what="short leases")
    stale = {"stale_after_seconds": 0}

    # While the live job holds its token, and while the crashed ones still hold theirs.
    outputs = run_many(db_url, [
        (("jobs", "list"), {}), (("jobs", "list", "--json"), {}),
        (("jobs", "show", str(live)), {}), (("jobs", "show", str(live), "--json"), {}),
    ])
    # One candidate per pass, so both the human and the JSON form report a decision.
    outputs.append(run_cli(db_url, "pass", batch_size=1, **stale))
    outputs.append(run_cli(db_url, "pass", "--json", batch_size=1, **stale))
    outputs += run_many(db_url, [(("decisions",), {}), (("decisions", "--json"), {})])

    for proc in outputs:
        assert proc.returncode == 0, f"{proc.args}: {proc.stderr}"
        for secret in secrets:
            assert secret not in proc.stdout, f"{proc.args[3:]} leaked {secret}"
            assert secret not in proc.stderr, f"{proc.args[3:]} leaked {secret}"
    assert all(str(j) in outputs[0].stdout for j in (resumable, doomed, live))
    assert "render" in outputs[2].stdout, "the human job view shows the steps"
    human_decisions = outputs[-2].stdout
    assert "resumed_from_unstarted_step" in human_decisions
    assert "worker_died_mid_step" in human_decisions


def test_jobs_list_filters_by_status_and_caps_newest_first(
    db_url: str, client: JobClient
) -> None:
    """`jobs list --status processing --limit 1` gives only the newest processing job."""
    first, second, third = (client.enqueue("report", steps=STEPS) for _ in range(3))
    claim_next(client, "w-list", 30)
    claim_next(client, "w-list", 30)

    capped, everything = (ok_json(p) for p in run_many(db_url, [
        (("jobs", "list", "--status", "processing", "--limit", "1", "--json"), {}),
        (("jobs", "list", "--json"), {}),
    ]))

    # The newest job overall is queued: the filter drops it, the cap drops the oldest.
    assert [(j["job_id"], j["status"]) for j in capped] == [(second, "processing")]
    assert [(j["job_id"], j["status"]) for j in everything] == [
        (third, "queued"), (second, "processing"), (first, "processing")]
    for job in everything:
        assert JOB_KEYS <= set(job) <= JOB_KEYS | JOB_EXTRA_KEYS


# -- pass -----------------------------------------------------------------------------------


def test_pass_json_shape_and_dry_run_writes_nothing(
    db_url: str, client: JobClient, engine: Engine
) -> None:
    """A dry run decides exactly what the real pass then does, and leaves no trace."""
    resumable = crashed_after_step_zero(client)
    doomed = crashed_in_effectful_step(client)
    live = client.enqueue("live", steps=STEPS)
    claim_next(client, "w-live", 60, "live")
    wait_until(lambda: leases_expired(engine, [resumable, doomed]), what="short leases")
    before = job_rows(engine)

    preview = cli_json(db_url, "pass", "--dry-run", stale_after_seconds=0)

    assert job_rows(engine) == before
    for table in (passes, decisions, leader_leases):
        assert count_rows(engine, table) == 0, f"dry run wrote to {table.name}"
    assert preview["pass_id"] is None
    assert preview.get("dry_run", True) is True

    report = cli_json(db_url, "pass", stale_after_seconds=0)

    for shown in (preview, report):
        assert PASS_KEYS <= set(shown) <= PASS_KEYS | PASS_EXTRA_KEYS, sorted(shown)
        for decision in shown["decisions"]:
            assert set(decision) == PASS_DECISION_KEYS
        assert (shown["candidates"], shown["resumed"], shown["terminalized"],
                shown["skipped"]) == (2, 1, 1, 0)
        by_job = {d["job_id"]: d for d in shown["decisions"]}
        assert live not in by_job, "a live lease is not a candidate"
        assert (by_job[resumable]["disposition"], by_job[resumable]["reason"],
                by_job[resumable]["resume_step_index"]) == (
            "resume", "resumed_from_unstarted_step", 1)
        assert (by_job[doomed]["disposition"], by_job[doomed]["reason"],
                by_job[doomed]["resume_step_index"]) == (
            "terminalize", "worker_died_mid_step", None)
    assert isinstance(report["pass_id"], int)
    assert count_rows(engine, passes) == 1
    assert count_rows(engine, decisions) == 2


# -- decisions ------------------------------------------------------------------------------


def test_decisions_json_is_the_stored_trail_newest_first(
    db_url: str, client: JobClient, engine: Engine
) -> None:
    """`decisions --json` lists stored records newest first; --reason/--since/--limit filter."""
    resumable = crashed_after_step_zero(client)
    doomed = crashed_in_effectful_step(client)
    wait_until(lambda: leases_expired(engine, [resumable, doomed]), what="short leases")
    report = cli_json(db_url, "pass", stale_after_seconds=0)
    assert report["candidates"] == 2

    trail, died, recent = (ok_json(p) for p in run_many(db_url, [
        (("decisions", "--json"), {}),
        (("decisions", "--reason", "worker_died_mid_step", "--json"), {}),
        (("decisions", "--since", "1h", "--limit", "1", "--json"), {}),
    ]))

    assert len(trail) == 2
    kinds = {job: job_row(engine, job)["job_kind"] for job in (resumable, doomed)}
    for record in trail:
        assert set(record) == STORED_DECISION_KEYS, sorted(record)
        assert record["pass_id"] == report["pass_id"]
        assert record["job_kind"] == kinds[record["job_id"]]  # the kind, as the pass read it
    ids = [r["decision_id"] for r in trail]
    assert ids == sorted(ids, reverse=True)
    assert [(r["job_id"], r["disposition"]) for r in died] == [(doomed, "terminalize")]
    assert recent == trail[:1]
    resumed = next(r for r in trail if r["job_id"] == resumable)
    assert (resumed["decision_reason"], resumed["resume_step_index"]) == (
        "resumed_from_unstarted_step", 1)
    assert resumed["generation_after"] == resumed["generation_before"] + 1
    assert isinstance(resumed["decision_evidence"], dict)


def test_decisions_limit_defaults_to_100_and_since_filters_by_age(
    db_url: str, engine: Engine
) -> None:
    """With 105 stored decisions the default listing shows the newest 100."""
    with engine.begin() as conn:
        pass_id = conn.execute(passes.insert().values(
            reconciler_instance="bulk-test", started_at=db_now(), finished_at=db_now(),
            pass_outcome="ok",  # noqa: S106 - an outcome code, not a password
        ).returning(passes.c.pass_id)).scalar_one()
        # The five oldest decisions were made two hours ago.
        for job_id, age in [(n, 7200.0 if n < 5 else 0.0) for n in range(105)]:
            conn.execute(decisions.insert().values(
                pass_id=pass_id, job_id=1000 + job_id, decided_at=now_plus(-age),
                disposition="skip",
                decision_reason="lease_live" if job_id % 2 else "recent_activity",
                generation_before=1))

    default, capped, hour, week_of_one_reason = (
        ok_json(p) for p in run_many(db_url, [
            (("decisions", "--json"), {}),
            (("decisions", "--limit", "2", "--json"), {}),
            (("decisions", "--since", "1h", "--limit", "500", "--json"), {}),
            (("decisions", "--since", "7d", "--reason", "lease_live", "--limit", "500",
              "--json"), {}),
        ]))

    ids = [r["decision_id"] for r in default]
    assert len(ids) == 100
    assert ids == sorted(ids, reverse=True)
    assert [r["job_id"] for r in default][:2] == [1104, 1103]
    assert capped == default[:2]
    assert len(hour) == 100
    assert min(r["job_id"] for r in hour) == 1005
    # Every odd row is lease_live, the two-hour-old ones included: 7d reaches them.
    assert len(week_of_one_reason) == 52
    assert {r["decision_reason"] for r in week_of_one_reason} == {"lease_live"}


def test_decisions_shadow_lists_only_decisions_recorded_in_shadow_mode(
    db_url: str, engine: Engine
) -> None:
    """`decisions --shadow` lists only shadow decisions, each `"shadow": true`; without it
    every decision is listed with its flag, whatever RECONCILER_SHADOW says; human lines
    mark shadow decisions; `--no-shadow` is a one-line usage error."""
    with engine.begin() as conn:
        pass_id = conn.execute(passes.insert().values(
            reconciler_instance="shadow-test", started_at=db_now(), finished_at=db_now(),
            pass_outcome="ok",  # noqa: S106 - an outcome code, not a password
        ).returning(passes.c.pass_id)).scalar_one()
        # Jobs 2000-2005; the even ones were decided by a shadow pass.
        for n in range(6):
            conn.execute(decisions.insert().values(
                pass_id=pass_id, job_id=2000 + n, decided_at=db_now(),
                disposition="resume" if n < 4 else "skip",
                decision_reason="resumed_from_unstarted_step" if n < 4 else "lease_live",
                generation_before=1, generation_after=2 if n < 4 else None,
                shadow_mode=n % 2 == 0))

    shadow, everything, env_shadow, shadow_resumes, human, no_shadow = run_many(db_url, [
        (("decisions", "--shadow", "--json"), {}),
        (("decisions", "--json"), {}),
        (("decisions", "--json"), {"shadow": "true"}),
        (("decisions", "--shadow", "--reason", "resumed_from_unstarted_step", "--json"), {}),
        (("decisions", "--shadow"), {}),
        (("decisions", "--no-shadow"), {}),
    ])

    assert [(r["job_id"], r["shadow"]) for r in ok_json(shadow)] == [
        (2004, True), (2002, True), (2000, True)]
    listed = ok_json(everything)
    assert [(r["job_id"], r["shadow"]) for r in listed] == [
        (2005 - n, n % 2 == 1) for n in range(6)]
    assert all(set(r) == STORED_DECISION_KEYS for r in listed)
    assert ok_json(env_shadow) == listed
    assert [r["job_id"] for r in ok_json(shadow_resumes)] == [2002, 2000]
    assert human.returncode == 0, human.stderr
    lines = human.stdout.strip().splitlines()
    assert len(lines) == 3
    assert all("[shadow: nothing changed]" in line for line in lines)
    assert "job 2004: skip (lease_live)" in lines[0]
    assert no_shadow.returncode == 2
    assert "--no-shadow" in no_shadow.stderr
    assert len(no_shadow.stderr.strip().splitlines()) == 1


def test_decisions_rejects_a_malformed_duration_or_limit(tmp_path: Path) -> None:
    """A bad --since or --limit is an argument error: non-zero, no traceback."""
    for proc in run_many(f"sqlite:///{tmp_path / 'jobs.db'}", [
        (("decisions", "--since", "soon"), {}),
        (("decisions", "--limit", "0"), {}),
    ]):
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""
        assert "--since" in proc.stderr.splitlines()[-1] or "--limit" in proc.stderr


# -- explain --------------------------------------------------------------------------------


def test_explain_prints_every_reason_in_table_order(tmp_path: Path) -> None:
    """`explain` prints the 14 rules in order, then the pass's own three outcomes."""
    never_created = tmp_path / "not-needed.db"

    proc = run_cli(f"sqlite:///{never_created}", "explain")

    assert proc.returncode == 0, proc.stderr
    positions = [proc.stdout.find(reason) for reason in TABLE_REASONS + PASS_OUTCOME_REASONS]
    assert -1 not in positions, proc.stdout
    assert positions == sorted(positions)
    assert not never_created.exists(), "explain needs no database"


# -- errors ---------------------------------------------------------------------------------


def test_bad_settings_end_with_one_line(tmp_path: Path) -> None:
    """An invalid flag or environment setting: one line naming it, non-zero, no traceback.

    Settings are checked before any database is opened, so one engine is enough here.
    """
    database = tmp_path / "jobs.db"
    cases: list[tuple[CliCall, str]] = [
        ((("pass",), {"batch_size": -1}), "batch_size"),
        ((("jobs", "list", "--stale-after-seconds", "abc"), {}), "stale_after_seconds"),
        ((("decisions",), {"stale_after_seconds": 60, "wedged_after_seconds": 60}),
         "wedged_after_seconds"),
        ((("db", "upgrade", "--metrics-port", "70000"), {}), "metrics_port"),
    ]

    results = run_many(f"sqlite:///{database}", [call for call, _ in cases])

    for proc, (_, setting) in zip(results, cases, strict=True):
        assert_one_line_error(proc, setting)
    assert not database.exists(), "a refused command opened the database"


def test_an_unreachable_database_ends_with_one_line() -> None:
    """No server behind the URL: one line naming the database, non-zero, no traceback."""
    commands: list[CliCall] = [
        (("pass", "--json"), {}), (("jobs", "list"), {}), (("decisions", "--json"), {}),
        (("db", "upgrade"), {}),
    ]

    for proc in run_many(UNREACHABLE_URL, commands):
        assert_one_line_error(proc, "127.0.0.1")


def test_a_sqlite_path_in_a_missing_directory_ends_with_one_line(tmp_path: Path) -> None:
    """SQLite cannot create a file in a missing folder: one clear line, non-zero."""
    url = f"sqlite:///{tmp_path / 'no-such-dir' / 'jobs.db'}"

    for proc in run_many(url, [(("pass",), {}), (("db", "upgrade"), {})]):
        assert_one_line_error(proc)
    assert not (tmp_path / "no-such-dir").exists()


def test_an_unmigrated_database_ends_with_one_line(empty_db_url: str) -> None:
    """No schema: one line telling the operator to run `reconciler db upgrade`."""
    commands: list[CliCall] = [
        (("pass", "--json"), {}), (("jobs", "list"), {}), (("decisions",), {}),
    ]

    for proc in run_many(empty_db_url, commands):
        assert_one_line_error(proc, "db upgrade")
    engine = sa.create_engine(empty_db_url)
    try:
        assert sa.inspect(engine).get_table_names() == [], "a refused command wrote a schema"
    finally:
        engine.dispose()


def test_showing_an_unknown_job_ends_with_one_line(db_url: str) -> None:
    """`jobs show` of an id that does not exist: non-zero and one line naming the id."""
    assert_one_line_error(run_cli(db_url, "jobs", "show", "987654", "--json"), "987654")


# -- db upgrade -----------------------------------------------------------------------------


def test_db_upgrade_on_an_empty_database_then_pass_works(empty_db_url: str) -> None:
    """`db upgrade` makes an empty database usable and says it created the schema; run
    again, it says the schema is current and changes nothing."""
    head = head_revision()
    first = run_cli(empty_db_url, "db", "upgrade")
    assert first.returncode == 0, first.stderr
    assert f"created this project's schema (revision {head})" in first.stdout
    again = run_cli(empty_db_url, "db", "upgrade")
    assert again.returncode == 0, again.stderr
    assert f"is up to date (revision {head}): nothing to do" in again.stdout

    report = cli_json(empty_db_url, "pass")

    assert (report["candidates"], report["decisions"]) == (0, [])
    assert isinstance(report["pass_id"], int)


def test_db_upgrade_says_which_revision_it_upgraded_from(empty_db_url: str) -> None:
    """A database one release behind: `db upgrade` names the revision it found and the
    one it reached, and the schema is then at head."""
    engine = create_engine(empty_db_url)
    try:
        upgrade(engine, "0010")
        proc = run_cli(empty_db_url, "db", "upgrade")
        assert proc.returncode == 0, proc.stderr
        assert f"from revision 0010 to {head_revision()}" in proc.stdout
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_a_postgresql_url_over_a_unix_socket_as_the_docs_spell_it(
        postgres: PostgresForTests | None) -> None:
    """``postgresql+psycopg://USER@/DB?host=SOCKET_FOLDER`` (docs/settings.md; the port
    only because this server's is not 5432): `db upgrade` and a pass work over it."""
    if postgres is None or postgres.server is None:
        pytest.skip("no throwaway PostgreSQL of this session's own (its socket folder)")
    server = postgres.server
    name = f"socket_{uuid.uuid4().hex[:8]}"
    server.create_database(name)
    url = (f"postgresql+psycopg://postgres@/{name}?host={server.socket_dir}"
           f"&port={server.port}")
    try:
        upgraded = run_cli(url, "db", "upgrade")
        assert upgraded.returncode == 0, upgraded.stderr
        assert "created this project's schema" in upgraded.stdout
        assert cli_json(url, "pass")["candidates"] == 0
    finally:
        server.drop_database(name)


def test_a_command_on_the_native_source_imports_no_system_adapter(db_url: str) -> None:
    """``jobs list`` on this project's own tables imports no foreign system's source, no
    broker or framework client, none of the sidecar's parts (its scheduler, console and
    metrics) and no demo (the parser reads only their names): a command pays for what it
    uses."""
    proc = run_python(
        "import contextlib, io, json, os, sys\n"
        "from reconciler.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['jobs', 'list'])\n"
        "print(json.dumps([code, sorted(sys.modules)]))\n",
        env={"RECONCILER_DATABASE_URL": db_url})
    assert proc.returncode == 0, proc.stderr
    code, loaded = json.loads(proc.stdout.splitlines()[-1])
    assert code == 0
    systems = ("procrastinate", "graphile_worker", "pgboss", "django_tasks", "celery", "table")
    unwanted = [m for m in loaded if m.split(".")[0] in (
        "celery", "kombu", "redis", "django", "procrastinate", "apscheduler", "jinja2",
        "prometheus_client") or m.startswith(("reconciler.sidecar", "reconciler.console",
                                              "reconciler.demos."))
        or any(m == f"reconciler.sources.{s}" or m.startswith(f"reconciler.sources.{s}_")
               for s in systems)]
    assert unwanted == []
