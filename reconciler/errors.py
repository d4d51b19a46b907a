"""Errors that carry the one line a user sees; the CLI prints it and exits non-zero."""

from __future__ import annotations


class ReconcilerError(Exception):
    """Base of every error with a user-facing line."""

    exit_code = 1


class ConfigError(ReconcilerError):
    """A setting is missing or invalid."""

    exit_code = 2


class DatabaseUnavailableError(ReconcilerError):
    """The database cannot be reached."""

    exit_code = 3


class SchemaOutOfDateError(ReconcilerError):
    """The database schema is not at the version this code needs."""

    exit_code = 4


class NotFoundError(ReconcilerError):
    """A named job or record does not exist."""

    exit_code = 5


class ActionRefusedError(ReconcilerError):
    """An operator action does not apply to the job in its current state."""

    exit_code = 6


class LeaseLost(Exception):  # noqa: N818 - the public name in the worker contract
    """A fenced write matched no row: this claim is no longer the job's current claim.

    Nothing was changed. The job was reclaimed, finished, released or cancelled by someone
    else; the worker must stop working on it.
    """

    def __init__(self, job_id: int | str) -> None:
        super().__init__(f"job {job_id}: lease lost; the write was refused")
        self.job_id = job_id
