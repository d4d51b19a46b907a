"""Small helpers the integration tests share: polling database state, reading rows."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobRun
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from tests.mariadb_server import INSTALL_HINT as MARIADB_INSTALL_HINT
from tests.mariadb_server import find_binaries as find_mariadb_binaries
from tests.pg_server import INSTALL_HINT, find_pg_bin

JOBS = JobRun.__table__
DEADLINE_SECONDS = 60.0
"""How long ``wait_for`` waits for an event before it fails: a generous bound on events
that otherwise come in well under a second (a worker process starting, a step starting),
so that a machine running the suite twice at once still sees them; a test that fails
waits this long, a test that passes never does."""


def wait_for(condition: Callable[[], Any], what: str,
             timeout: float = DEADLINE_SECONDS) -> Any:
    """Poll until ``condition()`` is truthy and return it; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def rows_of(engine: Engine, table: Any, *where: Any, order: Any = None
            ) -> list[dict[str, Any]]:
    """Every column of the matching rows."""
    query = sa.select(table).where(*where)
    if order is not None:
        query = query.order_by(order)
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def job_row(engine: Engine, job_id: int) -> dict[str, Any]:
    """The job's ``job_runs`` row."""
    [row] = rows_of(engine, JOBS, JOBS.c.job_id == job_id)
    return row


def require_pg_bin() -> None:
    """Skip when PostgreSQL's server binaries are missing; with CI=true, fail instead."""
    if find_pg_bin() is None:
        _unavailable("PostgreSQL", INSTALL_HINT)


def require_mariadb_bin() -> None:
    """Skip when MariaDB's server binaries are missing; with CI=true, fail instead."""
    if find_mariadb_binaries() is None:
        _unavailable("MariaDB", MARIADB_INSTALL_HINT)


def _unavailable(engine: str, hint: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {engine} is unavailable: {hint}", pytrace=False)
    pytest.skip(f"{engine} not available: {hint}")


@functools.cache
def _sqlite_template() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="reconciler-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "template.db"
    engine = create_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()  # the last connection checkpoints the WAL: the file alone is the database
    return path


def fresh_database(folder: Path, name: str = "jobs.db") -> str:
    """A URL of a freshly migrated SQLite database ``name`` in ``folder``: a copy of a
    template migrated once per process, so a test starts in milliseconds, not a migration
    run."""
    target = folder / name
    shutil.copyfile(_sqlite_template(), target)
    return f"sqlite:///{target}"


def sidecar_service(settings: Any, *, instance: str | None = None) -> Any:
    """A ``reconciler run`` service on these settings (the native source, no ``[kinds]``),
    its parts assembled by the composition root as ``reconciler run`` assembles them."""
    from reconciler.config.loader import Config, parse_kinds  # noqa: PLC0415
    from reconciler.config.tables import NativeConfig  # noqa: PLC0415
    from reconciler.root.sidecar import assemble_sidecar  # noqa: PLC0415
    from reconciler.sidecar.service import Service  # noqa: PLC0415 - only where needed

    config = Config(settings=settings, source=NativeConfig(), kinds=parse_kinds(None, settings))
    return Service(assemble_sidecar(config, instance=instance))


def demo_process(source: str, *blocked: str, path: str | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """``reconciler demo --source SOURCE`` in a process of its own, with ``blocked``
    packages made unimportable and ``PATH`` replaced where given."""
    argv = ["reconciler", "demo", "--source", source]
    body = (f"import sys; sys.modules.update(dict.fromkeys({list(blocked)!r})); "
            f"sys.argv = {argv!r}; from reconciler.cli import main; sys.exit(main())")
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                          timeout=240, check=False, env=env)
