"""The command line's grammar: every command and its arguments, the global options, the
argument types; each refusal is one line."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from reconciler import __version__
from reconciler.config.fields import SETTING_FIELDS
from reconciler.config.registry import DEFAULT_SOURCE
from reconciler.core.vocabulary import Disposition, JobStatus, Reason
from reconciler.demos import DEMOS
from reconciler.exports import FORMATS
from reconciler.views import printable

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_JOB_ID = 2**63 - 1  # the largest BIGINT: a LIMIT the database takes
MAX_SINCE_SECONDS = 100 * 365 * 86400.0


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h`` or ``7d`` as seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 7d)")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds > MAX_SINCE_SECONDS:
        raise argparse.ArgumentTypeError(f"duration too long: {text!r} (at most 100 years)")
    return seconds


def job_id_text(text: str) -> str:
    """A job id as text: the configured source parses it (a number, a UUID...)."""
    if not text or len(text) > 200 or not text.isprintable():
        raise argparse.ArgumentTypeError(f"not a job id: {text!r}")
    return text


def positive_int(text: str) -> int:
    """A count or limit: a whole number from 1 to 2**63-1 (a LIMIT the database takes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= MAX_JOB_ID:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_JOB_ID}: {text!r}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """Usage mistakes end with one line naming the fix, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, printable(f"{self.prog}: error: {message} (see {self.prog} --help)")
                  + "\n")


def settings_parent(without: frozenset[str] = frozenset(), *,
                    after_command: bool = False) -> OneLineParser:
    """Every setting as a flag, with ``--config`` and ``--verbose``: the global options.

    ``without`` names settings whose flag a command spells differently (``decisions
    --shadow`` filters the audit, it does not run in shadow). The root parser takes them
    before the command (``reconciler --config X pass``) and sets their defaults; a
    command's copy (``after_command``) sets only what it is given, so a flag before the
    command is kept and the same flag after it wins.
    """
    unset: object = argparse.SUPPRESS if after_command else None
    parent = OneLineParser(add_help=False)
    parent.add_argument("--config", metavar="PATH", default=unset,
                        help="a TOML config file: settings, [source] and [kinds] "
                        "(else RECONCILER_CONFIG; flags and RECONCILER_<NAME> win over it)")
    group = parent.add_argument_group("settings (flag, else RECONCILER_<NAME>, else default)")
    # Every setting has a flag, generated from its one declaration (plain data: the help
    # needs no validation library). Values stay text here: Settings validates, so a bad
    # flag and a bad env var read the same.
    for spec in SETTING_FIELDS:
        if spec.name in without:
            continue
        shown = "" if spec.default is None else f" (default {spec.default})"  # derived ones
        help_text = f"{spec.description}{shown}"
        if spec.is_switch:
            # A switch (``--shadow``, ``--no-shadow``) rather than ``--shadow true``.
            group.add_argument(spec.flag, dest=spec.name, default=unset,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(spec.flag, dest=spec.name, default=unset, metavar="VALUE",
                               help=help_text)
    parent.add_argument("--verbose", action="store_true",
                        default=argparse.SUPPRESS if after_command else False,
                        help="tracebacks and debug logs")
    return parent


OPERATOR_HELP = {
    "hold": "hold a job: the reconciler leaves it alone (native workers do not claim it)",
    "unhold": "release an operator hold",
    "retry": "requeue a failed or cancelled job, in its system's own terms, with a fresh "
             "attempt budget (--note required); or, with --reason, --disposition, --kind "
             "or --since, the jobs of a filter",
    "cancel": "cancel a queued or running job, in its system's own terms (--note "
              "required); or, with --reason, --disposition, --kind or --since, the jobs of "
              "a filter",
}
BULK_ACTIONS = frozenset({"retry", "cancel"})
"""The actions the bulk form takes."""
BULK_FILTERS = ("reason", "disposition", "kind", "since")
"""The bulk form's filters, on the jobs' latest decisions (the console's); any one of them
makes it bulk."""
_BULK_FLAGS = ", ".join(f"--{name}" for name in BULK_FILTERS)
NEEDS_NOTE = BULK_ACTIONS
"""The actions that need ``--note``: a reason, kept in the record."""


def _operator_arguments(acting: argparse.ArgumentParser, *, bulk: bool) -> None:
    """An operator action's arguments: the job, who and why; the bulk form's filters."""
    acting.add_argument("job_id", type=job_id_text, nargs="?" if bulk else None,
                        help="the job's id as its source spells it")
    acting.add_argument("--note", metavar="TEXT",
                        help="why (kept in the record; required for retry and cancel)")
    acting.add_argument("--as", dest="actor", metavar="NAME",
                        help="who acts, as the record names them (default: RECONCILER_OPERATOR, "
                             "else the OS user unless it is a service account)")
    acting.add_argument("--json", action="store_true")
    if not bulk:
        return
    acting.add_argument("--reason", choices=[r.value for r in Reason],
                        help="bulk: the jobs whose latest decision has this reason")
    acting.add_argument("--disposition", choices=[d.value for d in Disposition],
                        help="bulk: the jobs whose latest decision has this disposition")
    acting.add_argument("--kind", metavar="GLOB", help="bulk: only kinds matching this glob")
    acting.add_argument("--since", type=parse_duration, metavar="DURATION",
                        help="bulk: only decisions younger than this (90s, 15m, 2h, 7d)")
    acting.add_argument("--limit", type=positive_int,
                        help="bulk: act on at most this many jobs (default: every match)")
    acting.add_argument("--dry-run", action="store_true",
                        help="bulk: list the jobs it would act on, change nothing")
    acting.add_argument("--yes", action="store_true",
                        help="bulk: act without asking (else a yes typed on a terminal)")


def check_operator_arguments(parser: argparse.ArgumentParser,
                             args: argparse.Namespace) -> None:
    """The rules argparse cannot say: a note for retry and cancel, and one job or a
    filter (never both); a usage error (exit 2) otherwise."""
    action = getattr(args, "jobs_command", None)
    if args.command != "jobs" or action not in OPERATOR_HELP:
        return
    bulk = is_bulk(args)
    if action in NEEDS_NOTE and not (args.note or "").strip():
        parser.error(f"jobs {action} needs --note TEXT (why: it is kept in the record)")
    if bulk and args.job_id is not None:
        parser.error(f"jobs {action} takes a job id or filters ({_BULK_FLAGS}), not both")
    if not bulk and args.job_id is None:
        parser.error(f"jobs {action} needs a job id, or filters for the bulk form "
                     f"({_BULK_FLAGS})")
    if not bulk and any(getattr(args, flag, None) not in (None, False)
                        for flag in ("dry_run", "yes")):
        parser.error(f"--dry-run and --yes go with the bulk form's filters (jobs {action} "
                     f"with {_BULK_FLAGS})")


def is_bulk(args: argparse.Namespace) -> bool:
    """The bulk form: any of its filters given (each stands alone)."""
    return any(getattr(args, flag, None) is not None for flag in BULK_FILTERS)


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    common = settings_parent(after_command=True)
    # The global options go before the command or after it (`reconciler --config X pass`,
    # `reconciler pass --config X`).
    parser = OneLineParser(
        prog="reconciler", description="Find jobs whose workers died and recover them.",
        usage="%(prog)s [--config PATH] [--<setting> VALUE ...] [--verbose] COMMAND ...",
        parents=[settings_parent()])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     prog="reconciler")

    db = commands.add_parser("db", help="schema migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_commands.add_parser("upgrade", parents=[common], help="apply migrations up to head")

    commands.add_parser("run", parents=[common],
                        help="the sidecar: scheduled passes, /metrics, /healthz, /readyz")
    demo = commands.add_parser("demo", parents=[common],
                               help="crash real workers and watch the reconciler recover them")
    demo.add_argument("--keep", action="store_true", help="keep the demo's database file")
    demo.add_argument("--source",
                      choices=tuple(DEMOS), default=DEFAULT_SOURCE,
                      help="native: this project's workers on SQLite; procrastinate: a real "
                      "Procrastinate worker on a throwaway PostgreSQL; django-tasks: a real "
                      "django-tasks-db worker on SQLite; celery: real Celery workers and a "
                      "throwaway redis-server")

    run_once = commands.add_parser("pass", parents=[common], help="run one bounded pass now")
    run_once.add_argument("--dry-run", action="store_true", help="decide, write nothing")
    run_once.add_argument("--json", action="store_true")

    jobs = commands.add_parser("jobs", help="public, redacted job state")
    job_commands = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    listing = job_commands.add_parser("list", parents=[common], help="jobs, newest first")
    listing.add_argument("--status", choices=[s.value for s in JobStatus])
    listing.add_argument("--limit", type=positive_int, default=100)
    _output_arguments(listing)
    show = job_commands.add_parser("show", parents=[common], help="one job and its steps")
    show.add_argument("job_id", type=job_id_text, help="the job's id as its source spells it")
    show.add_argument("--json", action="store_true")

    why = job_commands.add_parser(
        "explain", parents=[common],
        help="what the decision table says about a processing job right now (read only)")
    why.add_argument("job_id", help="the job's id as its source spells it")
    why.add_argument("--json", action="store_true")
    for action, help_text in OPERATOR_HELP.items():
        acting = job_commands.add_parser(action, parents=[common], help=help_text)
        _operator_arguments(acting, bulk=action in BULK_ACTIONS)

    # Reading the audit never runs a pass, so the shadow setting means nothing here; its
    # flag is this command's filter instead (dest ``shadow_only``, so it is never a setting).
    audit = commands.add_parser("decisions", parents=[settings_parent(frozenset({"shadow"}),
                                                          after_command=True)],
                                help="the audit trail")
    audit.add_argument("--shadow", dest="shadow_only", action="store_true",
                       help="only decisions recorded in shadow mode (nothing was changed)")
    audit.add_argument("--reason", choices=[r.value for r in Reason])
    audit.add_argument("--since", type=parse_duration, metavar="DURATION",
                       help="only decisions younger than this (90s, 15m, 2h, 7d)")
    audit.add_argument("--limit", type=positive_int, default=100)
    _output_arguments(audit)

    kinds = commands.add_parser(
        "kinds", parents=[common],
        help="each [kinds] pattern with the running kinds it matches; warns about patterns "
        "that match none (read only)")
    kinds.add_argument("--json", action="store_true")

    explain = commands.add_parser("explain", parents=[common], help="print the decision table")
    explain.add_argument("--markdown", action="store_true",
                         help="as Markdown (docs/decision-table.md is made from this)")
    return parser


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, or ``--format text|json|csv`` (an export, written as it is read)."""
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="same as --format json")
    output.add_argument("--format", choices=FORMATS, default="text",
                        help="text for people (the default), json, or csv to export")
