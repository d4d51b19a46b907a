"""What every foreign source's conformance fixture shares: the pass through the composition
root, the audit, declared gaps.

A fixture names its ``[source]`` config; the pass is built exactly as ``reconciler pass
--config`` builds it (``root.cli.assemble_cli`` and ``config.loader.pass_config`` over a
``Config``), with ``TIMING``'s thresholds as the settings and one ``[kinds]`` table per
effect kind (``conformance.<effect>.*``), since a foreign job without step records takes
its one step's effect from its kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import ReconciliationDecision
from reconciler.config.loader import Config, SourceConfig, pass_config
from reconciler.config.settings import Settings
from reconciler.core.brake import BrakeLimits
from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.passes import PassConfig, PassReport, apply_and_record, plan_change, run_pass
from reconciler.core.ports import Cursor, PassStore
from reconciler.core.vocabulary import EffectKind, PassOutcome
from reconciler.root.cli import CliParts, assemble_cli
from tests.conformance.fixtures import (
    TIMING,
    AuditEntry,
    Capability,
    Feature,
    InterruptedPass,
    JobKey,
    SourceJob,
)
from tests.helpers import rows_of

DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)
INSTANCE = "conformance-reconciler"

KINDS = KindRules(
    [KindRule(f"conformance.{e.value}.*", effect=e, max_run_seconds=TIMING.lease_seconds)
     for e in EffectKind],
    stale_after_seconds=TIMING.stale_after_seconds,
    wedged_after_seconds=TIMING.wedged_after_seconds, max_attempts=3,
    crash_loop_after=TIMING.crash_loop_after)
"""Per effect kind: its effect, and a declared run time as long as a live lease (the lease
of a source that keeps none of its own)."""

ALIKE_KINDS = KindRules(
    [KindRule("*", max_run_seconds=TIMING.lease_seconds),
     *(KindRule(f"conformance.{e.value}.*", effect=e) for e in EffectKind)],
    stale_after_seconds=TIMING.stale_after_seconds,
    wedged_after_seconds=TIMING.wedged_after_seconds, max_attempts=3,
    crash_loop_after=TIMING.crash_loop_after)
"""``KINDS`` resolved alike, with every key a scan reads set by ``[kinds."*"]``: what a
source reads when its scans need not tell the kinds apart (the rq source then loads only
its expired jobs and counts the live ones)."""


def kind_for(effect: EffectKind, serial: int) -> str:
    """A job kind of its own per job (so a worker's fetch takes exactly that job)."""
    return f"conformance.{effect.value}.{serial}"


class ForeignFixture:
    """The pass, the audit and the declared gaps of a foreign source under test; a subclass
    makes situations and observes its system's rows."""

    source_name: str
    gaps: Mapping[Capability, str] = {}
    """What the source cannot express, each with the one line that says why."""
    kinds: KindRules = KINDS
    """The ``[kinds]`` its passes run under."""

    def __init__(self, engine: Engine, source: SourceConfig) -> None:
        self.engine = engine
        settings = Settings(database_url=engine.url.render_as_string(hide_password=False),
                            stale_after_seconds=TIMING.stale_after_seconds,
                            wedged_after_seconds=TIMING.wedged_after_seconds,
                            session_timeout_seconds=TIMING.session_timeout_seconds)
        self.config = Config(settings=settings, source=source, kinds=self.kinds)
        self.parts = assemble_cli(self.config, engine=engine)
        self.store: PassStore = self.parts.passes

    def supports(self, what: Capability) -> bool:
        """Everything but the declared gaps. No foreign source records a completion itself
        (only the native source recovers one)."""
        return what not in self.gaps and what not in (Feature.RECOVERS_COMPLETION,
                                                      Feature.PARKS)

    def why_unsupported(self, what: Capability) -> str:
        """The declared gap's line."""
        if what is Feature.RECOVERS_COMPLETION:
            return f"{self.source_name} keeps completion_unrecorded: its completion is its own"
        if what is Feature.PARKS:
            return f"{self.source_name}'s tables have no column of ours to park a job in"
        return self.gaps.get(what, f"{self.source_name} supports {what}")

    def audit(self, job: SourceJob) -> list[AuditEntry]:
        """The job's audit rows under this source's name, oldest first."""
        return [
            AuditEntry(r["pass_id"], self.key_of(r["job_id"]), r["disposition"],
                       r["decision_reason"], r["generation_before"], r["generation_after"])
            for r in rows_of(self.engine, DECISIONS,
                             (DECISIONS.c.job_source == self.source_name)
                             & (DECISIONS.c.job_id == str(job.key)),
                             order=DECISIONS.c.decision_id)
        ]

    def operator(self) -> CliParts:
        """A command's parts on this database, under the suite's settings."""
        return self.parts

    def key_of(self, text: str) -> JobKey:
        """A job id from the audit's text, as the source spells it (integers by default)."""
        return int(text)

    def pass_config(self, batch_size: int = 50) -> PassConfig:
        """The settings of the suite's passes (``run_pass``), for a test that runs its own."""
        return self._pass_config(batch_size)

    def _pass_config(self, batch_size: int) -> PassConfig:
        settings = self.config.settings.model_copy(update={"batch_size": batch_size})
        # The suite's situations go stale together on purpose: the mass-staleness brake
        # (tested on its own) would hold them all back.
        return replace(pass_config(settings, INSTANCE, self.kinds), brake=None)

    def run_pass(self, *, batch_size: int = 50, dry_run: bool = False,
                 after: object | None = None, brake: BrakeLimits | None = None) -> PassReport:
        """One pass, as ``reconciler pass --config`` runs it."""
        return run_pass(self.store, replace(self._pass_config(batch_size), brake=brake),
                        dry_run=dry_run, after=cast(Cursor | None, after))

    def run_interrupted_pass(self, between: Callable[[], None], *,
                             batch_size: int = 50) -> InterruptedPass:
        """Decide in one transaction, run ``between``, apply and record in the next."""
        config = self._pass_config(batch_size)
        with self.store.pass_transaction(dry_run=False) as tx:
            tx.jobs.expire_gone_owners(config.session_timeout_seconds)
            planned = [plan_change(row, config.thresholds_for(row.job_kind))
                       for row in tx.jobs.candidates(batch_size, config.thresholds, None)]
        between()
        with self.store.pass_transaction(dry_run=False) as tx:
            pass_id, recorded = apply_and_record(tx, config.instance, planned)
        return InterruptedPass(tuple(p.decision for p in planned),
                               PassReport(pass_id, PassOutcome.OK, tuple(recorded)))


def clear_audit(engine: Engine) -> None:
    """Forget every pass and decision (a shared database's job ids restart per test)."""
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM reconciliation_decisions"))
        conn.execute(sa.text("DELETE FROM reconciliation_passes"))


__all__ = ["ALIKE_KINDS", "KINDS", "Any", "ForeignFixture", "clear_audit", "kind_for"]
