"""The sidecar's watch on its source's liveness evidence, pass after pass.

A pass whose source could not read, or doubts, its owners' liveness (a broker down, or not
the app's) decides nothing that depends on it: correct, and silent unless said. The watch
says it once when the doubt begins (or its reason changes) and once when it ends, keeps
the metric, and gives ``/readyz`` its reason meanwhile.
"""

from __future__ import annotations

import json
import logging

from reconciler.core.ports import LivenessUnknown
from reconciler.redaction import redact
from reconciler.sidecar.metrics import Metrics

# The service's logger: operators filter the sidecar's lines by it.
log = logging.getLogger("reconciler.sidecar.service")


class LivenessWatch:
    """The last pass's doubt about its source's liveness (``unknown``; None: trusted)."""

    def __init__(self, metrics: Metrics, instance: str) -> None:
        self.metrics = metrics
        self.instance = instance
        self.unknown: LivenessUnknown | None = None

    def observe(self, unknown: LivenessUnknown | None) -> None:
        """Follow one pass's finding: a line where the state begins, changes or ends."""
        before, self.unknown = self.unknown, unknown
        self.metrics.observe_liveness(unknown)
        if unknown is not None and (before is None or before.code is not unknown.code):
            log.warning("event=liveness_unknown instance=%s code=%s where=%s detail=%s",
                        self.instance, unknown.code.value, json.dumps(redact(unknown.where)),
                        json.dumps("nothing that depends on liveness is decided until it "
                                   "can be read and trusted again"))
        elif unknown is None and before is not None:
            log.info("event=liveness_restored instance=%s code=%s where=%s", self.instance,
                     before.code.value, json.dumps(redact(before.where)))

    def why(self) -> str:
        """The line ``/readyz`` answers while the liveness is unknown."""
        unknown = self.unknown
        if unknown is None:
            return "liveness known"
        return (f"liveness unknown ({unknown.code.value}) at {redact(unknown.where)}: "
                "nothing that depends on it is decided")
