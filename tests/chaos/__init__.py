"""Chaos suite: real processes killed at every protocol point, and mutation checks.

See README.md in this folder. The full run (the issue's goal), per engine::

    python -m tests.chaos --engine sqlite --jobs 10000 --kills 1000 --replicas 3 --seconds 600
    python -m tests.chaos --engine postgresql --jobs 10000 --kills 1000 --replicas 3 \\
        --db-restarts 2 --seconds 600
"""
