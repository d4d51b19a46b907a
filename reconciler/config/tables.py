"""The config file's tables as models: ``[kinds."<glob>"]`` and each source's ``[source]``.

Values are typed as TOML types them (a string is never a number) and every duration and
count is bounded as the setting it refines is (``reconciler.config.fields``): finite, at most
a year, counts up to 2,147,483,647. Problems read as one line naming the table and key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from reconciler.config.fields import MAX_COUNT, MAX_SECONDS
from reconciler.config.settings import type_name
from reconciler.core.kinds import KindRule
from reconciler.core.vocabulary import EffectKind

_FileSeconds = Annotated[float, Strict()]
_FileCount = Annotated[int, Strict()]
_SQL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class FileTable(BaseModel):
    """A table of the config file: unknown keys refused, values as TOML typed them."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class KindSettings(FileTable):
    """One ``[kinds."<glob>"]`` table: each key optional (None: not set here), bounded like
    the setting it refines (finite durations up to a year, counts up to 2**31-1)."""

    effect: EffectKind | None = None
    stale_after_seconds: _FileSeconds | None = Field(None, ge=0, le=MAX_SECONDS,
                                                     allow_inf_nan=False)
    wedged_after_seconds: _FileSeconds | None = Field(None, gt=0, le=MAX_SECONDS,
                                                      allow_inf_nan=False)
    max_run_seconds: _FileSeconds | None = Field(None, gt=0, le=MAX_SECONDS,
                                                 allow_inf_nan=False)
    max_attempts: _FileCount | None = Field(None, ge=1, le=MAX_COUNT)
    crash_loop_after: _FileCount | None = Field(None, ge=1, le=MAX_COUNT)
    reconcile: StrictBool | None = None

    def rule(self, pattern: str) -> KindRule:
        """The core's rule for ``pattern`` with the keys this table sets."""
        return KindRule(pattern, **self.model_dump())


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class SourceSettings:
    """The ``[source]`` table of one kind of source (its keys besides ``kind``): a frozen
    dataclass validated on construction, by the loader and by code alike.

    Every value is a non-empty string; ``schema``, ``table`` and ``*_column`` keys name SQL
    objects and must be plain SQL names. ``from_settings`` names fields filled from the
    settings of the same name, never from the file.
    """

    kind: ClassVar[str]
    from_settings: ClassVar[frozenset[str]] = frozenset()
    sql_names: ClassVar[frozenset[str]] = frozenset({"schema"})
    """Keys naming SQL objects (besides every ``*_column``): plain SQL names only."""
    string_tables: ClassVar[frozenset[str]] = frozenset()
    """Keys whose value is a table of non-empty strings to non-empty strings."""
    string_lists: ClassVar[frozenset[str]] = frozenset()
    """Keys whose value is a non-empty list of non-empty strings (kept as a tuple)."""

    @field_validator("*", mode="before")
    @classmethod
    def _plain_text(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        if name in cls.from_settings or value is None:
            return value
        if name in cls.string_tables:
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) and v
                    for k, v in value.items()):
                raise ValueError("must be a table of non-empty strings to non-empty strings")
            return value
        if name in cls.string_lists:
            if not isinstance(value, list | tuple) or not value or not all(
                    isinstance(v, str) and v for v in value):
                raise ValueError("must be a non-empty list of non-empty strings")
            return tuple(value)
        if not isinstance(value, str) or not value:
            raise ValueError(f"must be a non-empty string, not {type_name(value)}")
        if (name in cls.sql_names or name.endswith("_column")) \
                and not _SQL_NAME.match(value):
            raise ValueError("must be a plain SQL name (letters, digits, '_', at most 63)")
        return value

    @classmethod
    def file_keys(cls) -> tuple[str, ...]:
        """The keys a ``[source]`` table of this kind may hold, ``kind`` first."""
        return ("kind", *(f.name for f in dataclasses.fields(cls)
                          if f.name not in cls.from_settings))


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class NativeConfig(SourceSettings):
    """``kind = "native"``: this project's own ``job_runs`` (the default; no keys)."""

    kind: ClassVar[str] = "native"


_WANTED = {"float_type": "a number", "int_type": "an integer", "bool_type": "true or false",
           "string_type": "a string"}


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the known key closest to a misspelt ``key`` (else "")."""
    # Imported for a misspelt key only, not by every command.
    import difflib  # noqa: PLC0415

    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def describe_table_error(exc: ValidationError, where: str) -> str:
    """The first problem of a config table as one line: ``<where> <key> must be ...``."""
    error = exc.errors()[0]
    key = ".".join(str(part) for part in error.get("loc", ()))
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    shown = str(value) if isinstance(value, float) else repr(value)
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{where} unknown key {key!r}"
    if kind in ("missing", "missing_argument"):
        return f"{where} needs {key}"
    if kind in _WANTED:
        found = "" if kind == "bool_type" else f", not {type_name(value)}"
        return f"{where} {key} must be {_WANTED[kind]}{found} (got {shown})"
    if kind == "finite_number":
        return f"{where} {key} must be a finite number (got {shown})"
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
              "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
    if kind in bounds:
        relation, name = bounds[kind]
        bound = ctx[name]
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"{where} {key} must be {relation} {bound} (got {shown})"
    if kind == "enum":
        return f"{where} {key} must be one of {ctx.get('expected', '')} (got {shown})"
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    if not key:  # a rule over several keys names them itself
        return f"{where} {message}"
    return f"{where} {key} {message} (got {shown})"


