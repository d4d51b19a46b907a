"""Named points where a process can be made to SIGKILL itself, for chaos tests and the demo.

Enabled only by ``RECONCILER_FAILPOINTS`` (comma-separated names, each optionally
qualified: ``after_step_start:effectful``), read once at import. When it is unset, ``hit``
is one truthiness check of an empty set.

Points in the worker runtime: ``before_step_start``, ``after_step_start`` (before the
step's effect), ``after_step_effect`` (before the step is recorded), ``between_steps``,
``in_heartbeat``, ``before_complete``, ``after_complete``. In the pass:
``between_decide_and_apply``, ``between_apply_and_record``.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "RECONCILER_FAILPOINTS"

POINTS = (
    "before_step_start", "after_step_start", "after_step_effect", "between_steps",
    "in_heartbeat", "before_complete", "after_complete",
    "between_decide_and_apply", "between_apply_and_record",
)

_ACTIVE: frozenset[str] = frozenset(
    part.strip() for part in os.environ.get(ENV, "").split(",") if part.strip()
)


def hit(name: str, qualifier: str | None = None) -> None:
    """SIGKILL this process if ``name`` (or ``name:qualifier``) is enabled."""
    if not _ACTIVE:
        return
    if name in _ACTIVE or (qualifier is not None and f"{name}:{qualifier}" in _ACTIVE):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
