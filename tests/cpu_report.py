"""Where the suite's CPU goes: a pytest plugin and its summary, for making the suite faster.

The README's test command is bound by two cores, not by waiting, so the wall clock of a
test says little about what it costs the run. With ``-p tests.cpu_report`` and
``SUITE_CPU_REPORT=<folder>``, each pytest process (each xdist worker) writes the
CPU seconds every test used, its own and its reaped subprocesses' (a worker fleet started
by a module's fixture counts where it is reaped), with when it began and ended, and
``python -m tests.cpu_report <folder>`` sums them by file. The database servers and
Redis, started once per worker, are not counted here: their CPU is the difference between
this sum and the run's total.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path

import pytest

FOLDER_VARIABLE = "SUITE_CPU_REPORT"

_spent: dict[str, tuple[float, float, float, float]] = {}


def _cpu() -> tuple[float, float]:
    times = os.times()
    return times.user + times.system, times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    own, children = _cpu()
    began = time.time()
    yield
    own_after, children_after = _cpu()
    _spent[item.nodeid] = (own_after - own, children_after - children, began, time.time())


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder:
        return
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{name}.json").write_text(json.dumps(_spent))


def main(folder: str, top: int = 40) -> None:
    """Print CPU seconds by test file, most first: the tests' own and their subprocesses'."""
    own: Counter[str] = Counter()
    children: Counter[str] = Counter()
    for report in Path(folder).glob("*.json"):
        for nodeid, (mine, theirs, _, _) in json.loads(report.read_text()).items():
            path = nodeid.split("::")[0]
            own[path] += mine
            children[path] += theirs
    total = own + children
    print(f"{'cpu s':>8} {'own':>8} {'subproc':>8}  file")
    for path, seconds in total.most_common(top):
        print(f"{seconds:8.1f} {own[path]:8.1f} {children[path]:8.1f}  {path}")
    print(f"{sum(total.values()):8.1f} {sum(own.values()):8.1f} {sum(children.values()):8.1f}"
          "  all tests")


if __name__ == "__main__":
    main(sys.argv[1])
