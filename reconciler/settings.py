"""Every setting and its default, declared once, with units in the names.

Precedence: a CLI flag, else ``RECONCILER_<SETTING>`` in the environment, else the default.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reconciler.errors import ConfigError


class Settings(BaseSettings):
    """The reconciler's settings; invalid values fail with one clear line."""

    model_config = SettingsConfigDict(env_prefix="RECONCILER_", extra="forbid", frozen=True)

    database_url: str = "sqlite:///reconciler.db"
    interval_seconds: float = Field(30.0, gt=0)
    batch_size: int = Field(500, ge=1, le=10_000)
    stale_after_seconds: float = Field(60.0, ge=0)
    wedged_after_seconds: float = Field(3600.0, gt=0)
    metrics_port: int = Field(9464, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    leader_lease_seconds: float = Field(90.0, gt=0)
    lease_seconds: float = Field(30.0, gt=0)
    default_max_attempts: int = Field(3, ge=1)
    retry_backoff_seconds: float = Field(1.0, ge=0)
    retry_backoff_max_seconds: float = Field(300.0, ge=0)
    instance_name: str = Field("", max_length=100)
    session_timeout_seconds: float = Field(30.0, gt=0)
    session_heartbeat_seconds: float = Field(5.0, gt=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    max_run_seconds: float = Field(600.0, gt=0)
    poll_interval_seconds: float = Field(1.0, gt=0)
    artifact_root: str = "artifacts"

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.wedged_after_seconds <= self.stale_after_seconds:
            raise ValueError("wedged_after_seconds must be greater than stale_after_seconds")
        if self.session_timeout_seconds < 2 * self.session_heartbeat_seconds:
            raise ValueError("session_timeout_seconds must be at least twice "
                             "session_heartbeat_seconds, or live workers look gone")
        if self.retry_backoff_max_seconds < self.retry_backoff_seconds:
            raise ValueError("retry_backoff_max_seconds must be at least retry_backoff_seconds")
        return self


def load_settings(**overrides: Any) -> Settings:
    """Build settings from flags (``overrides``; None means not given) and the environment."""
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem of a validation error as one line naming the setting."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    if not where:
        return f"invalid settings: {message}"
    source = f"RECONCILER_{where.upper()} / --{where.replace('_', '-')}"
    return f"invalid setting {where} ({source}): {message} (got {error.get('input')!r})"
