"""A home-grown job table, mapped column by column in the config file (``kind = "table"``):
its config model (``config``), its schema checks (``checks``) and its declaration
(``source.DECLARATION``: shape, fences and writes); what every source shares is in
``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.table.config import TableConfig
from reconciler.sources.table.source import DECLARATION, TableFence

__all__ = ["DECLARATION", "TableConfig", "TableFence"]
