"""The Debian packages the suite drives, listed once (tests/system_packages.py): how a
package is found, and the one line that names what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.system_packages import CONTAINER, SUITE, Package, install_line, missing

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_package_is_found_by_a_command_or_a_path() -> None:
    """A probe is a command on PATH, or a path (globs allowed); any one found will do."""
    assert Package("coreutils", ("no-such-command-here", "ls")).present()
    assert Package("base-files", ("/etc/*release",)).present()
    assert not Package("nothing", ("no-such-command-here", "/no/such/*/path")).present()


def test_what_is_missing_is_one_apt_get_line() -> None:
    packages = (Package("there", ("sh",)), Package("gone-a", ("nope-a",)),
                Package("gone-b", ("/nope/b",)))
    assert missing(packages) == ["gone-a", "gone-b"]
    assert install_line(["gone-a", "gone-b"]) == "apt-get install -y gone-a gone-b"


def test_the_lists_name_each_package_once() -> None:
    names = [p.name for p in SUITE + CONTAINER]
    assert len(names) == len(set(names))
    assert {"postgresql", "mariadb-server", "redis-server", "chromium",
            "chromium-driver"} <= set(names)


def test_the_installing_line_reaches_the_terminal_of_a_pytest_run(tmp_path: Path) -> None:
    """Run as root by the README's command, the line that says what it installs is seen:
    pytest imports the module while capturing stderr, and a stream taken then is lost."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import os
        from tests import system_packages

        def pytest_configure(config):
            system_packages.os.geteuid = lambda: 0
            system_packages.shutil.which = lambda name: "/usr/bin/" + name
            system_packages.install = lambda names: None
            present = iter([["gone-a"], []])
            system_packages.missing = lambda packages: next(present)
            assert system_packages.ensure(system_packages.SUITE) == []
    """))
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:cov", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                               "PYTHONPATH": str(REPO_ROOT)})  # .ci/run's --cov: not here
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tests: installing gone-a" in done.stdout + done.stderr
