"""The container tests: the image built from ops/container/Containerfile, run with podman.

Every test here is marked ``container``. The README's test command leaves them out
(``-m "not container"``: a cold build takes minutes); ``.ci/run`` runs them as a step of
their own. Without podman, runc or debootstrap they are skipped with a one-line hint,
except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import os

import pytest

from tests.container import podman_cli

# What the build measured, for the run's summary (pytest_terminal_summary below).
FACTS: dict[str, str] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/container" in str(item.path):
            item.add_marker(pytest.mark.container)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FACTS:
        terminalreporter.section("container image")
        for key, value in FACTS.items():
            terminalreporter.write_line(f"{key}: {value}")


@pytest.fixture(scope="session")
def image() -> str:
    """The image, built from the repository on the local Debian base (made when missing)."""
    missing = podman_cli.missing_tools()
    if missing:
        message = f"{', '.join(missing)} not found: {podman_cli.MISSING_HINT}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {message}", pytrace=False)
        pytest.skip(message)
    base_seconds = podman_cli.ensure_base()
    FACTS["base"] = (f"{podman_cli.BASE_IMAGE} made by debootstrap in {base_seconds:.0f} s"
                     if base_seconds is not None else f"{podman_cli.BASE_IMAGE} kept")
    build_seconds = podman_cli.build_image()
    FACTS["build"] = f"{build_seconds:.1f} s"
    return podman_cli.IMAGE
