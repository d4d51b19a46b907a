"""Procrastinate as a job source.

Its shape, fences and writes are in ``source``;
what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.procrastinate.source import ProcrastinateConfig, ProcrastinateSource

__all__ = ["ProcrastinateConfig", "ProcrastinateSource"]
