"""Errors that carry the one line a user sees; the CLI prints it and exits non-zero."""

from __future__ import annotations


class ReconcilerError(Exception):
    """Base of every error with a user-facing line."""

    exit_code = 1


class ConfigError(ReconcilerError):
    """A setting is missing or invalid."""

    exit_code = 2


class DatabaseUnavailableError(ReconcilerError):
    """The database cannot be reached, or refused this connection.

    ``code`` is the bounded code of what the database said (``unreachable`` when it said
    nothing); start-up gives up at once on one that waiting cannot clear
    (``DatabaseErrorCode.lasting``).
    """

    exit_code = 3

    def __init__(self, message: str, *, code: str = "unreachable"):
        super().__init__(message)
        self.code = code


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


class EffectInDoubt(LeaseLost):
    """A run of a job was opened while an effectful step that an earlier run started never
    finished, and no decision (a pass's or an operator's) has said it may run again: its
    effect may have happened, so this run is refused and records nothing.

    It is a ``LeaseLost``: the run must stop. The job system ran the job again by itself
    (its own retry, expiry or redelivery); the reconciler's pass ends the job with
    ``worker_died_mid_step``, and an operator who checked the effect can retry it.
    """

    def __init__(self, job_id: int | str, step_index: int, step_name: str) -> None:
        Exception.__init__(
            self, f"job {job_id}: step {step_index} ({step_name!r}, effectful) was started by "
                  "an earlier run that never finished it, so its effect may have happened; "
                  "this run is refused until the reconciler or an operator decides the job")
        self.job_id = job_id
        self.step_index = step_index
        self.step_name = step_name


LIVENESS_UNKNOWN_EXIT = 7
"""The exit code of a one-shot ``reconciler pass`` that ran but could not trust its
source's liveness evidence: nothing that depends on it was decided (its JSON and one line
on stderr name the code and the store), so a cron job running it is not green."""
