"""graphile-worker as a job source: its declaration (``source.DECLARATION``: shape,
fences and writes); what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.graphile_worker.source import DECLARATION, GraphileWorkerConfig

__all__ = ["DECLARATION", "GraphileWorkerConfig"]
