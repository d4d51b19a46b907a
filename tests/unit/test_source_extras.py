"""The extras a team installs for its job system (``pip install
'stale-claim-reconciler[celery]'``): each source that imports packages beyond the base
install names its extra and those packages in the registry, and a config naming it without
them installed is one line saying which extra to install, exit 2. The packages are hidden
from a fresh interpreter (``sys.modules[name] = None``: finding or importing one then fails
as for an uninstalled package)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from reconciler.config.registry import REGISTRY, Capabilities, SourceEntry
from reconciler.errors import ConfigError
from tests.conftest import REPO_ROOT

EXTRAS: dict[str, list[str]] = tomllib.loads(
    (REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

# Every package an extra brings or a job system's own workers run with: the sources
# without an extra must load with all of them missing.
SYSTEM_PACKAGES = ("celery", "kombu", "billiard", "redis", "rq", "django", "django_tasks",
                   "django_tasks_db", "django_celery_results", "procrastinate")
# A config of each such source, as a team writes it (the keys it requires).
CONFIGS = {"celery": 'broker_url = "redis://127.0.0.1:6379/0"\n',
           "rq": 'redis_url = "redis://127.0.0.1:6379/0"\n',
           "dramatiq": 'redis_url = "redis://127.0.0.1:6379/0"\n'}
# Hides the packages named by the first argument, then runs ``reconciler`` on the rest.
HIDING = ("import sys\n"
          "for name in sys.argv[1].split(','):\n"
          "    sys.modules[name] = None\n"
          "from reconciler.cli import main\n"
          "raise SystemExit(main(sys.argv[2:]))\n")

WITH_EXTRA = [entry for entry in REGISTRY if entry.extra is not None]


def reconciler_without(hidden: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    """``reconciler ARGV`` in a fresh interpreter where ``hidden`` cannot be imported."""
    return subprocess.run([sys.executable, "-c", HIDING, ",".join(hidden), *argv],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                          check=False)


def test_each_extra_a_source_names_is_in_pyproject() -> None:
    assert {entry.kind for entry in WITH_EXTRA} >= {"celery", "rq"}
    for entry in WITH_EXTRA:
        assert entry.extra in EXTRAS, f"{entry.kind}: no extra {entry.extra!r} in pyproject"
        assert entry.imports, f"{entry.kind}: name the packages it imports from its extra"
        assert entry.kind in CONFIGS
    assert all(not entry.imports for entry in REGISTRY if entry.extra is None)


@pytest.mark.parametrize("command", ["pass", "run"])
@pytest.mark.parametrize(("kind", "package"),
                         [(entry.kind, package) for entry in WITH_EXTRA
                          for package in entry.imports])
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path: Path, kind: str,
                                                        package: str, command: str) -> None:
    """One pass (``reconciler pass``) or the sidecar (``reconciler run``) refuses to start,
    before it touches the database."""
    config = tmp_path / "reconciler.toml"
    config.write_text(f'database_url = "sqlite:///{tmp_path / "r.db"}"\n\n'
                      f'[source]\nkind = "{kind}"\n{CONFIGS[kind]}')
    extra = next(entry.extra for entry in REGISTRY if entry.kind == kind)

    done = reconciler_without((package,), command, "--config", str(config))

    assert done.stderr.splitlines() == [
        f"reconciler: error: the {kind} source needs the package '{package}', which is not "
        f"installed: pip install 'stale-claim-reconciler[{extra}]'"]
    assert done.returncode == 2
    assert not (tmp_path / "r.db").exists()


def test_the_sources_without_an_extra_import_no_system_package() -> None:
    """Their sidecar reads the system's tables by SQL: no Django, Procrastinate or Celery."""
    kinds = [entry.kind for entry in REGISTRY if entry.extra is None]
    code = ("import sys\n"
            f"for name in {SYSTEM_PACKAGES!r}:\n"
            "    sys.modules[name] = None\n"
            "from reconciler.config.registry import SOURCES\n"
            f"for kind in {kinds!r}:\n"
            "    SOURCES[kind].config_model()\n"
            "    SOURCES[kind].declared()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert {"django-tasks", "procrastinate"} <= set(kinds)


def entry(config: str, extra: str | None) -> SourceEntry:
    return SourceEntry(kind="celery", config=config, source=config, job_key="text",
                       engines=frozenset({"sqlite"}),
                       capabilities=Capabilities(heartbeat=False, error_field=False,
                                                 actions=frozenset()), extra=extra)


def test_a_module_of_ours_missing_is_a_bug_not_an_extra() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"reconciler\.sources\.nowhere"):
        entry("reconciler.sources.nowhere:Config", "celery").config_model()


def test_a_package_missing_from_a_source_without_an_extra_keeps_its_error() -> None:
    with pytest.raises(ModuleNotFoundError, match="no_such_package"):
        entry("no_such_package.config:Config", None).declared()
    with pytest.raises(ConfigError, match=r"package 'no_such_package', .*\[celery\]'$"):
        entry("no_such_package.config:Config", "celery").declared()
