"""RQ, through its keys in Redis (docs/sources.md): its declaration (``source.DECLARATION``:
shape, fences and writes; ``snapshot``: Redis read once per transaction; ``writes``: RQ's
own shapes under a fence); what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.rq.config import RqConfig
from reconciler.sources.rq.source import DECLARATION

__all__ = ["DECLARATION", "RqConfig"]
