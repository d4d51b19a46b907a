"""Which rule of the decision table (or which outcome of the pass) a recorded reason
comes from, with the rule's text as ``reconciler explain`` prints it."""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core.decisions import RULES
from reconciler.core.vocabulary import Reason
from reconciler.views import LIVENESS_UNKNOWN


@dataclass(frozen=True, slots=True)
class RuleText:
    """A rule's number (None for an outcome of the pass itself), evidence and why."""

    number: int | None
    evidence: str
    description: str


# Every reason but these three is the reason of exactly one rule.
PASS_OUTCOMES: dict[str, RuleText] = {
    Reason.FENCE_LOST.value: RuleText(
        None, "the job changed between reading and applying",
        "the compare-and-swap matched no row; nothing changed"),
    Reason.RECONCILE_ERROR.value: RuleText(
        None, "the job's evidence could not be read",
        "recorded, and the pass went on with the other jobs"),
    Reason.MASS_STALENESS_BRAKE.value: RuleText(
        None, "too many jobs went stale at once",
        "a database, network or clock event is likelier than mass death: the brake held "
        "the change back (see the decision table's brake note)"),
}

# Not a recorded reason: the verdict a page shows for a job the table finds live while
# its source's liveness is unknown (``reconciler.views.verdict_view``).
PASS_OUTCOMES[LIVENESS_UNKNOWN] = RuleText(
    None, "its worker's liveness could not be read, or is in doubt",
    "its silence proves nothing now, and nothing says it is alive: it is left alone until "
    "the liveness can be read and trusted again (only max_run_seconds can end it meanwhile)")

BY_REASON: dict[str, RuleText] = {
    **{rule.reason.value: RuleText(rule.number, rule.evidence, rule.description)
       for rule in RULES},
    **PASS_OUTCOMES,
}


def rule_for(reason: str) -> RuleText | None:
    """The rule (or pass outcome) behind a recorded reason; None for an unknown one."""
    return BY_REASON.get(reason)
