"""The controller's one rewrite of the test modules (tests/rewrite_cache.py): the workers
find every module cached, and a failing assert still says what it compared."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _project(root: Path) -> None:
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["suite"]\n')
    suite = root / "suite"
    (suite / "deeper").mkdir(parents=True)
    # The count goes to a file: what pytest_configure prints is not always shown.
    (suite / "conftest.py").write_text(textwrap.dedent("""
        import os
        from pathlib import Path
        from tests import rewrite_cache

        def pytest_configure(config):
            count = rewrite_cache.warm(config)
            with open(Path(os.environ["WARMED_LOG"]), "a") as log:
                log.write(f"{count}\\n")
    """))
    (suite / "test_numbers.py").write_text(
        "def test_sum():\n    total = 1 + 1\n    assert total == 3\n")
    (suite / "deeper" / "test_more.py").write_text("def test_true():\n    assert True\n")
    (suite / "helpers.py").write_text("VALUE = 1\n")


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTHONDONTWRITEBYTECODE")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cov"],
        cwd=root, capture_output=True, text=True, timeout=120, check=False,
        env={**env, "PYTHONPATH": str(REPO_ROOT), "WARMED_LOG": str(root / "warmed.log")})


def test_each_test_module_is_rewritten_once_and_its_asserts_still_explain(
        tmp_path: Path) -> None:
    _project(tmp_path)
    first = _run(tmp_path)
    second = _run(tmp_path)

    # Both test modules the first time (pytest had rewritten the conftest when it loaded
    # it, before calling it); nothing the second.
    assert (tmp_path / "warmed.log").read_text().split() == ["2", "0"]
    cached = sorted(p.name.split(".")[0] for p in tmp_path.rglob("*-pytest-*.pyc"))
    assert cached == ["conftest", "test_more", "test_numbers"]
    for done in (first, second):
        assert done.returncode == 1, done.stdout + done.stderr
        assert "1 failed, 1 passed" in done.stdout
        assert "assert 2 == 3" in done.stdout, done.stdout  # rewritten: the value shown
