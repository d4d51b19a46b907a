"""``reconciler jobs explain``: one job's verdict, the ``[kinds]`` rules it was judged by,
and its evidence, as plain values (text and ``--json``).

A kind with ``reconcile = false`` is shown "not reconciled": no pass ever touches such a
job, whatever the table would say. An evidence error shows its privacy-safe detail (an
``error_code`` and the step or column it concerns), as the audit records it.
"""

from __future__ import annotations

import json
from typing import Any

from reconciler.core.job_story import JobDetail, budget_from
from reconciler.core.kinds import KIND_KEYS, KindRules
from reconciler.core.passes import Explained
from reconciler.views import verdict_view


def explain_view(explained: Explained, kinds: KindRules, job: JobDetail | None = None
                 ) -> dict[str, Any]:
    """The ``jobs explain --json`` shape: the verdict (null for a kind not reconciled) as
    every view tells it, the job's attempt budget and where it comes from (``job``: the
    system's own setting for the job), the kind's resolved rules with the pattern that
    set each, the evidence, and why the owner's liveness is unknown now
    (``liveness_unknown``: a code, null when known). ``job``: the job as ``jobs show``
    reads it (its budget's origin), if it could be read."""
    kind, change = explained.job_kind, explained.change
    policy = kinds.resolve(kind)
    reconciled = policy.reconcile
    verdict = verdict_view(explained, policy.max_run_seconds)
    values: dict[str, Any] = {
        "effect": policy.effect.value,
        "stale_after_seconds": change.thresholds.stale_after_seconds,
        "wedged_after_seconds": change.thresholds.wedged_after_seconds,
        "max_run_seconds": policy.max_run_seconds,
        "max_attempts": policy.max_attempts,
        "crash_loop_after": change.thresholds.crash_loop_after,
        "reconcile": policy.reconcile,
    }
    set_by = kinds.set_by(kind)
    return {
        "job_id": change.decision.job_id,
        "kind": kind,
        "reconciled": reconciled,
        **{key: verdict[key] if reconciled else None
           for key in ("disposition", "reason", "rule", "resume_step_index")},
        "never_reclaimed": reconciled and verdict["never_reclaimed"],
        "max_attempts": verdict["evidence"].get("max_attempts", policy.max_attempts),
        "max_attempts_from": job.max_attempts_from if job is not None
        else budget_from(None, set_by["max_attempts"]),
        "kind_rules": {"matched": kinds.matching(kind), **values, "set_by": set_by},
        "liveness_unknown": verdict["liveness_unknown"],
        "evidence": verdict["evidence"],
    }


def explain_lines(view: dict[str, Any]) -> list[str]:
    """The human lines of an explain view (the caller escapes control characters)."""
    head = f"job {view['job_id']} (kind {view['kind']}): "
    rules = view["kind_rules"]
    if not view["reconciled"]:
        pattern = rules["set_by"]["reconcile"]
        head += (f'not reconciled ([kinds."{pattern}"] sets reconcile = false): no pass '
                 "ever touches this job")
    else:
        rule = f"rule {view['rule']}" if view["rule"] else "pass outcome"
        head += f"{view['disposition']} ({view['reason']}, {rule})"
        if view["resume_step_index"] is not None:
            head += f" at step {view['resume_step_index']}"
    matched = ", ".join(f'"{p}"' for p in rules["matched"]) or "none (the defaults apply)"
    lines = [head]
    if view["liveness_unknown"]:
        lines.append(f"  liveness unknown ({view['liveness_unknown']}): its worker's silence "
                     "proves nothing now, and no evidence says it is alive; it is left alone "
                     "until the liveness can be read and trusted again (only max_run_seconds "
                     "can decide it meanwhile)")
    if view["never_reclaimed"]:
        lines.append("  never reclaimed: its system keeps no lease for it and its kind sets "
                     "no max_run_seconds, so nothing will ever end it if its worker dies; "
                     "set max_run_seconds for the kind in [kinds]")
    origin = view["max_attempts_from"]
    words = {"job": "the job's own, set in its system", "default": _source(None)}
    lines.append(f"  attempt budget: {view['max_attempts']} ({words.get(origin, origin)})")
    lines.append(f"  [kinds] patterns matched: {matched}")
    lines += [f"  {key}: {_plain(rules[key])} ({_source(rules['set_by'][key])})"
              + ("; the job's own budget applies instead"
                 if key == "max_attempts" and origin == "job" else "")
              for key in KIND_KEYS]
    lines.append("  evidence:")
    lines += [f"    {key}: {_plain(value)}" for key, value in view["evidence"].items()]
    return lines


def _source(pattern: str | None) -> str:
    return "the settings' default" if pattern is None else f'[kinds."{pattern}"]'


def _plain(value: Any) -> str:
    """A value as text: strings as they are, anything else as JSON (lists, null, true)."""
    return value if isinstance(value, str) else json.dumps(value)
