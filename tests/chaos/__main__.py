"""``python -m tests.chaos``: one chaos run; exit 1 when any invariant count is not 0.

See tests/chaos/README.md for what a run does and the full-run command.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from types import FrameType

from tests.chaos.harness import ENGINES, ChaosParams, run_chaos
from tests.mariadb_server import INSTALL_HINT as MARIADB_INSTALL_HINT
from tests.mariadb_server import find_binaries
from tests.pg_server import INSTALL_HINT, find_pg_bin


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos",
        description="Kill workers, reconciler replicas and the database at random; then "
                    "check that no job was lost, no effect repeated, no stale write landed.")
    parser.add_argument("--engine", choices=ENGINES, default="sqlite")
    parser.add_argument("--jobs", type=int, default=300, help="jobs enqueued during the run")
    parser.add_argument("--kills", type=int, default=40,
                        help="process deaths to cause (failpoints and the killer)")
    parser.add_argument("--replicas", type=int, default=2, help="`reconciler run` replicas")
    parser.add_argument("--db-restarts", type=int, default=0,
                        help="database server crashes and restarts (postgresql, mariadb)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the fault phase")
    parser.add_argument("--workers", type=int, default=4, help="worker processes at a time")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker")
    parser.add_argument("--drain-seconds", type=float, default=120.0,
                        help="longest the fault-free drain may take")
    parser.add_argument("--poison", type=int, default=2,
                        help="jobs whose step SIGKILLs every worker that runs it")
    parser.add_argument("--interval-seconds", type=float, default=0.3,
                        help="the replicas' pass interval")
    parser.add_argument("--seed", type=int, help="random seed (printed in the report)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run's folder (SQLite database, ledger, process logs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines on stderr (printed at least every 10 s)")
    return parser


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the harness's cleanup


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine == "postgresql" and find_pg_bin() is None:
        print(f"chaos: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if args.engine == "mariadb" and find_binaries() is None:
        print(f"chaos: {MARIADB_INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        params = ChaosParams(
            engine=args.engine, jobs=args.jobs, kills=args.kills, replicas=args.replicas,
            db_restarts=args.db_restarts, seconds=args.seconds, workers=args.workers,
            concurrency=args.concurrency, drain_seconds=args.drain_seconds, seed=args.seed,
            keep=args.keep, poison=args.poison, interval_seconds=args.interval_seconds,
            progress=not args.quiet)
    except ValueError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    result = run_chaos(params)
    if args.json:
        print(json.dumps(result.as_json(), sort_keys=False))
    else:
        print(result.render())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
