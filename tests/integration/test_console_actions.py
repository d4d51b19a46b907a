"""The console acts (issue 27): a named operator's hold, unhold, retry and cancel on a job
page, and the decisions list's bulk retry and cancel, previewed then confirmed; and what
keeps them safe: the read-only token never acts, a form needs its session's CSRF token
and this console's origin, no GET acts. Over HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import re
from html import unescape
from pathlib import Path
from urllib.parse import urlencode

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.storage.sql import actions
from reconciler.worker import JobClient
from tests.conftest import run_cli
from tests.console_support import HOSTILE_KIND, Answer, Seeded, decide, die, fetch, seed, served
from tests.helpers import job_row

READER = "reader-token-0123456789"
ALICE = "alice-token-0123456789"
HOSTILE_NOTE = '<script>window.__pwned=1</script><img src=x onerror="alert(1)">'


@pytest.fixture
def seeded(engine: Engine, client: JobClient) -> Seeded:
    return seed(engine, client)


@pytest.fixture
def operators(tmp_path: Path) -> str:
    """A tokens file naming one operator, alice."""
    path = tmp_path / "operators"
    path.write_text(f"# the console's operators\nalice {ALICE}\n")
    return str(path)


def _tokens(operators: str) -> dict[str, str]:
    return {"console_token": READER, "console_operator_tokens_file": operators}


def sign_in(base: str, token: str) -> str:
    """The session cookie the login form sets for ``token``."""
    answer = fetch(base + "/login", method="POST", data=f"token={token}&next=/".encode(),
                   headers={"Origin": base})
    assert answer.status == 303, answer.body
    return answer.headers["set-cookie"].split(";")[0]


def csrf_of(page: Answer) -> str:
    found = re.search(r'name="csrf" value="([^"]*)"', page.body)
    assert found is not None, "the page offers no form"
    return found[1]


def post(base: str, path: str, cookie: str, form: str, **headers: str) -> Answer:
    sent = {"Cookie": cookie, "Origin": base, **headers}
    return fetch(base + path, method="POST", data=form.encode(),
                 headers={k: v for k, v in sent.items() if v})


def recorded(engine: Engine, seeded: Seeded) -> list[tuple[int, str, str]]:
    """The operator actions recorded since ``seed`` held its job."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            sa.select(actions.c.job_id, actions.c.operator_action, actions.c.action_outcome)
            .where(actions.c.job_id != seeded.held).order_by(actions.c.action_id))]


def offered(body: str) -> list[str]:
    return re.findall(r'name="action" value="(\w+)"', body)


def test_an_operator_retries_a_terminalized_job_and_sees_the_outcome_and_the_record(
    db_url: str, engine: Engine, seeded: Seeded, operators: str
) -> None:
    """The job page of a job ended by a mid-step death offers retry (its state allows
    nothing else); the POST redirects (303) to the page, which says it was applied and
    lists the action above the decision; the note never travels in the URL."""
    job = seeded.died_mid_step
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        page = fetch(base + f"/jobs/native/{job}", headers={"Cookie": cookie})
        assert offered(page.body) == ["retry"]
        assert "signed in as <strong>alice</strong>" in page.body
        acted = post(base, f"/jobs/native/{job}", cookie,
                     f"csrf={csrf_of(page)}&action=retry&note=refund+checked")
        assert acted.status == 303
        assert acted.headers["location"] == f"/jobs/native/{job}?acted=retry&outcome=applied"
        shown = fetch(base + acted.headers["location"], headers={"Cookie": cookie}).body
        metrics = fetch(base + "/metrics").body
    assert job_row(engine, job)["job_status"] == "queued"
    assert recorded(engine, seeded) == [(job, "retry", "applied")]
    # The sidecar counts the console's actions (its one process that exposes metrics).
    assert re.search(r'reconciler_operator_actions_total\{action="retry",outcome="applied",'
                     r'source="native"\} 1\.0', metrics), metrics
    assert re.search(r'id="outcome">retry applied', shown)
    timeline = shown.split("Decisions and operator actions over time")[1]
    assert timeline.index("operator <strong>retry</strong> applied") < \
        timeline.index("worker_died_mid_step")
    assert "State failed &rarr; queued" in timeline
    assert offered(shown) == ["hold", "cancel"]  # queued again: held or cancelled now


def test_a_refused_action_says_why_and_is_recorded(
    db_url: str, engine: Engine, seeded: Seeded, operators: str
) -> None:
    """Retrying a job that is running is refused: the page says why, the record keeps it,
    the job is untouched; a retry or cancel without a note changes nothing (400)."""
    job = seeded.running
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        csrf = csrf_of(fetch(base + f"/jobs/native/{job}", headers={"Cookie": cookie}))
        noteless = post(base, f"/jobs/native/{job}", cookie, f"csrf={csrf}&action=cancel")
        acted = post(base, f"/jobs/native/{job}", cookie, f"csrf={csrf}&action=retry&note=x")
        shown = fetch(base + acted.headers["location"], headers={"Cookie": cookie}).body
    assert noteless.status == 400
    assert "cancel needs a note" in noteless.body
    assert acted.headers["location"].endswith("outcome=job_not_failed_or_cancelled")
    assert "retry refused: only a job that failed or was cancelled is retried" in shown
    assert recorded(engine, seeded) == [(job, "retry", "refused")]
    assert job_row(engine, job)["job_status"] == "processing"


def test_the_read_only_token_sees_no_form_and_its_posts_are_403(
    db_url: str, engine: Engine, seeded: Seeded, operators: str
) -> None:
    """Signed in with console_token: reading works, no action is offered, and an action
    POST (even carrying an operator's CSRF token) is 403 and recorded nowhere. With no
    operator token configured at all, every action request is 403 too."""
    job = seeded.died_mid_step
    with served(db_url, **_tokens(operators)) as base:
        alice = sign_in(base, ALICE)
        csrf = csrf_of(fetch(base + f"/jobs/native/{job}", headers={"Cookie": alice}))
        reader = sign_in(base, READER)
        page = fetch(base + f"/jobs/native/{job}", headers={"Cookie": reader})
        listing = fetch(base + "/decisions?reason=worker_died_mid_step",
                        headers={"Cookie": reader})
        refused = post(base, f"/jobs/native/{job}", reader,
                       f"csrf={csrf}&action=retry&note=n")
        bulk = post(base, "/decisions/bulk", reader,
                    f"csrf={csrf}&action=retry&note=n&reason=worker_died_mid_step")
        bearer = fetch(base + f"/jobs/native/{job}", method="POST",
                       data=b"action=retry&note=n",
                       headers={"Authorization": f"Bearer {ALICE}", "Origin": base})
    assert page.status == 200
    assert "worker_died_mid_step" in page.body
    assert offered(page.body) == []
    assert offered(listing.body) == []
    assert 'method="post" action="/jobs' not in page.body
    assert "signed in read-only" in page.body
    assert [refused.status, bulk.status, bearer.status] == [403, 403, 403]
    assert "only reads" in refused.body
    with served(db_url) as base:  # no token at all: open to read, never to act
        page = fetch(base + f"/jobs/native/{job}")
        anyone = fetch(base + f"/jobs/native/{job}", method="POST",
                       data=b"action=retry&note=n", headers={"Origin": base})
    assert offered(page.body) == []
    assert anyone.status == 403
    assert recorded(engine, seeded) == []
    assert job_row(engine, job)["job_status"] == "failed"


def test_a_bearer_token_reads_with_no_session_to_sign_out_of_and_never_acts(
    db_url: str, engine: Engine, seeded: Seeded, operators: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A script's bearer request: the page says it reads with a bearer token and offers no
    "Sign out" (there is no session); its POST, sent without an Origin as scripts send it,
    is refused as a bearer token's (logged ``why=bearer_token``, not ``foreign_origin``)
    and changes nothing."""
    job = seeded.died_mid_step
    with served(db_url, **_tokens(operators)) as base:
        page = fetch(base + f"/jobs/native/{job}",
                     headers={"Authorization": f"Bearer {ALICE}"})
        with caplog.at_level(logging.WARNING, logger="reconciler.console"):
            acted = fetch(base + f"/jobs/native/{job}", method="POST",
                          data=b"action=retry&note=n",
                          headers={"Authorization": f"Bearer {ALICE}"})
    assert page.status == 200
    assert "reading with a bearer token of <strong>alice</strong>" in page.body
    assert "Sign out" not in page.body
    assert "signed in" not in page.body
    assert acted.status == 403
    assert "a bearer token reads only" in acted.body
    assert "why=bearer_token" in caplog.text
    assert "foreign_origin" not in caplog.text
    assert recorded(engine, seeded) == []
    assert job_row(engine, job)["job_status"] == "failed"


def test_a_form_without_its_csrf_token_or_from_another_origin_is_refused(
    db_url: str, engine: Engine, seeded: Seeded, operators: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """403, logged as one line and recorded nowhere: no CSRF token, another session's,
    a foreign or null Origin, a foreign Referer, neither. Without Origin, this console's
    own Referer is enough."""
    job = seeded.died_mid_step
    path = f"/jobs/native/{job}"
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        csrf = csrf_of(fetch(base + path, headers={"Cookie": cookie}))
        other = csrf_of(fetch(base + path, headers={"Cookie": sign_in(base, ALICE)}))
        assert other != csrf  # bound to the session, not to the operator
        form = f"csrf={csrf}&action=retry&note=n"
        caplog.set_level(logging.WARNING, logger="reconciler.console")
        refusals = [
            post(base, path, cookie, "action=retry&note=n"),
            post(base, path, cookie, f"csrf={other}&action=retry&note=n"),
            post(base, path, cookie, form, Origin="http://evil.example"),
            post(base, path, cookie, form, Origin="null"),
            post(base, path, cookie, form, Origin="", Referer="http://evil.example/x"),
            post(base, path, cookie, form, Origin=""),
        ]
        assert [r.status for r in refusals] == [403] * 6
        assert recorded(engine, seeded) == []
        same_site = post(base, path, cookie, form, Origin="", Referer=base + path)
    assert same_site.status == 303
    assert recorded(engine, seeded) == [(job, "retry", "applied")]
    lines = [r.getMessage() for r in caplog.records if "console_post_refused" in r.getMessage()]
    assert len(lines) == 6
    assert not [line for line in lines if ALICE in line or csrf in line]


def test_get_never_acts(db_url: str, engine: Engine, seeded: Seeded, operators: str) -> None:
    """An action's parameters on a GET change nothing; the bulk form has no GET page."""
    job = seeded.died_mid_step
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        csrf = csrf_of(fetch(base + f"/jobs/native/{job}", headers={"Cookie": cookie}))
        query = f"csrf={csrf}&action=retry&note=n&confirm=1&job={job}"
        page = fetch(base + f"/jobs/native/{job}?{query}", headers={"Cookie": cookie})
        bulk = fetch(base + f"/decisions/bulk?{query}", headers={"Cookie": cookie})
    assert page.status == 200
    assert bulk.status == 404
    assert recorded(engine, seeded) == []
    assert job_row(engine, job)["job_status"] == "failed"


def test_bulk_retry_previews_then_acts_on_confirmation(
    db_url: str, engine: Engine, seeded: Seeded, operators: str
) -> None:
    """A filtered list offers "retry these"; the first POST lists the jobs and their
    count and changes nothing; the confirmation acts on each and redirects to the list
    with the counts; a second preview lists none (retried jobs are queued now)."""
    died = sorted([seeded.died_mid_step, seeded.hostile])
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        listing = fetch(base + "/decisions?reason=worker_died_mid_step&since=1h",
                        headers={"Cookie": cookie})
        assert offered(listing.body) == ["retry", "cancel"]
        filters = f"csrf={csrf_of(listing)}&reason=worker_died_mid_step&since=1h"
        preview = post(base, "/decisions/bulk", cookie,
                       f"{filters}&action=retry&note=charges+checked")
        assert preview.status == 200
        assert recorded(engine, seeded) == []
        assert "<strong>2</strong> jobs are in a state to retry now" in preview.body
        listed = sorted(int(j) for j in re.findall(r'class="job" href="/jobs/native/(\d+)"',
                                                   preview.body))
        assert listed == died
        confirm = re.search(r'<form method="post" action="/decisions/bulk" class="confirm">'
                            r"(.*?)</form>", preview.body, re.DOTALL)
        assert confirm is not None
        fields = re.findall(r'name="(\w+)" value="([^"]*)"', confirm[1])
        form = urlencode([(k, unescape(v)) for k, v in fields])
        acted = post(base, "/decisions/bulk", cookie, form)
        assert acted.status == 303
        location = acted.headers["location"]
        assert location.startswith("/decisions?")
        assert "reason=worker_died_mid_step" in location
        assert "acted=retry&applied=2&refused=0" in location
        assert "charges" not in location
        counts = fetch(base + location, headers={"Cookie": cookie}).body
        again = post(base, "/decisions/bulk", cookie, f"{filters}&action=retry&note=again")
        noteless = post(base, "/decisions/bulk", cookie, f"{filters}&action=retry")
    assert "retry these: 2 applied, 0 refused" in counts
    assert sorted(r[0] for r in recorded(engine, seeded)) == died
    assert {job_row(engine, j)["job_status"] for j in died} == {"queued"}
    assert "<strong>0</strong> jobs are in a state to retry now" in again.body
    assert noteless.status == 400


def test_jobs_moved_between_the_preview_and_the_confirmation_are_refused_the_rest_applied(
    db_url: str, engine: Engine, client: JobClient, seeded: Seeded, operators: str
) -> None:
    """The preview counts three failed jobs. Before alice confirms, a second operator
    retries two of them and a worker claims one of those; a pass fails a fourth job with
    the same reason. Confirmed with the count of three: the one still failed is retried,
    the two that moved are refused (no longer matching: left as the other operator and
    the worker made them, alice records nothing on them), and the job decided after the
    preview is not acted on: it waits for the next preview."""
    third = die(client, "payments.charge", "effectful")
    decide(engine, third)
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        listing = fetch(base + "/decisions?reason=worker_died_mid_step",
                        headers={"Cookie": cookie})
        filters = f"csrf={csrf_of(listing)}&reason=worker_died_mid_step"
        preview = post(base, "/decisions/bulk", cookie, f"{filters}&action=retry&note=ok")
        assert "<strong>3</strong> jobs are in a state to retry now" in preview.body
        for job in (seeded.hostile, third):
            other = run_cli(db_url, "jobs", "retry", str(job), "--note", "mine", "--as",
                            "bob")
            assert other.returncode == 0, other.stderr
        claim = client.claim(worker="w", lease_seconds=600, kinds=[HOSTILE_KIND])
        assert claim is not None
        assert claim.job_id == seeded.hostile
        late = die(client, "payments.capture", "effectful")
        decide(engine, late)
        confirm = re.search(r'<form method="post" action="/decisions/bulk" class="confirm">'
                            r"(.*?)</form>", preview.body, re.DOTALL)
        assert confirm is not None
        form = urlencode([(k, unescape(v)) for k, v in
                          re.findall(r'name="(\w+)" value="([^"]*)"', confirm[1])])
        acted = post(base, "/decisions/bulk", cookie, form)
    assert acted.status == 303
    assert "acted=retry&applied=1&refused=2" in acted.headers["location"]
    assert {j: job_row(engine, j)["job_status"] for j in
            (seeded.died_mid_step, seeded.hostile, third, late)} == {
        seeded.died_mid_step: "queued", seeded.hostile: "processing", third: "queued",
        late: "failed"}
    with engine.connect() as conn:
        by_alice = conn.execute(sa.select(actions.c.job_id).where(
            actions.c.acted_by == "alice")).scalars().all()
    assert by_alice == [seeded.died_mid_step]


def test_a_hostile_note_is_shown_as_text(
    db_url: str, seeded: Seeded, operators: str
) -> None:
    """A note holding markup is escaped where it is shown (the bulk preview, its
    confirmation form) and never put in a redirect's URL."""
    with served(db_url, **_tokens(operators)) as base:
        cookie = sign_in(base, ALICE)
        page = fetch(base + f"/jobs/native/{seeded.hostile}", headers={"Cookie": cookie})
        csrf = csrf_of(page)
        preview = post(base, "/decisions/bulk", cookie, urlencode({
            "csrf": csrf, "action": "cancel", "reason": "worker_died_mid_step",
            "note": HOSTILE_NOTE}))
        acted = post(base, f"/jobs/native/{seeded.hostile}", cookie, urlencode({
            "csrf": csrf, "action": "retry", "note": HOSTILE_NOTE}))
    assert preview.status == 200
    assert "<script>" not in preview.body
    assert "<img" not in preview.body
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in preview.body
    assert acted.status == 303
    assert "script" not in acted.headers["location"]


def test_the_session_cookie_and_headers_hold_the_line(
    db_url: str, seeded: Seeded, operators: str
) -> None:
    """The operator's cookie is HttpOnly and SameSite=Strict and holds no token; pages
    send Referrer-Policy: same-origin; signing out ends the session."""
    with served(db_url, **_tokens(operators)) as base:
        login = fetch(base + "/login", method="POST", data=f"token={ALICE}".encode(),
                      headers={"Origin": base})
        cookie = login.headers["set-cookie"].split(";")[0]
        page = fetch(base + "/", headers={"Cookie": cookie})
        login_page = fetch(base + "/login", headers={"Cookie": cookie})
        forged = fetch(base + "/", headers={"Cookie": cookie.replace("alice", "bob")})
        out = post(base, "/logout", cookie, "")
        foreign_login = fetch(base + "/login", method="POST", data=f"token={ALICE}".encode(),
                              headers={"Origin": "http://evil.example"})
    attributes = {a.strip() for a in login.headers["set-cookie"].split(";")[1:]}
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= attributes
    assert ALICE not in login.headers["set-cookie"]
    assert page.headers["referrer-policy"] == "same-origin"
    assert "signed in as <strong>alice</strong>" in page.body
    assert "signed in as <strong>alice</strong>" in login_page.body
    assert forged.status == 401
    assert out.status == 303
    assert "Max-Age=0" in out.headers["set-cookie"]
    assert foreign_login.status == 403
    assert "set-cookie" not in foreign_login.headers

