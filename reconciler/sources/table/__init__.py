"""A home-grown job table, mapped column by column in the config file (``kind = "table"``):
its config model (``config``), its schema checks (``checks``) and its shape, fences and
writes (``source``); what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.table.config import TableConfig
from reconciler.sources.table.source import TableFence, TableSource

__all__ = ["TableConfig", "TableFence", "TableSource"]
