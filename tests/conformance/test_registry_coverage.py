"""Every registered source has a conformance fixture, on the engines the registry names."""

from __future__ import annotations

from reconciler.config.registry import REGISTRY
from tests.conformance.conftest import CASES, SOURCES, dialect_of
from tests.conftest import ENGINES


def test_every_registered_source_has_a_fixture() -> None:
    """Adding a source to the registry without a fixture here fails."""
    assert {entry.kind for entry in REGISTRY} <= {registered.name for registered in SOURCES}


def test_each_source_runs_on_each_engine_the_registry_names() -> None:
    """The suite's cases are the registry's engines, source by source."""
    cases = {(registered.name, engine) for registered, engine in CASES}

    assert cases == {(entry.kind, engine) for entry in REGISTRY for engine in ENGINES
                     if dialect_of(engine) in entry.engines}
