"""What the worker client accepts, checked before the database is touched, alike on both
engines.

SQLite stores a 300-character kind, a NUL byte or a NaN without a word; PostgreSQL refuses
them with a driver error deep inside a transaction. Code that works on the embedded default
must not break in production, so both get the same ``ValueError``, naming the limit, from
here. The limits are the core's column lengths, which the schema (``models``) declares its
columns with, so they cannot drift from it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from reconciler.config.fields import MAX_SECONDS
from reconciler.core import vocabulary
from reconciler.core.evidence import PlanStep

KIND_MAX_LENGTH = vocabulary.JOB_KIND_MAX_LENGTH
KEY_MAX_LENGTH = vocabulary.JOB_KEY_MAX_LENGTH
SINGLETON_MAX_LENGTH = vocabulary.JOB_KEY_MAX_LENGTH
STEP_NAME_MAX_LENGTH = vocabulary.STEP_NAME_MAX_LENGTH
WORKER_MAX_LENGTH = vocabulary.WORKER_NAME_MAX_LENGTH
MAX_ATTEMPTS_LIMIT = 2**31 - 1  # job_runs.max_attempts is an INTEGER
MAX_STEPS = 10_000


def text_value(name: str, value: object, max_length: int, *, optional: bool = False
               ) -> str | None:
    """A short text column's value: a non-empty string of at most ``max_length``
    characters without NUL (PostgreSQL text cannot hold one)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > max_length:
        raise ValueError(f"{name} is {len(value)} characters long; the limit is {max_length}")
    if "\x00" in value:
        raise ValueError(f"{name} contains a NUL character, which PostgreSQL cannot store")
    return value


def attempts(value: object) -> int:
    """An attempt budget: a whole number from 1 to 2**31-1 (an INTEGER column)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("max_attempts must be a whole number")
    if not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise ValueError(f"max_attempts must be from 1 to {MAX_ATTEMPTS_LIMIT}: {value}")
    return value


def seconds(name: str, value: object) -> float:
    """A duration: a finite number of seconds above 0 and at most one year."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds")
    number = float(value)
    if not math.isfinite(number) or not 0 < number <= MAX_SECONDS:
        raise ValueError(f"{name} must be above 0 and at most {MAX_SECONDS:g} seconds: {value}")
    return number


def plan(steps: Sequence[PlanStep]) -> tuple[PlanStep, ...]:
    """A step plan of 1 to MAX_STEPS steps whose names fit ``step_runs.step_name``."""
    checked = tuple(steps)
    if not checked:
        raise ValueError("a job needs at least one step")
    if len(checked) > MAX_STEPS:
        raise ValueError(f"a job has at most {MAX_STEPS} steps: {len(checked)}")
    for index, step in enumerate(checked):
        text_value(f"step {index}'s name", step.step_name, STEP_NAME_MAX_LENGTH)
    return checked


def payload(value: Any) -> Any:
    """A payload both engines store alike: JSON without NaN or Infinity (PostgreSQL's JSON
    has neither) and without NUL characters in any string."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ValueError("payload holds NaN or Infinity, which JSON cannot carry") from None
    except (TypeError, RecursionError) as exc:
        raise ValueError(f"payload is not JSON-serialisable: {exc}") from None
    if _holds_nul(value):
        raise ValueError("payload contains a NUL character, which PostgreSQL cannot store")
    return value


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_nul(v) for v in value)
    return False
