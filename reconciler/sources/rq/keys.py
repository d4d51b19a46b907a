"""RQ's keys in Redis and the versions whose layout the source reads (RQ 2.x).

Read from RQ's own code (``rq/job.py``, ``registry.py``, ``executions.py``,
``results.py``, ``queue.py``, ``worker/base.py``, ``worker_registration.py``), the same
from 2.0 to 2.12:

- ``rq:job:<id>``: the job's hash (``status``, ``data``: zlib-compressed
  ``(func_name, instance, args, kwargs)`` in the app's serializer, ``origin``: its
  queue, ``worker_name``, ``started_at``, ``retries_left`` where enqueued with a
  ``Retry``, ``exc_info``: zlib-compressed text);
- ``rq:queues``: the set of queue keys, ``rq:queue:<name>``: its list of job ids;
- ``rq:wip:<queue>``: the started registry, a sorted set of ``<job id>:<execution id>``
  scored by when the entry expires: each heartbeat of the job's worker scores it when
  the next heartbeat is due plus ``HEARTBEAT_GRACE_SECONDS`` (``get_heartbeat_ttl``:
  ``min(remaining, job_monitoring_interval) + 60``; a ``SimpleWorker``, which beats
  not at all while it runs a job, scores it its job's ``timeout + 60``);
- ``rq:execution:<job id>:<execution id>``: the execution's hash, and
  ``rq:executions:<job id>``: the job's executions, a sorted set;
- ``rq:failed:<queue>``: the failed registry, job ids scored by when they expire;
  ``rq:deferred:<queue>``: the jobs waiting on others (``rq:job:<id>:dependents``,
  ``rq:job::<id>:dependencies``: who waits on whom);
- ``rq:results:<job id>``: the job's results, a stream (``latest_result()`` reads it);
- ``rq:worker:<name>``: the worker's hash (``last_heartbeat``, ``death``, ``birth``,
  ``version``), expiring when its heartbeats stop (while it runs a job, with the job's
  entry); ``rq:workers``: the set of worker keys. A worker refuses to start under a name
  whose key exists, so a dead worker's successor under the same name starts once that
  key expired, and its start-up cleanup (``StartedJobRegistry.cleanup``) then fails the
  dead worker's jobs, or requeues those with a ``Retry`` left.

RQ 3.0 is outside the range: its keys take a prefix from the environment of the app
(``RQ_KEY_PREFIX``), which the sidecar cannot read, and a job whose dependencies are met
passes through a ready registry of its own; a version outside the range is refused in
one line, never guessed at.
"""

from __future__ import annotations

import importlib.metadata
import re

from reconciler.errors import ConfigError

SUPPORTED = ((2, 0), (3, 0))
"""The RQ versions read: from 2.0 (executions in the started registry) up to 3.0."""
SUPPORTED_TEXT = "rq>=2.0,<3.0"
EXTRA_HINT = "pip install 'stale-claim-reconciler[rq]'"

QUEUES = "rq:queues"
QUEUE_PREFIX = "rq:queue:"
WORKERS = "rq:workers"
STARTED_STATUS = "started"
HEARTBEAT_GRACE_SECONDS = 60.0
"""What RQ adds to a heartbeat's interval when it scores a started entry (the ``+ 60`` of
``get_heartbeat_ttl``): an entry's score less this is when its worker's next heartbeat is
due."""


def job_key(job_id: str) -> str:
    """The job's hash."""
    return f"rq:job:{job_id}"


def dependents_key(job_id: str) -> str:
    """The set of the jobs that wait on it."""
    return f"rq:job:{job_id}:dependents"


def dependencies_key(job_id: str) -> str:
    """The set of the jobs it waits on (RQ's own spelling, with a second colon)."""
    return f"rq:job::{job_id}:dependencies"


def queue_key(queue: str) -> str:
    """The queue's list of job ids."""
    return f"{QUEUE_PREFIX}{queue}"


def started_key(queue: str) -> str:
    """The queue's started registry."""
    return f"rq:wip:{queue}"


def deferred_key(queue: str) -> str:
    """The queue's deferred registry (jobs waiting on others)."""
    return f"rq:deferred:{queue}"


def failed_key(queue: str) -> str:
    """The queue's failed registry."""
    return f"rq:failed:{queue}"


def execution_key(job_id: str, execution_id: str) -> str:
    """One execution's hash."""
    return f"rq:execution:{job_id}:{execution_id}"


def executions_key(job_id: str) -> str:
    """The job's executions."""
    return f"rq:executions:{job_id}"


def results_key(job_id: str) -> str:
    """The job's results stream."""
    return f"rq:results:{job_id}"


def worker_key(name: str) -> str:
    """A worker's hash."""
    return f"rq:worker:{name}"


def supported(version: str) -> bool:
    """Whether an RQ version (``2.12.0``, as RQ writes it) is in the range read."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return False
    parsed = (int(found[1]), int(found[2]))
    return SUPPORTED[0] <= parsed < SUPPORTED[1]


def require_supported(version: str, where: str) -> None:
    """One ``ConfigError`` line for a version outside the range (``where``: whose)."""
    if not supported(version):
        raise ConfigError(f"source rq: {where} is rq {version}, outside the versions this "
                          f"source reads ({SUPPORTED_TEXT}); it does not guess at another "
                          "layout")


def installed() -> str:
    """The installed RQ's version, checked against the range; one ``ConfigError`` line
    naming the extra to install when RQ or its Redis client is missing."""
    try:
        version = importlib.metadata.version("rq")
        importlib.metadata.version("redis")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"source rq needs the rq package beside the reconciler: "
                          f"{EXTRA_HINT}") from None
    require_supported(version, "the installed package")
    return version
