"""Migrations: empty to head and back, in agreement with the models, on both engines."""

from __future__ import annotations

import re
from collections.abc import Iterator
from enum import StrEnum

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Engine

import models
from reconciler.core.vocabulary import (
    ActionOutcome,
    ArtifactState,
    AttemptOutcome,
    Disposition,
    EffectKind,
    EndedBy,
    JobStatus,
    OperatorAction,
    PassOutcome,
    SessionEndReason,
    StepState,
)
from reconciler.errors import SchemaOutOfDateError
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import current_revision, downgrade, head_revision, upgrade
from reconciler.worker import JobClient

# docs/data-model.md: the tables of the lease contract and the audit trail.
CORE_TABLES = {
    "job_runs", "step_runs", "job_attempts", "reconciliation_passes",
    "reconciliation_decisions", "reconciler_leases",
}
# The worker runtime's tables.
WORKER_RUNTIME_TABLES = {"worker_sessions", "job_artifacts"}

# The pass's indexes: name -> (leading column, the status the index is limited to, unique).
PARTIAL_INDEXES = {
    "ix_job_runs_processing_lease_expiry": ("lease_expires_at", "processing", False),
    "ix_job_runs_processing_last_activity": ("last_activity_at", "processing", False),
    "ix_job_runs_queued_available": ("available_at", "queued", False),
    "uq_job_runs_processing_singleton": ("singleton_key", "processing", True),
}

SNAKE_CASE_WORDS = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
PREFIXED_NAME = re.compile(r"^(?P<prefix>pk|fk|uq|ck|ix)_(?P<rest>[a-z][a-z0-9]*(?:_[a-z0-9]+)+)$")
POSTGRESQL_IDENTIFIER_LIMIT = 63
# Public names that are one word (the public name wins over the style rule).
ONE_WORD_NAMES_IN_CONTRACT = {"disposition"}


@pytest.fixture
def empty_engine(empty_db_url: str) -> Iterator[Engine]:
    """An engine on a database with no schema at all."""
    engine = create_engine(empty_db_url)
    yield engine
    engine.dispose()


def _table_names(engine: Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def _index_sql(engine: Engine, table: str) -> dict[str, str]:
    """Each index's definition as the database stores it (partial ones carry a WHERE)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            rows = conn.execute(
                sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"),
                {"t": table},
            )
        else:
            rows = conn.execute(
                sa.text("SELECT name, sql FROM sqlite_master "
                        "WHERE type = 'index' AND tbl_name = :t AND sql IS NOT NULL"),
                {"t": table},
            )
        return {name: sql for name, sql in rows}


def _model_names(dialect: str | None = None) -> list[tuple[str, str, str]]:
    """(table, kind, name) for every constraint and index the models declare (on
    ``dialect``: those created there)."""
    created = models.compared_on(dialect or "")
    found: list[tuple[str, str, str]] = []
    for table in models.metadata.sorted_tables:
        for constraint in table.constraints:
            kind = {
                sa.PrimaryKeyConstraint: "pk", sa.ForeignKeyConstraint: "fk",
                sa.UniqueConstraint: "uq", sa.CheckConstraint: "ck",
            }[type(constraint)]
            found.append((table.name, kind, str(constraint.name)))
        for index in table.indexes:
            if dialect is None or created(index, index.name, "index", False, None):
                found.append((table.name, "uq" if index.unique else "ix", str(index.name)))
    return found


def _reflected_names(engine: Engine) -> set[tuple[str, str, str]]:
    """The same triples, read back from a migrated database."""
    inspector = sa.inspect(engine)
    compared = models.compared_on(engine.dialect.name)
    found: set[tuple[str, str, str]] = set()
    for table in models.metadata.tables:
        # MySQL names every primary key PRIMARY (reflected as no name): the model's stands.
        pk = (inspector.get_pk_constraint(table)["name"] if engine.dialect.name != "mysql"
              else models.metadata.tables[table].primary_key.name)
        found.add((table, "pk", str(pk)))
        found |= {(table, "fk", str(fk["name"])) for fk in inspector.get_foreign_keys(table)}
        found |= {(table, "uq", str(uq["name"]))
                  for uq in inspector.get_unique_constraints(table)
                  if compared(None, uq["name"], "unique_constraint", True, None)}
        found |= {(table, "ck", str(ck["name"]))
                  for ck in inspector.get_check_constraints(table)}
        for index in inspector.get_indexes(table):
            # PostgreSQL reports a UNIQUE constraint's backing index as an index too.
            if index.get("duplicates_constraint") or not compared(
                    None, index["name"], "index", True, None):
                continue
            found.add((table, "uq" if index["unique"] else "ix", str(index["name"])))
    return found


def test_upgrade_from_empty_creates_every_contract_table(empty_engine: Engine) -> None:
    """Upgrading an empty database to head creates the documented tables and stamps head."""
    assert _table_names(empty_engine) == set()
    assert current_revision(empty_engine) is None

    upgrade(empty_engine)

    assert _table_names(empty_engine) >= CORE_TABLES | {"alembic_version"}
    assert current_revision(empty_engine) == head_revision()


def test_upgrade_creates_the_worker_runtime_tables(empty_engine: Engine) -> None:
    """worker_sessions and job_artifacts are tables of the schema."""
    upgrade(empty_engine)

    missing = WORKER_RUNTIME_TABLES - _table_names(empty_engine)
    assert not missing, f"worker runtime tables missing after upgrade: {sorted(missing)}"


def test_upgrade_creates_the_partial_indexes_the_pass_relies_on(empty_engine: Engine) -> None:
    """The candidate and claim scans have partial indexes limited to their status."""
    if empty_engine.dialect.name == "mysql":
        pytest.skip("MySQL has no partial index: see the status-led indexes' test")
    upgrade(empty_engine)

    reflected = {ix["name"]: ix for ix in sa.inspect(empty_engine).get_indexes("job_runs")}
    stored_sql = _index_sql(empty_engine, "job_runs")
    for name, (column, status, unique) in PARTIAL_INDEXES.items():
        assert name in reflected, f"index {name} missing; have {sorted(map(str, reflected))}"
        assert reflected[name]["column_names"][0] == column
        assert bool(reflected[name]["unique"]) is unique, name
        definition = stored_sql[name]
        where = definition.upper().split(" WHERE ", 1)
        assert len(where) == 2, f"{name} is not partial: {definition}"
        assert "JOB_STATUS" in where[1], definition
        assert f"'{status.upper()}'" in where[1], definition
    # The operator listing index is a plain one: a partial one would not serve every status.
    assert " WHERE " not in stored_sql["ix_job_runs_status_job"].upper()


def test_mysql_leads_the_scan_indexes_with_the_status(empty_engine: Engine) -> None:
    """Without partial indexes, MySQL's claim and scan indexes start with the status (the
    session sweep's with the stop), so each reads (and locks) a range of its own rows."""
    if empty_engine.dialect.name != "mysql":
        pytest.skip("the other engines have partial indexes")
    upgrade(empty_engine)

    reflected = {ix["name"]: ix["column_names"]
                 for ix in sa.inspect(empty_engine).get_indexes("job_runs")}
    assert reflected["ix_job_runs_status_available"] == ["job_status", "available_at", "job_id"]
    assert reflected["ix_job_runs_status_lease_expiry"] == [
        "job_status", "lease_expires_at", "job_id"]
    assert reflected["ix_job_runs_status_last_activity"] == [
        "job_status", "last_activity_at", "job_id"]
    assert reflected["uq_job_runs_processing_singleton"] == ["processing_singleton_key"]
    assert {ix["name"]: ix["column_names"] for ix in sa.inspect(empty_engine).get_indexes(
        "worker_sessions")}["ix_worker_sessions_stopped_heartbeat"] == [
        "stopped_at", "heartbeat_at"]


def test_one_processing_job_per_singleton_key_and_any_number_finished(
    empty_engine: Engine,
) -> None:
    """The singleton index refuses a second processing job of a key, never a finished or a
    queued one (on MySQL a unique generated column; elsewhere a partial index)."""
    upgrade(empty_engine)
    row = {"job_kind": "k", "step_plan": [], "max_attempts": 1, "singleton_key": "one",
           "lease_token": "t", "available_at": sa.func.now(), "created_at": sa.func.now(),
           "updated_at": sa.func.now(), "lease_expires_at": sa.func.now(),
           "last_activity_at": sa.func.now()}
    with empty_engine.begin() as conn:
        for status in ("completed", "completed", "queued", "queued", "processing"):
            conn.execute(sa.insert(models.JobRun).values({**row, "job_status": status}))
    with pytest.raises(sa.exc.IntegrityError), empty_engine.begin() as conn:
        conn.execute(sa.insert(models.JobRun).values({**row, "job_status": "processing"}))
    with empty_engine.begin() as conn:
        conn.execute(sa.update(models.JobRun).where(models.JobRun.job_status == "processing")
                     .values(job_status="completed"))
        conn.execute(sa.insert(models.JobRun).values({**row, "job_status": "processing"}))


def test_downgrade_to_base_removes_every_table_and_upgrade_works_again(
    empty_engine: Engine,
) -> None:
    """Down to base leaves only Alembic's own table; going up again rebuilds the schema."""
    upgrade(empty_engine)
    downgrade(empty_engine, "base")

    assert _table_names(empty_engine) <= {"alembic_version"}
    assert current_revision(empty_engine) is None
    if empty_engine.dialect.name == "postgresql":
        with empty_engine.connect() as conn:
            leftovers = conn.execute(sa.text(
                "SELECT sequence_name FROM information_schema.sequences "
                "WHERE sequence_schema = 'public'")).scalars().all()
        assert leftovers == [], "downgrade left sequences behind"

    upgrade(empty_engine)

    assert _table_names(empty_engine) >= CORE_TABLES
    assert current_revision(empty_engine) == head_revision()
    with JobClient(empty_engine) as client:
        assert client.claim(worker="after-reupgrade", lease_seconds=1) is None


def test_models_and_migrations_agree(empty_engine: Engine) -> None:
    """Autogenerate finds nothing to change after upgrade (what `alembic check` checks)."""
    upgrade(empty_engine)

    with empty_engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "compare_type": True, "include_object": models.compared_on(conn.dialect.name)})
        diff = compare_metadata(context, models.metadata)

    assert diff == []


def test_migrated_constraint_and_index_names_are_the_models_names(empty_engine: Engine) -> None:
    """Every constraint and index the migration creates carries the model's name."""
    upgrade(empty_engine)

    assert _reflected_names(empty_engine) == set(_model_names(empty_engine.dialect.name))


def test_every_constraint_and_index_name_follows_the_naming_convention() -> None:
    """pk_/fk_/uq_/ck_/ix_ + table + at least one more descriptive snake_case word."""
    problems: list[str] = []
    for table, kind, name in _model_names():
        match = PREFIXED_NAME.match(name)
        if match is None:
            problems.append(f"{table}: {name!r} is not prefixed snake_case of 2+ words")
            continue
        if match["prefix"] != kind:
            problems.append(f"{table}: {name!r} should start with {kind}_")
        if not match["rest"].startswith(table):
            problems.append(f"{table}: {name!r} does not name its table")
        if kind != "pk" and match["rest"] == table:
            problems.append(f"{table}: {name!r} says nothing beyond its table")
        if len(name) > POSTGRESQL_IDENTIFIER_LIMIT:
            problems.append(f"{table}: {name!r} is longer than PostgreSQL keeps")
    assert problems == []
    assert models.NAMING_CONVENTION.keys() >= {"ix", "uq", "ck", "fk", "pk"}


def test_every_table_and_column_name_is_snake_case_of_two_words() -> None:
    """Table and column names are descriptive snake_case of 2+ words."""
    problems = [
        f"{table.name}.{column.name}"
        for table in models.metadata.sorted_tables
        for column in table.columns
        if not SNAKE_CASE_WORDS.match(column.name)
        and column.name not in ONE_WORD_NAMES_IN_CONTRACT
    ]
    problems += [t for t in models.metadata.tables if not SNAKE_CASE_WORDS.match(t)]
    assert problems == []


def test_job_client_refuses_an_unmigrated_database_with_one_line(empty_db_url: str) -> None:
    """A worker on an empty database fails at once, telling the operator what to run."""
    with pytest.raises(SchemaOutOfDateError) as raised:
        JobClient(empty_db_url)

    message = str(raised.value)
    assert "\n" not in message
    assert "db upgrade" in message


def test_job_client_refuses_a_schema_at_another_revision(empty_engine: Engine) -> None:
    """A database stamped at a revision this code does not know is refused, in one line."""
    upgrade(empty_engine)
    with empty_engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'older_revision'"))

    with pytest.raises(SchemaOutOfDateError) as raised:
        JobClient(empty_engine)

    message = str(raised.value)
    assert "\n" not in message
    assert "older_revision" in message
    assert head_revision() in message


# Each vocabulary CHECK of the migrated schema, and the enum it must hold exactly.
VOCABULARY_CHECKS: dict[tuple[str, str], type[StrEnum]] = {
    ("job_runs", "ck_job_runs_job_status_known"): JobStatus,
    ("step_runs", "ck_step_runs_step_state_known"): StepState,
    ("step_runs", "ck_step_runs_effect_kind_known"): EffectKind,
    ("job_attempts", "ck_job_attempts_attempt_outcome_known"): AttemptOutcome,
    ("job_attempts", "ck_job_attempts_ended_by_known"): EndedBy,
    ("reconciliation_passes", "ck_reconciliation_passes_pass_outcome_known"): PassOutcome,
    ("reconciliation_decisions", "ck_reconciliation_decisions_disposition_known"): Disposition,
    ("worker_sessions", "ck_worker_sessions_stop_reason_known"): SessionEndReason,
    ("job_artifacts", "ck_job_artifacts_artifact_state_known"): ArtifactState,
    ("operator_actions", "ck_operator_actions_operator_action_known"): OperatorAction,
    ("operator_actions", "ck_operator_actions_action_outcome_known"): ActionOutcome,
}


def test_every_vocabulary_check_of_the_migrated_schema_holds_exactly_its_enum(
    empty_engine: Engine,
) -> None:
    """The migrations' CHECK constraints and the code's enums name the same codes: a code
    added to an enum without a migration (or the reverse) fails here."""
    upgrade(empty_engine)
    inspector = sa.inspect(empty_engine)
    found: dict[tuple[str, str], set[str]] = {}
    for table in {table for table, _ in VOCABULARY_CHECKS}:
        for check in inspector.get_check_constraints(table):
            found[(table, str(check["name"]))] = set(re.findall(r"'([a-z_]+)'",
                                                                check["sqltext"]))
    assert {key: found.get(key) for key in VOCABULARY_CHECKS} == {
        key: {member.value for member in enum} for key, enum in VOCABULARY_CHECKS.items()}
