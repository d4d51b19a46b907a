"""``python -m reconciler.cli``: the same entry point as the ``reconciler`` script."""

import sys

from reconciler.cli.main import main

sys.exit(main())
