"""The suite's fork server (tests/fork_server.py): its children behave as ``python -c``
processes do, for the tests that start workers and racers through it."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.fork_server import run_script, start_script, suite_server


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_script(script, *args, env={**os.environ, **env}, timeout=60)


def test_a_script_sees_its_arguments_and_exactly_its_environment() -> None:
    done = _run("import json, os, sys, time\n"
                "print(json.dumps([sys.argv, __name__, os.environ.get('ONLY_HERE'),"
                " time.strftime('%z')]))",
                "a", "b", ONLY_HERE="yes", TZ="Pacific/Kiritimati")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '[["-c", "a", "b"], "__main__", "yes", "+1400"]'
    # The next child has the caller's environment, not the last one's.
    assert _run("import os; print(os.environ.get('ONLY_HERE'))").stdout.strip() == "None"


@pytest.mark.parametrize(("script", "code", "stderr"), [
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('gave up')", 1, "gave up\n"),
    ("raise ValueError('no')", 1, "ValueError: no\n"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
])
def test_a_script_ends_with_the_code_an_interpreter_would_give(
        script: str, code: int, stderr: str) -> None:
    done = _run(script)
    assert done.returncode == code
    assert done.stderr.endswith(stderr)


def test_a_script_ends_as_an_interpreter_does_threads_joined_then_atexit() -> None:
    done = _run("import atexit, threading, time\n"
                "atexit.register(print, 'atexit')\n"
                "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()")
    assert (done.returncode, done.stdout.split()) == (0, ["thread", "atexit"])


def test_a_running_child_is_read_through_a_pipe_and_killed_with_sigkill() -> None:
    process = start_script(suite_server(), "import time\nprint('ready', flush=True)\n"
                           "time.sleep(600)", [], os.environ, stdout=subprocess.PIPE)
    assert process.stdout is not None
    try:
        assert process.stdout.readline() == "ready\n"
        assert process.poll() is None
        os.kill(process.pid, 0)  # a process of its own, alive
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(0.1)
        process.kill()
        assert process.wait(30) == -signal.SIGKILL
        assert process.stdout.read() == ""  # its end of the pipe closed with it
    finally:
        process.kill()
        process.stdout.close()


def test_a_script_past_its_timeout_is_killed() -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_script("import time; time.sleep(600)", env=os.environ, timeout=0.5)
    assert time.monotonic() - started < 60  # killed, not waited for
