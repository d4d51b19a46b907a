"""What a command costs in CPU, every process it starts included: for making the suite cheaper.

``python -m tests.process_cpu -- <command...>`` runs the command with the kernel's process
accounting on (``acct(2)``: one record per process as it exits, killed ones too, with its
user and system time), then prints the command's wall time, the CPU of every process
that exited meanwhile, and that CPU by process name (``python`` for every interpreter,
``postgres``, ``mariadbd``, ``node``, chromium's threads...). The suite's CPU report
(``tests/cpu_report.py``) charges a subprocess to the test that reaps it, and misses one
it never reaps; this counts each process once, whoever started it.

It needs root (``CAP_SYS_PACCT``) and a machine with nothing else running: processes
of other users that exit meanwhile are counted too.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid,
# btime, etime (a float), then eight comp_t (utime, stime, mem, io, rw, minflt, majflt,
# swaps) and the command's name.
_RECORD = struct.Struct("<BBHIIIIIIf8H16s")
_TICKS_PER_SECOND = 100  # AHZ: comp_t counts these
ACTIVE_VARIABLE = "PROCESS_CPU_ACCOUNTING"
"""Set for the measured command: the kernel keeps one accounting file, and a process that
turned accounting on in there would end the measurement."""


def _seconds(comp: int) -> float:
    """A comp_t (13-bit mantissa, 3-bit base-8 exponent) in seconds."""
    return ((comp & 0x1FFF) << (3 * (comp >> 13))) / _TICKS_PER_SECOND


def records(path: Path) -> Iterator[tuple[str, float]]:
    """(process name, CPU seconds) of every process the accounting file holds."""
    data = path.read_bytes()
    for offset in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        fields = _RECORD.unpack_from(data, offset)
        name = fields[18].split(b"\0")[0].decode(errors="replace")
        yield name, _seconds(fields[10]) + _seconds(fields[11])


def _accounting(path: Path | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(None if path is None else str(path).encode()) != 0:
        error = ctypes.get_errno()
        raise SystemExit(f"process_cpu: acct() failed: {os.strerror(error)} "
                         "(process accounting needs root)")


def main(argv: list[str]) -> int:
    """Run the command after ``--`` under process accounting; print what it cost."""
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        raise SystemExit("usage: python -m tests.process_cpu -- <command...>")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "acct"
        path.touch()
        _accounting(path)
        began = time.monotonic()
        try:
            code = subprocess.call(command, env={**os.environ, ACTIVE_VARIABLE: "1"})
        finally:
            _accounting(None)
        wall = time.monotonic() - began
        by_name: Counter[str] = Counter()
        count = 0
        for name, seconds in records(path):
            by_name[name] += seconds
            count += 1
    total = sum(by_name.values())
    print(f"process_cpu: {wall:.1f} s wall, {total:.1f} CPU-s in {count} processes "
          f"(exit {code})", file=sys.stderr)
    for name, seconds in by_name.most_common(12):
        print(f"process_cpu: {seconds:9.1f} CPU-s  {name}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
