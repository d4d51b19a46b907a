"""The Debian packages the suite drives, listed once (tests/system_packages.py): how a
package is found, and the one line that names what is missing."""

from __future__ import annotations

from tests.system_packages import CONTAINER, SUITE, Package, install_line, missing


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
