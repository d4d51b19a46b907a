"""The result tables the celery source reads and writes, each a small typed description.

Two backends keep a task's state in a table, each in its own shape:

- **Celery's database backend** (``result_backend = "db+..."``): ``celery_taskmeta``, or
  the name its ``database_table_names`` setting gives it. ``args`` / ``kwargs`` are the
  call's own arguments as the result serializer encoded them (bytes); ``retries`` and
  ``queue`` are stored; ``date_done`` stays NULL until a ready state; ``result`` is bytes.
- **django-celery-results** (``result_backend = "django-db"``):
  ``django_celery_results_taskresult``. ``task_args`` / ``task_kwargs`` hold the message's
  ``argsrepr`` / ``kwargsrepr`` (a Python ``repr`` of the arguments, cut past
  ``argsrepr_maxsize``, or whatever the caller chose to show instead) encoded by the
  serializer; no retry count and no queue are stored; ``date_done`` is Django's
  ``auto_now``, stamped by every save (``STARTED`` included), so it changes with each
  write of the row; ``result`` is text, its ``content_type`` / ``content_encoding`` beside.

What the source does differently on each is read from the ``ResultTable`` that
``shape_for`` picks by the configured table name, here and nowhere else.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Any

import sqlalchemy as sa

from reconciler.sources.kit.shapes import constant
from reconciler.storage.audit import AuditHistory
from reconciler.storage.clock import db_now
from reconciler.storage.step_ledger import PassLedger

EXCEPTION_MODULE, EXCEPTION_TYPE = "billiard.exceptions", "WorkerLostError"
"""What a recovered task's result names: Celery's own exception for a worker lost
mid-task, importable wherever Celery is (billiard is its dependency)."""

DJANGO_TABLE = "django_celery_results_taskresult"
ARGSREPR_MAXSIZE = 1024
"""Celery's ``argsrepr_maxsize`` / ``kwargsrepr_maxsize``: a longer repr is cut (and
``'...'`` added), so a repr this long may not be the whole call."""
_CUT_MARGIN = 32
"""A cut repr ends a few characters past the limit, a whole one as many before it: any
repr this close to the limit is taken for a cut one."""


class ArgsFormat(StrEnum):
    """How a table stores a task's arguments."""

    SERIALIZED = "serialized"
    """The arguments themselves, as the result serializer (JSON) encoded them."""
    REPR = "repr"
    """The message's ``argsrepr`` / ``kwargsrepr`` text, encoded by the serializer."""


@dataclass(frozen=True, slots=True)
class ResultTable:
    """One result table's shape: its column names and how its values are written."""

    name_column: str
    args_column: str
    kwargs_column: str
    retries_column: str | None
    """None: the table keeps no retry count (attempts come from the audit and ledger)."""
    queue_column: str | None
    """None: the table keeps no queue (a re-publish goes where ``task_routes`` says)."""
    created_column: str | None
    args_format: ArgsFormat
    text_result: bool
    """``result`` is a text column (with ``content_type`` / ``content_encoding``)."""
    stamps_every_write: bool
    """``date_done`` changes with every write of the row: a fence repeats it as read, and
    a RETRY carries one as the backend's own retry does."""

    def columns(self) -> tuple[str, ...]:
        """Every column the source reads or writes, as the table names them."""
        # ``id``: both backends' autoincrement key, the order rows were first written in.
        named = ("id", "task_id", "status", "result", "date_done", "traceback", "worker",
                 self.name_column, self.args_column, self.kwargs_column,
                 self.retries_column, self.queue_column, self.created_column)
        content = ("content_type", "content_encoding") if self.text_result else ()
        return tuple(c for c in (*named, *content) if c is not None)


CELERY_TASKMETA = ResultTable(
    name_column="name", args_column="args", kwargs_column="kwargs", retries_column="retries",
    queue_column="queue", created_column=None, args_format=ArgsFormat.SERIALIZED,
    text_result=False, stamps_every_write=False)
DJANGO_CELERY_RESULTS = ResultTable(
    name_column="task_name", args_column="task_args", kwargs_column="task_kwargs",
    retries_column=None, queue_column=None, created_column="date_created",
    args_format=ArgsFormat.REPR, text_result=True, stamps_every_write=True)


def shape_for(table: str) -> ResultTable:
    """django-celery-results' table by its fixed name; any other is Celery's own table
    (its ``database_table_names`` may rename it)."""
    return DJANGO_CELERY_RESULTS if table == DJANGO_TABLE else CELERY_TASKMETA


class ResultRows:
    """A result table's columns as SQL, by what they mean (``name`` is the task name
    whatever the table calls it); ``retries``, ``queue`` and ``created`` may be None."""

    __slots__ = ("args", "created", "kwargs", "name", "queue", "retries", "shape", "sql_table")

    def __init__(self, table: str, shape: ResultTable) -> None:
        self.shape = shape
        self.sql_table = sa.table(table, *(sa.column(c) for c in shape.columns()))
        c = self.sql_table.c
        self.name, self.args, self.kwargs = (c[shape.name_column], c[shape.args_column],
                                             c[shape.kwargs_column])
        self.retries = None if shape.retries_column is None else c[shape.retries_column]
        self.queue = None if shape.queue_column is None else c[shape.queue_column]
        self.created = None if shape.created_column is None else c[shape.created_column]

    def attempt_columns(self, ledger: PassLedger, audit: AuditHistory
                        ) -> list[sa.ColumnElement[Any]]:
        """``retries`` as stored; or, where the table keeps none, the reconciler's own
        applied resumes of the task (``resumed``) and the step ledger's newest attempt
        (``ledger_attempt``), read with the row through their stores."""
        if self.retries is not None:
            return [self.retries.label("retries")]
        task_id = self.sql_table.c.task_id
        return [audit.resumes_counted(task_id).label("resumed"),
                ledger.newest_attempt(task_id).label("ledger_attempt")]

    def written(self, reason: str, *, resume: bool) -> dict[Any, Any]:
        """The values of a RETRY or FAILURE row the reconciler writes, as this table's
        backend writes its own."""
        c = self.sql_table.c
        result = exception_result(reason)
        values: dict[Any, Any] = {
            c.status: constant("RETRY" if resume else "FAILURE"),
            c.traceback: failure_traceback(reason),
            # Celery's backend leaves a RETRY undated; Django's auto_now dates every save.
            c.date_done: sa.null() if resume and not self.shape.stamps_every_write
            else db_now()}
        if self.shape.text_result:
            values |= {c.result: result, c.content_type: "application/json",
                       c.content_encoding: "utf-8"}
        else:
            values[c.result] = result.encode()
        return values


def queue_for(task_name: str, routes: Mapping[str, str], default: str) -> str:
    """The queue a task goes to by the app's ``task_routes`` globs (the first that
    matches), else ``task_default_queue``: for a table that keeps no queue."""
    return next((queue for glob, queue in routes.items() if fnmatchcase(task_name, glob)),
                default)


def attempt_of(row: Any, shape: ResultTable) -> int:
    """The running attempt: ``retries + 1``; where the table keeps no count, one past the
    reconciler's own resumes of it, or the ledger's attempt when the task counted more
    (its own ``self.retry()``)."""
    if shape.retries_column is not None:
        return (0 if row.retries is None else int(row.retries)) + 1
    return max(int(row.resumed or 0) + 1, int(row.ledger_attempt or 0))


def retries_of(row: Any, shape: ResultTable) -> int | None:
    """The row's ``retries`` as read (a fenced value), None where the table keeps none."""
    if shape.retries_column is None or row.retries is None:
        return None
    return int(row.retries)


def call_arguments(args: bytes | str | None, kwargs: bytes | str | None,
                   shape: ResultTable) -> tuple[list[Any], dict[str, Any]] | None:
    """The task's args and kwargs as they were sent; None when the table does not hold them
    faithfully (a cut or custom repr, values JSON cannot carry): such a task cannot be
    re-published."""
    try:
        found = _decoded(args, shape, []), _decoded(kwargs, shape, {})
        # What send_task will carry: JSON, as the app's task_serializer.
        positional, named = json.loads(json.dumps(found[0])), json.loads(json.dumps(found[1]))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(positional, list) or not isinstance(named, dict):
        return None
    return positional, named


def _decoded(raw: bytes | str | None, shape: ResultTable, empty: Any) -> Any:
    if raw is None:
        return empty
    stored = json.loads(raw if isinstance(raw, str) else bytes(raw).decode())
    if shape.args_format is ArgsFormat.SERIALIZED:
        return stored
    if not isinstance(stored, str) or len(stored) > ARGSREPR_MAXSIZE - _CUT_MARGIN:
        raise ValueError("not a whole repr")
    value = ast.literal_eval(stored)
    # Celery's saferepr writes strings unescaped ('a\\b' as 'a\b'): only a repr that
    # reads back to itself is the call's own arguments.
    from celery.utils.saferepr import saferepr  # noqa: PLC0415 - only this source needs it

    if saferepr(value, ARGSREPR_MAXSIZE) != stored:
        raise ValueError("a repr that does not read back")
    return value


def exception_result(reason: str) -> str:
    """The ``result`` of a RETRY or FAILURE row, as Celery's JSON serializer writes an
    exception (``prepare_exception``)."""
    message = f"{reason} (stale-claim-reconciler: the worker running this task is gone)"
    return json.dumps({"exc_type": EXCEPTION_TYPE, "exc_message": [message],
                       "exc_module": EXCEPTION_MODULE})


def failure_traceback(reason: str) -> str:
    """The ``traceback`` of a RETRY or FAILURE row the reconciler wrote."""
    return f"{EXCEPTION_MODULE}.{EXCEPTION_TYPE}: {reason}\n"
