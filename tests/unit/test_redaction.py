"""Passwords never shown, control characters never obeyed, database errors named by a code."""

from __future__ import annotations

import logging
import sqlite3

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from reconciler.core.vocabulary import DatabaseErrorCode
from reconciler.errors import DatabaseUnavailableError, SchemaOutOfDateError
from reconciler.logs import LogfmtFormatter
from reconciler.redaction import redact
from reconciler.storage.answering import DatabaseNotAnsweringError
from reconciler.storage.diagnosis import error_code, error_line
from reconciler.storage.engines import display_url
from reconciler.views import printable

SECRET = "Hunter2Secret"  # noqa: S105 - the value that must never show


class TestRedact:
    """``redact`` hides a password in every form it takes in a URL or a message."""

    @pytest.mark.parametrize("text", [
        f"postgresql+psycopg://rec:{SECRET}@db:5432/jobs",
        f"postgresql://rec:{SECRET}@db/jobs",
        f"postgresql+psycopg://rec@db/jobs?password={SECRET}",
        f"postgresql+psycopg://rec@db/jobs?sslmode=require&password={SECRET}&x=1",
        f"postgresql+psycopg:/rec:{SECRET}@h/db",                 # malformed: one slash
        f"postgresql+psycopg://rec:pa@ss#{SECRET}@127.0.0.1/db",  # an unescaped '@'
        f"postgresql+psycopg://rec:pa/ss{SECRET}@h/db",           # an unescaped '/'
        f"host=db port=5432 user=rec password={SECRET} dbname=jobs",
        f"host=db password='{SECRET} with spaces' dbname=jobs",
        f"sslpassword={SECRET}",
        f"PASSWORD={SECRET}",
        f'cannot reach the database at "postgresql://rec:{SECRET}@db/jobs": refused',
    ])
    def test_every_form_is_hidden(self, text: str) -> None:
        """The secret is gone and the mark is there."""
        shown = redact(text)
        assert SECRET not in shown, shown
        assert "***" in shown, shown

    def test_what_is_not_a_secret_stays(self) -> None:
        """Hosts, ports, users and ordinary text are left as they were."""
        text = ('connection to server at "127.0.0.1", port 5432 failed: password '
                "authentication failed for user \"rec\" (http://127.0.0.1:9464/readyz)")
        assert redact(text) == text
        assert redact("postgresql+psycopg://rec@db:5432/jobs") == \
            "postgresql+psycopg://rec@db:5432/jobs"

    def test_redacting_twice_changes_nothing_more(self) -> None:
        """A line already redacted keeps its punctuation when redacted again."""
        once = "cannot reach the database at postgresql://u@h/db?password=***: refused"
        assert redact(once) == once


class TestDisplayUrl:
    """``display_url`` shows a URL fit to print, or not at all when it cannot be parsed."""

    def test_both_password_forms_are_hidden(self) -> None:
        """user:pass@ and ?password= alike."""
        assert display_url(f"postgresql+psycopg://rec:{SECRET}@db/jobs") == \
            "postgresql+psycopg://rec:***@db/jobs"
        assert display_url(f"postgresql+psycopg://rec@db/jobs?password={SECRET}") == \
            "postgresql+psycopg://rec@db/jobs?password=***"

    @pytest.mark.parametrize("url", [f"postgresql+psycopg:/rec:{SECRET}@h/db",
                                     f"postgresql+psycopg://rec:{SECRET}@h:port/db",
                                     f"{SECRET}"])
    def test_an_unparseable_url_is_not_echoed(self, url: str) -> None:
        """Where the secret sits in a malformed URL is unknown: only the scheme shows."""
        shown = display_url(url)
        assert SECRET not in shown
        assert "unparseable" in shown


class TestPrintable:
    """Human output escapes what a terminal would obey."""

    @pytest.mark.parametrize(("raw", "shown"), [
        ("evil\n", "evil\\x0a"),
        ("\x1b[31mred", "\\x1b[31mred"),
        ("bell\x07", "bell\\x07"),
        ("del\x7f", "del\\x7f"),
        ("c1\x9b", "c1\\x9b"),
        ("rtl\u202eoverride", "rtl\\u202eoverride"),
        ("plain text, é and 東京", "plain text, é and 東京"),
    ])
    def test_controls_become_visible_escapes(self, raw: str, shown: str) -> None:
        """Each control character is shown as its escape; printable text is untouched."""
        assert printable(raw) == shown


class TestErrorCodes:
    """A failing pass is named by a bounded code derived from the driver's error."""

    @pytest.mark.parametrize(("exc", "code"), [
        (sqlite3.OperationalError("attempt to write a readonly database"), "read_only"),
        (sqlite3.OperationalError("database is locked"), "lock_timeout"),
        (sqlite3.OperationalError("unable to open database file"), "unreachable"),
        (sqlite3.OperationalError("no such table: job_runs"), "schema_mismatch"),
        (sqlite3.OperationalError("database or disk is full"), "disk_full"),
        (psycopg.errors.InsufficientPrivilege("permission denied"), "permission_denied"),
        (psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"),
         "lock_timeout"),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
         "timeout"),
        (psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE"), "read_only"),
        (psycopg.errors.UndefinedTable("relation does not exist"), "schema_mismatch"),
        (psycopg.errors.TooManyConnections("sorry"), "too_many_connections"),
        (psycopg.errors.SerializationFailure("could not serialize"), "conflict"),
        (psycopg.errors.NumericValueOutOfRange("out of range"), "invalid_data"),
        (psycopg.OperationalError("connection refused"), "unreachable"),
        (psycopg.OperationalError("password authentication failed for user"),
         "authentication_failed"),
        (psycopg.errors.ConnectionTimeout("connection timeout expired"), "unreachable"),
        (DatabaseNotAnsweringError("the database did not answer within 3s"), "no_answer"),
        (DatabaseUnavailableError("cannot reach"), "unreachable"),
        (SchemaOutOfDateError("old"), "schema_mismatch"),
        (ValueError("something else"), "other"),
    ], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
    def test_driver_errors_map_to_codes(self, exc: Exception, code: str) -> None:
        """Raw and wrapped (as SQLAlchemy raises them) alike."""
        assert error_code(exc) is DatabaseErrorCode(code)
        wrapped = OperationalError("SELECT 1", {}, exc)
        if isinstance(exc, (sqlite3.Error, psycopg.Error)):
            assert error_code(wrapped) is DatabaseErrorCode(code)

    def test_the_line_is_the_first_line_redacted_and_bounded(self) -> None:
        """Multi-line driver messages give their first line, without a password."""
        exc = psycopg.OperationalError(
            f"connection failed: postgresql://u:{SECRET}@h/db\nDETAIL: more\nHINT: x")
        assert error_line(exc) == "connection failed: postgresql://u:***@h/db"
        assert len(error_line(psycopg.OperationalError("x" * 1000))) == 200


class TestLogLines:
    """Every log line goes through the redaction, whatever put the URL there."""

    def test_a_url_in_a_log_message_is_redacted(self) -> None:
        """A message quoting a URL with a password is written without it."""
        record = logging.LogRecord("reconciler", logging.ERROR, __file__, 1,
                                   "event=x url=%s", (f"postgresql://u:{SECRET}@h/db",), None)
        line = LogfmtFormatter().format(record)
        assert SECRET not in line
        assert "url=postgresql://u:***@h/db" in line
