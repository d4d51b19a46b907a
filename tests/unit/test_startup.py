"""What the command line imports before it does anything: ``--help`` and a usage error
import no adapter, database driver or validation library, and a config imports only the
source it names (each run in a fresh interpreter, whose modules are then listed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.config.registry import REGISTRY

# The keys a [source] kind requires (the others' defaults are enough).
REQUIRED = {
    "table": 'table = "jobs"\nid_column = "id"\nstatus_column = "status"\n'
             'processing = "running"\nqueued = "queued"\nfailed = "failed"\n',
    "celery": 'broker_url = "redis://r:6379/0"\n',
}
HEAVY = ("sqlalchemy", "psycopg", "pydantic", "pydantic_settings", "alembic", "models",
         "reconciler.storage", "reconciler.sources", "reconciler.root")


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds once ``code`` ran (no config file of ours)."""
    listing = "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    done = subprocess.run([sys.executable, "-c", code + listing], env=env, check=True,
                          capture_output=True, text=True, timeout=60)
    return set(json.loads(done.stdout.splitlines()[-1]))


def heavy(found: set[str]) -> list[str]:
    return sorted(m for m in found
                  if any(m == h or m.startswith(f"{h}.") for h in HEAVY))


@pytest.mark.parametrize("argv", [["--help"], ["jobs"], ["jobs", "list", "--help"],
                                  ["demo", "--source", "nope"]])
def test_help_and_usage_errors_import_nothing_heavy(argv: list[str]) -> None:
    """They end in the argument parser: no storage, source, driver or pydantic."""
    code = (f"import contextlib, io\nfrom reconciler.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()), "
            f"contextlib.redirect_stderr(io.StringIO()):\n"
            f"    try:\n        main({argv!r})\n    except SystemExit:\n        pass")
    assert heavy(modules_after(code)) == []


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.kind)
def test_a_config_imports_only_the_source_it_names(tmp_path: Path, entry: object) -> None:
    """Loading ``[source] kind = X`` imports X's module and no other source's."""
    from reconciler.config.registry import SourceEntry  # noqa: PLC0415

    assert isinstance(entry, SourceEntry)
    others = {e.module for e in REGISTRY if e.module != entry.module}
    path = tmp_path / "reconciler.toml"
    path.write_text(f'[source]\nkind = "{entry.kind}"\n{REQUIRED.get(entry.kind, "")}')
    found = modules_after(f"from reconciler.config.loader import load_config\n"
                          f"load_config({str(path)!r})")
    assert entry.config.partition(":")[0] in found
    assert sorted(others & found) == []
