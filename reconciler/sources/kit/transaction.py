"""The state of one pass's transaction for one foreign source, made by the kit.

A declaration (a system's ``System``) holds none of it: what the transaction has read (the
kinds running, the brake's counts, each scanned job's kind, the liveness verdict, whether
its times are read as UTC yet) and the ports of this project's own tables it writes
through (the step ledger, with the fences its swaps ask for, and the audit's history)
live here, one object per transaction.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindPolicy
from reconciler.sources.kit.shapes import UtcTimes
from reconciler.storage.audit import AuditHistory
from reconciler.storage.step_ledger import PassLedger


class SourceTransaction:
    """What one transaction of a pass read and owes, for one source."""

    __slots__ = ("brake_counts", "history", "kinds_read", "ledger", "running_kinds", "utc",
                 "verdict", "verdict_every", "verdict_silent")

    def __init__(self, conn: Connection, source_name: str) -> None:
        self.ledger = PassLedger(conn, source_name)
        """The step ledger's evidence and fences (written by its own store)."""
        self.history = AuditHistory(conn, source_name)
        """The audit's past resumes (a foreign system keeps no history of lost attempts)."""
        self.running_kinds: dict[str, KindPolicy] | None = None
        """The kinds running, with their policies, once read (the scans need them)."""
        self.brake_counts: tuple[int, int] | None = None
        """(running, expired) of reconciled kinds, as the scan or the brake read them,
        until a swap changes them."""
        self.kinds_read: dict[str, str] = {}
        """Each scanned job's kind, by key text, for the audit's rows."""
        self.verdict: object | None = None
        """The declared liveness's verdict, once read (one per transaction)."""
        self.verdict_every = False
        """Whether the verdict is over every running job (else the live ones may be only
        counted), read again over every one when a read needs them."""
        self.verdict_silent = False
        """Whether it loaded the live jobs whose step ledger went silent (what the wedged
        scan reads), read again with them when the scan needs them."""
        self.utc = UtcTimes(conn)
        """Sets the transaction's TimeZone to UTC once, for a system of naive UTC times."""
