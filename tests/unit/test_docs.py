"""docs/ carries the contract: every setting, metric and command the code declares is
documented there, links between the pages resolve, and nothing cites a document outside
the repository.

The lists come from the code itself (the settings type, the metrics registry, the argument
parser), so a setting, metric or command added without its documentation fails here.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from reconciler.cli import build_parser
from reconciler.config.settings import Settings
from reconciler.sidecar.metrics import Metrics
from tests.unit.test_ops_files import register_service_metrics

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
INDEX = DOCS / "README.md"
SETTINGS_PAGE = DOCS / "settings.md"
METRICS_PAGE = DOCS / "metrics.md"
CLI_PAGE = DOCS / "cli.md"

# A citation of a document that is not in the repository. Spelled in pieces so that this
# file does not match itself.
_OUTSIDE = "DES" + "IGN"
OUTSIDE_CITATION = re.compile(
    rf"\b{_OUTSIDE}\.md\b|\b{_OUTSIDE}\s*(?:§|section\b)|(?:\.\./|/work/)shared\b")
# Options every command takes, documented once on the settings and CLI pages.
COMMON_OPTIONS = frozenset({"-h", "--help", "--config", "--verbose"})


def tracked_files() -> list[Path]:
    """Every file git tracks in this checkout (skipped outside a git checkout)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    try:
        out = subprocess.run([git, "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout
    except subprocess.CalledProcessError:
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.decode().split("\0") if name]


def table_row(text: str, name: str) -> str | None:
    """The Markdown table row whose first cell is `name` (in backticks), if any."""
    match = re.search(rf"^\| `{re.escape(name)}` \|.*$", text, re.MULTILINE)
    return match[0] if match else None


class TestNothingCitesOutside:
    """The repository stands on its own: no file points at a document outside it."""

    def test_no_tracked_file_cites_a_document_outside_the_repository(self) -> None:
        """No tracked file names the design document or the shared folder beside the
        checkout; docs/ holds what they said."""
        found = []
        for path in tracked_files():
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
                continue  # binary, or deleted in the work tree
            for number, line in enumerate(text.splitlines(), 1):
                if OUTSIDE_CITATION.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
        assert not found, "cites a document outside the repository:\n" + "\n".join(found)

    @pytest.mark.parametrize("line", [
        "see " + _OUTSIDE + ".md section 5", _OUTSIDE + " §3a: sessions",
        "(" + _OUTSIDE + " section 11)", "../" + "shared/STYLE.md", "/work/" + "shared/x",
    ])
    def test_the_check_recognises_a_citation(self, line: str) -> None:
        """The pattern catches each way the citations were spelled."""
        assert OUTSIDE_CITATION.search(line)

    @pytest.mark.parametrize("line", ["DESIGN_TABLE", "designed from", "shared_fixture"])
    def test_the_check_leaves_other_words_alone(self, line: str) -> None:
        """Names that merely contain the words are not citations."""
        assert not OUTSIDE_CITATION.search(line)


class TestSettingsPage:
    """docs/settings.md documents every setting of ``Settings`` with the code's default."""

    @pytest.mark.parametrize("name", sorted(Settings.model_fields))
    def test_every_setting_has_a_row_with_its_default(self, name: str) -> None:
        """A row per setting; where the default is a plain value, the row states it."""
        row = table_row(SETTINGS_PAGE.read_text(encoding="utf-8"), name)
        assert row is not None, f"docs/settings.md has no row for `{name}`"
        default = Settings.model_fields[name].default
        if default is None or default == "":
            return  # derived (a pass timeout) or absent (a file, a host-pid name): prose
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, str):
            shown = f"`{default}`"
        else:
            shown = f"{default:g}"
        assert cells[1] == shown, f"`{name}`: documented default {cells[1]!r}, code {shown!r}"

    def test_no_row_names_a_setting_that_does_not_exist(self) -> None:
        """Every setting row of the page is a setting of the code."""
        text = SETTINGS_PAGE.read_text(encoding="utf-8")
        section = text[text.index("## Every setting"):text.index("## The config file")]
        rows = re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)
        assert rows
        assert not set(rows) - set(Settings.model_fields)


@cache
def exposition_names() -> dict[str, frozenset[str]]:
    """Every metric /metrics serves, by the name a query uses, with its label names."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    register_service_metrics(metrics.registry)
    found: dict[str, frozenset[str]] = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels}
        found[name] = frozenset(labels - {"le"})
    return found


class TestMetricsPage:
    """docs/metrics.md documents every metric the service exports, with its labels."""

    def test_the_code_exports_metrics(self) -> None:
        """The list the next test walks is not empty."""
        assert "reconciler_passes_total" in exposition_names()

    @pytest.mark.parametrize("name", sorted(exposition_names()))
    def test_every_metric_has_a_row_naming_its_labels(self, name: str) -> None:
        """A row per metric, naming each of its labels."""
        row = table_row(METRICS_PAGE.read_text(encoding="utf-8"), name)
        assert row is not None, f"docs/metrics.md has no row for `{name}`"
        missing = [label for label in exposition_names()[name] if f"`{label}`" not in row]
        assert not missing, f"`{name}`: labels {missing} not documented"

    def test_no_row_names_a_metric_that_does_not_exist(self) -> None:
        """Every metric row of the page is exported."""
        text = METRICS_PAGE.read_text(encoding="utf-8")
        rows = re.findall(r"^\| `(reconciler_[a-z_]+)` \|", text, re.MULTILINE)
        assert rows
        assert not set(rows) - set(exposition_names())


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every runnable command line of the parser (``("jobs", "list")``...) and its parser."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield prefix, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from commands(sub, (*prefix, name))


def own_options(parser: argparse.ArgumentParser) -> set[str]:
    """A command's own long options: not a setting's flag, not one every command takes."""
    setting_flags = {f"--{name.replace('_', '-')}" for name in Settings.model_fields}
    return {option for action in parser._actions for option in action.option_strings
            if option.startswith("--") and option not in setting_flags
            and option not in COMMON_OPTIONS and not option.startswith("--no-")}


COMMAND_LINES = sorted(commands(build_parser()), key=lambda item: item[0])


class TestCommandLinePage:
    """docs/cli.md documents every command of the parser and each command's options."""

    def test_the_parser_has_commands(self) -> None:
        """The list the next tests walk is not empty."""
        assert ("pass",) in {words for words, _ in COMMAND_LINES}

    @pytest.mark.parametrize(("words", "parser"), COMMAND_LINES,
                             ids=[" ".join(words) for words, _ in COMMAND_LINES])
    def test_every_command_and_option_is_documented(
            self, words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        """`reconciler <command>` has a row, and each of its options is named on the page."""
        text = CLI_PAGE.read_text(encoding="utf-8")
        command = " ".join(("reconciler", *words))
        assert re.search(rf"^\| `{re.escape(command)}\b", text, re.MULTILINE), (
            f"docs/cli.md has no row for `{command}`")
        missing = sorted(o for o in own_options(parser) if f"{o}" not in text)
        assert not missing, f"`{command}`: options {missing} not in docs/cli.md"

    def test_common_options_are_documented(self) -> None:
        """The options every command takes are named on the page."""
        text = CLI_PAGE.read_text(encoding="utf-8")
        assert all(option in text for option in ("--config", "--verbose", "--version"))


def markdown_pages() -> list[Path]:
    """The README and every page of docs/."""
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def heading_anchors(path: Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of a Markdown file (outside code blocks)."""
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = None if fenced else re.match(r"^#{1,6}\s+(.+?)\s*#*$", line)
        if heading:
            base = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return frozenset(anchors)


def links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (outside code blocks)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"^[a-z]+:", target)]


class TestPagesHangTogether:
    """The index lists every page, and every relative link lands on a file and heading."""

    def test_the_index_links_every_page(self) -> None:
        """docs/README.md links each page of docs/ (docs/console.md included, once there)."""
        linked = set(links(INDEX))
        pages = {p.name for p in DOCS.glob("*.md")} - {INDEX.name}
        assert not pages - linked, f"docs/README.md does not link {sorted(pages - linked)}"

    def test_the_readme_links_the_index(self) -> None:
        """The README's contents lead to docs/README.md."""
        assert "docs/README.md" in links(REPO / "README.md")

    @pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
    def test_relative_links_resolve(self, page: Path) -> None:
        """Each relative link names a file that exists, and a heading that exists in it."""
        broken = []
        for target in links(page):
            file_part, _, anchor = target.partition("#")
            destination = (page.parent / file_part).resolve() if file_part else page
            if not destination.exists():
                broken.append(target)
                continue
            if anchor and destination.suffix == ".md" and \
                    anchor not in heading_anchors(destination):
                broken.append(target)
        assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


class TestConsolePage:
    """docs/console.md against the code."""

    def test_the_source_filter_row_names_every_source(self) -> None:
        """The ``source`` filter takes every registered source; its row names each one."""
        from reconciler.config.registry import SOURCES  # noqa: PLC0415

        [row] = [line for line in (DOCS / "console.md").read_text().splitlines()
                 if line.startswith("| `source` |")]
        assert [s for s in SOURCES if f"`{s}`" not in row] == []
