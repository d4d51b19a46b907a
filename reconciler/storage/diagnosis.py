"""What a database error means, as a bounded code and one redacted line.

The service logs and exposes the code (``reconciler_pass_errors_total{code}``, the
``error_code`` of an error pass, ``/readyz``); the line is the driver's first line with
passwords hidden, for the log and ``/readyz`` only (never a metric label).
"""

from __future__ import annotations

import re
import sqlite3
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError

from reconciler.core.conflicts import TransactionConflict
from reconciler.core.vocabulary import DatabaseErrorCode
from reconciler.errors import DatabaseUnavailableError, SchemaOutOfDateError
from reconciler.redaction import redact

if TYPE_CHECKING:
    import psycopg

LINE_LIMIT = 200

# PostgreSQL's refusals at connection time, which reach libpq as text only.
_NO_SUCH_ROLE = re.compile(r'FATAL:\s+role ".*" does not exist')
_NO_SUCH_DATABASE = re.compile(r'FATAL:\s+database ".*" does not exist')

# PostgreSQL SQLSTATE (or its two-character class) -> code; the first match wins.
_SQLSTATES: tuple[tuple[str, DatabaseErrorCode], ...] = (
    ("57014", DatabaseErrorCode.TIMEOUT),             # query_canceled: statement_timeout
    ("55P03", DatabaseErrorCode.LOCK_TIMEOUT),        # lock_not_available: lock_timeout
    ("25006", DatabaseErrorCode.READ_ONLY),           # read_only_sql_transaction
    ("42501", DatabaseErrorCode.PERMISSION_DENIED),   # insufficient_privilege
    ("42P01", DatabaseErrorCode.SCHEMA_MISMATCH),     # undefined_table
    ("42703", DatabaseErrorCode.SCHEMA_MISMATCH),     # undefined_column
    ("42883", DatabaseErrorCode.SCHEMA_MISMATCH),     # undefined_function
    ("3D000", DatabaseErrorCode.NO_SUCH_DATABASE),   # invalid_catalog_name
    ("53100", DatabaseErrorCode.DISK_FULL),
    ("53300", DatabaseErrorCode.TOO_MANY_CONNECTIONS),
    ("57P0", DatabaseErrorCode.UNREACHABLE),          # admin/crash shutdown, cannot connect now
    ("08", DatabaseErrorCode.UNREACHABLE),            # connection exceptions
    ("28", DatabaseErrorCode.AUTHENTICATION_FAILED),  # invalid authorization
    ("40", DatabaseErrorCode.CONFLICT),               # serialization failure, deadlock
    ("22", DatabaseErrorCode.INVALID_DATA),
    ("23", DatabaseErrorCode.INVALID_DATA),
)
# SQLite reports by message only; lower-case fragments -> code.
_SQLITE_MESSAGES: tuple[tuple[str, DatabaseErrorCode], ...] = (
    ("readonly database", DatabaseErrorCode.READ_ONLY),
    ("read-only", DatabaseErrorCode.READ_ONLY),
    ("database is locked", DatabaseErrorCode.LOCK_TIMEOUT),
    ("table is locked", DatabaseErrorCode.LOCK_TIMEOUT),
    ("unable to open database", DatabaseErrorCode.UNREACHABLE),
    ("disk i/o error", DatabaseErrorCode.UNREACHABLE),
    ("no such table", DatabaseErrorCode.SCHEMA_MISMATCH),
    ("no such column", DatabaseErrorCode.SCHEMA_MISMATCH),
    ("database or disk is full", DatabaseErrorCode.DISK_FULL),
    ("authorization denied", DatabaseErrorCode.PERMISSION_DENIED),
    ("interrupted", DatabaseErrorCode.TIMEOUT),
)
# MySQL and MariaDB error numbers -> code.
_MYSQL_ERRORS: dict[int, DatabaseErrorCode] = {
    1205: DatabaseErrorCode.LOCK_TIMEOUT,          # ER_LOCK_WAIT_TIMEOUT
    1213: DatabaseErrorCode.CONFLICT,              # ER_LOCK_DEADLOCK
    1969: DatabaseErrorCode.TIMEOUT,               # MariaDB: max_statement_time
    3024: DatabaseErrorCode.TIMEOUT,               # MySQL: max_execution_time
    1792: DatabaseErrorCode.READ_ONLY,             # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
    1290: DatabaseErrorCode.READ_ONLY,             # --read-only server
    1142: DatabaseErrorCode.PERMISSION_DENIED,     # ER_TABLEACCESS_DENIED_ERROR
    1044: DatabaseErrorCode.PERMISSION_DENIED,     # ER_DBACCESS_DENIED_ERROR
    1045: DatabaseErrorCode.AUTHENTICATION_FAILED,  # ER_ACCESS_DENIED_ERROR
    1146: DatabaseErrorCode.SCHEMA_MISMATCH,       # ER_NO_SUCH_TABLE
    1054: DatabaseErrorCode.SCHEMA_MISMATCH,       # ER_BAD_FIELD_ERROR
    1305: DatabaseErrorCode.SCHEMA_MISMATCH,       # ER_SP_DOES_NOT_EXIST
    1049: DatabaseErrorCode.NO_SUCH_DATABASE,      # ER_BAD_DB_ERROR
    1114: DatabaseErrorCode.DISK_FULL,             # ER_RECORD_FILE_FULL
    1040: DatabaseErrorCode.TOO_MANY_CONNECTIONS,  # ER_CON_COUNT_ERROR
    2003: DatabaseErrorCode.UNREACHABLE,           # CR_CONN_HOST_ERROR
    2006: DatabaseErrorCode.UNREACHABLE,           # CR_SERVER_GONE_ERROR
    2013: DatabaseErrorCode.UNREACHABLE,           # CR_SERVER_LOST
    1062: DatabaseErrorCode.INVALID_DATA,          # ER_DUP_ENTRY
    1452: DatabaseErrorCode.INVALID_DATA,          # ER_NO_REFERENCED_ROW_2
    1406: DatabaseErrorCode.INVALID_DATA,          # ER_DATA_TOO_LONG
}


def error_code(exc: BaseException) -> DatabaseErrorCode:
    """The bounded code for an error raised while talking to the database."""
    if isinstance(exc, SchemaOutOfDateError):
        return DatabaseErrorCode.SCHEMA_MISMATCH
    if isinstance(exc, DatabaseUnavailableError):
        return DatabaseErrorCode(exc.code)
    if isinstance(exc, TransactionConflict):  # deadlocked on every attempt
        return DatabaseErrorCode.CONFLICT
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    # psycopg is imported only by a PostgreSQL engine: with none loaded, no error is its.
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(orig, psycopg.Error):
        return _psycopg_code(psycopg, orig)
    pymysql = sys.modules.get("pymysql")
    if pymysql is not None and isinstance(orig, pymysql.err.MySQLError):
        number = orig.args[0] if orig.args and isinstance(orig.args[0], int) else None
        return _MYSQL_ERRORS.get(number, DatabaseErrorCode.OTHER) if number else (
            DatabaseErrorCode.UNREACHABLE if isinstance(orig, pymysql.err.OperationalError)
            else DatabaseErrorCode.OTHER)
    if isinstance(orig, sqlite3.Error):
        message = str(orig).lower()
        return next((code for fragment, code in _SQLITE_MESSAGES if fragment in message),
                    DatabaseErrorCode.OTHER)
    return DatabaseErrorCode.OTHER


def _psycopg_code(psycopg: ModuleType, orig: psycopg.Error) -> DatabaseErrorCode:
    """The code of a psycopg error (``psycopg``: the driver, already loaded)."""
    # Loaded with the driver by the engine that raised ``orig``; imported here so that
    # reading an error on SQLite never loads psycopg.
    from reconciler.storage.answering import DatabaseNotAnsweringError  # noqa: PLC0415

    if isinstance(orig, DatabaseNotAnsweringError):
        return DatabaseErrorCode.NO_ANSWER
    if isinstance(orig, psycopg.errors.ConnectionTimeout):
        return DatabaseErrorCode.UNREACHABLE
    state = orig.sqlstate
    if state is None:
        # No SQLSTATE: refused at connection time, or no server to talk to at all. The
        # server's refusals are told apart by its message (libpq passes no code for them).
        message = str(orig)
        if "authentication failed" in message or _NO_SUCH_ROLE.search(message):
            return DatabaseErrorCode.AUTHENTICATION_FAILED
        if _NO_SUCH_DATABASE.search(message):
            return DatabaseErrorCode.NO_SUCH_DATABASE
        return (DatabaseErrorCode.UNREACHABLE if isinstance(orig, psycopg.OperationalError)
                else DatabaseErrorCode.OTHER)
    return next((code for prefix, code in _SQLSTATES if state.startswith(prefix)),
                DatabaseErrorCode.OTHER)


def error_line(exc: BaseException) -> str:
    """The driver's first line of ``exc``, passwords hidden, at most LINE_LIMIT characters."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    lines = str(orig).strip().splitlines()
    first = lines[0].strip() if lines else type(orig).__name__
    first = redact(first)
    return first if len(first) <= LINE_LIMIT else first[:LINE_LIMIT - 3] + "..."
