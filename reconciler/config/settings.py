"""The validated settings: ``Settings``, built from the declarations of
``reconciler.config.fields`` (every default once, with units in the names).

Precedence: a CLI flag, else ``RECONCILER_<SETTING>`` in the environment, else the config
file's top-level key (``reconciler.config.loader.load_config`` reads the file), else the default.
``database_url`` may also come from a file (``database_url_file``), so a password never has
to sit in a command line (``ps`` shows those to every user) or an environment listing.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic.fields import FieldInfo

from reconciler.config.fields import ENV_PREFIX, FIELDS
from reconciler.core.brake import BrakeLimits
from reconciler.core.decisions import Thresholds
from reconciler.errors import ConfigError

log = logging.getLogger("reconciler.settings")

# Variables of ours that are not settings: the config file, the test suite, the chaos
# harness, failpoints, the real-systems source tests.
NON_SETTING_VARIABLES = frozenset({
    "RECONCILER_CONFIG", "RECONCILER_FAILPOINTS", "RECONCILER_PG_BIN",
    "RECONCILER_TEST_PG_DSN", "RECONCILER_TEST_MARIADB_URL", "RECONCILER_TEST_ENGINES",
    "RECONCILER_STATEMACHINE_EXAMPLES", "RECONCILER_STATEMACHINE_STEPS",
    "RECONCILER_SOURCES_FINDINGS", "RECONCILER_OPERATOR",
})

# Settings a file may hold instead (``<setting>_file``), so a secret never has to sit in a
# command line or an environment listing.
SECRET_FILES = (("database_url", "database_url_file"), ("console_token", "console_token_file"))


def setting(name: str) -> Any:
    """The validated field of the setting ``name``, from its one declaration."""
    spec = FIELDS[name]
    given = (("ge", spec.ge), ("gt", spec.gt), ("le", spec.le), ("max_length", spec.max_length))
    bounds: dict[str, Any] = {key: value for key, value in given if value is not None}
    if spec.finite:
        bounds["allow_inf_nan"] = False
    return Field(spec.default, description=spec.description, **bounds)


# An operator's name goes into the record and into the session cookie: plain characters.
OPERATOR_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
MIN_OPERATOR_TOKEN = 16
MAX_OPERATOR_TOKEN = 500


class Settings(BaseModel):
    """The reconciler's settings; invalid values fail with one clear line.

    Built from keyword arguments only: ``load_settings`` (and ``load_config`` over it) is
    what reads the environment and the config file. A plain model rather than
    pydantic-settings' ``BaseSettings``, whose import (every provider it knows: cloud
    secret stores, a CLI parser, dotenv) cost each command a tenth of a second to read a
    few ``RECONCILER_*`` variables.
    """

    # validate_default: the declared defaults are checked like given values.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    database_url: str = setting("database_url")
    database_url_file: str = setting("database_url_file")
    interval_seconds: float = setting("interval_seconds")
    batch_size: int = setting("batch_size")
    stale_after_seconds: float = setting("stale_after_seconds")
    wedged_after_seconds: float = setting("wedged_after_seconds")
    metrics_port: int = setting("metrics_port")
    metrics_host: str = setting("metrics_host")
    leader_lease_seconds: float = setting("leader_lease_seconds")
    lease_seconds: float = setting("lease_seconds")
    default_max_attempts: int = setting("default_max_attempts")
    retry_backoff_seconds: float = setting("retry_backoff_seconds")
    retry_backoff_max_seconds: float = setting("retry_backoff_max_seconds")
    instance_name: str = setting("instance_name")
    session_timeout_seconds: float = setting("session_timeout_seconds")
    session_heartbeat_seconds: float = setting("session_heartbeat_seconds")
    shutdown_grace_seconds: float = setting("shutdown_grace_seconds")
    max_run_seconds: float = setting("max_run_seconds")
    poll_interval_seconds: float = setting("poll_interval_seconds")
    audit_retention_days: float = setting("audit_retention_days")
    artifact_root: str = setting("artifact_root")
    shadow: bool = setting("shadow")
    brake_min_jobs: int = setting("brake_min_jobs")
    brake_stale_fraction: float = setting("brake_stale_fraction")
    brake_hold_seconds: float = setting("brake_hold_seconds")
    crash_loop_after: int = setting("crash_loop_after")
    job_retention_days: float = setting("job_retention_days")
    connect_timeout_seconds: int = setting("connect_timeout_seconds")
    statement_timeout_seconds: float = setting("statement_timeout_seconds")
    lock_timeout_seconds: float = setting("lock_timeout_seconds")
    sqlite_busy_timeout_seconds: float = setting("sqlite_busy_timeout_seconds")
    pass_statement_timeout_seconds: float | None = setting("pass_statement_timeout_seconds")
    pass_lock_timeout_seconds: float | None = setting("pass_lock_timeout_seconds")
    shutdown_timeout_seconds: float = setting("shutdown_timeout_seconds")
    start_retry_seconds: float = setting("start_retry_seconds")
    console: bool = setting("console")
    console_token: str = setting("console_token")
    console_token_file: str = setting("console_token_file")
    console_operator_tokens_file: str = setting("console_operator_tokens_file")
    _operator_tokens: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        # Before validation, so a value read from a file is checked like any other.
        if not isinstance(data, dict):
            return data
        for setting, file_setting in SECRET_FILES:
            if not data.get(file_setting):
                continue
            if data.get(setting) not in (None, ""):
                raise ValueError(f"give {setting} or {file_setting}, not both")
            data = {**data, setting: read_secret_file(data[file_setting], file_setting)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.wedged_after_seconds <= self.stale_after_seconds:
            raise ValueError("wedged_after_seconds must be greater than stale_after_seconds")
        if self.session_timeout_seconds < 2 * self.session_heartbeat_seconds:
            raise ValueError("session_timeout_seconds must be at least twice "
                             "session_heartbeat_seconds, or live workers look gone")
        if self.retry_backoff_max_seconds < self.retry_backoff_seconds:
            raise ValueError("retry_backoff_max_seconds must be at least retry_backoff_seconds")
        if self.console_operator_tokens_file:
            # Read once, here, so a bad file is one line at start and never a 500 later.
            tokens = read_operator_tokens(self.console_operator_tokens_file)
            if self.console_token and self.console_token in tokens.values():
                raise ValueError("console_operator_tokens_file: a token there is also "
                                 "console_token, which only reads; give operators their own")
            self._operator_tokens = tokens
        return self

    @property
    def operator_tokens(self) -> dict[str, str]:
        """The console's operators, name to token (``console_operator_tokens_file``)."""
        return dict(self._operator_tokens)

    @property
    def pass_timeouts(self) -> tuple[float, float]:
        """(statement, lock) timeouts of a pass on PostgreSQL, derived from the interval.

        A pass statement has the interval to finish (never under 10 s, so a short test
        interval does not cut an ordinary pass); a lock wait half of it (never under 5 s).
        """
        statement = self.pass_statement_timeout_seconds
        lock = self.pass_lock_timeout_seconds
        return (max(self.interval_seconds, 10.0) if statement is None else statement,
                max(self.interval_seconds / 2, 5.0) if lock is None else lock)

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


def read_secret_file(path_text: object, setting: str) -> str:
    """The one line a secret file (a Kubernetes secret, a systemd credential) holds; a
    ValueError naming ``setting`` when it cannot be read or holds more than one line."""
    path = Path(str(path_text))
    try:
        value = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            type(exc).__name__
        raise ValueError(f"{setting} {str(path)!r} cannot be read: {reason}") from None
    if not value or "\n" in value:
        raise ValueError(f"{setting} {str(path)!r} must hold one value on one line")
    return value


def given_or_read(value: str | None, path: object | None, setting: str) -> str:
    """``value``, else the one line of the file ``path`` names (``<setting>_file``); a
    ValueError unless exactly one of the two is given."""
    if (value is None) == (path is None):
        raise ValueError(f"give one of {setting} or {setting}_file")
    return value if value is not None else read_secret_file(path, f"{setting}_file")


def read_operator_tokens(path_text: str) -> dict[str, str]:
    """The operators of ``console_operator_tokens_file``: lines ``NAME TOKEN`` (blank lines
    and ``#`` comments skipped), read like a secret file; a ValueError naming the file and
    line (never the token) when it cannot be used."""
    setting = "console_operator_tokens_file"
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            type(exc).__name__
        raise ValueError(f"{setting} {path_text!r} cannot be read: {reason}") from None
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{setting} {path_text!r} line {number}"
        if len(words) != 2:  # a name and a token
            raise ValueError(f"{where}: expected NAME TOKEN")
        name, token = words
        if not OPERATOR_NAME.fullmatch(name):
            raise ValueError(f"{where}: a name is 1 to 64 letters, digits and . _ @ -")
        if not MIN_OPERATOR_TOKEN <= len(token) <= MAX_OPERATOR_TOKEN:
            raise ValueError(f"{where}: a token is {MIN_OPERATOR_TOKEN} to "
                             f"{MAX_OPERATOR_TOKEN} characters")
        if name in tokens or token in tokens.values():
            raise ValueError(f"{where}: the name or the token is given twice")
        tokens[name] = token
    if not tokens:
        raise ValueError(f"{setting} {path_text!r} names no operator")
    return tokens


def load_settings(*, file_values: Mapping[str, Any] | None = None,
                  file_name: str = "config", **overrides: Any) -> Settings:
    """Build settings: a flag (``overrides``; None means not given), else the environment,
    else ``file_values`` (the config file's top-level keys, read by
    ``reconciler.config.loader.load_config``, named ``file_name`` in errors), else the default.

    ``RECONCILER_*`` variables that are not settings are named in a warning, with the
    closest setting, instead of being silently ignored.
    """
    warn_unknown_variables(os.environ)
    given = {key: value for key, value in overrides.items() if value is not None}
    from_env = environment_values(os.environ)
    from_file = dict(file_values or {})
    for key, value in from_file.items():
        _check_setting_type(file_name, key, value, Settings.model_fields[key])
    # database_url and database_url_file are one setting given two ways: either from a flag
    # or the environment wins over either from the file (not "give one, not both").
    url_keys = ("database_url", "database_url_file")
    if any(k in given or from_env.get(k) for k in url_keys):
        from_file = {k: v for k, v in from_file.items() if k not in url_keys}
    try:
        return Settings(**{**from_file, **from_env, **given})
    except ValidationError as exc:
        if not from_file:
            raise ConfigError(describe_validation_error(exc)) from None
        raise ConfigError(_describe(exc, file_name, from_file, given)) from None


def environment_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``environ`` gives, as ``RECONCILER_<SETTING>`` (the name in any case),
    by setting name; their text is validated with the rest."""
    names = {f"{ENV_PREFIX}{name.upper()}": name for name in FIELDS}
    return {names[key.upper()]: value for key, value in environ.items()
            if key.upper() in names}


def _check_setting_type(name: str, key: str, value: Any, field: FieldInfo) -> None:
    """TOML values are typed: refuse a string or a boolean where a number belongs."""
    expected = field.annotation
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        wanted = "a number"
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        wanted = "an integer"
    elif expected is str:
        ok = isinstance(value, str)
        wanted = "a string"
    elif expected is bool:
        ok = isinstance(value, bool)
        wanted = "a boolean"
    else:  # pragma: no cover - every setting is one of the four
        return
    if not ok:
        raise ConfigError(f"{name}: setting {key} must be {wanted}, not {type_name(value)} "
                          f"(got {value!r})")


def _describe(exc: ValidationError, name: str, file_settings: Mapping[str, Any],
              flags: Mapping[str, Any]) -> str:
    """Name the file when the refused value came from it, else the flag / variable line."""
    error = exc.errors()[0]
    loc = error.get("loc", ())
    key = str(loc[0]) if loc else ""
    from_env = any(k.upper() == f"RECONCILER_{key.upper()}" for k in os.environ)
    if key in file_settings and key not in flags and not from_env:
        message = error.get("msg", "invalid value").removeprefix("Value error, ")
        return (f"{name}: invalid setting {key}: {message} "
                f"(got {error.get('input')!r})")
    line = describe_validation_error(exc)
    return line if key or not file_settings else f"{line} (with settings from {name})"



_warned: set[str] = set()


def unknown_variables(environ: Any) -> list[tuple[str, str | None]]:
    """``RECONCILER_*`` names in ``environ`` that are no setting, each with the closest one."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    found = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in NON_SETTING_VARIABLES:
            continue
        # Imported for a variable to name only, not by every command.
        import difflib  # noqa: PLC0415

        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.6)
        found.append((name, close[0] if close else None))
    return found


def warn_unknown_variables(environ: Any) -> None:
    """Log one warning per unknown ``RECONCILER_*`` variable (once per process)."""
    for name, closest in unknown_variables(environ):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean {closest}?" if closest else ""
        log.warning("event=unknown_setting variable=%s text=%s", name,
                    _quoted(f"{name} is not a setting and is ignored{hint}"))


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def type_name(value: Any) -> str:
    """How a TOML value's type is named in an error line."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), type(value).__name__)


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem of a validation error as one line naming the setting."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    if not where:
        return f"invalid settings: {message}"
    source = f"{ENV_PREFIX}{where.upper()} / --{where.replace('_', '-')}"
    shown = error.get("input")
    if where in ("database_url", "console_token"):
        shown = "<hidden>"  # a URL may hold a password; create_engine names the problem
    elif isinstance(shown, float) and not math.isfinite(shown):
        shown = str(shown)
    return f"invalid setting {where} ({source}): {message} (got {shown!r})"
