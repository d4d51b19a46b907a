"""``python -m reconciler.cli``: the same entry point as the ``reconciler`` script."""

import sys

from reconciler.cli.commands import main

sys.exit(main())
