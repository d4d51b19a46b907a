"""The command line: ``reconciler`` and its subcommands (the demos are ``reconciler.demos``)."""

from reconciler.cli.arguments import build_parser, parse_duration
from reconciler.cli.main import main

__all__ = ["build_parser", "main", "parse_duration"]
