"""When an RQ worker is gone, and when its job's heartbeat is overdue: what a pass judges
of each started entry it loads, on Redis's clock.

A worker is named, and the name outlives the process: a worker started again under it
(systemd, a supervisor, ``docker restart``) is another process. So the worker's key is
read with its ``birth``: a worker born after the job started is not the one that ran it.
Its ``last_heartbeat`` and the job's entry are renewed together, every
``job_monitoring_interval``; an entry is scored when the next heartbeat is due plus
RQ's grace (``keys.HEARTBEAT_GRACE_SECONDS``), so its worker's silence is read off its
score a minute before the entry expires and a successor under the name can start.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from reconciler.sources.rq import keys


def utc_seconds(text: bytes | str | None) -> float | None:
    """An RQ timestamp (``utcformat``) as seconds since the epoch (None: absent, bad)."""
    if not text:
        return None
    value = text.decode() if isinstance(text, bytes) else text
    if not value.endswith("Z"):
        return None
    try:  # RQ's two layouts (with and without microseconds), read at C speed
        return datetime.fromisoformat(value).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def silent_at(now: float, timeout: float) -> float:
    """The highest score of an entry whose worker's next heartbeat (its score less RQ's
    grace) is ``timeout`` seconds overdue, or that has expired."""
    return now + max(0.0, keys.HEARTBEAT_GRACE_SECONDS - timeout)


def silent_over(now: float, score: float, timeout: float) -> float:
    """Seconds past the entry's heartbeat being ``timeout`` overdue (negative before)."""
    return now - (score - keys.HEARTBEAT_GRACE_SECONDS) - timeout


def worker_gone(now: float, worker: Sequence[bytes | None] | None, started_at: float | None,
                timeout: float) -> bool:
    """The job's worker is gone: no key (expired), dead, silent past ``timeout``, or a
    later worker under its name (born after the job started). ``worker``: its key's
    ``last_heartbeat``, ``death``, ``birth`` and ``version`` as read (None: no key)."""
    if worker is None:
        return True
    heartbeat, death, birth, _ = worker
    last = utc_seconds(heartbeat)
    born = utc_seconds(birth)
    return (last is None or death is not None or now - last > timeout
            or (born is not None and started_at is not None and born > started_at))
