"""Where one batch of the recovery pass spends its time, part by part.

    python -m benchmarks.breakdown --engine sqlite --jobs 1000000 --stale 10000
    python -m benchmarks.breakdown --engine postgresql --jobs 1000000 --stale 10000
    python -m benchmarks.breakdown --engine mariadb --jobs 1000000 --stale 10000

Builds the recovery dataset, drains it as ``python -m benchmarks`` does (batches of 500),
and prints the mean milliseconds per batch of each part of a pass: the pass's own store
methods are wrapped with timers, so each figure is that part's SQL and its Python
together. The timers add a few microseconds per call; the main benchmark has none.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.dataset import Shape, build
from benchmarks.harness import Databases, drain, store_on
from reconciler.core import passes
from reconciler.storage.audit import SqlAudit, SqlLease
from reconciler.storage.native_source import NativeSource
from reconciler.storage.pass_store import SqlPassStore, SqlPassUnit

BATCH_SIZE = 500
PARTS = (
    ("take", "leader lease"),
    ("expire_gone_owners", "worker session sweep"),
    ("start_pass", "pass row"),
    ("candidates", "candidate scan and step records (rows built)"),
    ("plan_changes", "evidence and decision table, once per shape"),
    ("_swap", "compare-and-swap UPDATE (rows encoded)"),
    ("close_attempts", "attempt closing UPDATE (rows encoded)"),
    ("finish_pass", "audit INSERT and pass counts (rows encoded)"),
    ("commit", "commit"),
)


@contextmanager
def _timers() -> Iterator[dict[str, float]]:
    """Seconds spent in each part while the block runs; the wrapped methods are restored."""
    spent: dict[str, float] = defaultdict(float)
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - started

        saved.append((owner, name, original))
        setattr(owner, name, timed)

    wrap(SqlLease, "take", "take")
    for name in ("expire_gone_owners", "candidates", "apply", "_swap"):
        wrap(NativeSource, name, name)
    wrap(SqlAudit, "start_pass", "start_pass")
    wrap(SqlAudit, "finish_pass", "finish_pass")
    wrap(passes, "plan_changes", "plan_changes")
    original_transaction = SqlPassStore.pass_transaction

    @contextmanager
    def transaction(self: SqlPassStore, *, dry_run: bool) -> Iterator[SqlPassUnit]:
        with original_transaction(self, dry_run=dry_run) as tx:
            yield tx
            committing = time.perf_counter()
        spent["commit"] += time.perf_counter() - committing

    saved.append((SqlPassStore, "pass_transaction", original_transaction))
    SqlPassStore.pass_transaction = transaction  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
    # The source's apply() is the swap and the attempt closing.
    spent["close_attempts"] = spent.pop("apply", 0.0) - spent["_swap"]


def breakdown(engine_name: str, base_url: str | None, shape: Shape) -> list[tuple[str, float]]:
    """(part, milliseconds per full batch) for one drain of ``shape``; the total last."""
    dbs = Databases(engine_name, base_url)
    try:
        with dbs.fresh() as engine:
            build(engine, shape)
            store = store_on(engine)
            with _timers() as spent:
                started = time.perf_counter()
                decided, _ = drain(store, BATCH_SIZE)
                total = time.perf_counter() - started
    finally:
        dbs.close()
    if not decided:
        raise SystemExit("nothing was stale: give --stale a positive number")
    batches = decided / BATCH_SIZE
    rows = [(label, spent.get(part, 0.0) * 1000 / batches) for part, label in PARTS]
    rows.append(("everything else (pass loop, connection checkout)",
                 total * 1000 / batches - sum(ms for _, ms in rows)))
    rows.append(("total per batch", total * 1000 / batches))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("sqlite", "postgresql", "mariadb"),
                        default="sqlite")
    parser.add_argument("--database-url",
                        help="an empty PostgreSQL (or MariaDB) database to use")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--stale", type=int, default=10_000)
    args = parser.parse_args(argv)
    rows = breakdown(args.engine, args.database_url, Shape(args.jobs, args.stale))
    print(f"{args.engine}, N = {args.jobs}, S = {args.stale}, batches of {BATCH_SIZE}")
    print(f"{'part':<52} {'ms/batch':>9}")
    for label, ms in rows:
        print(f"{label:<52} {ms:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
