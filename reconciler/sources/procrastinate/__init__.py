"""Procrastinate as a job source: its declaration (``source.DECLARATION``: shape, fences
and writes); what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.procrastinate.source import DECLARATION, ProcrastinateConfig

__all__ = ["DECLARATION", "ProcrastinateConfig"]
