"""The short codes shared across modules: statuses, states, dispositions, reasons.

The one definition of every vocabulary: the schema's CHECK constraints (models/tables.py)
are built from these enums, so a code cannot exist in one and not the other.
"""

from __future__ import annotations

import re
from enum import StrEnum

JobKey = int | str
"""A job's id as its source spells it: opaque, compared for equality only."""


class JobStatus(StrEnum):
    """``job_runs.job_status``. ``waiting`` is in the public vocabulary (docs/data-model.md)
    but set by no release yet: a job waiting on a gate stays ``processing`` with its step
    ``waiting``, so its lease and the table keep watching it."""

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
    COMPLETION_RECOVERED = "completion_recovered"
    COMPLETION_UNRECORDED = "completion_unrecorded"
    STEP_FAILED = "step_failed"
    WORKER_DIED_MID_STEP = "worker_died_mid_step"
    CRASH_LOOP = "crash_loop"
    RESUME_EXHAUSTED = "resume_exhausted"
    RESUMED_IDEMPOTENT_STEP = "resumed_idempotent_step"
    RESUMED_FROM_UNSTARTED_STEP = "resumed_from_unstarted_step"
    FENCE_LOST = "fence_lost"
    RECONCILE_ERROR = "reconcile_error"
    MASS_STALENESS_BRAKE = "mass_staleness_brake"


class AttemptOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    RETRYING = "retrying"
    RELEASED = "released"
    ABANDONED = "abandoned"
    LOST = "lost"


class EndedBy(StrEnum):
    """Who ended an attempt."""

    WORKER = "worker"
    RECONCILER = "reconciler"
    OPERATOR = "operator"


class ArtifactState(StrEnum):
    STAGED = "staged"
    PUBLISHED = "published"
    DISCARDED = "discarded"


class OperatorAction(StrEnum):
    HOLD = "hold"
    UNHOLD = "unhold"
    RETRY = "retry"
    CANCEL = "cancel"


class ActionOutcome(StrEnum):
    APPLIED = "applied"
    REFUSED = "refused"


class SessionEndReason(StrEnum):
    """Why a worker session ended: a graceful stop, a restart under the same name, silence."""

    STOPPED = "stopped"
    REPLACED = "replaced"
    HEARTBEAT_LOST = "heartbeat_lost"


class PassOutcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    NOT_LEADER = "not_leader"
    LIVENESS_UNKNOWN = "liveness_unknown"
    """The pass ran, but its source could not read its owners' liveness, or has reason to
    doubt what it read: nothing that depends on liveness was decided."""


class LivenessDoubt(StrEnum):
    """Why a source's evidence of its owners' liveness was not trusted by a pass: the
    ``code`` of a ``liveness_unknown`` pass, log line and metric."""

    BROKER_UNREACHABLE = "broker_unreachable"
    """The broker that carries the liveness signal did not answer."""
    NO_WORKER_ANSWERS = "no_worker_answers"
    """The broker answered, but no worker at all did: a wrong broker, or a fleet that is
    down or cannot answer; silence proves nothing then."""
    QUEUES_MISSING = "queues_missing"
    """The broker holds none of the app's queues: not the app's broker (a wrong URL or
    database number)."""
    MIDDLEWARE_MISSING = "middleware_missing"
    """A gone worker held messages, and its app runs without the reconciler's middleware
    (Dramatiq): a message it started cannot be told from one it only prefetched."""


class StuckReason(StrEnum):
    """What held back a running job past its threshold that the last pass did not act on:
    the ``reason`` label of the stale-claim gauges."""

    AWAITING_DECISION = "awaiting_decision"
    """Its lease expired (or its owner is gone); no pass has reached it yet."""
    MASS_STALENESS_BRAKE = "mass_staleness_brake"
    OPERATOR_HOLD = "operator_hold"
    WAITING_ON_GATE = "waiting_on_gate"
    RECONCILE_ERROR = "reconcile_error"
    """Its evidence could not be read."""
    UNDECIDABLE = "undecidable"
    """The source cannot judge the row at all (a Celery row written without
    ``result_extended``)."""
    LIVENESS_UNKNOWN = "liveness_unknown"
    """Its owner's liveness could not be read or was doubted (see ``LivenessDoubt``)."""


class DatabaseErrorCode(StrEnum):
    """Why a pass (or a probe) failed, as a bounded code: the ``error_code`` of an error pass,
    the ``code`` label of ``reconciler_pass_errors_total``, the ``code=`` of a log line."""

    UNREACHABLE = "unreachable"
    NO_ANSWER = "no_answer"
    AUTHENTICATION_FAILED = "authentication_failed"
    NO_SUCH_DATABASE = "no_such_database"
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

    @property
    def database_answered(self) -> bool:
        """False when the error says the database cannot be talked to right now (writing
        down that failure there would only wait again)."""
        return self not in (DatabaseErrorCode.UNREACHABLE, DatabaseErrorCode.NO_ANSWER)

    @property
    def lasting(self) -> bool:
        """True when waiting cannot clear it: a password or role refused, no such
        database, a privilege not granted. Start-up gives up at once on these."""
        return self in (DatabaseErrorCode.AUTHENTICATION_FAILED,
                        DatabaseErrorCode.NO_SUCH_DATABASE,
                        DatabaseErrorCode.PERMISSION_DENIED)


class WorkerStatusReason(StrEnum):
    """``status_reason`` values a worker's own writes set."""

    JOB_FAILED = "job_failed"
    RETRIES_EXHAUSTED = "retries_exhausted"


class OperatorStatusReason(StrEnum):
    """``status_reason`` values an operator action sets."""

    OPERATOR_RETRY = "operator_retry"
    OPERATOR_CANCEL = "operator_cancel"


_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,63}$")


def short_code(value: str) -> str:
    """Validate an error code: a short identifier, never a message, path or identity."""
    if not isinstance(value, str) or not _CODE.match(value):
        raise ValueError(
            "error codes are short identifiers (a letter, then letters, digits, '_' or '.', "
            f"at most 64 characters), not messages: {value!r}"
        )
    return value


# The lengths of the text columns a worker fills. The schema (models/tables.py) declares
# its columns with these, and the worker client checks values against them before any
# write, so both engines refuse the same values the same way.
JOB_KIND_MAX_LENGTH = 100
"""``job_runs.job_kind``."""
RECORDED_KIND_MAX_LENGTH = 255
"""``reconciliation_decisions.job_kind``: a foreign system's kind is cut to this when
recorded (Celery's task names hold 155 characters, django-celery-results' 255)."""
JOB_KEY_MAX_LENGTH = 200
"""``job_runs.idempotency_key`` and ``job_runs.singleton_key``."""
STEP_NAME_MAX_LENGTH = 200
"""``step_runs.step_name``."""
WORKER_NAME_MAX_LENGTH = 200
"""``job_runs.lease_owner`` and ``job_attempts.lease_owner``: the claiming worker's name."""
SOURCE_NAME_MAX_LENGTH = 32
"""``operator_actions.job_source`` and ``operator_holds.job_source``: a source's name."""
ACTOR_MAX_LENGTH = 200
"""``operator_actions.acted_by``: who acted (an operator token's name, an OS user)."""
NOTE_MAX_LENGTH = 2000
"""``operator_actions.operator_note``: the operator's reason, kept as written."""
STATE_MAX_LENGTH = 64
"""``operator_actions.state_before`` and ``state_after``: a job's state as its source
reads it (its own status word, cut to this)."""
