"""What every measured job system shares: its size, the ``System`` port a system
implements, and the SQL helpers its builders use (``benchmarks.foreign_systems`` and
``benchmarks.foreign_python`` hold the systems)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg

REPO = Path(__file__).resolve().parent.parent
NODE_SCRIPTS = REPO / "tests" / "sources" / "node"
PEER_SWEEP = Path(__file__).resolve().parent / "node" / "peer_sweep.js"
DEAD_SECONDS = 5 * 3600  # older than every system's own threshold (graphile-worker: 4 h)


@dataclass(frozen=True, slots=True)
class Size:
    """How many jobs, how many of them claimed, how many of those orphaned."""

    jobs: int
    running: int
    orphans: int


class System(Protocol):
    """One job system's schema, data and own recovery, on one PostgreSQL database."""

    name: str
    source_toml: str
    """The ``[source]`` table (and any ``[kinds]``) a user of this system would write."""
    user_index: str | None
    """The index docs/sources.md suggests a user add for the reconciler's scans (it never
    adds one itself); ``--with-index`` measures with it. None: the system's own suffice."""
    silence_seconds: float
    """How long after ``kill`` the reconciler must have seen the owners silent before they
    are gone (Celery's ``session_timeout_seconds`` across passes); 0: at once."""

    def build(self, conninfo: str, size: Size) -> None:
        """Create the system's schema with its own code and fill it; orphans still alive."""

    def keep_alive(self, conninfo: str) -> None:
        """Every owner heartbeats now (where the system keeps heartbeats)."""

    def kill(self, conninfo: str, size: Size) -> None:
        """Make the orphans' owners dead (again, after a recovery), as time would."""

    def peer_quiet(self, conninfo: str, runs: int) -> list[float]:
        """Milliseconds of the system's own sweep, ``runs`` times, nothing to recover."""

    def peer_recover(self, conninfo: str, size: Size) -> tuple[float, int]:
        """Seconds of one run of the system's own recovery over the orphans; jobs it
        recovered."""

    def close(self) -> None:
        """Stop what ``build`` started beside the database (a broker, a worker)."""


class InDatabase:
    """A system that is all in the database: its owners' liveness is rows, nothing runs
    beside it."""

    silence_seconds = 0.0

    def close(self) -> None:
        """Nothing to stop."""


def execute(conninfo: str, *statements: str, params: dict[str, Any] | None = None) -> None:
    """The statements in one transaction, each with ``params``."""
    with psycopg.connect(conninfo, autocommit=False) as conn:
        for statement in statements:
            conn.execute(statement, params)  # type: ignore[arg-type]
        conn.commit()


def vacuum(conninfo: str, tables: str) -> None:
    """Hint bits, visibility map and statistics current, as a live system's would be."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {tables}")  # type: ignore[arg-type]


def bounds(size: Size) -> dict[str, int]:
    """The builders' parameters: the size, where the waiting jobs end, how old a dead
    claim is."""
    waiting_end = size.running + (size.jobs - size.running) // 2
    return {"jobs": size.jobs, "running": size.running, "orphans": size.orphans,
            "waiting_end": waiting_end, "dead": DEAD_SECONDS}
