"""Which Celery worker process holds each running task: liveness about a process, not a
name.

A ``STARTED`` row names its worker by node name (``celery@%h``, ``-n w1@%h``), and the
name outlives the process: systemd, ``docker restart``, ``celery multi restart`` and a
container restarted in its pod start a new process under it, which answers ping for the
name without holding any of its predecessor's tasks. So a task is live while a worker
process that was seen holding it is still the one answering under its name:

- each pass asks the named workers Celery's own ``stats`` (one broadcast; it returns as
  soon as each has answered): a process is its node name, ``pid`` and start (the broker's
  clock less its ``uptime``, which the worker measures on its own clock: no skew between
  the two machines enters), the same process across passes within
  ``INCARNATION_TOLERANCE_SECONDS``;
- a task remembered (in the broker, ``HELD_KEY``) as held by a process that still answers
  under its name is live, with nothing more asked;
- any other task is asked of its named workers with Celery's own ``query_task`` (a
  request a worker process keeps from receiving a message to finishing it: active,
  reserved or scheduled), and a task none of them holds is asked of every worker (a
  message redelivered under ``task_acks_late`` may be held by another worker, or by the
  new process);
- a task no worker holds is remembered (``UNHELD_KEY``) from when it was first found so,
  and is an orphan once that is ``session_timeout_seconds`` ago. While it is, it is asked
  of every worker in each pass, at the same time as the ``stats``, and its named worker
  is asked nothing of its own where none of its tasks is held any more.

A broadcast to every worker returns once as many have replied as the broker has
connections subscribed to broadcasts (``_listening``), else at its timeout (workers that
also listen for events, Celery's default, hold two such connections each: then it is the
timeout). So a quiet pass costs one ``stats`` broadcast to the named workers (its replies
are the ping) and two reads of the broker's memory; a task not yet seen held costs a
``query_task`` to its named worker, once; a pass over a dead worker's tasks, at most one
broadcast timeout (the first after the death, two: its ``stats`` waits for the dead
worker too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

PING_TIMEOUT_SECONDS = 1.0
"""How long a control broadcast waits for replies (all of them, when sent to everyone)."""
INCARNATION_TOLERANCE_SECONDS = 3.0
"""How far two reads of one process's start may differ: ``uptime`` is whole seconds, and
a reply takes its time to arrive."""
HELD_KEY = "reconciler:celery:held"
"""Hash: a process seen holding tasks, ``[host, pid, start]`` (broker seconds) -> the ids of
the tasks it was seen holding, one a line: a few fields however many tasks run, so a pass
reads it in one round trip and parses a few strings."""
UNHELD_KEY = "reconciler:celery:unheld"
"""Hash: task id -> when the reconciler first found no worker holding it (broker seconds)."""
OLD_SILENT_KEY = "reconciler:celery:silent"
"""Where earlier releases kept worker silences by name: forgotten with the unheld tasks."""


@dataclass(frozen=True, slots=True)
class Incarnation:
    """One worker process: its node name, pid, and when it started (broker seconds)."""

    host: str
    pid: int
    started: float

    def same(self, other: Incarnation) -> bool:
        """Whether both are one process: the same name and pid, started at the same time
        (a new process under the name, its pid reused or not, started later)."""
        return (self.host == other.host and self.pid == other.pid
                and abs(self.started - other.started) <= INCARNATION_TOLERANCE_SECONDS)

    def encoded(self) -> str:
        return json.dumps([self.host, self.pid, self.started])

    @classmethod
    def decoded(cls, raw: bytes | str) -> Incarnation | None:
        try:
            host, pid, started = json.loads(raw)
            return cls(str(host), int(pid), float(started))
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class Holding:
    """What one read found: the named workers that answered (their process), the tasks
    some worker process holds (that process), and whether any worker answered at all."""

    answering: Mapping[str, Incarnation]
    held: Mapping[str, Incarnation]
    anyone: bool
    remembered: Mapping[str, Incarnation] = field(default_factory=dict)
    """The tasks the broker's memory held when read, and by which process."""


def holding(app: Any, second: Any, client: Any, now: float, *, names: Sequence[str],
            owners: Mapping[str, str]) -> Holding:
    """Who holds each of the tasks of ``owners`` (task id -> the worker its row names;
    ``names``: the workers to ask, those names among them), as the module says.

    The tasks already found held by none in an earlier pass (a dead worker's) are asked of
    every worker at once with the ``stats`` to the named workers (``second``: an app of its
    own, so each broadcast collects its own replies), and a named worker none of whose
    tasks is held any more is not asked ``stats`` at all (that broadcast would wait its
    whole timeout for a dead one; the one to every worker says whether it answers). The
    broadcast to every worker returns once as many workers replied as subscribe to the
    broker's broadcasts (``_listening``), else at its timeout."""
    task_ids = sorted(owners)
    known = _known(client)
    suspects = set(task_ids) & _unheld_ids(client)
    wanted = {owners[t] for t in task_ids if t not in suspects}
    stat_names = sorted(set(names) - ({owners[t] for t in suspects} - wanted))
    listening = _listening(client) if suspects or not stat_names else None
    if suspects:
        with ThreadPoolExecutor(max_workers=1) as pool:
            everyone = pool.submit(_holders, second, sorted(suspects), None, listening)
            answering = _incarnations(app, stat_names, now)
            repliers, elsewhere = everyone.result()
    else:
        answering = _incarnations(app, stat_names, now)
        repliers, elsewhere = frozenset(), {}
    held: dict[str, Incarnation] = {}
    for task_id in task_ids:
        seen = known.get(task_id)
        current = None if seen is None else answering.get(seen.host)
        if seen is not None and current is not None and current.same(seen):
            held[task_id] = current
    rest = [t for t in task_ids if t not in held and t not in suspects]
    named: dict[str, str] = {}
    if rest and answering:
        named = _holders(app, rest, sorted(answering))[1]
    rest = [t for t in rest if t not in named]
    if rest or not (answering or repliers):
        # Held by none of its named workers (or no worker answered yet): every worker is
        # asked, which also says whether any answers at all.
        more, found = _holders(app, rest, None, listening or _listening(client))
        repliers, elsewhere = repliers | more, {**elsewhere, **found}
    found_by = {**elsewhere, **named}
    # The processes of the workers found holding a task, and of the named ones that
    # answered only the broadcast to every worker (what the evidence says of them).
    asked = ({*found_by.values()} | (repliers & set(names))) - set(answering)
    every = {**_incarnations(app, sorted(asked), now), **answering}
    held.update({t: every[h] for t, h in found_by.items() if h in every and t not in held})
    return Holding({h: p for h, p in every.items() if h in names}, held,
                   bool(answering or repliers), known)


def _incarnations(app: Any, names: Sequence[str], now: float) -> dict[str, Incarnation]:
    """Celery's own ``stats`` to ``names``: each answering worker's process."""
    if not names:
        return {}
    replies = app.control.broadcast("stats", destination=list(names), reply=True,
                                    timeout=PING_TIMEOUT_SECONDS) or []
    found: dict[str, Incarnation] = {}
    for reply in replies:
        for host, stats in reply.items():
            if not isinstance(stats, dict):
                continue
            pid, uptime = stats.get("pid"), stats.get("uptime")
            if isinstance(pid, int) and isinstance(uptime, int | float):
                found[host] = Incarnation(host, pid, now - float(uptime))
    return found


def _holders(app: Any, task_ids: Sequence[str], destination: list[str] | None,
             limit: int | None = None) -> tuple[frozenset[str], dict[str, str]]:
    """Celery's own ``query_task`` (to ``destination``, else to every worker, returning
    once ``limit`` replied where given): the workers that answered, and which of them
    holds each of ``task_ids`` it holds."""
    replies = app.control.broadcast(
        "query_task", arguments={"ids": list(task_ids)}, destination=destination,
        reply=True, timeout=PING_TIMEOUT_SECONDS, limit=limit) or []
    repliers: set[str] = set()
    held: dict[str, str] = {}
    for reply in replies:
        for host, tasks in reply.items():
            repliers.add(host)
            if isinstance(tasks, dict):
                held.update((str(task_id), host) for task_id in tasks)
    return frozenset(repliers), held


def _listening(client: Any) -> int | None:
    """How many workers could answer a broadcast to every worker, at most: kombu's Redis
    transport delivers a broadcast through a pattern subscription on a connection of each
    worker's, so the connections with one (``CLIENT LIST TYPE pubsub``, ``psub`` > 0) are
    never fewer than the workers that can answer; more where workers also listen for
    events or other apps share the server, and then the broadcast waits its timeout, as
    with none. (``PUBSUB NUMPAT`` would not do: it counts distinct patterns, one for all
    the workers of an app.) None: none, or Redis would not say."""
    try:
        count = sum(1 for c in client.client_list(_type="pubsub")
                    if int(c.get("psub", 0)) > 0)
    except Exception:  # a Redis that refuses CLIENT LIST: the timeout alone bounds the wait
        return None
    return count or None


def _unheld_ids(client: Any) -> set[str]:
    """The tasks remembered as held by none (from an earlier pass)."""
    return {k.decode() if isinstance(k, bytes) else str(k) for k in client.hkeys(UNHELD_KEY)}


def _known(client: Any) -> dict[str, Incarnation]:
    """The tasks remembered as held, and by which process."""
    known: dict[str, Incarnation] = {}
    for raw, tasks in client.hgetall(HELD_KEY).items():
        process = Incarnation.decoded(raw)
        if process is not None:
            text = tasks.decode() if isinstance(tasks, bytes) else str(tasks)
            known.update(dict.fromkeys(text.split("\n") if text else (), process))
    return known


def remember(client: Any, found: Holding, running: Iterable[str], now: float
             ) -> dict[str, float]:
    """What this read found, kept for the next (written only where it changed): each task
    held, by which process, and from when each running task no worker holds was first
    found so (the others forgotten); seconds each unheld task has been held by none."""
    running = set(running)
    unheld = sorted(running - set(found.held))
    pipe = client.pipeline()
    if found.held != found.remembered:  # written only when what is held changed
        by_process: dict[Incarnation, list[str]] = {}
        for task_id, process in found.held.items():
            by_process.setdefault(process, []).append(task_id)
        pipe.delete(HELD_KEY)
        if by_process:
            pipe.hset(HELD_KEY, mapping={process.encoded(): "\n".join(sorted(tasks))
                                         for process, tasks in by_process.items()})
    known_unheld = _unheld_ids(client)
    for task_id in known_unheld - set(unheld):
        pipe.hdel(UNHELD_KEY, task_id)
    for task_id in set(unheld) - known_unheld:
        pipe.hsetnx(UNHELD_KEY, task_id, repr(now))
    pipe.execute()
    since = client.hmget(UNHELD_KEY, unheld) if unheld else []
    return {task_id: now - float(first)
            for task_id, first in zip(unheld, since, strict=True) if first is not None}


def forget(client: Any) -> None:
    """Forget what was seen: what was observed while the answers proved nothing does not
    count towards a task's orphaning (nor keeps it live)."""
    client.delete(HELD_KEY, UNHELD_KEY, OLD_SILENT_KEY)
