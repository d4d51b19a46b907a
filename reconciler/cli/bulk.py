"""``reconciler jobs retry|cancel --reason R | --disposition D | --kind GLOB | --since D
...``: one action on the jobs whose latest decision matches the filters (the console's, as
one ``BulkFilter``; each stands alone), each fenced and recorded on its own.

It first says how many match, acts only with ``--yes`` or after a yes typed on a terminal,
on every match or at most ``--limit`` where one is given, and ends with the counts applied
and refused (exit 6 when any was refused). ``--dry-run`` lists them and changes nothing.

It acts a chunk at a time (``BULK_CHUNK`` jobs, a pass's batch), each chunk through the
desk's ``act_on_chunk``: on a source that takes a batch, one transaction whose few
statements fence every job inside them and record every action in one insert, so an
interrupted bulk (SIGINT, a lost connection) leaves each job acted on and recorded, or
untouched, and the same command run again finishes the rest. A terminal shows a progress
bar; with ``--json``, each chunk's counts are a JSON object a line on stderr; each refusal
is a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime, timedelta
from typing import TextIO

from reconciler.core.operator_desk import (
    BULK_CHUNK,
    ActionReport,
    BulkFilter,
    OperatorDesk,
    act_in_chunks,
)
from reconciler.core.vocabulary import OperatorAction
from reconciler.errors import ActionRefusedError
from reconciler.views import printable

PAST = {OperatorAction.RETRY: "retried", OperatorAction.CANCEL: "cancelled"}
"""The bulk form's actions, as its count line says them."""
BAR_WIDTH = 30


class Progress:
    """A bar on a terminal (``stream`` a TTY), redrawn in place; nothing elsewhere."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total = total
        self._stream = stream
        self._on = stream.isatty() and total > BULK_CHUNK
        self._drawn = False

    def show(self, done: int) -> None:
        """``done`` of the total acted on."""
        if not self._on:
            return
        filled = BAR_WIDTH * done // max(self._total, 1)
        self._stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                           f"{done}/{self._total}")
        self._stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """The bar's line emptied, so that another line can be printed."""
        if self._drawn:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()
            self._drawn = False


def json_progress(done: int, applied: int, refused: int, total: int,
                  stream: TextIO) -> None:
    """One chunk's progress for ``--json``: a JSON object on a line of its own, on stderr
    (``stream``) because stdout is one JSON document, the bulk's result (docs/cli.md)."""
    stream.write(json.dumps({"event": "progress", "done": done, "applied": applied,
                             "refused": refused, "total": total}) + "\n")
    stream.flush()


def _say(args: argparse.Namespace, line: str) -> None:
    """A line for people; with ``--json`` on stderr, so stdout stays one JSON document."""
    print(printable(line), file=sys.stderr if args.json else sys.stdout, flush=True)


def _confirmed(args: argparse.Namespace, action: OperatorAction, count: int) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        _say(args, f"nothing changed: pass --yes to {action} them")
        return False
    print(f"{action} these {count} jobs? type yes: ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        _say(args, "nothing changed")
        return False
    return True


def bulk_action(args: argparse.Namespace, desk: OperatorDesk, action: OperatorAction,
                actor: str) -> int:
    """Run the bulk form (see the module's docstring); the exit code."""
    since = None if args.since is None else datetime.now(UTC) - timedelta(seconds=args.since)
    chosen = BulkFilter(reason=args.reason, disposition=args.disposition, kind=args.kind,
                        since=since)
    targets = desk.bulk_targets(action, limit=sys.maxsize if args.limit is None
                                else args.limit, **chosen)
    filters = ", ".join(
        ([f"latest decision {args.reason}"] if args.reason else [])
        + ([f"disposition {args.disposition}"] if args.disposition else [])
        + ([f"kind {args.kind}"] if args.kind else [])
        + ([f"decided in the last {args.since:g} s"] if args.since is not None else [])
        + ([f"at most {args.limit}"] if args.limit is not None else []))
    _say(args, f"{len(targets)} {desk.source} jobs match ({filters}) and can be "
               f"{PAST[action]} now")
    if args.dry_run or not targets or not _confirmed(args, action, len(targets)):
        if args.dry_run:
            for job_id in targets:
                _say(args, f"  job {job_id}")
        if args.json:
            # The same document whatever happens, counts included: a script reads one shape.
            print(json.dumps({"matched": targets, "applied": [], "refused": [],
                              "dry_run": bool(args.dry_run),
                              "counts": {"matched": len(targets), "applied": 0,
                                         "refused": 0}}, indent=2))
        return 0
    reports: list[ActionReport] = []
    applied_so_far = 0
    progress = Progress(len(targets), sys.stderr)
    for chunk in act_in_chunks(desk, action, targets, actor=actor, note=args.note):
        reports += chunk
        applied_so_far += sum(report.applied for report in chunk)
        progress.clear()
        for report in chunk:
            if not report.applied:
                _say(args, report.line)
        if args.json:
            json_progress(len(reports), applied_so_far, len(reports) - applied_so_far,
                          len(targets), sys.stderr)
        progress.show(len(reports))
    progress.clear()
    applied = [r.job_id for r in reports if r.applied]
    refused = [{"job_id": r.job_id, "refusal": r.refusal} for r in reports if not r.applied]
    _say(args, f"{action}: applied {len(applied)}, refused {len(refused)}")
    if args.json:
        print(json.dumps({"matched": targets, "applied": applied, "refused": refused,
                          "dry_run": False,
                          "counts": {"matched": len(targets), "applied": len(applied),
                                     "refused": len(refused)}}, indent=2))
    return ActionRefusedError.exit_code if refused else 0
