"""The import contract: the tree's architecture, checked from the source of every module.

The core is pure (no storage, no SQLAlchemy, no service); only storage, the sources, the
demos and the composition root touch a concrete adapter (the schema's ``models`` is one)
or a database driver or broker client; the composition root is imported only by entry
points; no two modules import each other, directly or round about, in the package or in
``benchmarks/``; no module, in either, grows past about 400 lines. An import under ``if
TYPE_CHECKING`` counts like any other: a cycle that only the type checker follows is still
two modules that need each other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reconciler"
# Packages whose import graph must have no cycle.
ACYCLIC = (PACKAGE, ROOT / "benchmarks")
MAX_MODULE_LINES = 420

# Third-party packages that mean I/O or a framework: the core may import none of them.
FRAMEWORKS = ("sqlalchemy", "alembic", "psycopg", "prometheus_client", "apscheduler",
              "pydantic", "pydantic_settings", "http", "socket", "models", "redis", "kombu",
              "celery", "django")
# What the core may import from the rest of the package: the failpoints are the chaos
# tests' SIGKILL hooks, one truthiness check when unset.
CORE_MAY_IMPORT = ("reconciler.core", "reconciler.failpoints")
# Where concrete adapters live (the ORM models are the schema's SQLAlchemy face).
ADAPTERS = ("reconciler.storage", "reconciler.sources", "models")
# The composition root: one module per process role.
COMPOSITION_ROOT = ("reconciler.root",)
# The demos run real systems' workers and assemble their process as the root does.
DEMOS = ("reconciler.demos",)
# What an app adds to its own workers (Dramatiq's middleware): it writes in its source's
# layout, which it imports from the source's keys.
INTEGRATIONS = ("reconciler.integrations",)
# Who may import an adapter: the adapters themselves, the demos and the root. The source
# registry (``reconciler.config.registry``) is no exception: it names each source by where
# it lives and imports none.
MAY_IMPORT_ADAPTERS = (*ADAPTERS, *DEMOS, *COMPOSITION_ROOT, *INTEGRATIONS)
# Database drivers, the ORM and the brokers' clients: only where adapters may be imported.
DRIVERS = ("sqlalchemy", "psycopg", "redis", "kombu", "celery", "django", "dramatiq")
# The entry points, the only importers of the root besides the root itself:
# - the command line's commands (``cli.main`` imports them once the arguments parse; the
#   ``kinds`` command is a module of its own);
# - the demos, each a process of its own, assembled as ``reconciler run`` is;
# - ``reconciler.connect``, the narrow factory of the library's public constructors
#   ``JobClient(...)`` (``reconciler.worker``) and ``StepLedger(...)``
#   (``reconciler.ledger``), which have no entry point of their own;
# - ``alembic/env.py`` (outside the package; checked below).
ROOT_IMPORTERS = ("reconciler.cli.commands", "reconciler.cli.kinds_command", "reconciler.connect",
                  *DEMOS, *COMPOSITION_ROOT)
ALEMBIC_ENV = ROOT / "alembic" / "env.py"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def all_modules() -> dict[str, Path]:
    """Every module of the package and of ``benchmarks/``."""
    return {module_name(p): p for root in ACYCLIC for p in sorted(root.rglob("*.py"))}


@cache
def modules() -> dict[str, Path]:
    """The package's modules."""
    return {name: path for name, path in all_modules().items() if under(name, ("reconciler",))}


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, anywhere in the module: at its top, in a function, and under
    ``if TYPE_CHECKING`` (what the type checker follows is a dependency too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


@cache
def imports_of(name: str) -> frozenset[str]:
    """Absolute names a module imports; ``from pkg import mod`` names the module."""
    return _imports_in(all_modules()[name])


def _imports_in(path: Path) -> frozenset[str]:
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif node.module is not None and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(
                all_modules())
            # ``from reconciler import failpoints`` imports the module, not the package's
            # namespace; ``from reconciler import __version__`` imports the package.
            found.update(submodules or {node.module})
    return frozenset(found)


def internal_graph() -> dict[str, set[str]]:
    """Module -> the modules (of the package and ``benchmarks/``) it imports. A package
    means its ``__init__``, and importing ``a.b.c`` runs ``a.b`` first, so that is an edge
    too, except to the importer's own enclosing packages, which Python has begun before
    the importer."""
    known = all_modules()
    graph: dict[str, set[str]] = {}
    for name in known:
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges = set()
        for imported in imports_of(name):
            parts = imported.split(".")
            edges.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[name] = {e for e in edges if e in known and e not in own}
    return graph


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_core_imports_no_framework_and_nothing_outside_the_core() -> None:
    """Every core module's imports are the standard library and the core itself."""
    offences = [
        f"{name} imports {imported}"
        for name in modules() if under(name, ("reconciler.core",))
        for imported in imports_of(name)
        if under(imported, FRAMEWORKS)
        or (under(imported, ("reconciler",)) and not under(imported, CORE_MAY_IMPORT))
    ]
    assert not offences, offences


def test_only_storage_sources_the_demos_and_the_composition_root_import_an_adapter() -> None:
    """The CLI, the sidecar, the console, the config and the worker reach storage and the
    sources only through the composition root."""
    offences = [
        f"{name} imports {imported}"
        for name in modules() if not under(name, MAY_IMPORT_ADAPTERS)
        for imported in imports_of(name)
        if under(imported, ADAPTERS)
    ]
    assert not offences, offences


def test_drivers_and_brokers_are_imported_only_where_adapters_are() -> None:
    """SQLAlchemy, psycopg and the brokers' and frameworks' clients (redis, kombu, celery,
    django) are imported only by storage, the sources, the schema's models, the demos and
    the composition root."""
    offences = [
        f"{name} imports {imported}"
        for name in modules() if not under(name, MAY_IMPORT_ADAPTERS)
        for imported in imports_of(name)
        if under(imported, DRIVERS)
    ]
    assert not offences, offences


def test_only_entry_points_import_the_composition_root() -> None:
    """Nothing below the root imports it: the worker client, the ledger, the sidecar's
    service and the console get their parts handed to them."""
    offences = [
        f"{name} imports {imported}"
        for name in modules() if not under(name, ROOT_IMPORTERS)
        for imported in imports_of(name)
        if under(imported, COMPOSITION_ROOT)
    ]
    assert not offences, offences


def test_alembic_reads_the_config_through_the_root() -> None:
    """``alembic/env.py`` migrates the database the one config loader names: it reads no
    environment of its own and builds no engine of its own."""
    found = _imports_in(ALEMBIC_ENV)
    assert "reconciler.root.migrations" in found
    assert not {"os", "reconciler.storage.engines"} & found


def test_no_module_imports_itself_round_about() -> None:
    """The import graph of the package and of ``benchmarks/`` has no cycle (a package
    counts as its __init__)."""
    graph = internal_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[name] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_no_module_is_over_about_400_lines() -> None:
    """Each module, of the package and of ``benchmarks/``, stays small enough to read in
    one sitting."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in all_modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES} == {}


def test_the_contract_sees_what_it_checks() -> None:
    """The checks above read real imports: the pass imports the ports, the CLI the root."""
    assert "reconciler.core.ports" in imports_of("reconciler.core.passes")
    assert "reconciler.root.cli" in imports_of("reconciler.cli.commands")
    assert "reconciler.root.worker" in imports_of("reconciler.connect")
    assert "sqlalchemy.engine" in imports_of("reconciler.root.worker")
    assert "sqlalchemy" in imports_of("reconciler.storage.sql")
    # An import under ``if TYPE_CHECKING`` is an edge too.
    assert "alembic.config" in imports_of("reconciler.storage.schema")
    assert "benchmarks.harness" in imports_of("benchmarks.peers")
    assert {"reconciler.core", "reconciler.storage", "reconciler.worker",
            "reconciler.sidecar", "reconciler.cli", "reconciler.root", "reconciler.demos",
            "reconciler.config"} <= set(modules())
