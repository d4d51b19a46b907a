"""The short codes shared across modules: statuses, states, dispositions, reasons."""

from __future__ import annotations

import re
from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    PROCESSING = "processing"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StepState(StrEnum):
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    WAITING = "waiting"


class EffectKind(StrEnum):
    PURE = "pure"
    IDEMPOTENT = "idempotent"
    EFFECTFUL = "effectful"


class Disposition(StrEnum):
    RESUME = "resume"
    TERMINALIZE = "terminalize"
    SKIP = "skip"


class Reason(StrEnum):
    """Every reason a decision can carry: the table's rules, then the pass's own outcomes."""

    OPERATOR_HOLD = "operator_hold"
    WORKER_WEDGED = "worker_wedged"
    LEASE_LIVE = "lease_live"
    RECENT_ACTIVITY = "recent_activity"
    UNRESUMABLE_PLAN = "unresumable_plan"
    WAITING_ON_GATE = "waiting_on_gate"
    COMPLETION_UNRECORDED = "completion_unrecorded"
    STEP_FAILED = "step_failed"
    WORKER_DIED_MID_STEP = "worker_died_mid_step"
    RESUME_EXHAUSTED = "resume_exhausted"
    RESUMED_IDEMPOTENT_STEP = "resumed_idempotent_step"
    RESUMED_FROM_UNSTARTED_STEP = "resumed_from_unstarted_step"
    FENCE_LOST = "fence_lost"
    RECONCILE_ERROR = "reconcile_error"


class AttemptOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    RETRYING = "retrying"
    RELEASED = "released"
    ABANDONED = "abandoned"
    LOST = "lost"


class PassOutcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    NOT_LEADER = "not_leader"


class DatabaseErrorCode(StrEnum):
    """Why a pass (or a probe) failed, as a bounded code: the ``error_code`` of an error pass,
    the ``code`` label of ``reconciler_pass_errors_total``, the ``code=`` of a log line."""

    UNREACHABLE = "unreachable"
    NO_ANSWER = "no_answer"
    AUTHENTICATION_FAILED = "authentication_failed"
    TIMEOUT = "timeout"
    LOCK_TIMEOUT = "lock_timeout"
    READ_ONLY = "read_only"
    PERMISSION_DENIED = "permission_denied"
    SCHEMA_MISMATCH = "schema_mismatch"
    DISK_FULL = "disk_full"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    CONFLICT = "conflict"
    INVALID_DATA = "invalid_data"
    OTHER = "other"


class WorkerStatusReason(StrEnum):
    """``status_reason`` values a worker's own writes set."""

    JOB_FAILED = "job_failed"
    RETRIES_EXHAUSTED = "retries_exhausted"


_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,63}$")


def short_code(value: str) -> str:
    """Validate an error code: a short identifier, never a message, path or identity."""
    if not isinstance(value, str) or not _CODE.match(value):
        raise ValueError(
            "error codes are short identifiers (a letter, then letters, digits, '_' or '.', "
            f"at most 64 characters), not messages: {value!r}"
        )
    return value
