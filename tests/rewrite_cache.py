"""Every test module's asserts rewritten once, before the xdist workers start.

pytest rewrites a test module's ``assert`` statements when it first imports it, and keeps
the result in the module's ``__pycache__`` (a ``-pytest-`` ``.pyc``). In a fresh clone the
five workers start together, none finds that cache, and each rewrites all of the suite's
modules: about 4 CPU-s a worker, 20 for the run. Here the controller rewrites them once,
split over two processes (the machine's two cores), before it starts the workers; they
then read the cache. A module already cached is left as it is.

This uses pytest's own rewriting functions, which are private: if they move, ``warm`` does
nothing and the workers rewrite as they always did.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

import pytest

PROCESSES = 2


def module_paths(config: pytest.Config) -> list[Path]:
    """The files collection imports through the rewriting hook: ``python_files`` and
    ``conftest.py`` under the configured test paths."""
    patterns = [*config.getini("python_files"), "conftest.py"]
    found: set[Path] = set()
    for root in config.getini("testpaths"):
        for path in (config.rootpath / root).rglob("*.py"):
            if any(fnmatch.fnmatch(path.name, p) for p in patterns):
                found.add(path)
    return sorted(found)


def warm(config: pytest.Config) -> int:
    """Rewrite and cache every test module not cached yet; how many were."""
    if sys.dont_write_bytecode:
        return 0
    try:
        from _pytest.assertion import rewrite  # noqa: PLC0415 - private, hence guarded
        from _pytest.assertion.rewrite import (  # noqa: PLC0415
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            get_cache_dir,
        )
        state = config.stash[rewrite.assertstate_key]
    except (ImportError, AttributeError, KeyError):
        return 0

    def pyc(path: Path) -> Path:
        return get_cache_dir(path) / (path.name[:-3] + PYC_TAIL)

    stale = [path for path in module_paths(config) if _read_pyc(path, pyc(path)) is None]

    def rewrite_all(paths: list[Path]) -> None:
        for path in paths:
            try:
                source_hash, code = _rewrite_test(path, config)
            except SyntaxError:
                continue  # collection reports it, with the file's name
            get_cache_dir(path).mkdir(parents=True, exist_ok=True)
            _write_pyc(state, code, source_hash, pyc(path))

    shares = [stale[i::PROCESSES] for i in range(PROCESSES)]
    children = []
    for share in shares[1:]:
        pid = os.fork()
        if pid == 0:
            try:
                rewrite_all(share)
            finally:
                os._exit(0)
        children.append(pid)
    rewrite_all(shares[0])
    for pid in children:
        os.waitpid(pid, 0)
    return len(stale)
