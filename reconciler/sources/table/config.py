"""The ``[source] kind = "table"`` configuration: a home-grown job table, mapped column by
column (its own module so that the table source and its start-up checks both read it)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from reconciler.config.tables import SourceSettings


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class TableConfig(SourceSettings):
    """``kind = "table"``: a home-grown job table, mapped column by column."""

    kind: ClassVar[str] = "table"
    sql_names: ClassVar[frozenset[str]] = frozenset({"schema", "table"})
    table: str
    id_column: str
    status_column: str
    processing: str
    queued: str
    failed: str
    cancelled: str | None = None
    schema: str | None = None
    kind_column: str | None = None
    reason_column: str | None = None
    activity_column: str | None = None
    lease_expires_column: str | None = None
    owner_column: str | None = None
    attempts_column: str | None = None
    max_attempts_column: str | None = None
    generation_column: str | None = None
    resume_column: str | None = None
    plan_column: str | None = None
    steps_column: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> TableConfig:
        if self.processing in (self.queued, self.failed):
            raise ValueError(f"processing ({self.processing!r}) must differ from queued and "
                             "failed")
        if self.cancelled in (self.processing, self.queued, self.failed):
            raise ValueError(f"cancelled ({self.cancelled!r}) must differ from processing, "
                             "queued and failed")
        if (self.plan_column is None) != (self.steps_column is None):
            raise ValueError("plan_column and steps_column are mapped together (a plan "
                             "without step results would rerun finished steps)")
        if self.resume_column is not None and self.plan_column is None:
            raise ValueError("resume_column needs plan_column and steps_column")
        seen: dict[str, str] = {}
        for key, column in self.mapped_columns().items():
            if column in seen:
                raise ValueError(f"{key} and {seen[column]} both map column {column!r}")
            seen[column] = key
        return self

    def mapped_columns(self) -> dict[str, str]:
        """Every mapped column by the key that maps it (``id_column`` -> ``id``...)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.endswith("_column") and getattr(self, f.name) is not None}
