"""The Debian packages the test suite drives, in one place: the README's test command
(through ``tests/conftest.py``, before any test runs) and ``.ci/run`` both read this list.

As root, what is missing is installed (``apt-get``); otherwise one line says which
packages to install. Standard library only: ``.ci/run`` runs it before the virtualenv
exists, as ``python3 -m tests.system_packages [--container] [--install]``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Package:
    """A Debian package and how to tell it is there: any of its ``probes`` found (a
    command on ``PATH``, or a path, globs allowed)."""

    name: str
    probes: tuple[str, ...]

    def present(self) -> bool:
        return any(glob.glob(p) if "/" in p else shutil.which(p) for p in self.probes)


SUITE = (
    Package("postgresql", ("initdb", "/usr/lib/postgresql/*/bin/initdb")),
    Package("mariadb-server", ("mariadbd", "/usr/sbin/mariadbd")),
    Package("redis-server", ("redis-server",)),
    Package("chromium", ("/usr/bin/chromium",)),
    Package("chromium-driver", ("/usr/bin/chromedriver",)),
    Package("prometheus", ("promtool",)),
    Package("nodejs", ("node",)),
    Package("npm", ("npm",)),
)
"""What the README's test command drives: the throwaway PostgreSQL and MariaDB, Redis (the
Celery and RQ tests' broker), the console's browser, promtool and Prometheus, Node for
graphile-worker and pg-boss."""
CONTAINER = (
    Package("podman", ("podman",)),
    Package("runc", ("runc",)),
    Package("debootstrap", ("debootstrap",)),
    Package("uidmap", ("newuidmap",)),
    Package("fuse-overlayfs", ("fuse-overlayfs",)),
)
"""What the container image's tests add (``.ci/run``'s step of their own)."""


def missing(packages: tuple[Package, ...]) -> list[str]:
    """The names of the packages not found."""
    return [p.name for p in packages if not p.present()]


def install_line(names: list[str]) -> str:
    """The one line that says what to install."""
    return f"apt-get install -y {' '.join(names)}"


def install(names: list[str]) -> None:
    """``apt-get`` the packages (as root), quietly; raise with its output on a failure."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *names]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()[-800:]}")


def ensure(packages: tuple[Package, ...], *, out: TextIO | None = None) -> list[str]:
    """Install what is missing when running as root; the packages still missing (none
    once installed; else what a user must install). ``out`` defaults to ``sys.stderr`` as
    it is at the call: pytest imports this module while it captures ``sys.stderr``, so a
    default taken at import wrote the line into a capture nobody reads."""
    names = missing(packages)
    if names and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"tests: installing {' '.join(names)}", file=out or sys.stderr)
        install(names)
        names = missing(packages)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.system_packages",
                                     description=__doc__)
    parser.add_argument("--container", action="store_true",
                        help="the container image's tests' packages too")
    parser.add_argument("--install", action="store_true",
                        help="install what is missing (as root), else exit 1 naming it")
    args = parser.parse_args(argv)
    packages = SUITE + (CONTAINER if args.container else ())
    names = ensure(packages) if args.install else missing(packages)
    if names:
        print(f"tests: missing Debian packages; run: {install_line(names)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
