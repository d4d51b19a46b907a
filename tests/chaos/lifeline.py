"""Child processes of the chaos harness die with it: no orphan worker or replica, ever."""

from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "CHAOS_PARENT_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the harness that started it dies.

    The harness starts every child from its main thread (the death signal follows the
    thread that forked) and names itself in ``CHAOS_PARENT_PID``; a child whose parent is
    already gone by the time the request takes effect exits at once.
    """
    expected = os.environ.get(PARENT_ENV)
    if expected is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):
        os._exit(1)
