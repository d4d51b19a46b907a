"""A chaos reconciler replica: exactly ``reconciler run``, but it dies with the harness.

    python -m tests.chaos.chaos_replica

Settings come from ``RECONCILER_*`` in the environment (the harness sets a short interval,
stale threshold and leader lease); ``RECONCILER_FAILPOINTS`` may name a pass failpoint.
"""

from __future__ import annotations

import sys

from tests.chaos.lifeline import die_with_parent

if __name__ == "__main__":
    die_with_parent()
    from reconciler.cli import main

    sys.exit(main(["run"]))
