"""The command line: ``reconciler`` and its subcommands, the public redacted views, the demo."""

from reconciler.cli.arguments import build_parser, parse_duration
from reconciler.cli.commands import main

__all__ = ["build_parser", "main", "parse_duration"]
