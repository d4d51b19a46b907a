"""Argument types and the parser class of the command line: each refusal is one line."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from reconciler.cli.views import printable
from reconciler.settings import Settings

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_JOB_ID = 2**63 - 1  # job_runs.job_id is a BIGINT
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


def job_id(text: str) -> int:
    """A job id as ``job_runs`` can hold it: a whole number from 1 to 2**63-1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a job id: {text!r}") from None
    if not 1 <= value <= MAX_JOB_ID:
        raise argparse.ArgumentTypeError(
            f"no job can have id {text!r}: ids run from 1 to {MAX_JOB_ID}")
    return value


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
    # Every setting has a flag, generated from the one declaration in Settings. Values stay
    # text here: Settings validates, so a bad flag and a bad env var read the same.
    for name, spec in Settings.model_fields.items():
        if name in without:
            continue
        flag = f"--{name.replace('_', '-')}"
        shown = "" if spec.default is None else f" (default {spec.default})"  # derived ones
        help_text = f"{spec.description}{shown}"
        if spec.annotation is bool:
            # A switch (``--shadow``, ``--no-shadow``) rather than ``--shadow true``.
            group.add_argument(flag, dest=name, default=unset,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag, dest=name, default=unset, metavar="VALUE", help=help_text)
    parent.add_argument("--verbose", action="store_true",
                        default=argparse.SUPPRESS if after_command else False,
                        help="tracebacks and debug logs")
    return parent
