"""Settings: defaults declared once; flag, else RECONCILER_<NAME>, else default; one-line errors."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from reconciler.cli import build_parser
from reconciler.config.fields import SETTING_FIELDS
from reconciler.config.settings import Settings, load_settings, unknown_variables
from reconciler.errors import ConfigError

DEFAULTS: dict[str, Any] = {
    # the settings the first release named
    "database_url": "sqlite:///reconciler.db",
    "interval_seconds": 30.0,
    "batch_size": 500,
    "stale_after_seconds": 60.0,
    "wedged_after_seconds": 3600.0,
    "metrics_port": 9464,
    "metrics_host": "127.0.0.1",
    # the rest of the settings type
    "leader_lease_seconds": 90.0,
    "lease_seconds": 30.0,
    "default_max_attempts": 3,
    "retry_backoff_seconds": 1.0,  # the first retry delay
    "retry_backoff_max_seconds": 300.0,
    "instance_name": "",
    "session_timeout_seconds": 30.0,
    "session_heartbeat_seconds": 5.0,
    "shutdown_grace_seconds": 30.0,
    "max_run_seconds": 600.0,  # Worker(max_run_seconds=600)
    "poll_interval_seconds": 1.0,
    "audit_retention_days": 30.0,  # issue 4: bounded retention of the audit trail
    "artifact_root": "artifacts",
    # operating safely (issue 13)
    "shadow": False,
    "brake_min_jobs": 20,
    "brake_stale_fraction": 0.5,
    "brake_hold_seconds": 120.0,
    "crash_loop_after": 2,
    "job_retention_days": 30.0,
    # issue 14: nothing waits on the database forever; the URL may come from a file
    "database_url_file": "",
    "connect_timeout_seconds": 5,
    "statement_timeout_seconds": 30.0,
    "lock_timeout_seconds": 10.0,
    "sqlite_busy_timeout_seconds": 30.0,
    "pass_statement_timeout_seconds": None,  # issue 12: derived from interval_seconds
    "pass_lock_timeout_seconds": None,
    "shutdown_timeout_seconds": 30.0,
    "start_retry_seconds": 10.0,
    # issue 20: the operator console, on unless turned off; no token unless given
    "console": True,
    "console_token": "",
    "console_token_file": "",
    # issue 27: the console's named operators, none unless given
    "console_operator_tokens_file": "",
}

# (setting, text as it would come from a flag or an env var, value it means)
GOOD_VALUES: list[tuple[str, str, Any]] = [
    ("database_url", "postgresql+psycopg://u@db:5432/jobs", "postgresql+psycopg://u@db:5432/jobs"),
    ("interval_seconds", "2.5", 2.5),
    ("batch_size", "25", 25),
    ("stale_after_seconds", "120", 120.0),
    ("wedged_after_seconds", "7200", 7200.0),
    ("metrics_port", "9100", 9100),
    ("metrics_host", "0.0.0.0", "0.0.0.0"),  # noqa: S104 - a value under test, nothing binds
    ("leader_lease_seconds", "15", 15.0),
    ("lease_seconds", "10", 10.0),
    ("default_max_attempts", "7", 7),
    ("retry_backoff_seconds", "0.5", 0.5),
    ("retry_backoff_max_seconds", "60", 60.0),
    ("instance_name", "reconciler-a", "reconciler-a"),
    ("session_timeout_seconds", "20", 20.0),
    ("session_heartbeat_seconds", "2", 2.0),
    ("shutdown_grace_seconds", "0", 0.0),
    ("max_run_seconds", "120", 120.0),
    ("poll_interval_seconds", "0.25", 0.25),
    ("artifact_root", "/var/lib/reconciler/artifacts", "/var/lib/reconciler/artifacts"),
    ("shadow", "true", True),
    ("shadow", "0", False),
    ("brake_min_jobs", "1", 1),
    ("brake_stale_fraction", "1", 1.0),
    ("brake_stale_fraction", "0.25", 0.25),
    ("brake_hold_seconds", "0", 0.0),
    ("crash_loop_after", "1", 1),
    ("crash_loop_after", "5", 5),
    ("job_retention_days", "0.5", 0.5),
    ("connect_timeout_seconds", "3", 3),
    ("statement_timeout_seconds", "5", 5.0),
    ("lock_timeout_seconds", "0.5", 0.5),
    ("sqlite_busy_timeout_seconds", "0", 0.0),
    ("pass_statement_timeout_seconds", "12", 12.0),
    ("pass_lock_timeout_seconds", "3", 3.0),
    ("shutdown_timeout_seconds", "5", 5.0),
    ("start_retry_seconds", "0", 0.0),
]

# (setting, bad text); each is refused on its own, with every other setting at its default.
BAD_VALUES: list[tuple[str, str]] = [
    ("interval_seconds", "0"),
    ("interval_seconds", "-5"),
    ("interval_seconds", "soon"),
    ("batch_size", "0"),
    ("batch_size", "10001"),
    ("batch_size", "lots"),
    ("batch_size", "2.5"),
    ("stale_after_seconds", "-1"),
    ("wedged_after_seconds", "0"),
    ("wedged_after_seconds", "forever"),
    ("metrics_port", "65536"),
    ("metrics_port", "-1"),
    ("metrics_port", "http"),
    ("leader_lease_seconds", "0"),
    ("lease_seconds", "-3"),
    ("default_max_attempts", "0"),
    ("retry_backoff_seconds", "-1"),
    ("instance_name", "x" * 101),
    ("session_timeout_seconds", "0"),
    ("session_heartbeat_seconds", "0"),
    ("shutdown_grace_seconds", "-1"),
    ("max_run_seconds", "0"),
    ("poll_interval_seconds", "never"),
    ("shadow", "maybe"),
    ("brake_min_jobs", "0"),
    ("brake_min_jobs", "1.5"),
    ("brake_stale_fraction", "0"),
    ("brake_stale_fraction", "1.5"),
    ("brake_stale_fraction", "half"),
    ("brake_hold_seconds", "-1"),
    ("crash_loop_after", "0"),
    ("crash_loop_after", "two"),
    ("job_retention_days", "0"),
    ("job_retention_days", "-30"),
    ("brake_hold_seconds", "inf"),
    ("job_retention_days", "1e9"),
    # issue 14: values that overflowed later (OverflowError in `run`, "interval out of
    # range" from PostgreSQL) are refused up front
    ("interval_seconds", "inf"),
    ("interval_seconds", "nan"),
    ("leader_lease_seconds", "1e300"),
    ("wedged_after_seconds", "inf"),
    ("stale_after_seconds", "1e20"),
    ("lease_seconds", "-inf"),
    ("audit_retention_days", "1e9"),
    ("default_max_attempts", "1000000000000"),
    ("connect_timeout_seconds", "1"),
    ("statement_timeout_seconds", "0"),
    ("pass_lock_timeout_seconds", "inf"),
    ("shutdown_timeout_seconds", "0"),
    ("start_retry_seconds", "-1"),
    ("start_retry_seconds", "inf"),
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RECONCILER_* variable from the caller's shell leaks into these tests."""
    for name in list(os.environ):
        if name.upper().startswith("RECONCILER_"):
            monkeypatch.delenv(name)


def env_name(setting: str) -> str:
    """The environment variable of a setting."""
    return f"RECONCILER_{setting.upper()}"


class TestDefaults:
    """Every default is declared once, on the settings type."""

    def test_defaults(self) -> None:
        """With no flags and no environment every setting has its documented default."""
        assert load_settings().model_dump() == DEFAULTS

    def test_defaults_are_declared_on_the_type(self) -> None:
        """The settings type itself declares each default (no default lives elsewhere)."""
        declared = {name: field.default for name, field in Settings.model_fields.items()}
        assert declared == DEFAULTS

    def test_flags_not_given_leave_defaults(self) -> None:
        """A flag passed as None (not given on the command line) leaves the default."""
        assert load_settings(**dict.fromkeys(DEFAULTS)).model_dump() == DEFAULTS

    def test_defaults_are_consistent(self) -> None:
        """The default thresholds satisfy the cross-field rules (stale < wedged)."""
        settings = load_settings()
        assert settings.stale_after_seconds < settings.wedged_after_seconds
        assert settings.retry_backoff_seconds <= settings.retry_backoff_max_seconds
        assert settings.session_timeout_seconds >= 2 * settings.session_heartbeat_seconds

    def test_thresholds_carry_the_decision_table_settings(self) -> None:
        """Settings.thresholds() is how every caller builds the table's limits."""
        thresholds = load_settings(stale_after_seconds="10", wedged_after_seconds="20",
                                   crash_loop_after="4").thresholds()
        assert (thresholds.stale_after_seconds, thresholds.wedged_after_seconds,
                thresholds.crash_loop_after) == (10.0, 20.0, 4)
        assert load_settings().thresholds().crash_loop_after == 2

    def test_brake_limits_carry_the_brake_settings(self) -> None:
        """Settings.brake_limits() holds the three brake settings."""
        limits = load_settings(brake_min_jobs="5", brake_stale_fraction="0.9",
                               brake_hold_seconds="30").brake_limits()
        assert (limits.min_jobs, limits.stale_fraction, limits.hold_seconds) == (5, 0.9, 30.0)

    def test_settings_are_frozen(self) -> None:
        """Loaded settings cannot be changed afterwards."""
        settings = load_settings()
        with pytest.raises(ValidationError):
            settings.batch_size = 1


class TestPrecedence:
    """A flag beats RECONCILER_<NAME>, which beats the default."""

    @pytest.mark.parametrize(("setting", "text", "value"), GOOD_VALUES,
                             ids=[s for s, _, _ in GOOD_VALUES])
    def test_environment_overrides_default(self, setting: str, text: str, value: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """RECONCILER_<SETTING> replaces the default, parsed to the setting's type."""
        monkeypatch.setenv(env_name(setting), text)
        assert getattr(load_settings(), setting) == value

    @pytest.mark.parametrize(("setting", "text", "value"), GOOD_VALUES,
                             ids=[s for s, _, _ in GOOD_VALUES])
    def test_flag_text_is_parsed(self, setting: str, text: str, value: Any) -> None:
        """A flag's text is parsed to the setting's type, as the environment's is."""
        assert getattr(load_settings(**{setting: text}), setting) == value

    def test_environment_overrides_only_its_setting(self,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """Setting one variable changes that setting and leaves the others at default."""
        monkeypatch.setenv("RECONCILER_BATCH_SIZE", "42")
        assert load_settings().model_dump() == {**DEFAULTS, "batch_size": 42}

    def test_flag_beats_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An explicit value wins over RECONCILER_<SETTING>."""
        monkeypatch.setenv("RECONCILER_BATCH_SIZE", "10")
        monkeypatch.setenv("RECONCILER_DATABASE_URL", "sqlite:///from-env.db")
        settings = load_settings(batch_size="20", database_url="sqlite:///from-flag.db")
        assert (settings.batch_size, settings.database_url) == (20, "sqlite:///from-flag.db")

    def test_flag_not_given_falls_back_to_environment(self,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """A flag passed as None lets RECONCILER_<SETTING> through."""
        monkeypatch.setenv("RECONCILER_METRICS_PORT", "9999")
        assert load_settings(metrics_port=None).metrics_port == 9999

    def test_flags_and_environment_combine(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Settings from flags and from the environment are validated together."""
        monkeypatch.setenv("RECONCILER_STALE_AFTER_SECONDS", "100")
        settings = load_settings(wedged_after_seconds="200")
        assert (settings.stale_after_seconds, settings.wedged_after_seconds) == (100.0, 200.0)


class TestInvalidSettings:
    """A bad setting raises ConfigError with one line naming the setting and its variable."""

    @pytest.mark.parametrize(("setting", "text"), BAD_VALUES,
                             ids=[f"{s}={t[:12]}" for s, t in BAD_VALUES])
    def test_bad_environment_value(self, setting: str, text: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """A bad RECONCILER_<SETTING> is refused in one line naming the setting and variable."""
        monkeypatch.setenv(env_name(setting), text)
        with pytest.raises(ConfigError) as caught:
            load_settings()
        message = str(caught.value)
        assert "\n" not in message
        assert setting in message
        assert env_name(setting) in message

    @pytest.mark.parametrize(("setting", "text"), BAD_VALUES,
                             ids=[f"{s}={t[:12]}" for s, t in BAD_VALUES])
    def test_bad_flag_value(self, setting: str, text: str) -> None:
        """A bad flag value is refused in the same one line as a bad variable."""
        with pytest.raises(ConfigError) as caught:
            load_settings(**{setting: text})
        message = str(caught.value)
        assert "\n" not in message
        assert setting in message
        assert env_name(setting) in message

    def test_error_shows_the_bad_value(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The error line quotes the value that was refused."""
        monkeypatch.setenv("RECONCILER_METRICS_PORT", "70000")
        with pytest.raises(ConfigError, match="70000"):
            load_settings()

    def test_value_with_a_newline_still_gives_one_line(self) -> None:
        """A refused value containing a newline is quoted, so the error stays one line."""
        with pytest.raises(ConfigError) as caught:
            load_settings(batch_size="12\n34")
        assert "\n" not in str(caught.value)

    def test_config_error_is_not_a_traceback_exit(self) -> None:
        """ConfigError carries a non-zero exit code for the CLI."""
        assert ConfigError.exit_code != 0

    def test_validation_error_does_not_leak(self) -> None:
        """load_settings raises ConfigError, not pydantic's multi-line ValidationError."""
        with pytest.raises(ConfigError) as caught:
            load_settings(batch_size="0")
        assert not isinstance(caught.value, ValidationError)
        assert caught.value.__cause__ is None
        assert caught.value.__suppress_context__

    def test_error_points_only_at_flags_the_cli_accepts(self) -> None:
        """A bad setting's error line names a command-line flag only if some command has it."""
        accepted = cli_option_strings(build_parser())
        misleading = []
        for setting in DEFAULTS:
            with pytest.raises(ConfigError) as caught:
                load_settings(**{setting: []})
            flag = f"--{setting.replace('_', '-')}"
            if flag in str(caught.value) and flag not in accepted:
                misleading.append(str(caught.value))
        assert misleading == []


def cli_option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of a parser and, recursively, of its subcommands."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= cli_option_strings(sub)
    return found


class TestCrossFieldRules:
    """Settings that only make sense together are checked together."""

    @pytest.mark.parametrize(("stale", "wedged"), [("60", "60"), ("60", "30"), ("100", "99.9")])
    def test_wedged_must_exceed_stale(self, stale: str, wedged: str) -> None:
        """wedged_after_seconds <= stale_after_seconds is refused in one line naming both."""
        with pytest.raises(ConfigError) as caught:
            load_settings(stale_after_seconds=stale, wedged_after_seconds=wedged)
        message = str(caught.value)
        assert "\n" not in message
        assert "wedged_after_seconds" in message
        assert "stale_after_seconds" in message

    def test_wedged_below_default_stale_is_refused(self,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """Lowering only RECONCILER_WEDGED_AFTER_SECONDS below the default stale is refused."""
        monkeypatch.setenv("RECONCILER_WEDGED_AFTER_SECONDS", "30")
        with pytest.raises(ConfigError, match="wedged_after_seconds"):
            load_settings()

    def test_backoff_cap_must_not_be_below_first_delay(self) -> None:
        """retry_backoff_max_seconds < retry_backoff_seconds is refused in one line."""
        with pytest.raises(ConfigError) as caught:
            load_settings(retry_backoff_seconds="10", retry_backoff_max_seconds="5")
        message = str(caught.value)
        assert "\n" not in message
        assert "retry_backoff_max_seconds" in message

    @pytest.mark.parametrize(("timeout", "heartbeat"), [("9", "5"), ("5", "5"), ("1", "5")])
    def test_session_timeout_must_cover_two_heartbeats(self, timeout: str,
                                                       heartbeat: str) -> None:
        """A session timeout shorter than two heartbeats is refused in one line naming both."""
        with pytest.raises(ConfigError) as caught:
            load_settings(session_timeout_seconds=timeout, session_heartbeat_seconds=heartbeat)
        message = str(caught.value)
        assert "\n" not in message
        assert "session_timeout_seconds" in message
        assert "session_heartbeat_seconds" in message

    def test_session_timeout_of_exactly_two_heartbeats_is_accepted(self) -> None:
        """A session timeout of exactly two heartbeats is allowed."""
        settings = load_settings(session_timeout_seconds="10", session_heartbeat_seconds="5")
        assert settings.session_timeout_seconds == 10.0

    def test_equal_backoff_and_cap_are_accepted(self) -> None:
        """A cap equal to the first delay is allowed (constant backoff)."""
        settings = load_settings(retry_backoff_seconds="5", retry_backoff_max_seconds="5")
        assert settings.retry_backoff_max_seconds == 5.0


class TestUnknownSettings:
    """Misspelled settings are refused, not silently ignored."""

    def test_unknown_key_is_refused(self) -> None:
        """A setting the type does not declare raises ConfigError naming it."""
        with pytest.raises(ConfigError) as caught:
            load_settings(batch_sise="10")
        message = str(caught.value)
        assert "batch_sise" in message
        assert "\n" not in message

    def test_unknown_key_given_as_none_is_ignored(self) -> None:
        """An absent flag (None) is not a setting at all, whatever its name."""
        assert load_settings(verbose=None).model_dump() == DEFAULTS


class TestDerivedPassTimeouts:
    """Issue 12: a pass's statement and lock timeouts follow the interval unless given."""

    def test_derived_from_the_interval_with_floors(self) -> None:
        """interval, at least 10 s; half of it, at least 5 s."""
        assert load_settings().pass_timeouts == (30.0, 15.0)
        assert load_settings(interval_seconds="0.3").pass_timeouts == (10.0, 5.0)
        assert load_settings(interval_seconds="120").pass_timeouts == (120.0, 60.0)

    def test_given_values_win(self) -> None:
        """Set explicitly, the pass timeouts are what was set."""
        settings = load_settings(pass_statement_timeout_seconds=2.0,
                                 pass_lock_timeout_seconds=0.5)
        assert settings.pass_timeouts == (2.0, 0.5)


class TestDatabaseUrlFile:
    """Issue 14: the URL (and its password) from a file, e.g. a Kubernetes secret."""

    def test_the_file_gives_the_url(self, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """RECONCILER_DATABASE_URL_FILE names a file holding the URL (trailing newline ok)."""
        secret = tmp_path / "database-url"
        secret.write_text("postgresql+psycopg://rec:Hunter2Secret@db/jobs\n")
        monkeypatch.setenv("RECONCILER_DATABASE_URL_FILE", str(secret))
        assert load_settings().database_url == "postgresql+psycopg://rec:Hunter2Secret@db/jobs"

    def test_both_url_and_file_are_refused(self, tmp_path: Path) -> None:
        """A URL and a URL file at once is ambiguous: one line naming both."""
        secret = tmp_path / "database-url"
        secret.write_text("sqlite:///a.db")
        with pytest.raises(ConfigError) as caught:
            load_settings(database_url="sqlite:///b.db", database_url_file=str(secret))
        assert "database_url_file" in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_a_missing_file_is_one_line_naming_it(self, tmp_path: Path) -> None:
        """A file that cannot be read: one line with the path and why."""
        with pytest.raises(ConfigError) as caught:
            load_settings(database_url_file=str(tmp_path / "nope"))
        message = str(caught.value)
        assert "nope" in message
        assert "No such file" in message
        assert "\n" not in message


class TestConsoleTokenFile:
    """Issue 20: the console token from a file, read like the database URL file."""

    def test_the_file_gives_the_token(self, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """RECONCILER_CONSOLE_TOKEN_FILE names a file holding the token."""
        secret = tmp_path / "console-token"
        token = "Tok3n-from-a-file"  # noqa: S105 - a test's own token
        secret.write_text(token + "\n")
        monkeypatch.setenv("RECONCILER_CONSOLE_TOKEN_FILE", str(secret))
        assert load_settings().console_token == token

    def test_token_and_file_are_refused_together_and_a_bad_token_stays_hidden(
        self, tmp_path: Path
    ) -> None:
        """Both at once is one line naming the file setting; an invalid token is not
        echoed back."""
        secret = tmp_path / "console-token"
        secret.write_text("a")
        with pytest.raises(ConfigError) as caught:
            load_settings(console_token="b",  # noqa: S106 - a test's own token
                          console_token_file=str(secret))
        assert "console_token_file" in str(caught.value)
        with pytest.raises(ConfigError) as too_long:
            load_settings(console_token="Secr3t" * 100)
        assert "Secr3t" not in str(too_long.value)
        assert "<hidden>" in str(too_long.value)


class TestOperatorTokensFile:
    """Issue 27: the console's operators from a file of ``NAME TOKEN`` lines."""

    def test_the_file_names_each_operator(self, tmp_path: Path) -> None:
        """Lines of a name and a token (comments and blank lines skipped)."""
        tokens = tmp_path / "operators"
        tokens.write_text("# who may act\nalice  alice-token-0123456789\n\n"
                          "bob.k@ops bob-token-0123456789abc\n")
        settings = load_settings(console_operator_tokens_file=str(tokens))
        assert settings.operator_tokens == {"alice": "alice-token-0123456789",
                                            "bob.k@ops": "bob-token-0123456789abc"}
        assert load_settings().operator_tokens == {}

    @pytest.mark.parametrize(("content", "expected"), [
        ("alice\n", "line 1: expected NAME TOKEN"),
        ("alice tok en-0123456789abcdef\n", "line 1: expected NAME TOKEN"),
        ("al:ice alice-token-0123456789\n", "line 1: a name is"),
        ("alice short\n", "line 1: a token is 16 to 500"),
        ("alice alice-token-0123456789\nalice other-token-0123456789\n", "line 2: the name"),
        ("# nobody\n", "names no operator"),
    ])
    def test_a_bad_file_is_one_line_naming_the_line_never_the_token(
        self, tmp_path: Path, content: str, expected: str
    ) -> None:
        """Each mistake is one line with the file and line; no token is echoed."""
        tokens = tmp_path / "operators"
        tokens.write_text(content)
        with pytest.raises(ConfigError) as caught:
            load_settings(console_operator_tokens_file=str(tokens))
        message = str(caught.value)
        assert expected in message
        assert str(tokens) in message
        assert "\n" not in message
        assert "0123456789" not in message

    def test_a_missing_file_and_a_shared_token_are_refused(self, tmp_path: Path) -> None:
        """An unreadable file says why; the read-only token cannot also be an operator's."""
        with pytest.raises(ConfigError) as missing:
            load_settings(console_operator_tokens_file=str(tmp_path / "nope"))
        assert "No such file" in str(missing.value)
        tokens = tmp_path / "operators"
        tokens.write_text("alice alice-token-0123456789\n")
        with pytest.raises(ConfigError) as shared:
            load_settings(console_operator_tokens_file=str(tokens),
                          console_token="alice-token-0123456789")  # noqa: S106
        assert "only reads" in str(shared.value)
        assert "alice-token" not in str(shared.value)


class TestUnknownVariables:
    """Issue 14: a mistyped RECONCILER_* variable is named, with the closest setting."""

    def test_a_misspelled_variable_is_named_with_the_closest_setting(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """RECONCILER_BATCHSIZE=10 warns "did you mean RECONCILER_BATCH_SIZE" and changes
        nothing."""
        monkeypatch.setenv("RECONCILER_BATCHSIZE", "10")
        with caplog.at_level(logging.WARNING, logger="reconciler.settings"):
            settings = load_settings()
        assert settings.batch_size == 500
        (record,) = [r for r in caplog.records if "RECONCILER_BATCHSIZE" in r.getMessage()]
        assert "did you mean RECONCILER_BATCH_SIZE?" in record.getMessage()

    def test_our_other_variables_are_not_settings_but_not_unknown(self) -> None:
        """The test suite's and the harness's own variables draw no warning."""
        environ = {"RECONCILER_TEST_PG_DSN": "x", "RECONCILER_FAILPOINTS": "x",
                   "RECONCILER_BATCH_SIZE": "1", "RECONCILER_INTERVALSECONDS": "1"}
        assert unknown_variables(environ) == [
            ("RECONCILER_INTERVALSECONDS", "RECONCILER_INTERVAL_SECONDS")]


def test_the_settings_type_is_built_from_the_plain_declarations() -> None:
    """``Settings`` has exactly the declared fields, in their order, each with its declared
    default and help, a switch where the declaration's default is true or false."""
    assert list(Settings.model_fields) == [spec.name for spec in SETTING_FIELDS]
    for spec in SETTING_FIELDS:
        field = Settings.model_fields[spec.name]
        assert (field.default, field.description) == (spec.default, spec.description)
        assert (field.annotation is bool) == spec.is_switch, spec.name
