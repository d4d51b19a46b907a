"""``reconciler kinds``: each ``[kinds]`` pattern with the running kinds it matches.

A pattern that matches no running kind is warned about: ``"report.*"`` never matches kind
``reports.daily``, and a typo in a pattern silently leaves its jobs under the defaults
(``effectful``: ended, never resumed). Running kinds that no pattern matches are listed
too. Reads only; the kinds are those of the configured source's running jobs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from reconciler.core.kinds import KindRules
from reconciler.wiring import CliParts

Emit = Callable[[argparse.Namespace, Any, Callable[[], list[str]]], None]


def kinds_command(assemble: Callable[[argparse.Namespace], CliParts],
                  emit: Emit) -> Callable[[argparse.Namespace], int]:
    """The command's handler, given the CLI's assembly and output."""

    def run(args: argparse.Namespace) -> int:
        with assemble(args) as cli, cli.passes.pass_transaction(dry_run=True) as tx:
            running = tx.jobs.running_kinds()
        view = kinds_view(cli.config.kinds, running)
        emit(args, view, lambda: kinds_lines(view))
        return 0

    return run


def kinds_view(kinds: KindRules, running: list[str]) -> dict[str, Any]:
    """The ``kinds --json`` shape: patterns (most specific first) with the running kinds
    each matches, the patterns matching none, and the running kinds no pattern matches."""
    return {
        "patterns": [{"pattern": rule.pattern,
                      "matches": [kind for kind in running if rule.matches(kind)]}
                     for rule in kinds.rules],
        "unmatched_patterns": kinds.unmatched(running),
        "running_kinds": running,
        "kinds_under_defaults": [kind for kind in running if not kinds.matching(kind)],
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
    return lines
