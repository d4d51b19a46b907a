"""``python -m tests.chaos.foreign --system NAME``: one chaos run with a real job system;
exit 1 when any invariant count is not 0, 2 when the run cannot start.

See tests/chaos/README.md for what a run does and the longer runs' commands.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from types import FrameType

from tests.chaos.foreign.run import ForeignParams, run_foreign_chaos
from tests.chaos.foreign.systems import SYSTEMS, UnavailableError
from tests.pg_server import INSTALL_HINT, find_pg_bin


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.foreign",
        description="Kill and stop a real job system's workers and the reconciler's "
                    "replicas, restart PostgreSQL once (RQ: its Redis); then check no "
                    "effectful task ran "
                    "twice because of us, no job was left behind, no budget was overrun and "
                    "each attempt was decided once.")
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--jobs", type=int, default=60, help="jobs enqueued")
    parser.add_argument("--kills", type=int, default=12,
                        help="SIGKILLs of workers and replicas during the fault phase")
    parser.add_argument("--stops", type=int,
                        help="workers SIGSTOPped inside a task for a while (default: a "
                             "third of --kills, at least 2)")
    parser.add_argument("--seconds", type=float, default=30.0, help="fault phase length")
    parser.add_argument("--workers", type=int, default=4, help="worker processes at a time")
    parser.add_argument("--replicas", type=int, default=2, help="`reconciler run` replicas")
    parser.add_argument("--hang-max-seconds", type=float, default=1.0,
                        help="longest a task attempt sleeps (each draws 0.1 s to this)")
    parser.add_argument("--drain-seconds", type=float, default=120.0,
                        help="longest the fault-free drain may take")
    parser.add_argument("--seed", type=int, help="random seed (printed in the report)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run's folder (config, markers, process logs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the run's cleanup


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if find_pg_bin() is None:
        print(f"chaos: {INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        params = ForeignParams(
            system=args.system, jobs=args.jobs, kills=args.kills, stops=args.stops,
            seconds=args.seconds, workers=args.workers, replicas=args.replicas,
            hang_max_seconds=args.hang_max_seconds, drain_seconds=args.drain_seconds,
            seed=args.seed, keep=args.keep)
    except ValueError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    try:
        result = run_foreign_chaos(params)
    except UnavailableError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json()) if args.json else result.render())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
