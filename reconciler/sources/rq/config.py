"""The ``[source]`` table of ``kind = "rq"``: the app's Redis, the queues watched, and the
serializer its jobs were written with."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import ClassVar

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from reconciler.config.settings import given_or_read
from reconciler.config.tables import SourceSettings

RQ_SERIALIZERS = ("pickle", "json")
"""RQ's own two serializers (``rq.serializers``): the job's ``data`` is read in their
format, never by loading it (a pickle is walked opcode by opcode, not run)."""
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class RqConfig(SourceSettings):
    """``kind = "rq"``: RQ's jobs, registries and workers in the app's Redis."""

    kind: ClassVar[str] = "rq"
    from_settings: ClassVar[frozenset[str]] = frozenset({"session_timeout_seconds"})
    string_lists: ClassVar[frozenset[str]] = frozenset({"queues"})
    redis_url: str | None = None
    """The app's RQ connection (``redis://``, ``rediss://`` or ``unix://``)."""
    redis_url_file: str | None = None
    """A file holding ``redis_url`` on one line (a password kept out of the config)."""
    queues: tuple[str, ...] = ("*",)
    """The queues watched, as globs (fnmatch) over RQ's queue names; default: all."""
    serializer: str = "pickle"
    """The app's serializer: ``pickle`` (RQ's default) or ``json``."""
    session_timeout_seconds: float = 30.0
    """A worker whose last heartbeat is older than this is silent (the
    ``session_timeout_seconds`` setting)."""

    @model_validator(mode="after")
    def _one_url(self) -> RqConfig:
        url = self.url
        # Only the scheme is named back: a Redis URL may hold a password.
        if not url.startswith(REDIS_SCHEMES):
            raise ValueError(f"redis_url must be a Redis URL (redis://...), got "
                             f"{url.split(':')[0]}:")
        if self.serializer not in RQ_SERIALIZERS:
            raise ValueError(f"serializer must be one of {', '.join(RQ_SERIALIZERS)} "
                             f"(got {self.serializer!r})")
        return self

    @property
    def url(self) -> str:
        """The Redis URL, read from ``redis_url_file`` where the config names one."""
        return given_or_read(self.redis_url, self.redis_url_file, "redis_url")

    def watches(self, queue: str) -> bool:
        """Whether the queue named ``queue`` is one of the watched."""
        return any(fnmatchcase(queue, glob) for glob in self.queues)
