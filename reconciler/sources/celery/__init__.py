"""Celery, through its result backend's table and its broker (docs/sources.md).

Its shape, fences and writes are in ``source``;
what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.celery.source import CeleryConfig, CelerySource

__all__ = ["CeleryConfig", "CelerySource"]
