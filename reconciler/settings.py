"""Every setting and its default, declared once, with units in the names.

Precedence: a CLI flag, else ``RECONCILER_<SETTING>`` in the environment, else the default.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Thresholds
from reconciler.errors import ConfigError


class Settings(BaseSettings):
    """The reconciler's settings; invalid values fail with one clear line."""

    model_config = SettingsConfigDict(env_prefix="RECONCILER_", extra="forbid", frozen=True)

    database_url: str = Field(
        "sqlite:///reconciler.db",
        description="SQLAlchemy URL: sqlite:///PATH or postgresql+psycopg://...")
    interval_seconds: float = Field(30.0, gt=0, description="seconds between scheduled passes")
    batch_size: int = Field(500, ge=1, le=10_000,
                            description="most candidates one pass examines")
    stale_after_seconds: float = Field(
        60.0, ge=0, description="activity younger than this protects an expired lease")
    wedged_after_seconds: float = Field(
        3600.0, gt=0, description="no activity this long under a live lease is a hang")
    metrics_port: int = Field(9464, ge=0, le=65535, description="port of /metrics and /healthz")
    metrics_host: str = Field("127.0.0.1", description="address /metrics binds to")
    leader_lease_seconds: float = Field(
        90.0, gt=0, description="how long a reconciler's leadership lasts unrenewed")
    lease_seconds: float = Field(30.0, gt=0, description="a claim's lease when none is given")
    default_max_attempts: int = Field(
        3, ge=1, description="a job's attempt budget when enqueue names none")
    retry_backoff_seconds: float = Field(
        1.0, ge=0, description="first retry delay; doubles per attempt")
    retry_backoff_max_seconds: float = Field(300.0, ge=0, description="longest retry delay")
    instance_name: str = Field(
        "", max_length=100, description="this reconciler's name in the audit trail "
        "(default: host and process id)")
    session_timeout_seconds: float = Field(
        30.0, gt=0, description="a worker session silent this long is gone")
    session_heartbeat_seconds: float = Field(
        5.0, gt=0, description="how often a worker renews its session")
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, description="how long a stopping worker lets running steps finish")
    max_run_seconds: float = Field(
        600.0, gt=0, description="longest a worker lets one job's handlers run")
    poll_interval_seconds: float = Field(
        1.0, gt=0, description="how often an idle worker looks for work")
    audit_retention_days: float = Field(
        30.0, gt=0, description="passes and decisions older than this are deleted")
    artifact_root: str = Field("artifacts", description="folder for staged and published "
                               "artifacts")
    shadow: bool = Field(
        False, description="passes decide and record every decision marked shadow, and "
        "change no job")
    brake_min_jobs: int = Field(
        20, ge=1, description="fewest stale jobs in one pass that can engage the "
        "mass-staleness brake")
    brake_stale_fraction: float = Field(
        0.5, gt=0, le=1, description="share of running jobs that must be stale at once to "
        "engage the brake")
    brake_hold_seconds: float = Field(
        120.0, ge=0, description="how long the brake leaves stale jobs alone from the first "
        "braked pass (0: never)")
    crash_loop_after: int = Field(
        2, ge=1, description="a job whose last this many attempts were all lost ends "
        "crash_loop")
    job_retention_days: float = Field(
        30.0, gt=0, description="finished jobs (with their steps, attempts and artifact "
        "records) older than this are deleted")

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


    def thresholds(self) -> Thresholds:
        """The decision table's limits from these settings (every caller builds them here)."""
        return Thresholds(stale_after_seconds=self.stale_after_seconds,
                          wedged_after_seconds=self.wedged_after_seconds,
                          crash_loop_after=self.crash_loop_after)

    def brake_limits(self) -> BrakeLimits:
        """The mass-staleness brake's limits from these settings."""
        return BrakeLimits(min_jobs=self.brake_min_jobs,
                           stale_fraction=self.brake_stale_fraction,
                           hold_seconds=self.brake_hold_seconds)


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
