"""``reconciler kinds``: each ``[kinds]`` pattern with the running kinds it matches.

A pattern that matches no kind the source has ever run is warned about: ``"report.*"``
never matches kind ``reports.daily``, and a typo in a pattern silently leaves its jobs
under the defaults (``effectful``: ended, never resumed). A pattern of a kind that is
merely idle now is not: the kinds known are the running ones, those of the system's
newest ``KNOWN_KINDS_READ`` jobs whatever their state, and those the audit recorded. A
catch-all (``"*"``) has nothing to misspell and is never warned about. Running kinds that
no pattern matches are listed too, and so are the running jobs with no kind the source can
read (a Celery row written without ``result_extended``), with the setting they miss. Reads
only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from reconciler.core.kinds import KindRules
from reconciler.core.ports import Unjudged
from reconciler.root.cli import CliParts

KNOWN_KINDS_READ = 5000
"""How many of the system's newest jobs, and of the audit's newest decisions, the kinds
known are read from (a bounded read, however large the system's table)."""

Emit = Callable[[argparse.Namespace, Any, Callable[[], list[str]]], None]


def kinds_command(assemble: Callable[[argparse.Namespace], CliParts],
                  emit: Emit) -> Callable[[argparse.Namespace], int]:
    """The command's handler, given the CLI's assembly and output."""

    def run(args: argparse.Namespace) -> int:
        with assemble(args) as cli:
            with cli.passes.pass_transaction(dry_run=True) as tx:
                running = tx.jobs.running_kinds()
            unjudged = cli.jobs.unjudged()
            known = known_kinds(cli, running)
        view = kinds_view(cli.config.kinds, running, unjudged, known)
        emit(args, view, lambda: kinds_lines(view))
        return 0

    return run


def known_kinds(cli: CliParts, running: list[str]) -> list[str]:
    """The kinds the source is known to have run (see the module), each once, sorted."""
    source = cli.config.source.kind
    listed = [job.job_kind for job in cli.jobs.list_jobs(None, KNOWN_KINDS_READ)]
    decided = [d["job_kind"] for d in cli.store.list_decisions(None, None, KNOWN_KINDS_READ)
               if d.get("job_source") == source]
    return sorted({kind for kind in (*running, *listed, *decided) if kind})


def kinds_view(kinds: KindRules, running: list[str], unjudged: Unjudged | None = None,
               known: list[str] | None = None) -> dict[str, Any]:
    """The ``kinds --json`` shape: patterns (most specific first) with the running kinds
    each matches, the patterns matching no kind ever run (``known``; default: the running
    ones), the running kinds no pattern matches, and the running jobs without a kind
    (``unnamed_running``: their count and the setting they miss; null when there is
    none)."""
    known = running if known is None else known
    return {
        "patterns": [{"pattern": rule.pattern,
                      "matches": [kind for kind in running if rule.matches(kind)]}
                     for rule in kinds.rules],
        "unmatched_patterns": kinds.unmatched(known),
        "running_kinds": running,
        "known_kinds": known,
        "kinds_under_defaults": [kind for kind in running if not kinds.matching(kind)],
        "unnamed_running": None if unjudged is None else {
            "count": unjudged.count, "missing_setting": unjudged.missing_setting,
            "why": unjudged.why, "fix": unjudged.fix},
    }


def kinds_lines(view: dict[str, Any]) -> list[str]:
    """The human lines (the caller escapes control characters)."""
    if not view["patterns"]:
        lines = ["no [kinds] patterns: every kind is judged under the settings' defaults"]
    else:
        lines = [f'[kinds."{p["pattern"]}"] matches '
                 + (", ".join(p["matches"]) if p["matches"] else "no running kind")
                 for p in view["patterns"]]
    known = ", ".join(view["known_kinds"]) or "none yet"
    lines += [f'warning: [kinds."{pattern}"] matches no kind this source has run '
              f"({known}); check its spelling (fnmatch, case-sensitive)"
              for pattern in view["unmatched_patterns"]]
    if view["kinds_under_defaults"]:
        lines.append("running kinds no pattern matches (the defaults apply): "
                     + ", ".join(view["kinds_under_defaults"]))
    unnamed = view["unnamed_running"]
    if unnamed is not None:
        lines.append(f"warning: {unnamed['count']} running job(s) have no kind, so no "
                     f"pattern applies and no pass judges them ({unnamed['missing_setting']} "
                     f"is missing): {unnamed['why']}. To fix: {unnamed['fix']}")
    return lines
