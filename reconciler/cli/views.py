"""The CLI's public, redacted views: the ones in ``reconciler.views``, shared with the console
(which cannot import the CLI package: the CLI starts the sidecar that serves it)."""

from reconciler.views import NOT_STARTED, decision_view, job_view, pass_view, printable

__all__ = ["NOT_STARTED", "decision_view", "job_view", "pass_view", "printable"]
