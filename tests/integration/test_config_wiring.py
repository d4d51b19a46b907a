"""A config file's ``[kinds]`` on the native source, and ``--config`` on the command line.

The pass is built by the composition root from the file (``root.cli.assemble_cli`` and
``config.loader.pass_config``), as ``reconciler pass --config`` and ``reconciler run``
build it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobRun
from reconciler.config.loader import Config, load_config, pass_config
from reconciler.core.passes import PassReport, run_pass
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from reconciler.ledger import StepLedger
from reconciler.root.cli import assemble_cli
from reconciler.root.sidecar import assemble_sidecar
from reconciler.sidecar.service import Service
from reconciler.storage.clock import now_plus
from reconciler.worker import JobClient, Step
from tests.conftest import run_cli
from tests.helpers import job_row

pytestmark = pytest.mark.integration

JOBS = cast(sa.Table, JobRun.__table__)


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "reconciler.toml"
    path.write_text(textwrap.dedent(body))
    return path


def claimed(client: JobClient, kind: str, *, idle: float, lease_in: float) -> int:
    """A job of ``kind`` claimed and inside its first (idempotent) step, its last progress
    ``idle`` seconds ago and its lease ending in ``lease_in`` seconds (the database clock)."""
    job = client.enqueue(kind, steps=[Step("work", EffectKind.IDEMPOTENT)])
    claim = client.claim("worker-1", 300, [kind])
    assert claim is not None
    assert claim.job_id == job
    claim.start_step(0)
    with client.store.engine.begin() as conn:
        conn.execute(JOBS.update().where(JOBS.c.job_id == job).values(
            last_activity_at=now_plus(-idle), lease_expires_at=now_plus(lease_in)))
    return job


def one_pass(engine: Engine, config: Config, batch_size: int = 50) -> PassReport:
    settings = config.settings.model_copy(update={"batch_size": batch_size})
    return run_pass(assemble_cli(config, engine=engine).passes,
                    pass_config(settings, "kinds-test", config.kinds))


def config_of(tmp_path: Path, db_url: str, kinds: str) -> Config:
    return load_config(write_config(tmp_path, kinds), database_url=db_url)


def test_a_kind_not_reconciled_is_never_touched_nor_fills_the_batch(
        tmp_path: Path, db_url: str, engine: Engine, client: JobClient) -> None:
    """``reconcile = false``: its dead job is left running, and a batch of one still
    reaches the next kind's job, although the excluded job's lease ran out first."""
    config = config_of(tmp_path, db_url, """
        [kinds."legacy.*"]
        reconcile = false
    """)
    excluded = claimed(client, "legacy.export", idle=900, lease_in=-600)
    reconciled = claimed(client, "mail.digest", idle=900, lease_in=-300)

    report = one_pass(engine, config, batch_size=1)

    assert [(d.job_id, d.disposition) for d in report.decisions] == [
        (reconciled, Disposition.RESUME)]
    assert job_row(engine, excluded)["job_status"] == "processing"
    assert one_pass(engine, config).decisions == ()


def test_a_kind_wedged_sooner_than_the_default_is_found_and_others_are_not(
        tmp_path: Path, db_url: str, engine: Engine, client: JobClient) -> None:
    """The scan uses the shortest configured wedged time and decides per kind: a ``fast``
    job idle 10 minutes under a live lease is wedged; a default-kind job is not yet."""
    config = config_of(tmp_path, db_url, """
        wedged_after_seconds = 3600

        [kinds."fast.*"]
        wedged_after_seconds = 300
    """)
    fast = claimed(client, "fast.thumbnail", idle=600, lease_in=300)
    slow = claimed(client, "report.monthly", idle=600, lease_in=300)

    report = one_pass(engine, config)

    assert [(d.job_id, d.disposition, d.reason) for d in report.decisions] == [
        (fast, Disposition.TERMINALIZE, Reason.WORKER_WEDGED)]
    assert job_row(engine, fast)["job_status"] == "failed"
    assert job_row(engine, slow)["job_status"] == "processing"


def test_per_kind_stale_after_seconds_protects_recent_activity(
        tmp_path: Path, db_url: str, engine: Engine, client: JobClient) -> None:
    """A kind's own ``stale_after_seconds`` decides: 5 minutes idle is recent for a kind
    that allows 10, stale under the default of 60 seconds."""
    config = config_of(tmp_path, db_url, """
        stale_after_seconds = 60

        [kinds."patient.*"]
        stale_after_seconds = 600
    """)
    patient = claimed(client, "patient.crawl", idle=300, lease_in=-30)
    default = claimed(client, "mail.send", idle=300, lease_in=-30)

    decided = {d.job_id: d.reason for d in one_pass(engine, config).decisions}

    assert decided == {patient: Reason.RECENT_ACTIVITY,
                       default: Reason.RESUMED_IDEMPOTENT_STEP}


def test_crash_loop_after_resolves_per_kind_with_the_setting_as_default(
        tmp_path: Path) -> None:
    """``crash_loop_after`` is a ``[kinds]`` key; unset, a kind gets the setting's."""
    config = load_config(write_config(tmp_path, """
        crash_loop_after = 4

        [kinds."flaky.*"]
        crash_loop_after = 2
    """), database_url="sqlite://")
    assert config.kinds.resolve("flaky.sync").thresholds.crash_loop_after == 2
    assert config.kinds.resolve("mail.send").thresholds.crash_loop_after == 4
    assert pass_config(config.settings, "x", config.kinds).thresholds_for(
        "mail.send").crash_loop_after == 4


# --------------------------------------------------------------------------- #
# The command line
# --------------------------------------------------------------------------- #


def test_pass_reads_kinds_from_the_config_flag_and_from_the_environment(
        tmp_path: Path, db_url: str, engine: Engine, client: JobClient) -> None:
    """``--config`` (after the command or before it) and ``RECONCILER_CONFIG`` name the same
    file; the flag wins."""
    path = write_config(tmp_path, """
        [kinds."legacy.*"]
        reconcile = false
    """)
    excluded = claimed(client, "legacy.export", idle=900, lease_in=-600)

    by_flag = json.loads(run_cli(db_url, "pass", "--json", "--config", str(path)).stdout)
    before = json.loads(run_cli(db_url, "--config", str(path), "pass", "--json").stdout)
    by_env = json.loads(run_cli(db_url, "pass", "--json", config=str(path)).stdout)
    assert by_flag["decisions"] == before["decisions"] == by_env["decisions"] == []
    assert job_row(engine, excluded)["job_status"] == "processing"

    missing = run_cli(db_url, "pass", "--json", "--config", str(tmp_path / "none.toml"),
                      config=str(path))
    assert missing.returncode != 0
    assert "none.toml" in missing.stderr
    assert "Traceback" not in missing.stderr

    # Without the file, the same job is recovered.
    plain = json.loads(run_cli(db_url, "pass", "--json").stdout)
    assert [d["job_id"] for d in plain["decisions"]] == [excluded]


def test_db_upgrade_names_a_missing_foreign_schema_in_one_line(
        tmp_path: Path, db_url: str) -> None:
    """This project's tables are created; the configured pg-boss schema is not there."""
    path = write_config(tmp_path, """
        [source]
        kind = "pg-boss"
    """)
    done = run_cli(db_url, "db", "upgrade", "--config", str(path))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    expected = "needs PostgreSQL" if not db_url.startswith("postgresql") else "pgboss"
    assert expected in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["procrastinate", "graphile-worker", "pg-boss"])
def test_a_foreign_source_on_mysql_is_refused_in_one_line(
        tmp_path: Path, db_url: str, kind: str) -> None:
    """The PostgreSQL-only systems on MySQL or MariaDB: ``db upgrade`` says which engine
    the configured one needs, in one line (this project's tables are there)."""
    if not db_url.startswith("mysql"):
        pytest.skip("the refusal of MySQL")
    path = write_config(tmp_path, f"""
        [source]
        kind = "{kind}"
    """)
    done = run_cli(db_url, "db", "upgrade", "--config", str(path))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"source {kind} needs PostgreSQL (the database_url is mysql)" in lines[0]


def test_db_upgrade_with_a_table_source_checks_its_columns(
        tmp_path: Path, db_url: str, engine: Engine) -> None:
    """A mapped column that is not there is named; nothing of the app's table is altered."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE app_jobs (id INTEGER PRIMARY KEY, state TEXT)"))
    path = write_config(tmp_path, """
        [source]
        kind = "table"
        table = "app_jobs"
        id_column = "id"
        status_column = "state"
        processing = "running"
        queued = "ready"
        failed = "dead"
        activity_column = "touched_at"
    """)
    done = run_cli(db_url, "db", "upgrade", "--config", str(path))
    assert done.returncode != 0
    assert "touched_at" in done.stderr
    columns = {c["name"] for c in sa.inspect(engine).get_columns("app_jobs")}
    assert columns == {"id", "state"}


def test_readyz_checks_the_configured_source_as_the_start_up_check_does(
        tmp_path: Path, db_url: str, engine: Engine) -> None:
    """/readyz runs the start-up's check with the configured ``[source]``: the mapped table
    dropped under a running service makes it not ready, naming the table."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE app_jobs (id INTEGER PRIMARY KEY, state TEXT)"))
    path = write_config(tmp_path, """
        [source]
        kind = "table"
        table = "app_jobs"
        id_column = "id"
        status_column = "state"
        processing = "running"
        queued = "ready"
        failed = "dead"
    """)
    service = Service(assemble_sidecar(load_config(path, database_url=db_url),
                                       instance="readyz-source"))
    service.probe.fresh_seconds = 0.0  # every call below checks the database again
    service.probe.wait_seconds = 30.0  # a loaded machine's slow answer is not the subject
    try:
        assert service.run_one_pass() is not None
        assert service.readiness() == (True, "ready")
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE app_jobs"))
        ready, why = service.readiness()
    finally:
        service.close()
    assert not ready
    assert "app_jobs" in why


def test_the_worker_side_reads_the_config_file_when_given_no_url(
        tmp_path: Path, db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``JobClient()`` and ``StepLedger()`` take the database and the settings from the file
    ``RECONCILER_CONFIG`` names, as the reconciler does."""
    path = tmp_path / "worker.toml"
    path.write_text(f"database_url = {json.dumps(db_url)}\nlease_seconds = 42\n")
    monkeypatch.setenv("RECONCILER_CONFIG", str(path))
    monkeypatch.delenv("RECONCILER_DATABASE_URL", raising=False)
    monkeypatch.delenv("RECONCILER_LEASE_SECONDS", raising=False)
    with JobClient() as client:
        assert client.settings.lease_seconds == 42
        job = client.enqueue("configured", steps=[Step("work", EffectKind.IDEMPOTENT)])
    assert job_row(engine, job)["job_kind"] == "configured"
    ledger = StepLedger()
    try:
        ledger.run("procrastinate", 77, 1, [Step("work", EffectKind.IDEMPOTENT)])
    finally:
        ledger.close()
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT job_key FROM step_ledger_entries")).scalars().all()
    assert keys == ["77"]
