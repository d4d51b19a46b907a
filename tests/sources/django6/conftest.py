"""Django 6's own tasks framework (``django.tasks``) with django-tasks-db: a venv of its own
on Python 3.12 or newer (Django 6 needs it), beside the suite's, which runs the reconciler.

The venv is built once per interpreter version and requirement set, into a cached folder
named by both (sessions side by side build it once), by pip from PyPI. Without Python 3.12+
the tests are skipped, saying how to get one, except under ``CI=true``, where that is a
failure.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sources.conftest import unavailable

DJANGO6_REQUIREMENTS = ("django==6.1.3", "django-tasks-db==0.13.0", "psycopg[binary]==3.3.9")
"""What the Django 6 project installs: no django-tasks backport, Django's own framework."""
PYTHON_ENV = "RECONCILER_TEST_PYTHON312"
PYTHON_HINT = (f"Python 3.12 or newer is needed for Django 6 (looked for: {PYTHON_ENV}, else "
               "python3.12 to python3.14 on PATH, else ~/.pyenv/versions/3.12+): install one "
               f"(pyenv install 3.12) or name its interpreter in {PYTHON_ENV}")


def _candidates() -> Iterator[str]:
    """Interpreters that may be 3.12+: the one named, else PATH's, else pyenv's."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        yield named
        return
    for name in ("python3.12", "python3.13", "python3.14"):
        found = shutil.which(name)
        if found:
            yield found  # a pyenv shim for a version not selected fails below: skipped
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    yield from sorted(str(p) for p in versions.glob("3.1[2-9]*/bin/python3"))


def _version(python: str) -> str | None:
    """``python``'s version (``3.12.1``) if it runs and is 3.12 or newer."""
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info >= (3, 12), "
                           "'.'.join(map(str, sys.version_info[:3])))"],
            capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return None
    newer, _, version = done.stdout.strip().partition(" ")
    return version if done.returncode == 0 and newer == "True" else None


@pytest.fixture(scope="session")
def django6_python() -> str:
    """The interpreter of a venv with Django 6 and django-tasks-db, built once and cached."""
    found = next(((p, v) for p in _candidates() if (v := _version(p))), None)
    if found is None:
        unavailable(PYTHON_HINT)
    assert found is not None  # unavailable() skipped or failed
    base, version = found
    key = re.sub(r"[^A-Za-z0-9.=-]+", "_", "-".join((f"python{version}", *DJANGO6_REQUIREMENTS)))
    folder = Path(tempfile.gettempdir()) / "reconciler-test-django6" / key
    python = folder / "bin" / "python"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # sessions running side by side build it once
        if not (folder / ".complete").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a broken build left
            for argv in ([base, "-m", "venv", str(folder)],
                         [str(python), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", *DJANGO6_REQUIREMENTS]):
                done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                                      check=False)
                if done.returncode != 0:
                    pytest.fail(f"building the Django 6 venv failed ({' '.join(argv[:4])}): "
                                f"{done.stderr.strip()[-800:]}", pytrace=False)
            (folder / ".complete").write_text("\n".join(DJANGO6_REQUIREMENTS))
    return str(python)
