"""The ``[source]`` table of ``kind = "dramatiq"``: the app's Redis, the broker's
namespace and the queues watched."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import ClassVar

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from reconciler.config.settings import given_or_read
from reconciler.config.tables import SourceSettings
from reconciler.sources.dramatiq.keys import canonical

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class DramatiqConfig(SourceSettings):
    """``kind = "dramatiq"``: Dramatiq's messages in the app's Redis (its ``RedisBroker``)."""

    kind: ClassVar[str] = "dramatiq"
    from_settings: ClassVar[frozenset[str]] = frozenset({"session_timeout_seconds"})
    string_lists: ClassVar[frozenset[str]] = frozenset({"queues"})
    redis_url: str | None = None
    """The app's broker connection (``redis://``, ``rediss://`` or ``unix://``)."""
    redis_url_file: str | None = None
    """A file holding ``redis_url`` on one line (a password kept out of the config)."""
    namespace: str = "dramatiq"
    """The broker's ``namespace`` (``RedisBroker(namespace=...)``)."""
    queues: tuple[str, ...] = ("*",)
    """The queues watched, as globs (fnmatch) over Dramatiq's queue names; default: all."""
    session_timeout_seconds: float = 30.0
    """A worker whose heartbeat has not moved for this long (Redis's clock) is gone (the
    ``session_timeout_seconds`` setting)."""

    @model_validator(mode="after")
    def _valid(self) -> DramatiqConfig:
        # Only the scheme is named back: a Redis URL may hold a password.
        if not self.url.startswith(REDIS_SCHEMES):
            raise ValueError(f"redis_url must be a Redis URL (redis://...), got "
                             f"{self.url.split(':')[0]}:")
        if not self.namespace or any(c in self.namespace for c in "*?[]"):
            raise ValueError("namespace must be the broker's namespace, without glob "
                             "characters")
        return self

    @property
    def url(self) -> str:
        """The Redis URL, read from ``redis_url_file`` where the config names one."""
        return given_or_read(self.redis_url, self.redis_url_file, "redis_url")

    def watches(self, queue: str) -> bool:
        """Whether ``queue`` (or the queue a delay queue feeds) is watched."""
        return any(fnmatchcase(canonical(queue), glob) for glob in self.queues)
