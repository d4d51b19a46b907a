"""Celery, through its result backend's table and its broker (docs/sources.md): its
declaration (``source.DECLARATION``: shape, fences and writes; ``liveness``: the broker's
answers); what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.celery.source import DECLARATION, CeleryConfig

__all__ = ["DECLARATION", "CeleryConfig"]
