"""The suite's process accounting tool counts the CPU of processes it never reaps, killed
ones included (tests/process_cpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.process_cpu import ACTIVE_VARIABLE

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="process accounting needs root"),
    pytest.mark.skipif(ACTIVE_VARIABLE in os.environ,
                       reason="the suite is being measured: accounting on here would end that"),
]

# A grandchild that burns about half a second of CPU, then is SIGKILLed by its parent
# without being waited for: only the kernel's accounting sees what it cost.
BURN_THEN_KILLED = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass\\n"
    "time.sleep(60)"])
time.sleep(0.1)
while True:
    with open(f"/proc/{child.pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    if (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") >= 0.5:
        break
    time.sleep(0.05)
os.kill(child.pid, signal.SIGKILL)
"""


def test_a_killed_unreaped_grandchild_is_counted() -> None:
    done = subprocess.run([sys.executable, "-m", "tests.process_cpu", "--", sys.executable,
                           "-c", BURN_THEN_KILLED], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    total = float(first.split(" CPU-s")[0].rsplit(", ", 1)[1])
    assert total >= 0.5, done.stderr
    assert "(exit 0)" in first
