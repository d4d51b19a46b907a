"""The ``reconciler`` command run in this process, seen as a finished process.

A fresh interpreter costs 0.75 s of CPU before ``main()`` starts (imports), more under
coverage, and about 1.5 s of a busy machine's time: the CLI tests spent most of theirs so.
Where no process boundary is under test (output, exit codes, what a command writes),
``run_main`` calls ``reconciler.cli.main()`` here instead and returns what a subprocess
would have: the exit code, stdout and stderr (tracebacks and warnings included, as a fresh
interpreter would print them).

What a process gives for free is recreated for the call and undone after it: its own
environment and working directory, its own logging set-up, the once-per-process warnings,
and the database connections it leaves behind (closed, as at exit). Calls are serialised:
stdout, stderr, the environment and the working directory belong to the whole process.

Commands that are about a process stay real processes: ``run`` and ``demo`` (signal
handlers, ``os._exit``, child processes) get one unless the test is of a ``run`` that must
refuse to start (see ``run_main``); a test about signals, pipes or the installed entry
point starts its process itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from reconciler.cli import main
from reconciler.config import settings as settings_module

REPO_ROOT = Path(__file__).resolve().parent.parent
ARGV0 = (sys.executable, "-m", "reconciler.cli")
PROCESS_COMMANDS = frozenset({"run", "demo"})
"""Commands that run until signalled or start processes of their own: never in-process."""

# The interpreter's default warning filters (``python -W`` unset), so a warning a command
# raises reaches its stderr as it would from a fresh process.
_DEFAULT_FILTERS: tuple[tuple[str, type[Warning], str], ...] = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)
_LOGGERS = ("", "alembic", "sqlalchemy", "apscheduler")
_one_at_a_time = threading.Lock()


def settings_env(db: str, **settings: Any) -> dict[str, str]:
    """This environment plus the database URL and ``settings`` as ``RECONCILER_*``."""
    env = {**os.environ, "RECONCILER_DATABASE_URL": db}
    env.update({f"RECONCILER_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def run_main(args: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: Path | str = REPO_ROOT, timeout: float = 60, process: bool | None = None
             ) -> subprocess.CompletedProcess[str]:
    """``reconciler ARGS`` with exactly ``env`` as its environment (default: this one),
    in ``cwd``; as ``subprocess.run(..., capture_output=True, text=True)`` would return it.

    ``process``: True starts a real process; None does for ``run`` and ``demo`` only;
    False calls even ``run`` here, for a test of a ``run`` that must refuse to start: it
    cannot go on to serve by mistake, since outside the main thread it cannot install its
    signal handlers (that ends it with a traceback and exit 1, which fails the test).

    A command still running after ``timeout`` seconds raises ``subprocess.TimeoutExpired``,
    as ``subprocess.run`` does (the call is left behind in its daemon thread).
    """
    argv = [*ARGV0, *args]
    if process or (process is None and args and args[0] in PROCESS_COMMANDS):
        return subprocess.run(argv, check=False, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd,
                              env=dict(os.environ if env is None else env))
    out, err = io.StringIO(), io.StringIO()
    result: list[int] = []
    with _one_at_a_time, _as_a_fresh_process(env, cwd, out, err):
        call = threading.Thread(target=_call_main, args=(list(args), result, err),
                                name="reconciler-cli", daemon=True)
        call.start()
        call.join(timeout)
        if call.is_alive():
            raise subprocess.TimeoutExpired(argv, timeout, out.getvalue(), err.getvalue())
    return subprocess.CompletedProcess(argv, result[0], out.getvalue(), err.getvalue())


def _call_main(args: list[str], result: list[int], err: io.StringIO) -> None:
    """What the interpreter does around ``sys.exit(main())``."""
    try:
        code: Any = main(args)
    except SystemExit as exc:  # argparse: usage errors, --help, --version
        code = exc.code
    except BaseException:  # an uncaught error: a traceback on stderr and exit 1
        traceback.print_exc(file=err)
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=err)
        code = 1
    result.append(code)


@contextlib.contextmanager
def _as_a_fresh_process(env: Mapping[str, str] | None, cwd: Path | str,
                        out: io.StringIO, err: io.StringIO) -> Iterator[None]:
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    saved_logging = [(logger, logger.handlers[:], logger.level) for logger in loggers]
    saved_warned = set(settings_module._warned)
    engines: list[sa.Engine] = []
    real_create_engine = sa.create_engine

    def recorded_engine(*args: Any, **kwargs: Any) -> sa.Engine:
        engine = real_create_engine(*args, **kwargs)
        engines.append(engine)
        return engine

    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    settings_module._warned.clear()  # "once per process": this call is a new process
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_DEFAULT_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            sa.create_engine = recorded_engine  # type: ignore[assignment]
            try:
                yield
            finally:
                sa.create_engine = real_create_engine
    finally:
        for engine in engines:  # what exit does to the connections a command left open
            engine.dispose()
        os.chdir(saved_cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(saved_env)
        settings_module._warned.clear()
        settings_module._warned.update(saved_warned)
        for logger, handlers, level in saved_logging:
            logger.handlers[:] = handlers
            logger.setLevel(level)
