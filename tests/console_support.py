"""The console's test set-up: jobs that real passes decide, and the sidecar serving them.

``seed`` makes jobs die the ways an operator reviews (mid-step in an effectful step, in an
idempotent one, under a hostile kind) and lets real passes decide them; ``served`` runs
the sidecar's own HTTP server with the console on a free port.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.sidecar.service import Service
from reconciler.storage.sql import decisions
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.helpers import sidecar_service, wait_for

# The page sets this flag if an injected kind ever runs; the browser test reads it.
HOSTILE_KIND = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
DEAD_LEASE_SECONDS = 0.001


@dataclass(frozen=True, slots=True)
class Seeded:
    """The jobs ``seed`` made, by what happened to them."""

    died_mid_step: int
    resumed: int
    hostile: int
    held: int
    running: int
    gated: int


def die(client: JobClient, kind: str, effect: str) -> int:
    """A job whose worker died in its second step (``effect``), its lease already gone."""
    job_id = client.enqueue(kind, steps=[Step("fetch", "pure"), Step("charge", effect)],
                            payload={"card": "payload-marker-42"})
    claim = client.claim(worker="worker-marker-42", lease_seconds=DEAD_LEASE_SECONDS,
                         kinds=[kind])
    assert claim is not None
    assert claim.job_id == job_id
    claim.start_step(0)
    claim.finish_step(0)
    claim.start_step(1)
    return job_id


def seed(engine: Engine, client: JobClient) -> Seeded:
    """Jobs whose workers died, decided by real passes (one waiting on its gate, so
    recorded and parked), plus a held and a running job."""
    gated = client.enqueue("approvals.wait", steps=[Step("approve", "pure")])
    claim = client.claim(worker="worker-marker-42", lease_seconds=DEAD_LEASE_SECONDS)
    assert claim is not None
    claim.start_step(0)
    claim.wait_step(0)
    died = die(client, "payments.charge", "effectful")
    resumed = die(client, "reports.build", "idempotent")
    hostile = die(client, HOSTILE_KIND, "effectful")
    held = client.enqueue("payments.refund", steps=[Step("refund", "effectful")])
    SqlStore(engine).operator_action(held, "hold")
    running = client.enqueue("reports.mail", steps=[Step("send", "effectful")])
    claim = client.claim(worker="worker-marker-42", lease_seconds=600, kinds=["reports.mail"])
    assert claim is not None
    claim.start_step(0)
    decide(engine, died, resumed, hostile, gated)
    return Seeded(died, resumed, hostile, held, running, gated)


def decide(engine: Engine, *job_ids: int) -> None:
    """Real passes until each of ``job_ids`` is decided."""
    store = SqlStore(engine)
    config = PassConfig(batch_size=100, thresholds=Thresholds(0.0, 3600.0),
                        instance="console-test")
    keys = [str(job_id) for job_id in job_ids]

    def decided() -> bool:
        run_pass(store, config)
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count(sa.distinct(decisions.c.job_id)))
                                .where(decisions.c.job_id.in_(keys))).scalar_one() == len(keys)

    wait_for(decided, f"jobs {', '.join(keys)} to be decided")


@contextmanager
def served(db_url: str, **settings: object) -> Iterator[str]:
    """The sidecar's HTTP server (no scheduled passes) with the console; its base URL."""
    with serving(sidecar_service(Settings(database_url=db_url, metrics_port=0,
                                          **settings))) as base:
        yield base


@contextmanager
def serving(service: Service) -> Iterator[str]:
    """``service``'s HTTP server (no scheduled passes) while the block runs; its base URL."""
    service.start_http()
    assert service.http is not None
    try:
        yield f"http://127.0.0.1:{service.http.server_address[1]}"
    finally:
        service.http.shutdown()
        service.http.server_close()
        service.close()


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer as a test reads it."""

    status: int
    headers: dict[str, str]
    body: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def fetch(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
          data: bytes | None = None) -> Answer:
    """One request, redirects not followed, error statuses returned rather than raised."""
    assert url.startswith("http://127.0.0.1:")
    # The URL is the test server's own (checked above), never a file: or other scheme.
    request = urllib.request.Request(  # noqa: S310
        url, data=data, method=method, headers=headers or {})
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=30) as response:
            return Answer(response.status, {k.lower(): v for k, v in response.headers.items()},
                          response.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, {k.lower(): v for k, v in exc.headers.items()},
                      exc.read().decode())
