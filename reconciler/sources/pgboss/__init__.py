"""pg-boss as a job source: its declaration (``source.DECLARATION``: shape, fences and
writes); what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.pgboss.source import DECLARATION, PgBossConfig

__all__ = ["DECLARATION", "PgBossConfig"]
