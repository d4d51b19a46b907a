"""The command line: ``reconciler`` and its subcommands, the public redacted views, the demo."""

from reconciler.cli.arguments import parse_duration
from reconciler.cli.commands import build_parser, main

__all__ = ["build_parser", "main", "parse_duration"]
