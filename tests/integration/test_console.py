"""The operator console over HTTP (no browser): what an operator reads, what stays hidden,
the token, the security headers, and keyset paging; on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from html import unescape
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.config.loader import load_config, pass_config
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.core.vocabulary import Disposition, PassOutcome
from reconciler.root.console import assemble_console
from reconciler.storage.sql import decisions, jobs, passes
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.console_support import HOSTILE_KIND, Seeded, die, fetch, seed, served
from tests.helpers import job_row, wait_for

TOKEN = "s3cret-console-token"  # noqa: S105 - a test's own token


@pytest.fixture
def seeded(engine: Engine, client: JobClient) -> Seeded:
    return seed(engine, client)


def _links(body: str) -> list[str]:
    return [unescape(h) for h in re.findall(r'href="([^"]+)"', body)]


def test_from_the_overview_an_operator_reaches_a_dead_jobs_evidence_and_rule(
    db_url: str, seeded: Seeded
) -> None:
    """/ links to the last hour's mid-step deaths; that list links to the job, whose page
    shows the evidence and the rule (number and text) that decided it."""
    with served(db_url) as base:
        overview = fetch(base + "/")
        assert overview.status == 200
        assert "<title>worker_died_mid_step: 2</title>" in overview.body  # the chart's bar
        assert "<title>resumed_idempotent_step: 1</title>" in overview.body
        wanted = next(h for h in _links(overview.body)
                      if "reason=worker_died_mid_step" in h and "since=1h" in h)
        listing = fetch(base + wanted)
        assert listing.status == 200
        job_links = [h for h in _links(listing.body) if h.startswith("/jobs/")]
        assert f"/jobs/native/{seeded.died_mid_step}" in job_links
        assert f"/jobs/native/{seeded.resumed}" not in job_links
        page = fetch(base + f"/jobs/native/{seeded.died_mid_step}").body
    assert "worker_died_mid_step" in page
    assert "rule 10" in page
    assert "first unfinished step started, effectful" in page
    assert "succeeded, started" in page  # the step states, from the evidence
    assert "lease_expired_seconds" in page


def test_held_parked_and_gated_jobs_are_listed(db_url: str, seeded: Seeded) -> None:
    """The held job among the held, the gated one parked and recorded as waiting; no
    foreign job held (the native source's holds are its rows')."""
    with served(db_url) as base:
        body = fetch(base + "/held").body
    held, foreign, parked, recorded = body.split("<h2>")[1:5]
    assert f"/jobs/native/{seeded.held}" in held
    assert "in other systems" in foreign
    assert 'class="empty">none' in foreign
    assert f"/jobs/native/{seeded.gated}" in parked
    assert f"/jobs/native/{seeded.gated}" in recorded
    assert "waiting_on_gate" in recorded


def test_a_running_job_page_says_what_a_pass_would_decide_now(db_url: str, seeded: Seeded
                                                              ) -> None:
    """The explain section: decision, rule and evidence of the running job, read only."""
    with served(db_url) as base:
        body = fetch(base + f"/jobs/native/{seeded.running}").body
    explained = body.split('id="explain"')[1].split("</div>")[0]
    assert "lease_live" in explained
    assert "rule 3" in explained


def test_pages_show_no_worker_identity_or_payload(db_url: str, seeded: Seeded) -> None:
    """Like the CLI's views: no lease owner, no payload, on any page."""
    with served(db_url) as base:
        bodies = [fetch(base + path).body for path in (
            "/", "/decisions", "/held", f"/jobs/native/{seeded.died_mid_step}",
            f"/jobs/native/{seeded.running}")]
    for body in bodies:
        assert "marker-42" not in body


def test_a_hostile_kind_is_shown_as_text(db_url: str, seeded: Seeded) -> None:
    """A kind holding markup is escaped wherever it shows: never a tag of the page."""
    with served(db_url) as base:
        for path in ("/decisions", f"/jobs/native/{seeded.hostile}", "/"):
            body = fetch(base + path).body
            assert "<script" not in body
            assert "<img" not in body
        job = fetch(base + f"/jobs/native/{seeded.hostile}").body
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in job
    assert unescape(re.search(r'class="kind">([^<]*)<', job)[1]) == HOSTILE_KIND  # type: ignore[index]


def test_every_console_answer_carries_a_strict_content_security_policy(
    db_url: str, seeded: Seeded
) -> None:
    """No script source at all, nothing framed, even on errors and the login page."""
    with served(db_url) as base:
        answers = [fetch(base + p) for p in ("/", "/decisions?reason=nonsense", "/nowhere",
                                             "/login", f"/jobs/native/{seeded.held}")]
    for answer in answers:
        policy = answer.headers["content-security-policy"]
        assert "default-src 'none'" in policy
        assert "script-src" not in policy  # falls back to default-src 'none'
        assert "frame-ancestors 'none'" in policy
        assert answer.headers["x-content-type-options"] == "nosniff"
    assert [a.status for a in answers] == [200, 400, 404, 200, 200]


def test_the_console_changes_nothing_and_refuses_other_methods(
    db_url: str, seeded: Seeded, engine: Engine
) -> None:
    """Only GET and HEAD on pages (405 otherwise); reading changes no row."""
    def snapshot() -> list[object]:
        with engine.connect() as conn:
            return [list(conn.execute(sa.text(f"SELECT * FROM {t} ORDER BY 1")))
                    for t in ("job_runs", "reconciliation_decisions", "reconciliation_passes")]

    before = snapshot()
    with served(db_url) as base:
        assert fetch(base + "/", method="POST", data=b"x=1").status == 405
        # No handler for other methods at all: the server answers 501 Not Implemented.
        assert fetch(base + f"/jobs/native/{seeded.running}", method="DELETE").status == 501
        head = fetch(base + "/", method="HEAD")
        assert (head.status, head.body) == (200, "")
        fetch(base + f"/jobs/native/{seeded.running}")  # explains a running job
    assert snapshot() == before


def test_filters_narrow_the_list_and_bad_ones_are_one_line(db_url: str, seeded: Seeded
                                                            ) -> None:
    """Disposition, reason, kind glob and source narrow; an unknown value is a 400."""
    def jobs(base: str, query: str) -> set[str]:
        answer = fetch(base + "/decisions?" + query)
        assert answer.status == 200, answer.body
        return {h for h in _links(answer.body) if h.startswith("/jobs/")}

    with served(db_url) as base:
        everything = jobs(base, "")
        assert len(everything) >= 3
        assert jobs(base, "disposition=resume") == {f"/jobs/native/{seeded.resumed}"}
        assert jobs(base, "kind=payments.*") == {f"/jobs/native/{seeded.died_mid_step}"}
        assert jobs(base, "kind=" + quote("<script>*")) == {f"/jobs/native/{seeded.hostile}"}
        assert jobs(base, "source=pg-boss") == set()
        assert jobs(base, "since=1h&reason=worker_died_mid_step") == {
            f"/jobs/native/{seeded.died_mid_step}", f"/jobs/native/{seeded.hostile}"}
        bad = fetch(base + "/decisions?disposition=" + quote("<b>explode</b>"))
    assert bad.status == 400
    assert "unknown disposition" in bad.body
    assert "<b>explode" not in bad.body


def _audit(engine: Engine, count: int) -> None:
    """``count`` terminalize decisions on one pass, ids in insertion order."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        pass_id = conn.execute(passes.insert().values(
            reconciler_instance="paging", started_at=now, finished_at=now,
            pass_outcome=PassOutcome.OK.value).returning(passes.c.pass_id)).scalar_one()
        conn.execute(decisions.insert(), [
            {"pass_id": pass_id, "job_source": "pg-boss", "job_id": f"job-{i:04d}",
             "decided_at": now, "disposition": "terminalize",
             "decision_reason": "worker_wedged", "shadow_mode": False}
            for i in range(count)])


def test_decisions_page_by_key_newest_first_each_once(db_url: str, engine: Engine) -> None:
    """Following "older" from the first page lists every decision once, newest first,
    with ``before=<decision id>`` links (never an offset)."""
    _audit(engine, 123)
    seen: list[str] = []
    with served(db_url) as base:
        link: str | None = "/decisions?reason=worker_wedged"
        while link is not None:
            body = fetch(base + link).body
            seen += [h for h in _links(body) if h.startswith("/jobs/")]
            older = re.search(r'id="older" href="([^"]+)"', body)
            link = unescape(older[1]) if older else None
            assert link is None or re.search(r"before=\d+", link)
            assert "offset" not in (link or "")
    assert seen == [f"/jobs/pg-boss/job-{i:04d}" for i in reversed(range(123))]


def test_shadow_decisions_are_kept_apart(db_url: str, engine: Engine) -> None:
    """A shadow decision is listed under shadow decisions, not among real ones."""
    _audit(engine, 1)
    with engine.begin() as conn:
        conn.execute(decisions.update().values(shadow_mode=True, job_id="shadowed"))
    _audit(engine, 1)
    with served(db_url) as base:
        real = fetch(base + "/decisions").body
        shadow = fetch(base + "/decisions?shadow=1").body
        job = fetch(base + "/jobs/pg-boss/shadowed").body
    assert "/jobs/pg-boss/shadowed" not in real
    assert "/jobs/pg-boss/job-0000" in real
    assert "/jobs/pg-boss/shadowed" in shadow
    assert "shadow: nothing changed" in job


def test_a_set_token_guards_every_page_but_not_metrics_or_probes(
    db_url: str, seeded: Seeded
) -> None:
    """Without the token: 401 and the login form; with it as a bearer token or the login
    form's cookie: the page. /metrics and /healthz stay open."""
    with served(db_url, console_token=TOKEN) as base:
        for path in ("/", "/decisions", f"/jobs/native/{seeded.died_mid_step}", "/held"):
            refused = fetch(base + path)
            assert refused.status == 401
            assert 'action="/login"' in refused.body
            assert "worker_died_mid_step" not in refused.body
        assert fetch(base + "/", headers={"Authorization": "Bearer wrong"}).status == 401
        assert fetch(base + "/", headers={"Authorization": f"Bearer {TOKEN}"}).status == 200
        assert fetch(base + "/metrics").status == 200
        assert fetch(base + "/healthz").status == 200
        own = {"Origin": base}
        wrong = fetch(base + "/login", method="POST", data=b"token=nope&next=/held",
                      headers=own)
        assert wrong.status == 401
        assert "set-cookie" not in wrong.headers
        login = fetch(base + "/login", method="POST",
                      data=f"token={TOKEN}&next=/held".encode(), headers=own)
        assert (login.status, login.headers["location"]) == (303, "/held")
        cookie = login.headers["set-cookie"].split(";")[0]
        assert TOKEN not in cookie
        assert "HttpOnly" in login.headers["set-cookie"]
        assert fetch(base + "/held", headers={"Cookie": cookie}).status == 200
        assert fetch(base + "/held", headers={"Cookie": cookie + "x"}).status == 401
        away = fetch(base + "/login", method="POST",
                     data=f"token={TOKEN}&next=//evil.example/".encode(), headers=own)
    assert away.headers["location"] == "/"


def test_console_false_serves_no_page(db_url: str) -> None:
    """With ``console = false`` the pages are gone; /metrics and the probes are not."""
    with served(db_url, console=False) as base:
        assert fetch(base + "/").status == 404
        assert fetch(base + "/login").status == 404
        assert fetch(base + "/metrics").status == 200
        assert fetch(base + "/healthz").status == 200


def test_a_page_being_read_holds_no_pass_up(db_url: str, engine: Engine, client: JobClient,
                                            seeded: Seeded) -> None:
    """While a page's read transaction is open, a pass still decides and writes."""
    config = load_config(database_url=db_url)
    console = assemble_console(config, pass_config(config.settings, "console-test"))
    late = die(client, "late.kind", "effectful")
    store = SqlStore(engine)
    config = PassConfig(batch_size=100, thresholds=Thresholds(0.0, 3600.0))
    try:
        with console.pages.reading():
            assert console.pages.overview().context["latest"]  # the page's reads ran
            wait_for(lambda: run_pass(store, config).count(Disposition.TERMINALIZE) == 1,
                     "a pass to decide the late job")
        assert job_row(engine, late)["job_status"] == "failed"
    finally:
        console.close()


def test_the_front_page_says_first_when_no_running_job_has_a_live_worker(
        db_url: str, engine: Engine, client: JobClient) -> None:
    """Two running jobs, one under a live lease: some worker is alive. Its lease gone too,
    the front page's first line says no live workers, with the count."""
    dead = die(client, "reports.build", "idempotent")
    live = client.enqueue("reports.mail", steps=[Step("send", "effectful")])
    claim = client.claim(worker="w-live", lease_seconds=600, kinds=["reports.mail"])
    assert claim is not None
    assert claim.job_id == live
    with served(db_url) as base:
        before = fetch(base + "/").body
        with engine.begin() as conn:  # its worker stops renewing: the lease runs out
            conn.execute(sa.update(jobs).where(jobs.c.job_id == live)
                         .values(lease_expires_at=datetime(2026, 1, 1, tzinfo=UTC)))
        after = fetch(base + "/").body
    assert re.search(r'<p id="workers">2 running jobs of native, some with a live worker',
                     before), before[:2000]
    first = after.split("<h1>Overview</h1>", 1)[1].lstrip()
    assert first.startswith('<p class="alert" id="workers"><strong>No live workers</strong>: '
                            "2 running jobs of native"), first[:300]
    assert dead != live


def test_a_job_page_shows_its_timeline_oldest_first(db_url: str, seeded: Seeded) -> None:
    """Claimed, its steps, the lease running out as the pass saw it, the decision with its
    rule, the attempt ended: in that order, no worker identity."""
    with served(db_url) as base:
        page = fetch(base + f"/jobs/native/{seeded.died_mid_step}").body
    section = page.split('id="timeline"', 1)[1].split("</section>", 1)[0]
    kinds = re.findall(r'<li class="([a-z_]+)">', section)
    # The seeded lease lasts a millisecond: it runs out somewhere among the steps.
    assert [k for k in kinds if k != "lease_expired"] == [
        "claimed", "step_started", "step_finished", "step_started", "decision",
        "attempt_ended"], kinds
    assert kinds.index("lease_expired") < kinds.index("decision")
    assert "rule 10" in section
    assert "worker-marker-42" not in page
