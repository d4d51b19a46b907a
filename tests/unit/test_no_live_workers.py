"""When a source has no live worker at all (``reconciler.core.stuck.no_live_workers``)."""

from __future__ import annotations

import pytest

from reconciler.core.ports import StuckCount
from reconciler.core.stuck import no_live_workers
from reconciler.core.vocabulary import StuckReason

pytestmark = pytest.mark.fast

AWAITING, HOLD = StuckReason.AWAITING_DECISION, StuckReason.OPERATOR_HOLD


@pytest.mark.parametrize(("work", "running", "none_alive"), [
    ({}, 0, False),                                                   # nothing runs
    ({AWAITING: StuckCount(3)}, 3, True),                             # every one is stale
    ({AWAITING: StuckCount(2), HOLD: StuckCount(1)}, 3, True),        # held ones count
    ({AWAITING: StuckCount(2)}, 3, False),                            # one is alive
    ({AWAITING: StuckCount(0)}, 4, False),                            # all alive
    ({StuckReason.LIVENESS_UNKNOWN: StuckCount(3)}, 3, False),        # cannot tell
    ({AWAITING: StuckCount(1), StuckReason.LIVENESS_UNKNOWN: StuckCount(2)}, 3, False),
])
def test_no_live_workers(work: dict[StuckReason, StuckCount], running: int,
                         none_alive: bool) -> None:
    assert no_live_workers(work, running) is none_alive
