"""`reconciler jobs explain`: the decision table's verdict on one processing job, read only."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

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


# -- what explain says about the rules it used ------------------------------------------------

KINDS_CONFIG = """
[kinds."report*"]
effect = "idempotent"
wedged_after_seconds = 7200

[kinds."report.*"]
stale_after_seconds = 30

[kinds."noise.*"]
reconcile = false
"""


def _dead(engine: Engine, client: JobClient, kind: str, steps: list[Step]) -> int:
    """A job of ``kind`` claimed, inside its first step, its lease run out a while ago."""
    job_id = client.enqueue(kind, steps=steps)
    claim = client.claim(worker="w", lease_seconds=60, kinds=[kind])
    assert claim is not None
    claim.start_step(0)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE job_runs SET lease_expires_at = :t, last_activity_at = :t "
                             "WHERE job_id = :id"),
                     {"t": datetime.now(UTC) - timedelta(seconds=600), "id": job_id})
    return job_id


def _config(tmp_path: Path, body: str = KINDS_CONFIG) -> str:
    path = tmp_path / "reconciler.toml"
    path.write_text(body)
    return str(path)


def test_explain_shows_plain_values_the_matching_pattern_and_the_thresholds_used(
    db_url: str, engine: Engine, client: JobClient, tmp_path: Path
) -> None:
    """Text and JSON say which ``[kinds]`` pattern set each threshold and show the evidence
    as plain values (``started``, never ``<StepState.STARTED: 'started'>``)."""
    job_id = _dead(engine, client, "reports.daily", [Step("fetch", "idempotent"),
                                                     Step("publish", "effectful")])
    config = _config(tmp_path)
    text = run_cli(db_url, "jobs", "explain", str(job_id), "--config", config)
    assert text.returncode == 0, text.stderr
    assert "<StepState" not in text.stdout
    assert 'step_states: ["started", "not_started"]' in text.stdout
    assert 'patterns matched: "report*"' in text.stdout
    assert 'wedged_after_seconds: 7200.0 ([kinds."report*"])' in text.stdout
    assert "stale_after_seconds: 60.0 (the settings' default)" in text.stdout
    as_json = run_cli(db_url, "jobs", "explain", str(job_id), "--config", config, "--json")
    view = json.loads(as_json.stdout)
    assert (view["kind"], view["reconciled"], view["reason"]) == (
        "reports.daily", True, "resumed_idempotent_step")
    rules = view["kind_rules"]
    assert (rules["matched"], rules["wedged_after_seconds"], rules["set_by"]["effect"],
            rules["set_by"]["stale_after_seconds"]) == (["report*"], 7200.0, "report*", None)


def test_a_kind_with_reconcile_false_is_explained_as_not_reconciled(
    db_url: str, engine: Engine, client: JobClient, tmp_path: Path
) -> None:
    """No pass ever touches it: explain says so, not what the table would do."""
    job_id = _dead(engine, client, "noise.tick", [Step("tick", "idempotent")])
    config = _config(tmp_path)
    text = run_cli(db_url, "jobs", "explain", str(job_id), "--config", config)
    assert text.returncode == 0, text.stderr
    assert 'not reconciled ([kinds."noise.*"] sets reconcile = false)' in text.stdout
    assert "resume" not in text.stdout.splitlines()[0]
    view = json.loads(run_cli(db_url, "jobs", "explain", str(job_id), "--config", config,
                              "--json").stdout)
    assert (view["reconciled"], view["disposition"], view["reason"], view["rule"]) == (
        False, None, None, None)


def test_an_evidence_error_is_explained_with_which_step(
    db_url: str, engine: Engine, client: JobClient
) -> None:
    """A step record outside the plan: the code and the step, not only the error's type."""
    job_id = _dead(engine, client, "report", [Step("fetch", "idempotent")])
    with engine.begin() as conn:
        generation = conn.execute(sa.text("SELECT claim_generation FROM job_runs WHERE "
                                          "job_id = :id"), {"id": job_id}).scalar_one()
        conn.execute(sa.text(
            "INSERT INTO step_runs (job_id, step_index, step_name, effect_kind, step_state, "
            "claim_generation, started_at) VALUES (:id, 5, 'ghost', 'pure', 'succeeded', :g, "
            ":t)"), {"id": job_id, "g": generation, "t": datetime.now(UTC)})
    view = json.loads(run_cli(db_url, "jobs", "explain", str(job_id), "--json").stdout)
    assert view["reason"] == "reconcile_error"
    assert view["evidence"] == {"error": "EvidenceError", "error_code": "step_outside_plan",
                                "step": 5, "plan_length": 1}


def test_kinds_lists_each_pattern_with_the_running_kinds_it_matches_and_warns_on_none(
    db_url: str, engine: Engine, client: JobClient, tmp_path: Path
) -> None:
    """``"report.*"`` never matches ``reports.daily``: ``reconciler kinds`` says so."""
    _dead(engine, client, "reports.daily", [Step("fetch", "idempotent")])
    _dead(engine, client, "mail.send", [Step("send", "effectful")])
    config = _config(tmp_path)
    text = run_cli(db_url, "kinds", "--config", config)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert '[kinds."report*"] matches reports.daily' in lines
    assert any(line.startswith('warning: [kinds."report.*"] matches no kind this source has '
                               "run") for line in lines)
    assert "running kinds no pattern matches (the defaults apply): mail.send" in lines
    view = json.loads(run_cli(db_url, "kinds", "--config", config, "--json").stdout)
    assert view["unmatched_patterns"] == ["report.*", "noise.*"]
    assert view["running_kinds"] == ["mail.send", "reports.daily"]


def test_kinds_warns_of_no_pattern_whose_kind_is_merely_idle_now(
    db_url: str, engine: Engine, client: JobClient, tmp_path: Path
) -> None:
    """A ``noise.tick`` job ran and finished; none runs now: ``[kinds."noise.*"]`` is not a
    typo, so no warning, while the ``report`` patterns (no such kind ever) still are."""
    job_id = client.enqueue("noise.tick", steps=[Step("tick", "pure")])
    claim = client.claim(worker="w", lease_seconds=60, kinds=["noise.tick"])
    assert claim is not None
    assert claim.job_id == job_id
    claim.start_step(0)
    claim.finish_step(0)
    claim.complete()
    view = json.loads(run_cli(db_url, "kinds", "--config", _config(tmp_path), "--json").stdout)
    assert view["running_kinds"] == []
    assert view["known_kinds"] == ["noise.tick"]
    assert sorted(view["unmatched_patterns"]) == ["report*", "report.*"]


def test_a_dry_run_applies_the_brake_and_says_so(
    db_url: str, engine: Engine, client: JobClient
) -> None:
    """Three jobs stale at once with ``brake_min_jobs = 2``: the dry run says the brake is
    engaged and holds every change, as the pass after it does."""
    for kind in ("a", "b", "c"):
        _dead(engine, client, kind, [Step("fetch", "idempotent")])
    preview = run_cli(db_url, "pass", "--dry-run", brake_min_jobs=2)
    assert preview.returncode == 0, preview.stderr
    assert "mass-staleness brake engaged" in preview.stdout.splitlines()[0]
    assert "resumed=0 terminalized=0 skipped=3" in preview.stdout
    view = json.loads(run_cli(db_url, "pass", "--dry-run", "--json",
                              brake_min_jobs=2).stdout)
    assert view["braked"] is True
    real = json.loads(run_cli(db_url, "pass", "--json", brake_min_jobs=2).stdout)
    assert (real["braked"], real["skipped"]) == (True, 3)
