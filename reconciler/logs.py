"""Structured logs: one event per line, ``key=value`` pairs (logfmt)."""

from __future__ import annotations

import json
import logging
import sys
import time

from reconciler.redaction import redact


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=... logger=... event=... key=value``; never more than one line, never
    a database password (every line goes through ``redact``)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        message = record.getMessage().replace("\n", " ").replace("\r", " ")
        if not message.startswith("event="):
            message = f"event=message text={json.dumps(message)}"
        line = (f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
                f"logger={record.name} {message}")
        if record.exc_info and record.exc_info[0] is not None:
            line += f" error={record.exc_info[0].__name__}"
        return redact(line)


class RedactingFormatter(logging.Formatter):
    """The plain formatter of ``--verbose`` (tracebacks included), passwords hidden."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(verbose: bool = False, level: int = logging.INFO) -> None:
    """Send logfmt lines to stderr; ``verbose`` adds debug lines and tracebacks."""
    handler = logging.StreamHandler(sys.stderr)
    formatter: logging.Formatter = (
        RedactingFormatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
        if verbose else LogfmtFormatter()
    )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else level)
    # Library chatter stays quiet: alembic's migration notes, APScheduler's per-run and
    # skipped-run lines (the service logs its own event=pass_overrun for the latter), and
    # psycopg's warning that a pipeline could not end on a lost connection (the command or
    # the pass says the database failed, with its code, in its own one line).
    for noisy, quiet_level in (("alembic", logging.WARNING), ("sqlalchemy", logging.WARNING),
                               ("apscheduler", logging.ERROR), ("psycopg", logging.ERROR)):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else quiet_level)
