"""The ``reconciler`` commands: what each does, ``--json``, one-line errors, exit codes.

The grammar (every command's arguments) is ``cli.arguments`` and the entry point
``cli.main``, which imports this module only once the arguments parse; here each command
gets its parts from the composition root and prints what it found.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable
from typing import Any

from reconciler.cli.arguments import OPERATOR_HELP, is_bulk
from reconciler.cli.bulk import bulk_action
from reconciler.cli.explain_view import explain_lines, explain_view
from reconciler.cli.kinds_command import kinds_command
from reconciler.cli.who_acts import who_acts
from reconciler.config.fields import SETTING_FIELDS
from reconciler.config.loader import Config, load_config
from reconciler.config.registry import DEFAULT_SOURCE, is_native
from reconciler.core.decisions import render_markdown, render_table
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import explain_by_kind, run_pass
from reconciler.core.vocabulary import JobKey, OperatorAction
from reconciler.demos import DEMOS
from reconciler.errors import (
    LIVENESS_UNKNOWN_EXIT,
    ActionRefusedError,
    ConfigError,
    DatabaseUnavailableError,
    NotFoundError,
    ReconcilerError,
)
from reconciler.exports import DECISION_COLUMNS, JOB_COLUMNS, csv_chunks, json_chunks
from reconciler.logs import configure_logging
from reconciler.redaction import redact
from reconciler.root.cli import (
    DATABASE_ERRORS,
    CliParts,
    assemble_cli,
    error_code,
    error_line,
)
from reconciler.root.migrations import migrate
from reconciler.views import (
    decision_view,
    job_lines,
    job_list_lines,
    job_view,
    pass_view,
    printable,
    timeline_view,
    with_history,
)

log = logging.getLogger("reconciler.cli")


def _config(args: argparse.Namespace) -> Config:
    """Flag > environment > config file (``--config``, else ``RECONCILER_CONFIG``) > default."""
    flag_url = getattr(args, "database_url", None)
    if flag_url and redact(flag_url) != flag_url:
        # The process list shows every argument to every user on the machine.
        log.warning("event=password_on_command_line text=%s", json.dumps(
            "--database-url carries a password, which `ps` shows to every user; use "
            "RECONCILER_DATABASE_URL_FILE or RECONCILER_DATABASE_URL"))
    return load_config(getattr(args, "config", None),
                       **{spec.name: getattr(args, spec.name, None) for spec in SETTING_FIELDS})


def _assemble(args: argparse.Namespace) -> CliParts:
    """The command's parts, from its config: one engine, checked once. No command but
    ``db upgrade`` leaves an empty SQLite file behind."""
    return assemble_cli(_config(args))


def _emit(args: argparse.Namespace, data: Any, human: Callable[[], list[str]]) -> None:
    """``--json``: the data as JSON (which escapes by itself). Otherwise the human lines,
    each through ``printable``: a newline or an escape sequence stored in a job's kind or
    a step's name is shown escaped on its own line, never obeyed by the terminal."""
    if getattr(args, "json", False):
        print(json_text(data))
    else:
        print("\n".join(printable(line) for line in human()))


def json_text(data: Any) -> str:
    """``data`` as a command's ``--json`` prints it (a value JSON has no type for: as text)."""
    return json.dumps(data, indent=2, default=str)


def _exported(args: argparse.Namespace, columns: tuple[str, ...],
              pages: Iterable[list[dict[str, Any]]]) -> bool:
    """``--json`` or ``--format json|csv``: the records written as they are read, a page at
    a time (True); else nothing written (False: the caller prints its human lines)."""
    fmt = "json" if args.json else args.format
    if fmt == "text":
        return False
    chunks = json_chunks(pages) if fmt == "json" else csv_chunks(columns, pages)
    for chunk in chunks:
        sys.stdout.write(chunk)
    sys.stdout.flush()
    return True


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    print(printable(migrate(_config(args))))
    return 0


def cmd_pass(args: argparse.Namespace) -> int:
    cli = _assemble(args)
    settings = cli.config.settings
    instance = settings.instance_name or f"cli-{socket.gethostname()}-{os.getpid()}"
    report = run_pass(cli.passes, cli.pass_config(instance), dry_run=args.dry_run)
    view = pass_view(report)

    def human() -> list[str]:
        title = "dry run (nothing written)" if report.dry_run else f"pass {report.pass_id}"
        if report.shadow:
            title += " (shadow: decisions recorded, no job changed)"
        if report.braked:
            title += (" (mass-staleness brake engaged: every resume and terminalization "
                      "held as skip mass_staleness_brake)")
        lines = [f"{title}: outcome={view['outcome']} candidates={view['candidates']} "
                 f"resumed={view['resumed']} terminalized={view['terminalized']} "
                 f"skipped={view['skipped']}"]
        lines += [f"  job {d['job_id']}: {d['disposition']} ({d['reason']})"
                  + (f" at step {d['resume_step_index']}"
                     if d["resume_step_index"] is not None else "")
                  for d in view["decisions"]]
        return lines

    _emit(args, view, human)
    if report.liveness is not None:
        # What cron runs: not green while nothing that depends on liveness can be decided.
        where = redact(report.liveness.where)
        print(printable(f"reconciler: liveness unknown ({report.liveness.code.value}) at "
                        f"{where}: nothing that depends on it was decided"), file=sys.stderr)
        return LIVENESS_UNKNOWN_EXIT
    return 0


def _job_key(config: Config, text: str) -> JobKey:
    """A job id as the configured source spells it; one line (exit 2) when it cannot be."""
    try:
        return config.source_entry.parse_job_key(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def cmd_jobs_list(args: argparse.Namespace) -> int:
    jobs = _assemble(args).jobs
    views = [job_view(j) for j in jobs.list_jobs(args.status, args.limit)]
    if not _exported(args, JOB_COLUMNS, [views]):
        _emit(args, views, lambda: job_list_lines(views))
    return 0


def cmd_jobs_show(args: argparse.Namespace) -> int:
    config = _config(args)
    job_key = _job_key(config, args.job_id)  # a malformed id: one line, no database opened
    view = show_view(assemble_cli(config), job_key, args.job_id)
    _emit(args, view, lambda: job_lines(view, config.source_entry.kind))
    return 0


def show_view(cli: CliParts, job_key: JobKey, text: str) -> dict[str, Any]:
    """What ``jobs show --json`` prints of the job ``text`` names (``job_key``)."""
    job = cli.jobs.get_job(job_key)
    if job is None:
        raise NotFoundError(_no_job(cli.config, text))
    # Our decisions about the job and the operators' actions on it, in time order.
    return _with_actions(cli, job.job_id, job_view(job))


def _no_job(config: Config, text: str) -> str:
    foreign = "" if is_native(config.source) else f"{config.source_entry.kind} "
    return f"no {foreign}job with id {text}"


def cmd_jobs_explain(args: argparse.Namespace) -> int:
    cli = _assemble(args)
    config = cli.config
    try:
        # The id as the source spells it (a UUID for pg-boss, a number elsewhere).
        job_key = config.source_entry.parse_job_key(args.job_id)
    except ValueError:
        raise NotFoundError(_no_job(config, args.job_id)) from None
    view = explained_view(cli, job_key, args.job_id)
    _emit(args, view, lambda: explain_lines(view))
    return 0


def explained_view(cli: CliParts, job_key: JobKey, text: str) -> dict[str, Any]:
    """What ``jobs explain --json`` prints of the job ``text`` names (``job_key``); a job
    no pass judges now is refused with why (``ActionRefusedError``: exit 6)."""
    planned = explain_by_kind(cli.passes, [job_key], cli.pass_config("cli-explain"))
    if not planned:
        job = cli.jobs.get_job(job_key)
        if job is None:
            raise NotFoundError(_no_job(cli.config, text))
        unjudged = cli.jobs.unjudged(job_key) if job.job_status == "processing" else None
        if unjudged is not None:
            # Processing, yet no pass can judge it: say what its row lacks and what to set.
            raise ActionRefusedError(
                f"job {text} is processing but cannot be judged: {unjudged.why}; "
                f"no pass will decide it. To fix: {unjudged.fix}")
        raise ActionRefusedError(f"job {text} is {job.job_status}, not processing: "
                                 "the reconciler only judges processing jobs")
    return explain_view(planned[0], cli.config.kinds, cli.jobs.get_job(job_key))


def cmd_jobs_action(args: argparse.Namespace) -> int:
    config = _config(args)
    entry = config.source_entry
    action = OperatorAction(args.jobs_command)
    if action not in entry.capabilities.actions:
        # Refused before anything is read: the source's system has its own tools for it.
        raise ActionRefusedError(
            f"cannot {action} job {args.job_id}: source {entry.kind} takes no {action} "
            f"(operator commands it takes: "
            f"{', '.join(sorted(entry.capabilities.actions)) or 'none'})")
    # A dry run records nothing, so it needs no name for who acts.
    actor = "" if getattr(args, "dry_run", False) else who_acts(args.actor)
    if is_bulk(args):
        return bulk_action(args, _desk(assemble_cli(config)), action, actor)
    _job_key(config, args.job_id)  # a malformed id: one line, no database opened
    cli = assemble_cli(config)
    report = _desk(cli).act(action, args.job_id, actor=actor, note=args.note)
    if report.refusal == "no_such_job":
        raise NotFoundError(_no_job(config, args.job_id))
    view = {"job_id": args.job_id, "action": action.value, "applied": report.applied,
            "refusal": report.refusal, "line": report.line, "actor": actor,
            "note": args.note}
    if not report.applied and not args.json:
        raise ActionRefusedError(f"cannot {action} job {args.job_id}: {report.refusal}")
    _emit(args, view, lambda: [report.line])
    return 0 if report.applied else ActionRefusedError.exit_code


def _desk(cli: CliParts) -> OperatorDesk:
    if cli.desk is None:  # pragma: no cover - the registry lists actions it has no desk for
        raise ActionRefusedError(f"source {cli.config.source_entry.kind} takes no action")
    return cli.desk


def _with_actions(cli: CliParts, job_key: JobKey, view: dict[str, Any]) -> dict[str, Any]:
    """``jobs show``'s view with the operator actions and, in time order, the history."""
    source = cli.config.source_entry.kind
    decisions = cli.jobs.decisions_about(job_key, 50)
    shown = with_history(view, decisions, cli.store.actions_about(source, job_key, 50))
    shown["timeline"] = timeline_view(cli.jobs.timeline(job_key, 50))
    if not is_native(cli.config.source) and cli.store.held_by_operator(source, job_key):
        shown["operator_hold"] = True
    return shown


def cmd_decisions(args: argparse.Namespace) -> int:
    store = _assemble(args).store
    pages = ([decision_view(r) for r in page] for page in store.decision_pages(
        args.reason, args.since, args.limit, shadow_only=args.shadow_only))
    if _exported(args, DECISION_COLUMNS, pages):
        return 0
    records = [record for page in pages for record in page]

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
    # Imported here: the sidecar's scheduler, HTTP server and console are for this command.
    from reconciler.root.sidecar import assemble_sidecar  # noqa: PLC0415
    from reconciler.sidecar.service import Service  # noqa: PLC0415

    configure_logging(args.verbose)
    service = Service(assemble_sidecar(_config(args)))
    code = service.run_until_signalled()
    if not service.stuck:
        # Everything the service held is released (engines, sockets, its threads): what
        # is left is the interpreter's teardown of every module, most of a second that a
        # rolling deploy waits for. The exit handlers run (a coverage tool's save), then
        # the process ends, right after its `service_stopped` line.
        atexit._run_exitfuncs()
    # Stuck: a thread is still blocked inside the database driver, and the interpreter
    # would wait for it at exit (for as long as the database stays frozen).
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    os._exit(code)


def cmd_demo(args: argparse.Namespace) -> int:
    # Only the asked-for demo is imported: each real system is an optional peer.
    module, _, function = DEMOS[args.source].partition(":")
    demo = getattr(importlib.import_module(module), function)
    # Only the native demo has a database file of its own to keep (--keep).
    return int(demo(keep=args.keep) if args.source == DEFAULT_SOURCE else demo())


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
    ("kinds",): kinds_command(_assemble, _emit),
}


def _command_key(args: argparse.Namespace) -> tuple[str, ...]:
    sub = getattr(args, f"{args.command}_command", None)
    return (args.command,) if sub is None else (args.command, sub)


def run(args: argparse.Namespace) -> int:
    """Run one parsed command; errors become one line on stderr and an exit code."""
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
    except DATABASE_ERRORS as exc:
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

