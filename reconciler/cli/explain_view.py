"""``reconciler jobs explain``: one job's verdict, the ``[kinds]`` rules it was judged by,
and its evidence, as plain values (text and ``--json``).

A kind with ``reconcile = false`` is shown "not reconciled": no pass ever touches such a
job, whatever the table would say. An evidence error shows its privacy-safe detail (an
``error_code`` and the step or column it concerns), as the audit records it.
"""

from __future__ import annotations

import json
from typing import Any

from reconciler.core.kinds import KIND_KEYS, KindRules
from reconciler.core.ports import LivenessUnknown, PlannedChange


def explain_view(kind: str, change: PlannedChange, kinds: KindRules,
                 liveness: LivenessUnknown | None = None) -> dict[str, Any]:
    """The ``jobs explain --json`` shape: the verdict (null for a kind not reconciled),
    the kind's resolved rules with the pattern that set each, the evidence, and why the
    owner's liveness is unknown now (``liveness_unknown``: a code, null when known)."""
    policy = kinds.resolve(kind)
    d = change.decision
    reconciled = policy.reconcile
    values: dict[str, Any] = {
        "effect": policy.effect.value,
        "stale_after_seconds": change.thresholds.stale_after_seconds,
        "wedged_after_seconds": change.thresholds.wedged_after_seconds,
        "max_run_seconds": policy.max_run_seconds,
        "max_attempts": policy.max_attempts,
        "crash_loop_after": change.thresholds.crash_loop_after,
        "reconcile": policy.reconcile,
    }
    return {
        "job_id": d.job_id,
        "kind": kind,
        "reconciled": reconciled,
        "disposition": d.disposition.value if reconciled else None,
        "reason": d.reason.value if reconciled else None,
        "rule": d.rule_number if reconciled else None,
        "resume_step_index": d.resume_step_index if reconciled else None,
        "kind_rules": {"matched": kinds.matching(kind), **values,
                       "set_by": kinds.set_by(kind)},
        "liveness_unknown": None if liveness is None else liveness.code.value,
        # Through JSON and back: enum members become their plain values.
        "evidence": json.loads(json.dumps(change.evidence)),
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
                     "proves nothing now, so it is treated as alive; only max_run_seconds "
                     "can decide it until the liveness can be read and trusted again")
    lines.append(f"  [kinds] patterns matched: {matched}")
    lines += [f"  {key}: {_plain(rules[key])} ({_source(rules['set_by'][key])})"
              for key in KIND_KEYS]
    lines.append("  evidence:")
    lines += [f"    {key}: {_plain(value)}" for key, value in view["evidence"].items()]
    return lines


def _source(pattern: str | None) -> str:
    return "the settings' default" if pattern is None else f'[kinds."{pattern}"]'


def _plain(value: Any) -> str:
    """A value as text: strings as they are, anything else as JSON (lists, null, true)."""
    return value if isinstance(value, str) else json.dumps(value)
