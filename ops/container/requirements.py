"""Print the requirements a container build installs, one per line, from pyproject.toml.

    python3 requirements.py pyproject.toml build            # the build backend's
    python3 requirements.py pyproject.toml run [EXTRAS]     # the project's, with extras

The Containerfile installs these before it copies the source, so the layer that downloads
every dependency is rebuilt only when pyproject.toml changes, not on every code change.
Standard library only: it runs on Debian's python3 before any virtualenv exists.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, what: str, extras: str = "") -> list[str]:
    """The build system's requirements (``build``) or the project's with ``extras``
    (``run``; a comma-separated list); an unknown extra is a ValueError naming the known."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    if what == "build":
        return list(data["build-system"]["requires"])
    if what != "run":
        raise ValueError(f"expected build or run, not {what!r}")
    project = data["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    wanted = list(project.get("dependencies", []))
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        if extra not in optional:
            raise ValueError(f"no extra {extra!r}; the extras are: {', '.join(sorted(optional))}")
        wanted += optional[extra]
    return wanted


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        lines = requirements(Path(argv[0]), argv[1], *argv[2:])
    except ValueError as exc:
        print(f"requirements.py: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
