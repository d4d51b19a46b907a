"""graphile-worker as a job source.

Its shape, fences and writes are in ``source``;
what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.graphile_worker.source import GraphileWorkerConfig, GraphileWorkerSource

__all__ = ["GraphileWorkerConfig", "GraphileWorkerSource"]
