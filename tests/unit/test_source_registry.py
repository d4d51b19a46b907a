"""The source registry: every source declared once, and named nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from reconciler.config.loader import load_config
from reconciler.config.registry import REGISTRY, SOURCES, entry_for, integer_keyed
from reconciler.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[2] / "reconciler"
KINDS = frozenset(SOURCES)

# Modules that may spell a source's kind: the registry, and each source's own modules
# (where its config model and its class live; the native source lives in storage).
NATIVE_MODULE = "reconciler.storage.native_source"
# The demos: ``reconciler demo --source`` picks one by the system it runs (not by the
# configured source), and each demo configures its system's source.
DEMOS = "reconciler.demos"


def allowed_modules() -> set[str]:
    found = {"reconciler.config.registry", NATIVE_MODULE}
    for entry in REGISTRY:
        found.add(entry.config.partition(":")[0])
        found.add(entry.module)
    return found


def allowed(name: str) -> bool:
    """A source's own package (every module of it), the registry, the demos."""
    return any(name == module or name.startswith(f"{module}.")
               for module in (*allowed_modules(), DEMOS))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants (and attribute docstrings) of a module."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for statement in body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                found.add(id(statement.value))
    return found


def kinds_named(path: Path) -> list[tuple[int, str]]:
    """(line, kind) of each string constant in a module that is exactly a source kind."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in KINDS and id(node) not in skip]


def test_no_module_but_the_registry_and_the_sources_names_a_source_kind() -> None:
    """A source is spelled in its own module and its registry entry, nowhere else: code
    that needs to know about sources asks the registry."""
    offences = [f"{module_name(path)}:{line} names {kind!r}"
                for path in sorted(PACKAGE.rglob("*.py"))
                if not allowed(module_name(path))
                for line, kind in kinds_named(path)]
    assert offences == []


def test_the_check_sees_a_kind_named_in_code(tmp_path: Path) -> None:
    """The scan finds a kind compared in code, and leaves a docstring alone."""
    module = tmp_path / "m.py"
    module.write_text('"""Mentions "pg-boss" in prose."""\nif kind == "pg-boss":\n    pass\n')
    assert kinds_named(module) == [(2, "pg-boss")]


def test_each_entry_opens_the_source_its_config_names() -> None:
    """Kinds are unique, each entry's config model declares its kind, and a foreign source
    records decisions under its kind."""
    assert len(KINDS) == len(REGISTRY)
    for entry in REGISTRY:
        assert entry.config_model().kind == entry.kind
        opened = getattr(entry.declared(), "name", entry.kind)
        assert opened == entry.kind


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.kind)
def test_config_parsing_reads_the_registry(tmp_path: Path, entry: object) -> None:
    """Every registered kind is a [source] kind the loader takes, with its own keys."""
    from reconciler.config.registry import SourceEntry  # noqa: PLC0415

    assert isinstance(entry, SourceEntry)
    path = tmp_path / "reconciler.toml"
    path.write_text(f'[source]\nkind = "{entry.kind}"\nno_such_key = "x"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "no_such_key" in message
    assert ", ".join(entry.config_model().file_keys()) in message


@pytest.mark.parametrize(("kind", "text", "expected"), [
    ("native", "7", 7),
    ("procrastinate", "7", 7),
    ("pg-boss", "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10",
     "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10"),
    ("table", "7", 7),
    ("table", "job-7", "job-7"),
    ("django-tasks", "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10",
     "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10"),
    ("celery", "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10",
     "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10"),
])
def test_job_ids_as_each_source_spells_them(kind: str, text: str, expected: object) -> None:
    """The command line parses a job id by the source's key type."""
    assert entry_for(kind).parse_job_key(text) == expected


@pytest.mark.parametrize(("kind", "text"), [
    ("native", "seven"), ("native", "0"), ("native", str(2**63)), ("graphile-worker", "-1"),
    ("procrastinate", "\u0661"), ("pg-boss", ""),
])
def test_a_bad_job_id_is_refused(kind: str, text: str) -> None:
    """A text the source cannot hold as an id is refused, naming the source."""
    with pytest.raises(ValueError, match=kind):
        entry_for(kind).parse_job_key(text)


def test_integer_keyed_sources() -> None:
    """The audit keeps ids as text; views give integer-keyed sources' ids back as numbers."""
    assert {kind for kind in KINDS if integer_keyed(kind)} == {
        "native", "procrastinate", "graphile-worker"}
    assert not integer_keyed("no-such-source")


FOREIGN = [e for e in REGISTRY if e.kind != "native"]


@pytest.mark.parametrize("entry", FOREIGN, ids=lambda e: e.kind)
def test_a_foreign_source_is_a_declaration_over_the_one_kit_class(entry: object) -> None:
    """A foreign entry names its package's frozen ``Declaration`` (its config model and
    how its ``System`` is declared); no module under ``reconciler/sources`` subclasses
    the kit's ``DeclaredSource``, and a ``System`` is frozen data."""
    import dataclasses  # noqa: PLC0415

    from reconciler.config.registry import SourceEntry  # noqa: PLC0415
    from reconciler.sources.kit.declaration import Declaration  # noqa: PLC0415
    from reconciler.sources.kit.system import System  # noqa: PLC0415

    assert isinstance(entry, SourceEntry)
    declared = entry.declared()
    assert isinstance(declared, Declaration)
    assert declared.config is entry.config_model()
    assert System.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert all(f.name != "connection" for f in dataclasses.fields(System))
    subclasses = [f"{path}:{node.lineno}"
                  for path in sorted((PACKAGE / "sources").rglob("*.py"))
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.ClassDef)
                  and any(getattr(base, "id", getattr(base, "attr", None)) == "DeclaredSource"
                          for base in node.bases)]
    assert subclasses == []


def test_a_fence_snapshot_is_the_sources_own_frozen_dataclass() -> None:
    """Each foreign fence is a frozen, slotted dataclass; the ledger part is a field."""
    import dataclasses  # noqa: PLC0415

    from reconciler.sources.celery.source import CeleryFence  # noqa: PLC0415
    from reconciler.sources.django_tasks.source import DjangoTasksFence  # noqa: PLC0415
    from reconciler.sources.graphile_worker.source import (  # noqa: PLC0415
        GraphileWorkerFence,
    )
    from reconciler.sources.kit.fences import ForeignFence  # noqa: PLC0415
    from reconciler.sources.pgboss.source import PgBossFence  # noqa: PLC0415
    from reconciler.sources.procrastinate.source import ProcrastinateFence  # noqa: PLC0415
    from reconciler.sources.table import TableFence  # noqa: PLC0415

    for fence in (GraphileWorkerFence, PgBossFence, ProcrastinateFence, TableFence,
                  DjangoTasksFence, CeleryFence):
        assert issubclass(fence, ForeignFence)
        assert fence.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert "__slots__" in vars(fence)
        assert "ledger" in {f.name for f in dataclasses.fields(fence)}
