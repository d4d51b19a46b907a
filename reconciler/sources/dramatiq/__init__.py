"""Dramatiq, through its Redis broker's keys and the middleware its app adds
(docs/sources.md): its declaration (``source.DECLARATION``), Redis read once per
transaction (``snapshot``), moves in Dramatiq's own shapes under a fence (``writes``)."""

from __future__ import annotations

from reconciler.sources.dramatiq.config import DramatiqConfig
from reconciler.sources.dramatiq.source import DECLARATION

__all__ = ["DECLARATION", "DramatiqConfig"]
