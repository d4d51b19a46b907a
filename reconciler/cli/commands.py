"""The ``reconciler`` command line: subcommands, ``--json``, one-line errors, exit codes."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from reconciler import __version__
from reconciler.cli.arguments import (
    MAX_JOB_ID,
    OneLineParser,
    job_id,
    parse_duration,
    positive_int,
    settings_parent,
)
from reconciler.cli.views import decision_view, job_view, pass_view, printable
from reconciler.config import Config, NativeConfig, load_config
from reconciler.core.decisions import render_markdown, render_table
from reconciler.core.passes import explain_jobs, run_pass
from reconciler.core.vocabulary import JobStatus, Reason
from reconciler.errors import (
    ActionRefusedError,
    DatabaseUnavailableError,
    NotFoundError,
    ReconcilerError,
)
from reconciler.logs import configure_logging
from reconciler.redaction import display_url, redact
from reconciler.settings import Settings
from reconciler.wiring import (
    DatabaseTimeouts,
    check_schema,
    error_code,
    error_line,
    open_engine,
    open_pass_store,
    open_store,
    pass_config,
    upgrade_schema,
)

log = logging.getLogger("reconciler.cli")


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    common = settings_parent()
    parser = OneLineParser(
        prog="reconciler", description="Find jobs whose workers died and recover them.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    db = commands.add_parser("db", help="schema migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_commands.add_parser("upgrade", parents=[common], help="apply migrations up to head")

    commands.add_parser("run", parents=[common],
                        help="the sidecar: scheduled passes, /metrics, /healthz, /readyz")
    demo = commands.add_parser("demo", parents=[common],
                               help="crash real workers and watch the reconciler recover them")
    demo.add_argument("--keep", action="store_true", help="keep the demo's database file")
    demo.add_argument("--source",
                      choices=("native", "procrastinate", "django-tasks", "celery"),
                      default="native",
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
    listing.add_argument("--json", action="store_true")
    show = job_commands.add_parser("show", parents=[common], help="one job and its steps")
    show.add_argument("job_id", type=job_id)
    show.add_argument("--json", action="store_true")

    why = job_commands.add_parser(
        "explain", parents=[common],
        help="what the decision table says about a processing job right now (read only)")
    why.add_argument("job_id", help="the job's id as its source spells it")
    why.add_argument("--json", action="store_true")
    for action, help_text in OPERATOR_HELP.items():
        acting = job_commands.add_parser(action, parents=[common], help=help_text)
        acting.add_argument("job_id", type=job_id)
        acting.add_argument("--json", action="store_true")

    # Reading the audit never runs a pass, so the shadow setting means nothing here; its
    # flag is this command's filter instead (dest ``shadow_only``, so it is never a setting).
    audit = commands.add_parser("decisions", parents=[settings_parent(frozenset({"shadow"}))],
                                help="the audit trail")
    audit.add_argument("--shadow", dest="shadow_only", action="store_true",
                       help="only decisions recorded in shadow mode (nothing was changed)")
    audit.add_argument("--reason", choices=[r.value for r in Reason])
    audit.add_argument("--since", type=parse_duration, metavar="DURATION",
                       help="only decisions younger than this (90s, 15m, 2h, 7d)")
    audit.add_argument("--limit", type=positive_int, default=100)
    audit.add_argument("--json", action="store_true")

    explain = commands.add_parser("explain", parents=[common], help="print the decision table")
    explain.add_argument("--markdown", action="store_true",
                         help="as Markdown (docs/decision-table.md is made from this)")
    return parser


def _config(args: argparse.Namespace) -> Config:
    """Flag > environment > config file (``--config``, else ``RECONCILER_CONFIG``) > default."""
    flag_url = getattr(args, "database_url", None)
    if flag_url and redact(flag_url) != flag_url:
        # The process list shows every argument to every user on the machine.
        log.warning("event=password_on_command_line text=%s", json.dumps(
            "--database-url carries a password, which `ps` shows to every user; use "
            "RECONCILER_DATABASE_URL_FILE or RECONCILER_DATABASE_URL"))
    return load_config(getattr(args, "config", None),
                       **{name: getattr(args, name, None) for name in Settings.model_fields})


def _settings(args: argparse.Namespace) -> Settings:
    return _config(args).settings


def _open_engine(settings: Settings, config: Config | None = None) -> Engine:
    # must_exist: no command but `db upgrade` leaves an empty SQLite file behind.
    engine = open_engine(settings.database_url,
                         timeouts=DatabaseTimeouts.from_settings(settings), must_exist=True)
    check_schema(engine, config)
    return engine


def _emit(args: argparse.Namespace, data: Any, human: Callable[[], list[str]]) -> None:
    """``--json``: the data as JSON (which escapes by itself). Otherwise the human lines,
    each through ``printable``: a newline or an escape sequence stored in a job's kind or
    a step's name is shown escaped on its own line, never obeyed by the terminal."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n".join(printable(line) for line in human()))


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    config = _config(args)
    settings = config.settings
    engine = open_engine(settings.database_url,
                         timeouts=DatabaseTimeouts.from_settings(settings))
    upgrade_schema(engine, config)
    shown = display_url(engine.url.render_as_string(hide_password=True))
    print(printable(f"database at {shown} is up to date"))
    return 0


def cmd_pass(args: argparse.Namespace) -> int:
    config = _config(args)
    settings = config.settings
    store = open_pass_store(_open_engine(settings, config), config)
    instance = settings.instance_name or f"cli-{socket.gethostname()}-{os.getpid()}"
    report = run_pass(store, pass_config(settings, instance, config.kinds),
                      dry_run=args.dry_run)
    view = pass_view(report)

    def human() -> list[str]:
        title = "dry run (nothing written)" if report.dry_run else f"pass {report.pass_id}"
        if report.shadow:
            title += " (shadow: decisions recorded, no job changed)"
        lines = [f"{title}: outcome={view['outcome']} candidates={view['candidates']} "
                 f"resumed={view['resumed']} terminalized={view['terminalized']} "
                 f"skipped={view['skipped']}"]
        lines += [f"  job {d['job_id']}: {d['disposition']} ({d['reason']})"
                  + (f" at step {d['resume_step_index']}"
                     if d["resume_step_index"] is not None else "")
                  for d in view["decisions"]]
        return lines

    _emit(args, view, human)
    return 0


def cmd_jobs_list(args: argparse.Namespace) -> int:
    store = open_store(_open_engine(_settings(args)))
    views = [job_view(j) for j in store.list_jobs(args.status, args.limit)]

    def human() -> list[str]:
        if not views:
            return ["no jobs"]
        lines = [f"{'JOB':>8}  {'KIND':<16} {'STATUS':<11} {'ATTEMPTS':>8}  {'STEP':>4}  REASON"]
        lines += [f"{v['job_id']:>8}  {printable(v['job_kind'])[:16]:<16} {v['status']:<11} "
                  f"{v['attempts_used']:>3}/{v['max_attempts']:<4}  {v['resume_step_index']:>4}"
                  f"  {v['reason'] or '-'}" for v in views]
        return lines

    _emit(args, views, human)
    return 0


def cmd_jobs_show(args: argparse.Namespace) -> int:
    store = open_store(_open_engine(_settings(args)))
    job = store.get_job(args.job_id)
    if job is None:
        raise NotFoundError(f"no job with id {args.job_id}")
    view = job_view(job)

    def human() -> list[str]:
        lines = [f"job {view['job_id']} ({view['job_kind']}): {view['status']}"
                 + (f" ({view['reason']})" if view["reason"] else ""),
                 f"  attempts {view['attempts_used']}/{view['max_attempts']}, "
                 f"resumes at step {view['resume_step_index']}"
                 + (", held by an operator" if view["operator_hold"] else "")]
        lines += [f"  step {s['index']}: {s['name']} [{s.get('effect_kind', '?')}] {s['state']}"
                  for s in view["steps"]]
        return lines

    _emit(args, view, human)
    return 0


def cmd_jobs_explain(args: argparse.Namespace) -> int:
    config = _config(args)
    settings = config.settings
    engine = _open_engine(settings, config)
    store = open_store(engine)
    job_id: int | str = args.job_id
    if not isinstance(config.source, NativeConfig):
        # A foreign job id as its system spells it (a UUID for pg-boss, a number elsewhere);
        # the source compares it with its own key column.
        job_id = int(args.job_id) if args.job_id.isdigit() else args.job_id
        planned = explain_jobs(open_pass_store(engine, config), [job_id],
                               pass_config(settings, "cli-explain", config.kinds))
        if not planned:
            raise NotFoundError(f"no running {config.source.kind} job with id {args.job_id}")
    else:
        if not args.job_id.isdigit() or int(args.job_id) > MAX_JOB_ID:
            raise NotFoundError(f"no job with id {args.job_id}")
        job_id = int(args.job_id)
        planned = explain_jobs(open_pass_store(engine, config), [job_id],
                               pass_config(settings, "cli-explain", config.kinds))
    if not planned:
        job = store.get_job(int(job_id))
        if job is None:
            raise NotFoundError(f"no job with id {args.job_id}")
        raise ActionRefusedError(f"job {args.job_id} is {job.job_status}, not processing: "
                                 "the reconciler only judges processing jobs")
    change = planned[0]
    d = change.decision
    view = {"job_id": d.job_id, "disposition": d.disposition.value, "reason": d.reason.value,
            "rule": d.rule_number, "resume_step_index": d.resume_step_index,
            "evidence": change.evidence}

    def human() -> list[str]:
        rule = f"rule {d.rule_number}" if d.rule_number else "pass outcome"
        lines = [f"job {d.job_id}: {d.disposition.value} ({d.reason.value}, {rule})"]
        lines += [f"  {key}: {value}" for key, value in change.evidence.items()]
        return lines

    _emit(args, view, human)
    return 0


OPERATOR_HELP = {
    "hold": "hold a job: workers do not claim it and the reconciler leaves it alone",
    "unhold": "release an operator hold",
    "retry": "requeue a failed or cancelled job with a fresh attempt budget",
    "cancel": "cancel a queued or processing job (its worker is fenced out at once)",
}


def cmd_jobs_action(args: argparse.Namespace) -> int:
    store = open_store(_open_engine(_settings(args)))
    applied, refusal = store.operator_action(args.job_id, args.jobs_command)
    if refusal == "no_such_job":
        raise NotFoundError(f"no job with id {args.job_id}")
    if not applied:
        raise ActionRefusedError(f"cannot {args.jobs_command} job {args.job_id}: {refusal}")
    job = store.get_job(args.job_id)
    view = job_view(job) if job is not None else {"job_id": args.job_id}
    line = f"job {args.job_id}: {args.jobs_command} applied; status {view.get('status')}"
    if args.jobs_command == "retry" and view.get("operator_hold"):
        # A retry never lifts a hold: the operator who held the job decides when it runs.
        line += (f"; it is still held and will not run until `reconciler jobs unhold "
                 f"{args.job_id}`")
    _emit(args, view, lambda: [line])
    return 0


def cmd_decisions(args: argparse.Namespace) -> int:
    config = _config(args)
    store = open_store(_open_engine(config.settings, config))
    records = [decision_view(r) for r in store.list_decisions(
        args.reason, args.since, args.limit, shadow_only=args.shadow_only)]

    def human() -> list[str]:
        if not records:
            return ["no decisions"]
        return [
            f"{r['decided_at']}  pass {r['pass_id']}  job {r['job_id']}: {r['disposition']} "
            f"({r['decision_reason']})"
            + (f" at step {r['resume_step_index']}" if r["resume_step_index"] is not None else "")
            + (" [shadow: nothing changed]" if r["shadow"] else "")
            for r in records]

    _emit(args, records, human)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    print("The decision table: rules in order; the first rule that matches decides.\n")
    print(render_table())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from reconciler.sidecar.service import Service  # noqa: PLC0415 - keeps other commands light

    configure_logging(args.verbose)
    config = _config(args)
    service = Service(config.settings, config=config)
    code = service.run_until_signalled()
    if service.stuck:
        # A thread is still blocked inside the database driver: the interpreter would wait
        # for it at exit (for as long as the database stays frozen). Exit now instead.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    return code


FOREIGN_DEMOS = {"procrastinate": ("demo_procrastinate", "run_procrastinate_demo"),
                 "django-tasks": ("demo_django_tasks_run", "run_django_tasks_demo"),
                 "celery": ("demo_celery_run", "run_celery_demo")}
"""Each real system's demo, imported only when asked for (its system is an optional peer)."""


def cmd_demo(args: argparse.Namespace) -> int:
    if args.source in FOREIGN_DEMOS:
        module, function = FOREIGN_DEMOS[args.source]
        return int(getattr(importlib.import_module(f"reconciler.cli.{module}"), function)())
    from reconciler.cli.demo import run_demo  # noqa: PLC0415 - keeps other commands light

    return run_demo(keep=args.keep)


COMMANDS: dict[tuple[str, ...], Callable[[argparse.Namespace], int]] = {
    ("db", "upgrade"): cmd_db_upgrade,
    ("run",): cmd_run,
    ("demo",): cmd_demo,
    ("pass",): cmd_pass,
    ("jobs", "list"): cmd_jobs_list,
    ("jobs", "show"): cmd_jobs_show,
    ("jobs", "explain"): cmd_jobs_explain,
    **{("jobs", action): cmd_jobs_action for action in OPERATOR_HELP},
    ("decisions",): cmd_decisions,
    ("explain",): cmd_explain,
}


def _command_key(args: argparse.Namespace) -> tuple[str, ...]:
    sub = getattr(args, f"{args.command}_command", None)
    return (args.command,) if sub is None else (args.command, sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run one command; errors become one line on stderr and an exit code."""
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    configure_logging(verbose, level=logging.WARNING)
    try:
        code = COMMANDS[_command_key(args)](args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _output_closed()
    except ReconcilerError as exc:
        if verbose:
            log.exception("command failed")
        return _fail(str(exc), exc.exit_code)
    except (OperationalError, DBAPIError) as exc:
        if verbose:
            log.exception("database error")
        return _fail(f"database error ({error_code(exc).value}): {error_line(exc)}",
                     DatabaseUnavailableError.exit_code)
    except KeyboardInterrupt:
        return 130


def _fail(message: str, code: int) -> int:
    """The one error line: passwords hidden, control characters escaped."""
    print(printable(f"reconciler: error: {redact(message)}"), file=sys.stderr)
    return code


def _output_closed() -> int:
    """The reader of our output went away (``| head -1``): what it wanted it got. End
    quietly; point stdout at /dev/null so the interpreter's final flush cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0

