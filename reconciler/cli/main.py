"""The ``reconciler`` script's entry point: parse the arguments, then run the command.

Parsing needs only the grammar (``cli.arguments``, over the settings' plain declarations
and the source registry's plain data), so ``reconciler --help`` and a usage error end
before the database layer, pydantic or any source is imported; a command then imports
what it uses, and only the source it is configured with.
"""

from __future__ import annotations

from collections.abc import Sequence

from reconciler.cli.arguments import build_parser, check_operator_arguments


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run one command; errors become one line on stderr and an exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_operator_arguments(parser, args)
    # Imported once the arguments parse: --help and usage errors have exited above.
    from reconciler.cli.commands import run  # noqa: PLC0415

    return run(args)
