"""A job's timeline: every attempt and step, what each pass saw and decided, and every
operator action, in time order, as ``jobs show`` and the console's job page show it.

Pure: the records storage read in, entries out. The facts come from what each source
keeps: this project's attempts and step runs for its own jobs; the step ledger for a
foreign job (its system's own history stays its system's); the audit's decisions and the
operators' actions for every job. A worker's identity is never among them: an attempt is
its number, a claim its time.

What a pass saw is read back from the evidence it recorded: a worker gone (its session
ended) is seen when the pass decided; a lease that ran out, ``lease_expired_seconds``
before that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from reconciler.core.decisions import RULES
from reconciler.core.job_story import aware

RULE_OF = {rule.reason.value: rule.number for rule in RULES}
"""The number of the rule behind each reason a rule decides (pass outcomes have none)."""

ORDER = ("claimed", "step_started", "step_finished", "lease_expired", "owner_gone",
         "decision", "attempt_ended", "action")
"""Entries at one instant, in the order they happen: a pass's decision ends an attempt in
the same transaction, and an operator reads what the pass did before acting."""


def timeline(*, attempts: Iterable[Mapping[str, Any]] = (),
             steps: Iterable[Mapping[str, Any]] = (),
             decisions: Iterable[Mapping[str, Any]] = (),
             actions: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The entries, oldest first, each with its ``type`` (one of ``ORDER``) and ``at``.

    ``attempts``: ``attempt_number``, ``claimed_at``, ``ended_at``, ``attempt_outcome``,
    ``ended_by``. ``steps``: ``step_index``, ``step_name``, ``effect_kind``,
    ``step_state``, ``attempt_number`` (None where unknown), ``started_at``,
    ``finished_at``, ``error_code`` (a short code, if any). ``decisions``: the audit's
    records (``decided_at``, ``pass_id``, ``disposition``, ``decision_reason`` or
    ``reason``, ``resume_step_index``, ``decision_evidence``, ``shadow``). ``actions``:
    ``acted_at``, ``action``, ``outcome``, ``refusal``, ``actor``, ``note``,
    ``state_before``, ``state_after``.
    """
    entries: list[dict[str, Any]] = []
    for a in attempts:
        number = a.get("attempt_number")
        entries.append({"type": "claimed", "at": aware(a["claimed_at"]), "attempt": number})
        if a.get("ended_at") is not None:
            entries.append({"type": "attempt_ended", "at": aware(a["ended_at"]),
                            "attempt": number, "outcome": a.get("attempt_outcome"),
                            "ended_by": a.get("ended_by")})
    for s in steps:
        step = {"step": s["step_index"], "name": s["step_name"],
                "effect_kind": s.get("effect_kind"), "attempt": s.get("attempt_number")}
        if s.get("started_at") is not None:
            entries.append({"type": "step_started", "at": aware(s["started_at"]), **step})
        if s.get("finished_at") is not None:
            entries.append({"type": "step_finished", "at": aware(s["finished_at"]), **step,
                            "state": s.get("step_state"), "error_code": s.get("error_code")})
    for d in decisions:
        entries += _decided(d)
    for a in actions:
        entries.append({"type": "action", "at": aware(a["acted_at"]),
                        **{k: a.get(k) for k in ("action", "outcome", "refusal", "actor",
                                                 "note", "state_before", "state_after")}})
    known = sorted((e for e in entries if e["at"] is not None),
                   key=lambda e: (e["at"], ORDER.index(e["type"])))
    return _ended_with_their_decisions(known)


def _ended_with_their_decisions(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each attempt a pass ended placed right after the decision that ended it: both are
    one transaction, but an engine may stamp the attempt's end a little before the
    decision's record (SQLite's clock moves within a transaction)."""
    out = [e for e in entries
           if not (e["type"] == "attempt_ended" and e.get("ended_by") == "reconciler")]
    for ended in (e for e in entries
                  if e["type"] == "attempt_ended" and e.get("ended_by") == "reconciler"):
        after = next((i for i, e in enumerate(out) if e["type"] == "decision"
                      and not e["shadow"] and e["at"] >= ended["at"]), None)
        if after is None:
            out.append(ended)
        else:
            out.insert(after + 1, ended)
    return out


def _decided(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A decision, and before it what its pass saw of the worker (when it can be told)."""
    at: datetime | None = aware(record["decided_at"])
    if at is None:
        return []
    reason = str(record.get("decision_reason") or record.get("reason"))
    evidence = record.get("decision_evidence") or {}
    shadow = bool(record.get("shadow", record.get("shadow_mode", False)))
    pass_id = record.get("pass_id")
    seen: list[dict[str, Any]] = []
    expired = evidence.get("lease_expired_seconds")
    if not shadow and evidence.get("session_gone"):
        seen.append({"type": "owner_gone", "at": at, "pass_id": pass_id})
    elif not shadow and isinstance(expired, int | float) and not isinstance(expired, bool):
        seen.append({"type": "lease_expired", "at": at - timedelta(seconds=float(expired)),
                     "pass_id": pass_id})
    return [*seen, {"type": "decision", "at": at, "pass_id": pass_id,
                    "disposition": record.get("disposition"), "reason": reason,
                    "rule": RULE_OF.get(reason),
                    "resume_step_index": record.get("resume_step_index"),
                    "evidence": evidence, "shadow": shadow}]
