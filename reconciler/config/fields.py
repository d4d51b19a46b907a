"""Every setting declared once, as plain data: its name, default, unit (in its name),
bounds and one line of help.

Nothing here imports pydantic: the command line's parser reads these declarations to
offer a flag per setting, so ``reconciler --help`` and a usage error start in a fraction
of the time validating them takes. ``reconciler.config.settings.Settings`` builds its
validated fields from the same declarations, and a unit test keeps the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENV_PREFIX", "FIELDS", "MAX_COUNT", "MAX_DAYS", "MAX_SECONDS", "SETTING_FIELDS",
           "SettingField"]

ENV_PREFIX = "RECONCILER_"
# Long enough for any real schedule or threshold, short enough that every duration still
# fits a timedelta, an APScheduler trigger and a PostgreSQL interval.
MAX_SECONDS = 365 * 86400.0
MAX_DAYS = 36_500.0
# The largest count a PostgreSQL integer column (and so every attempt budget) holds.
MAX_COUNT = 2_147_483_647

Default = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class SettingField:
    """One setting: its default and help, and the bounds its value is validated against."""

    name: str
    default: Default
    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    max_length: int | None = None
    finite: bool = False
    """Refuse nan and the infinities."""

    @property
    def is_switch(self) -> bool:
        """Whether the setting is true or false (a ``--x/--no-x`` flag)."""
        return isinstance(self.default, bool)

    @property
    def flag(self) -> str:
        """Its command-line flag."""
        return f"--{self.name.replace('_', '-')}"


def _field(name: str, default: Default, *, description: str, ge: float | None = None,
           gt: float | None = None, le: float | None = None, max_length: int | None = None,
           allow_inf_nan: bool = True) -> SettingField:
    return SettingField(name, default, description, ge=ge, gt=gt, le=le,
                        max_length=max_length, finite=not allow_inf_nan)


def _seconds(name: str, default: float, description: str, *, minimum: float = 0.0,
             inclusive: bool = False, maximum: float = MAX_SECONDS) -> SettingField:
    """A finite duration in seconds within [minimum, maximum] (or (minimum, maximum])."""
    return SettingField(name, default, description, ge=minimum if inclusive else None,
                        gt=None if inclusive else minimum, le=maximum, finite=True)


SETTING_FIELDS: tuple[SettingField, ...] = (
    _field("database_url",
        "sqlite:///reconciler.db",
        description="SQLAlchemy URL: sqlite:///PATH, postgresql+psycopg://... or "
                    "mysql+pymysql://..."),
    _field("database_url_file",
        "", description="a file whose content is database_url (a Kubernetes secret, a "
        "systemd credential); keeps the password out of ps and the environment"),
    _seconds("interval_seconds", 30.0, "seconds between scheduled passes"),
    _field("batch_size", 500, ge=1, le=10_000,
                            description="most candidates one pass examines"),
    _seconds("stale_after_seconds",
        60.0, "activity younger than this protects an expired lease", inclusive=True),
    _seconds("wedged_after_seconds",
        3600.0, "no activity this long under a live lease is a hang"),
    _field("metrics_port", 9464, ge=0, le=65535, description="port of /metrics and /healthz"),
    _field("metrics_host", "127.0.0.1", description="address /metrics binds to"),
    _seconds("leader_lease_seconds",
        90.0, "how long a reconciler's leadership lasts unrenewed"),
    _seconds("lease_seconds", 30.0, "a claim's lease when none is given"),
    _field("default_max_attempts",
        3, ge=1, le=MAX_COUNT, description="a job's attempt budget when enqueue names none"),
    _seconds("retry_backoff_seconds",
        1.0, "first retry delay; doubles per attempt", inclusive=True),
    _seconds("retry_backoff_max_seconds", 300.0, "longest retry delay", inclusive=True),
    _field("instance_name",
        "", max_length=100, description="this reconciler's name in the audit trail "
        "(default: host and process id)"),
    _seconds("session_timeout_seconds", 30.0, "a worker session silent this long is gone"),
    _seconds("session_heartbeat_seconds", 5.0, "how often a worker renews its session"),
    _seconds("shutdown_grace_seconds",
        30.0, "how long a stopping worker lets running steps finish", inclusive=True),
    _seconds("max_run_seconds", 600.0, "longest a worker lets one job's handlers run"),
    _seconds("poll_interval_seconds", 1.0, "how often an idle worker looks for work"),
    _field("audit_retention_days",
        30.0, gt=0, le=MAX_DAYS, allow_inf_nan=False,
        description="passes and decisions older than this are deleted"),
    _field("artifact_root", "artifacts", description="folder for staged and published "
                               "artifacts"),
    _field("shadow",
        False, description="passes decide and record every decision marked shadow, and "
        "change no job"),
    _field("brake_min_jobs",
        20, ge=1, le=MAX_COUNT, description="fewest stale jobs in one pass that can engage the "
        "mass-staleness brake"),
    _field("brake_stale_fraction",
        0.5, gt=0, le=1, allow_inf_nan=False, description="share of running jobs that must "
        "be stale at once to engage the brake"),
    _seconds("brake_hold_seconds",
        120.0, "how long the brake leaves stale jobs alone from the first braked pass "
        "(0: never)", inclusive=True),
    _field("crash_loop_after",
        2, ge=1, le=MAX_COUNT, description="a job whose last this many attempts were all lost ends "
        "crash_loop"),
    _field("job_retention_days",
        30.0, gt=0, le=MAX_DAYS, allow_inf_nan=False, description="finished jobs (with "
        "their steps, attempts and artifact records) older than this are deleted"),
    # -- talking to the database: nothing waits on it forever ----------------------------
    _field("connect_timeout_seconds",
        5, ge=2, le=300, description="longest wait for a PostgreSQL connection (whole "
        "seconds, at least 2 as in libpq)"),
    _seconds("statement_timeout_seconds",
        30.0, "PostgreSQL statement_timeout of every session; a server silent this much "
        "longer (plus a margin) is given up on", maximum=3600.0),
    _seconds("lock_timeout_seconds",
        10.0, "PostgreSQL lock_timeout of every session", maximum=3600.0),
    _seconds("sqlite_busy_timeout_seconds",
        30.0, "how long a SQLite writer waits for the write lock", inclusive=True,
        maximum=3600.0),
    _field("pass_statement_timeout_seconds",
        None, gt=0, le=3600.0, allow_inf_nan=False,
        description="statement_timeout of a pass on PostgreSQL (default: interval_seconds, "
        "at least 10)"),
    _field("pass_lock_timeout_seconds",
        None, gt=0, le=3600.0, allow_inf_nan=False,
        description="lock_timeout of a pass on PostgreSQL (default: half of interval_seconds, "
        "at least 5)"),
    _seconds("shutdown_timeout_seconds",
        30.0, "how long `reconciler run` waits at SIGTERM for its pass in flight before it "
        "exits 1 anyway", maximum=3600.0),
    _seconds("start_retry_seconds",
        10.0, "how long `reconciler run` retries a database it cannot reach at start (a "
        "restart in progress) before it exits 3 (0: no retry)", inclusive=True,
        maximum=3600.0),
    _field("console", True, description="serve the operator console on the metrics port "
                          "(`reconciler run`)"),
    _field("console_token",
        "", max_length=500, description="when set, every console page needs it (a bearer "
        "token or the login form's cookie); it only reads: it offers no action; /metrics "
        "and the probes stay open"),
    _field("console_token_file",
        "", description="a file whose content is console_token (keeps it out of ps and the "
        "environment)"),
    _field("console_operator_tokens_file",
        "", description="a file of lines `NAME TOKEN`: each token signs its operator in to "
        "the console to hold, unhold, retry and cancel jobs, recorded under NAME"),
)

FIELDS: dict[str, SettingField] = {spec.name: spec for spec in SETTING_FIELDS}
"""Every setting by its name, in declaration order."""
