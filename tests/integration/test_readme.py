"""The README's snippets run as written, on a fresh database, in a fresh folder.

Blocks preceded by ``<!-- readme-test: NAME -->`` are run in order, per NAME, shell blocks
with bash and Python blocks with this interpreter, with the virtualenv's commands on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

MARKED = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)


def snippets(name: str) -> list[tuple[str, str]]:
    """(language, code) of the README's blocks marked ``name``, in order."""
    text = (REPO_ROOT / "README.md").read_text()
    return [(lang, code) for marked, lang, code in MARKED.findall(text) if marked == name]


def run_snippets(name: str, folder: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    found = snippets(name)
    assert found, f"README.md has no block marked readme-test: {name}"
    for lang, code in found:
        command = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else \
            [sys.executable, "-c", code]
        assert lang in ("sh", "python"), lang
        proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, f"this README block failed:\n{code}\n---\n{proc.stderr}"


def test_the_worker_snippets_run_as_written_on_a_fresh_database(tmp_path: Path) -> None:
    """`reconciler db upgrade`, the worker protocol and the worker runtime, in order, in an
    empty folder: each block exits 0 (the protocol snippet used to fail with
    SchemaOutOfDateError, the runtime snippet named undefined handlers)."""
    run_snippets("worker", tmp_path)
    assert (tmp_path / "jobs.db").exists()


def test_the_schema_change_instructions_work(tmp_path: Path) -> None:
    """The Development section's autogenerate commands, on a copy of the migrations: a new
    revision file appears (they used to fail with "Target database is not up to date")."""
    if shutil.which("alembic", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("alembic's command is not installed beside this interpreter")
    shutil.copy(REPO_ROOT / "alembic.ini", tmp_path / "alembic.ini")
    shutil.copytree(REPO_ROOT / "alembic", tmp_path / "alembic",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = set((tmp_path / "alembic" / "versions").glob("*.py"))

    run_snippets("schema", tmp_path)

    created = set((tmp_path / "alembic" / "versions").glob("*.py")) - before
    assert len(created) == 1, created
