"""Start a throwaway MariaDB server for the test suite (Debian's ``mariadb-server``).

Usage as a library::

    with ThrowawayMariaDB() as db:
        db.create_database("t1")
        engine = create_engine(db.url("t1"))

Usage as a wrapper (exports ``RECONCILER_TEST_MARIADB_URL`` for the command)::

    python -m tests.mariadb_server -- pytest -q

The server runs from a data directory of its own in a temporary directory (on
``/dev/shm`` where it exists: the suite writes more than it reads), on a free port of the
loopback, as the ``mysql`` user when started by root (``mariadbd`` refuses root), and is
stopped at the end, or by the watchdog when the process that started it dies.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pymysql

URL_ENV = "RECONCILER_TEST_MARIADB_URL"
INSTALL_HINT = ("MariaDB server binaries (mariadbd, mariadb-install-db) not found: on "
                "Debian/Ubuntu run `apt-get install -y mariadb-server`")
_HOST = "127.0.0.1"
_SERVER_USER = "mysql"
_RAM_DIR = Path("/dev/shm")  # noqa: S108 - a tmpfs on Linux; skipped where it is missing


def find_binaries() -> tuple[str, str] | None:
    """``mariadbd`` and ``mariadb-install-db``, or None when either is missing."""
    server = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin")
    install = shutil.which("mariadb-install-db")
    return None if server is None or install is None else (server, install)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


class ThrowawayMariaDB:
    """One MariaDB server of the tests' own: ``start``, ``url``, ``create_database``,
    ``stop``. ``buffer_pool``: InnoDB's buffer pool (small for tests; benchmarks hold
    their million jobs in memory)."""

    def __init__(self, *, buffer_pool: str = "64M") -> None:
        found = find_binaries()
        if found is None:
            raise RuntimeError(INSTALL_HINT)
        self._server, self._install = found
        base = str(_RAM_DIR) if _RAM_DIR.is_dir() else None
        self.base = Path(tempfile.mkdtemp(prefix="reconciler-mariadb-", dir=base))
        self.port = _free_port()
        self.buffer_pool = buffer_pool
        self._process: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        """The server's data directory."""
        return self.base / "data"

    @property
    def tmp_dir(self) -> Path:
        """The server's own temporary folder: servers bootstrapping side by side in a
        shared ``/tmp`` deleted each other's temporary tables (``mariadb-install-db``
        failed with "Error on delete of '/tmp/#sql-temptable-...'")."""
        return self.base / "tmp"

    def url(self, dbname: str) -> str:
        """The SQLAlchemy URL of database ``dbname`` on this server.

        ``ssl_disabled``: the throwaway server has no TLS, and PyMySQL's default (TLS when
        the server offers it) loads the system's CA certificates for every connection
        first, 0.1 s of CPU each (the MariaDB tests of a subset: 61 against 48 CPU-s)."""
        return f"mysql+pymysql://root@{_HOST}:{self.port}/{dbname}?ssl_disabled=true"

    def _as_server_user(self) -> list[str]:
        return [f"--user={_SERVER_USER}"] if os.geteuid() == 0 else []

    def start(self) -> ThrowawayMariaDB:
        """Initialise the data directory and start the server; wait until it answers."""
        self.tmp_dir.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.base, _SERVER_USER, _SERVER_USER)
            shutil.chown(self.tmp_dir, _SERVER_USER, _SERVER_USER)
        log = self.base / "install.log"
        with log.open("wb") as out:
            done = subprocess.run(
                [self._install, "--no-defaults", f"--datadir={self.data_dir}",
                 "--auth-root-authentication-method=normal", "--skip-test-db",
                 f"--tmpdir={self.tmp_dir}", *self._as_server_user()],
                stdout=out, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {log.read_text()[-2000:]}")
        self._launch()
        atexit.register(self.stop)
        self._start_watchdog()
        self._wait_ready()
        return self

    def _launch(self) -> None:
        self._process = subprocess.Popen(
            [self._server, "--no-defaults", f"--datadir={self.data_dir}",
             f"--port={self.port}", f"--bind-address={_HOST}", "--skip-name-resolve",
             f"--socket={self.base / 'mariadb.sock'}", f"--pid-file={self.base / 'pid'}",
             f"--log-error={self.base / 'error.log'}", f"--tmpdir={self.tmp_dir}",
             # A test server: small, and not durable across a power cut (the suite's data
             # is thrown away); the engine's own settings are the reconciler's to set.
             f"--innodb-buffer-pool-size={self.buffer_pool}",
             "--innodb-flush-log-at-trx-commit=2", "--max-connections=500",
             *self._as_server_user()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def restart(self) -> None:
        """Kill the server (SIGKILL: a crash, as PostgreSQL's immediate restart) and start
        it again on the same data and port; InnoDB recovers from its log. The watchdog
        stops whichever server runs when this process dies."""
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        self._launch()
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
        self._start_watchdog()
        self._wait_ready()

    def _start_watchdog(self) -> None:
        """A shell that stops the server when this process dies (a killed test run)."""
        assert self._process is not None
        script = (f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; "
                  f"kill -9 {self._process.pid} 2>/dev/null; rm -rf '{self.base}'")
        self._watchdog = subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True,
                                          stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                pymysql.connect(host=_HOST, port=self.port, user="root",
                                connect_timeout=2).close()
                return
            except pymysql.err.OperationalError:
                if self._process is not None and self._process.poll() is not None:
                    raise RuntimeError("mariadbd exited: " + self._error_tail()) from None
                if time.monotonic() > deadline:
                    raise RuntimeError("mariadbd did not answer: "
                                       + self._error_tail()) from None
                time.sleep(0.1)

    def _error_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.base / "error.log").read_text()[-2000:]
        return "(no error log)"

    def admin(self, statement: str) -> None:
        """Run one statement as the server's root."""
        conn = pymysql.connect(host=_HOST, port=self.port, user="root", autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
        finally:
            conn.close()

    def create_database(self, name: str) -> None:
        """Create an empty database (utf8mb4, binary collation: keys compare as bytes,
        as on the other engines)."""
        self.admin(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")

    def drop_database(self, name: str) -> None:
        """Drop a database if it exists."""
        self.admin(f"DROP DATABASE IF EXISTS `{name}`")

    def stop(self) -> None:
        """Stop the server and remove its files."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> ThrowawayMariaDB:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--`` with a throwaway server's URL in ``URL_ENV``."""
    args = sys.argv[1:] if argv is None else argv
    if "--" in args:
        args = args[args.index("--") + 1:]
    if not args:
        print("usage: python -m tests.mariadb_server -- COMMAND...", file=sys.stderr)
        return 2
    with ThrowawayMariaDB() as db:
        db.create_database("reconciler_test")
        env = {**os.environ, URL_ENV: db.url("reconciler_test")}
        return subprocess.call(args, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
