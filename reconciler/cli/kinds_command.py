"""``reconciler kinds``: each ``[kinds]`` pattern with the running kinds it matches.

A pattern that matches no running kind is warned about: ``"report.*"`` never matches kind
``reports.daily``, and a typo in a pattern silently leaves its jobs under the defaults
(``effectful``: ended, never resumed). A catch-all (``"*"``) has nothing to misspell and is
never warned about. Running kinds that no pattern matches are listed too, and so are the
running jobs with no kind the source can read (a Celery row written without
``result_extended``), with the setting they miss. Reads only; the kinds are those of the
configured source's running jobs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from reconciler.core.kinds import KindRules
from reconciler.core.ports import Unjudged
from reconciler.root.cli import CliParts

Emit = Callable[[argparse.Namespace, Any, Callable[[], list[str]]], None]


def kinds_command(assemble: Callable[[argparse.Namespace], CliParts],
                  emit: Emit) -> Callable[[argparse.Namespace], int]:
    """The command's handler, given the CLI's assembly and output."""

    def run(args: argparse.Namespace) -> int:
        with assemble(args) as cli:
            with cli.passes.pass_transaction(dry_run=True) as tx:
                running = tx.jobs.running_kinds()
            unjudged = cli.jobs.unjudged()
        view = kinds_view(cli.config.kinds, running, unjudged)
        emit(args, view, lambda: kinds_lines(view))
        return 0

    return run


def kinds_view(kinds: KindRules, running: list[str], unjudged: Unjudged | None = None
               ) -> dict[str, Any]:
    """The ``kinds --json`` shape: patterns (most specific first) with the running kinds
    each matches, the patterns matching none, the running kinds no pattern matches, and
    the running jobs without a kind (``unnamed_running``: their count and the setting
    they miss; null when there is none)."""
    return {
        "patterns": [{"pattern": rule.pattern,
                      "matches": [kind for kind in running if rule.matches(kind)]}
                     for rule in kinds.rules],
        "unmatched_patterns": kinds.unmatched(running),
        "running_kinds": running,
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
    running = ", ".join(view["running_kinds"]) or "none"
    lines += [f'warning: [kinds."{pattern}"] matches none of the kinds running now '
              f"({running}); check its spelling (fnmatch, case-sensitive)"
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
