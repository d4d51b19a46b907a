"""How long a ``reconciler`` command takes from the shell, start-up included.

    python -m benchmarks.startup [--runs 7] [--tree PATH ...] [--json]

Each command runs ``--runs`` times in a fresh interpreter (``python -m reconciler.cli``)
against a SQLite database made by ``reconciler db upgrade``; the median wall time and the
median CPU time (user + system, which a loaded machine inflates less) are printed, with
the load average before and after. ``--tree PATH`` runs another checkout's code as well
(``PYTHONPATH=PATH``, with this interpreter and its packages), each run of it right after
the same run of this one, so that a before and an after see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = str(Path(__file__).resolve().parents[1])
# (name, arguments, which database: "current", "absent" or "old")
COMMANDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("--help", ("--help",), "current"),
    ("usage error", ("jobs",), "current"),
    ("jobs list", ("jobs", "list"), "current"),
    ("jobs list --json", ("jobs", "list", "--json"), "current"),
    ("jobs show 1", ("jobs", "show", "1"), "current"),
    ("jobs explain 1", ("jobs", "explain", "1"), "current"),
    ("decisions", ("decisions",), "current"),
    ("kinds", ("kinds",), "current"),
    ("jobs list, no database file", ("jobs", "list"), "absent"),
    ("jobs list, old schema", ("jobs", "list"), "old"),
)


def _databases(folder: Path) -> dict[str, Path]:
    """A database at this release's schema, one whose schema is older, and no file."""
    current, old = folder / "current.db", folder / "old.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    subprocess.run([sys.executable, "-m", "reconciler.cli", "db", "upgrade",
                    "--database-url", f"sqlite:///{current}"],
                   env=dict(env, PYTHONPATH=HERE), check=True, capture_output=True)
    old.write_bytes(current.read_bytes())
    with sqlite3.connect(old) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0001'")
    return {"current": current, "old": old, "absent": folder / "absent.db"}


def _once(tree: str, argv: tuple[str, ...], database: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``reconciler ARGV`` with ``tree``'s code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    env.update(PYTHONPATH=tree, RECONCILER_DATABASE_URL=f"sqlite:///{database}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "reconciler.cli", *argv], env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    """Measure every command; one line (or JSON object) per command and tree."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tree", action="append", default=[],
                        help="another checkout to measure beside this one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    trees = [*args.tree, HERE]
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="reconciler-startup-") as folder:
        databases = _databases(Path(folder))
        for name, command, which in COMMANDS:
            runs: dict[str, list[tuple[float, float]]] = {tree: [] for tree in trees}
            for _ in range(args.runs):
                for tree in trees:
                    runs[tree].append(_once(tree, command, databases[which]))
            for tree, measured in runs.items():
                wall = statistics.median(w for w, _ in measured)
                cpu = statistics.median(c for _, c in measured)
                if args.json:
                    print(json.dumps({"command": name, "tree": tree, "runs": args.runs,
                                      "wall_seconds": round(wall, 3),
                                      "cpu_seconds": round(cpu, 3)}))
                else:
                    print(f"{name:30s} {tree:28s} wall {wall:.3f} s  cpu {cpu:.3f} s")
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
