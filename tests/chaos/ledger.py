"""The chaos suite's own records, kept outside the job database: effects and writes.

Two kinds of line go into one append-only JSON-lines file per process:

- the **effect ledger**: a step handler writes ``begin`` when it starts and ``effect`` when
  its side effect is done, before it returns, so before the runtime records the step
  finished. Both lines are fsynced. A repeated effect, or one the store claims happened but
  never did, is visible here whatever the job database says.
- the **write log**: every fenced store write of an instrumented client (``instrument``)
  writes ``call`` before it reaches the database and ``res`` (``ok``, ``lost`` or
  ``error``) after. ``ok`` means the write landed; a call with no ``res`` (the process was
  killed) or ``error`` may or may not have landed. These lines are not fsynced: a killed
  process loses nothing already written; only a machine crash could.

A file per process means no two processes share a write offset; each line is one
``os.write`` on an ``O_APPEND`` descriptor, so threads of one process do not tear lines.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reconciler.errors import LeaseLost
from reconciler.storage.sql_store import SqlStore

SUFFIX = ".jsonl"

# Every write a claim makes after it is taken; each is fenced on (job, lease token, status).
FENCED_OPS = ("heartbeat", "report_progress", "record_step", "complete", "fail", "release",
              "stage_artifact")


class Ledger:
    """One process's append-only ledger file (thread-safe: one ``os.write`` per line)."""

    def __init__(self, directory: Path | str, role: str) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}{SUFFIX}"
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                       0o644)
        self._prefix = self.path.stem
        self._numbers = itertools.count()

    def _write(self, entry: dict[str, Any], *, sync: bool = False) -> None:
        if self._fd is None:
            raise RuntimeError("ledger closed")
        os.write(self._fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
        if sync:
            os.fsync(self._fd)

    def began(self, job_id: int, step_index: int, generation: int, effect_kind: str) -> None:
        """A step handler started (its effect may follow)."""
        self._write({"k": "begin", "j": job_id, "s": step_index, "g": generation,
                     "e": effect_kind, "t": time.time()}, sync=True)

    def effect(self, job_id: int, step_index: int, generation: int, effect_kind: str) -> None:
        """A step handler's side effect is done (written before the step is recorded)."""
        self._write({"k": "effect", "j": job_id, "s": step_index, "g": generation,
                     "e": effect_kind, "t": time.time()}, sync=True)

    def claimed(self, job_id: int, generation: int) -> None:
        """This process's claim took the job at this generation."""
        self._write({"k": "claim", "j": job_id, "g": generation, "t": time.time()})

    def call(self, op: str, job_id: int, generation: int | None,
             step_index: int | None = None, state: str | None = None) -> str:
        """A fenced write is about to reach the database; returns its call id."""
        call_id = f"{self._prefix}:{next(self._numbers)}"
        entry: dict[str, Any] = {"k": "call", "c": call_id, "op": op, "j": job_id,
                                 "g": generation, "t": time.time()}
        if step_index is not None:
            entry["s"] = step_index
            entry["st"] = state
        self._write(entry)
        return call_id

    def result(self, call_id: str, outcome: str) -> None:
        """How a fenced write ended: ``ok`` (landed), ``lost`` (fenced out) or ``error``."""
        self._write({"k": "res", "c": call_id, "r": outcome, "t": time.time()})

    def close(self) -> None:
        """Close the file (lines already written stay)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def instrument(store: SqlStore, ledger: Ledger) -> None:
    """Log every claim and fenced write of ``store`` (this instance only) to ``ledger``.

    The real methods are looked up on the class at call time, so a test that swaps a
    method for a broken copy (test_mutations) is logged the same way.
    """
    cls = type(store)
    generations: dict[str, int] = {}  # lease token -> the generation its claim took

    def claim(*args: Any, **kwargs: Any) -> Any:
        job = cls.claim(store, *args, **kwargs)
        if job is not None:
            generations[job.lease_token] = job.claim_generation
            ledger.claimed(job.job_id, job.claim_generation)
        return job

    def fenced(op: str) -> Callable[..., Any]:
        def write(job_id: int, token: str, *args: Any, **kwargs: Any) -> Any:
            step_index = state = None
            if op == "record_step":
                step_index, state = args[0], args[2].value
            call_id = ledger.call(op, job_id, generations.get(token), step_index, state)
            try:
                result = getattr(cls, op)(store, job_id, token, *args, **kwargs)
            except LeaseLost:
                ledger.result(call_id, "lost")
                raise
            except BaseException:
                ledger.result(call_id, "error")
                raise
            ledger.result(call_id, "ok")
            return result

        return write

    store.claim = claim  # type: ignore[method-assign]
    for op in FENCED_OPS:
        setattr(store, op, fenced(op))


@dataclass(frozen=True, slots=True)
class Call:
    """One fenced write from the write log; ``outcome`` None when the process died in it."""

    op: str
    job_id: int
    generation: int | None
    step_index: int | None
    state: str | None
    started: float
    outcome: str | None


@dataclass
class LedgerData:
    """Everything the ledger files say, indexed for the checks."""

    began: set[tuple[int, int, int]] = field(default_factory=set)
    effects: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    effect_kinds: dict[tuple[int, int], str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    claims: int = 0
    unreadable_lines: int = 0

    def effect_generations(self, job_id: int, step_index: int) -> list[int]:
        """Generations in which this step's effect was done, once per time it was done."""
        return self.effects.get((job_id, step_index), [])


def read_ledger(directory: Path | str) -> LedgerData:
    """Read every ledger file in ``directory``; a torn or unreadable line is counted."""
    data = LedgerData()
    pending: dict[str, dict[str, Any]] = {}
    outcomes: dict[str, str] = {}
    for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
        with path.open("rb") as handle:
            for raw in handle:
                try:
                    entry = json.loads(raw)
                    kind = entry["k"]
                except (ValueError, KeyError, TypeError):
                    data.unreadable_lines += 1
                    continue
                if kind == "begin":
                    data.began.add((entry["j"], entry["s"], entry["g"]))
                elif kind == "effect":
                    key = (entry["j"], entry["s"])
                    data.effects[key].append(entry["g"])
                    data.effect_kinds[key] = entry["e"]
                elif kind == "call":
                    pending[entry["c"]] = entry
                elif kind == "res":
                    outcomes[entry["c"]] = entry["r"]
                elif kind == "claim":
                    data.claims += 1
    for call_id, entry in pending.items():
        data.calls.append(Call(
            op=entry["op"], job_id=entry["j"], generation=entry["g"],
            step_index=entry.get("s"), state=entry.get("st"), started=entry["t"],
            outcome=outcomes.get(call_id),
        ))
    return data
