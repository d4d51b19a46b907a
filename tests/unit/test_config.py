"""The TOML config file: settings (flag > env > file > default), [source], [kinds]."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from reconciler.config.loader import CONFIG_ENV, load_config
from reconciler.config.settings import Settings
from reconciler.config.tables import NativeConfig
from reconciler.core.vocabulary import EffectKind
from reconciler.errors import ConfigError
from reconciler.root.checks import open_foreign_source
from reconciler.sources.graphile_worker import GraphileWorkerConfig
from reconciler.sources.pgboss import PgBossConfig
from reconciler.sources.procrastinate import ProcrastinateConfig
from reconciler.sources.table.config import TableConfig

DESIGN_EXAMPLE = """
database_url = "postgresql+psycopg://app@db/app"
interval_seconds = 30

[source]
kind = "procrastinate"     # native | procrastinate | graphile-worker | pg-boss | table

[kinds."*"]
effect = "effectful"

[kinds."reports.*"]
effect = "idempotent"
stale_after_seconds = 300
max_run_seconds = 900
"""

TABLE_EXAMPLE = """
[source]
kind = "table"
table = "jobs"
id_column = "id"
status_column = "status"
processing = "processing"
queued = "pending"
failed = "failed"
kind_column = "job_type"
reason_column = "status_reason"
activity_column = "last_activity_at"
lease_expires_column = "lease_until"
owner_column = "claimed_by"
attempts_column = "attempts"
max_attempts_column = "max_attempts"
generation_column = "generation"
resume_column = "resume_step"
plan_column = "step_plan"
steps_column = "step_results"
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RECONCILER_* variable of the developer's shell leaks into these tests."""
    for name in list(os.environ):
        if name.upper().startswith("RECONCILER_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "reconciler.toml"
    path.write_text(textwrap.dedent(text))
    return path


def refused(path: Path, **flags: object) -> str:
    """The one line a refused config ends with."""
    with pytest.raises(ConfigError) as caught:
        load_config(path, **flags)
    message = str(caught.value)
    assert "\n" not in message
    return message


class TestDesignExamples:
    """The documented examples load as written."""

    def test_procrastinate_example(self, tmp_path: Path) -> None:
        """Settings, the source and both kind tables come through."""
        config = load_config(write(tmp_path, DESIGN_EXAMPLE))
        assert config.settings.database_url == "postgresql+psycopg://app@db/app"
        assert config.settings.interval_seconds == 30.0
        assert isinstance(config.source, ProcrastinateConfig)
        assert config.source.schema is None
        assert config.source.session_timeout_seconds == config.settings.session_timeout_seconds
        reports = config.kinds.resolve("reports.daily")
        assert reports.effect is EffectKind.IDEMPOTENT
        assert reports.thresholds.stale_after_seconds == 300.0
        assert reports.max_run_seconds == 900.0
        assert config.kinds.resolve("mail").effect is EffectKind.EFFECTFUL

    def test_table_example_maps_every_key(self, tmp_path: Path) -> None:
        """Every key of the table example lands in its field."""
        config = load_config(write(tmp_path, TABLE_EXAMPLE))
        source = config.source
        assert isinstance(source, TableConfig)
        assert (source.table, source.id_column, source.status_column) == ("jobs", "id", "status")
        assert (source.processing, source.queued, source.failed) == (
            "processing", "pending", "failed")
        assert source.mapped_columns() == {
            "id_column": "id", "status_column": "status", "kind_column": "job_type",
            "reason_column": "status_reason", "activity_column": "last_activity_at",
            "lease_expires_column": "lease_until", "owner_column": "claimed_by",
            "attempts_column": "attempts", "max_attempts_column": "max_attempts",
            "generation_column": "generation", "resume_column": "resume_step",
            "plan_column": "step_plan", "steps_column": "step_results",
        }

    @pytest.mark.parametrize(("kind", "expected"), [
        ("native", NativeConfig()),
        ("graphile-worker", GraphileWorkerConfig(schema="graphile_worker")),
        ("pg-boss", PgBossConfig(schema="pgboss")),
    ])
    def test_each_kind_with_its_default_schema(self, tmp_path: Path, kind: str,
                                               expected: object) -> None:
        """Each system's default schema is its own default."""
        assert load_config(write(tmp_path, f'[source]\nkind = "{kind}"\n')).source == expected

    def test_schema_key(self, tmp_path: Path) -> None:
        """schema names where the foreign tables live."""
        config = load_config(write(tmp_path, '[source]\nkind = "pg-boss"\nschema = "jobs"\n'))
        assert config.source == PgBossConfig(schema="jobs")

    def test_no_file_is_native_with_defaults(self) -> None:
        """Without a file the source is native and the settings are the defaults."""
        config = load_config()
        assert config.source == NativeConfig()
        assert config.settings == Settings()
        assert config.path is None


class TestPrecedence:
    """A flag beats the environment, which beats the file, which beats the default."""

    def test_file_beats_default(self, tmp_path: Path) -> None:
        """A setting only the file gives is taken from the file."""
        assert load_config(write(tmp_path, "batch_size = 42\n")).settings.batch_size == 42

    def test_environment_beats_file(self, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """RECONCILER_<SETTING> wins over the file."""
        monkeypatch.setenv("RECONCILER_BATCH_SIZE", "7")
        assert load_config(write(tmp_path, "batch_size = 42\n")).settings.batch_size == 7

    def test_flag_beats_environment_and_file(self, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        """A flag wins over both; a flag given as None is no flag."""
        monkeypatch.setenv("RECONCILER_BATCH_SIZE", "7")
        path = write(tmp_path, "batch_size = 42\n")
        assert load_config(path, batch_size=9).settings.batch_size == 9
        assert load_config(path, batch_size=None).settings.batch_size == 7

    def test_a_url_file_from_the_environment_beats_the_files_url(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """RECONCILER_DATABASE_URL_FILE (the Kubernetes and systemd examples) wins over a
        `database_url` in the file, as any variable does, instead of "not both"; and
        RECONCILER_DATABASE_URL wins over a `database_url_file` in the file."""
        secret = tmp_path / "database-url"
        secret.write_text("sqlite:///from-secret.db\n")
        monkeypatch.setenv("RECONCILER_DATABASE_URL_FILE", str(secret))
        path = write(tmp_path, 'database_url = "sqlite:///from-file.db"\n')
        assert load_config(path).settings.database_url == "sqlite:///from-secret.db"
        monkeypatch.delenv("RECONCILER_DATABASE_URL_FILE")
        monkeypatch.setenv("RECONCILER_DATABASE_URL", "sqlite:///from-env.db")
        path = write(tmp_path, f"database_url_file = {str(secret)!r}\n")
        assert load_config(path).settings.database_url == "sqlite:///from-env.db"

    def test_config_path_from_environment(self, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        """RECONCILER_CONFIG names the file when no path is given; a path wins over it."""
        monkeypatch.setenv(CONFIG_ENV, str(write(tmp_path, "batch_size = 42\n")))
        assert load_config().settings.batch_size == 42
        other = tmp_path / "other.toml"
        other.write_text("batch_size = 11\n")
        assert load_config(other).settings.batch_size == 11

    def test_result_is_the_plain_settings_type(self, tmp_path: Path) -> None:
        """Callers get Settings itself, equal to one built from the same values."""
        settings = load_config(write(tmp_path, "batch_size = 42\n")).settings
        assert type(settings) is Settings
        assert settings == Settings(batch_size=42)

    def test_file_thresholds_are_the_kind_defaults(self, tmp_path: Path) -> None:
        """Kinds without their own thresholds inherit the file's settings."""
        config = load_config(write(tmp_path, "stale_after_seconds = 120\n"))
        assert config.kinds.resolve("x").thresholds.stale_after_seconds == 120.0


class TestRefusals:
    """Every problem is one line naming the file and the key."""

    @pytest.mark.parametrize(("text", "names"), [
        ("batch_sise = 3\n", ["batch_sise", "not a setting", "did you mean batch_size?"]),
        ("[sources]\nkind = 'table'\n", ["[sources]", "unknown table"]),
        ("batch_size = '10'\n", ["batch_size", "an integer", "a string"]),
        ("batch_size = true\n", ["batch_size", "a boolean"]),
        ("interval_seconds = 'fast'\n", ["interval_seconds", "a number"]),
        ("metrics_host = 80\n", ["metrics_host", "a string"]),
        ("batch_size = 0\n", ["batch_size", "reconciler.toml"]),
        ("source = 'table'\n", ["source", "must be a table"]),
        ("[source]\nschema = 'x'\n", ["[source]", "kind"]),
        ("[source]\nkind = 'sidekiq'\n", ["sidekiq", "native"]),
        ("[source]\nkind = 'pg-boss'\ntable = 'x'\n", ["table", "pg-boss"]),
        ("[source]\nkind = 'pg-boss'\nschema = 3\n", ["schema", "an integer"]),
        ("[source]\nkind = 'pg-boss'\nschema = 'a b'\n", ["schema", "plain SQL name"]),
        ("[kinds.'*']\neffect = 'maybe'\n", ['[kinds."*"]', "effect", "maybe"]),
        ("[kinds.'*']\neffct = 'pure'\n", ['[kinds."*"]', "effct", "did you mean effect?"]),
        ("[source]\nkind = 'rq'\nredis_ur = 'redis://x'\n",
         ["redis_ur", "did you mean redis_url?"]),
        ("[kinds.reports.daily]\neffect = 'pure'\n", ['kinds."reports.daily"', "daily"]),
        ("[kinds.'*']\nmax_attempts = 0\n", ["max_attempts", ">= 1"]),
        ("[kinds.'*']\nmax_attempts = 2.5\n", ["max_attempts", "an integer"]),
        ("[kinds.'*']\nmax_run_seconds = 0\n", ["max_run_seconds", "> 0"]),
        ("[kinds.'*']\nstale_after_seconds = -1\n", ["stale_after_seconds", ">= 0"]),
        ("[kinds.'*']\nwedged_after_seconds = '1h'\n", ["wedged_after_seconds", "a number"]),
        ("[kinds.'*']\nreconcile = 'no'\n", ["reconcile", "true or false"]),
        ("[kinds.'*']\nreconcile = 1\n", ["reconcile", "true or false"]),
        ("[kinds.'slow']\nstale_after_seconds = 7200\n", ["slow", "wedged_after_seconds"]),
        ("kinds = 3\n", ["kinds", "must be a table"]),
        ("[kinds]\nx = 3\n", ["kinds.x", "must be a table"]),
        ("this is not toml", ["not valid TOML"]),
    ])
    def test_refused_in_one_line(self, tmp_path: Path, text: str, names: list[str]) -> None:
        """The line names what is wrong."""
        message = refused(write(tmp_path, text))
        for name in names:
            assert name in message

    def test_bad_file_value_names_the_file_not_a_variable(self, tmp_path: Path) -> None:
        """A value refused from the file points at the file, not at RECONCILER_*."""
        message = refused(write(tmp_path, "metrics_port = 70000\n"))
        assert "reconciler.toml" in message
        assert "metrics_port" in message
        assert "RECONCILER_METRICS_PORT" not in message

    def test_bad_environment_value_still_names_the_variable(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """With a file present, a bad variable is still reported as the variable."""
        monkeypatch.setenv("RECONCILER_METRICS_PORT", "70000")
        message = refused(write(tmp_path, "metrics_port = 9000\n"))
        assert "RECONCILER_METRICS_PORT" in message

    def test_missing_file(self, tmp_path: Path) -> None:
        """A config path that does not exist is one line naming it."""
        message = refused(tmp_path / "nope.toml")
        assert "nope.toml" in message
        assert "not found" in message

    def test_cross_setting_rule_spans_file_and_environment(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """wedged from the environment below stale from the file is refused."""
        monkeypatch.setenv("RECONCILER_WEDGED_AFTER_SECONDS", "100")
        message = refused(write(tmp_path, "stale_after_seconds = 200\n"))
        assert "wedged_after_seconds" in message


class TestTableSource:
    """kind = "table": required keys enforced, mapped columns consistent."""

    @pytest.mark.parametrize("missing", ["table", "id_column", "status_column", "processing",
                                         "queued", "failed"])
    def test_required_key(self, tmp_path: Path, missing: str) -> None:
        """Each required key, left out, is named."""
        text = "\n".join(line for line in TABLE_EXAMPLE.splitlines()
                         if not line.startswith(f"{missing} "))
        message = refused(write(tmp_path, text))
        assert missing in message
        assert "needs" in message

    def test_minimal_table(self, tmp_path: Path) -> None:
        """Only the required keys: every optional column is None."""
        text = "\n".join(TABLE_EXAMPLE.splitlines()[:9])
        source = load_config(write(tmp_path, text)).source
        assert isinstance(source, TableConfig)
        assert source.owner_column is None
        assert source.plan_column is None

    @pytest.mark.parametrize("value", ["processing", "pending", "failed"])
    def test_a_cancelled_status_another_key_maps_is_refused(self, tmp_path: Path,
                                                             value: str) -> None:
        """``cancelled`` naming the processing, queued or failed value would make a
        cancelled job read as running, waiting or failed: one line names it."""
        message = refused(write(tmp_path, TABLE_EXAMPLE + f'cancelled = "{value}"\n'))
        assert f"cancelled ({value!r}) must differ from processing, queued and failed" in \
            message
        assert "\n" not in message.strip()

    def test_plan_without_steps_is_refused(self, tmp_path: Path) -> None:
        """A plan without step results would rerun finished steps: refused."""
        text = "\n".join(line for line in TABLE_EXAMPLE.splitlines()
                         if not line.startswith("steps_column"))
        message = refused(write(tmp_path, text))
        assert "plan_column" in message
        assert "steps_column" in message

    def test_one_column_for_two_keys_is_refused(self, tmp_path: Path) -> None:
        """status_column and reason_column cannot be one column."""
        text = TABLE_EXAMPLE.replace('reason_column = "status_reason"',
                                     'reason_column = "status"')
        message = refused(write(tmp_path, text))
        assert "reason_column" in message
        assert "status_column" in message

    def test_processing_equal_to_queued_is_refused(self, tmp_path: Path) -> None:
        """A resume must change the status."""
        text = TABLE_EXAMPLE.replace('queued = "pending"', 'queued = "processing"')
        assert "processing" in refused(write(tmp_path, text))

    def test_unknown_table_key(self, tmp_path: Path) -> None:
        """A misspelled mapping is named, not ignored."""
        message = refused(write(tmp_path, TABLE_EXAMPLE + 'lease_column = "x"\n'))
        assert "lease_column" in message


class TestOpenForeignSource:
    """Each [source] kind opens its own declared system; native is the store's."""

    @pytest.mark.parametrize(("text", "expected"), [
        ('kind = "procrastinate"', "procrastinate"),
        ('kind = "graphile-worker"', "graphile-worker"),
        ('kind = "pg-boss"', "pg-boss"),
        (TABLE_EXAMPLE.split("[source]\n", 1)[1], "table"),
    ])
    def test_kind_to_class(self, tmp_path: Path, text: str, expected: str) -> None:
        """No database is touched to build one."""
        config = load_config(write(tmp_path, f"[source]\n{text}\n"))
        source = open_foreign_source(None, config.source, config.kinds)  # type: ignore[arg-type]
        assert source.source_name == expected

    def test_native_is_not_foreign(self, tmp_path: Path) -> None:
        """The native source is not built here."""
        config = load_config()
        with pytest.raises(ValueError, match="native"):
            open_foreign_source(None, config.source, config.kinds)  # type: ignore[arg-type]


class TestDocsExamples:
    """Every copy-paste reconciler.toml in docs/sources.md loads as written."""

    def test_each_toml_block_loads(self, tmp_path: Path) -> None:
        """Eight sources, eleven blocks (Celery's two result tables; Django's and Celery's
        on MySQL); each is accepted and names its kind."""
        text = (Path(__file__).resolve().parents[2] / "docs" / "sources.md").read_text()
        blocks = [b.split("```", 1)[0] for b in text.split("```toml\n")[1:]]
        kinds = [load_config(write(tmp_path, block)).source.kind for block in blocks]
        assert kinds == ["procrastinate", "graphile-worker", "pg-boss", "django-tasks",
                         "django-tasks", "celery", "celery", "celery", "rq", "dramatiq",
                         "table"]


class TestKindBounds:
    """A kind's values are bounded as the settings they refine: finite durations up to a
    year, attempt counts from 1 to 2,147,483,647, each refused in one line naming the key."""

    @pytest.mark.parametrize(("line", "names"), [
        ("stale_after_seconds = nan", ["stale_after_seconds", "finite", "nan"]),
        ("stale_after_seconds = inf", ["stale_after_seconds", "finite"]),
        ("wedged_after_seconds = -inf", ["wedged_after_seconds", "finite"]),
        ("max_run_seconds = inf", ["max_run_seconds", "finite", "inf"]),
        ("max_run_seconds = 1e300", ["max_run_seconds", "<= 31536000"]),
        ("wedged_after_seconds = 31536001", ["wedged_after_seconds", "<= 31536000"]),
        ("max_attempts = 99999999999999999999", ["max_attempts", "<= 2147483647"]),
        ("max_attempts = 2147483648", ["max_attempts", "<= 2147483647"]),
        ("crash_loop_after = 0", ["crash_loop_after", ">= 1"]),
        ("crash_loop_after = 2147483648", ["crash_loop_after", "<= 2147483647"]),
        ("max_attempts = true", ["max_attempts", "an integer", "a boolean"]),
        ("stale_after_seconds = false", ["stale_after_seconds", "a number"]),
    ])
    def test_out_of_bounds_is_refused(self, tmp_path: Path, line: str,
                                      names: list[str]) -> None:
        """The reproduced defects: nan, infinities, 1e300 and huge integers."""
        message = refused(write(tmp_path, f'[kinds."*"]\n{line}\n'))
        assert message.startswith(f"{tmp_path / 'reconciler.toml'}: [kinds.\"*\"]")
        for name in names:
            assert name in message

    @pytest.mark.parametrize(("line", "key", "value"), [
        ("stale_after_seconds = 0", "stale_after_seconds", 0.0),
        ("max_run_seconds = 31536000", "max_run_seconds", 31_536_000.0),
        ("max_attempts = 2147483647", "max_attempts", 2_147_483_647),
        ("max_attempts = 1", "max_attempts", 1),
    ])
    def test_the_bounds_themselves_are_taken(self, tmp_path: Path, line: str, key: str,
                                             value: float) -> None:
        """A bound is a value a kind may have."""
        kinds = load_config(write(tmp_path, f'[kinds."x"]\n{line}\n')).kinds
        policy = kinds.resolve("x")
        found = {"stale_after_seconds": policy.thresholds.stale_after_seconds,
                 "max_run_seconds": policy.max_run_seconds,
                 "max_attempts": policy.max_attempts}[key]
        assert found == value

    def test_the_settings_share_the_bounds(self) -> None:
        """The settings a kind refines refuse what the kind refuses."""
        for flags in ({"stale_after_seconds": "nan"}, {"crash_loop_after": "2147483648"},
                      {"default_max_attempts": "99999999999999999999"},
                      {"wedged_after_seconds": "1e300"}, {"brake_min_jobs": "2147483648"}):
            with pytest.raises(ConfigError):
                load_config(**flags)


class TestUnreadableFiles:
    """A file that is not UTF-8 TOML, an empty pattern and an empty path: one line each."""

    def test_not_utf8(self, tmp_path: Path) -> None:
        """`printf '\\xff\\xfe'` is named as not UTF-8, not a traceback."""
        path = tmp_path / "reconciler.toml"
        path.write_bytes(b"\xff\xfe")
        message = refused(path)
        assert "not UTF-8" in message
        assert str(path) in message

    def test_byte_order_mark(self, tmp_path: Path) -> None:
        """A BOM-prefixed file (a Windows editor's UTF-8) is named as such."""
        path = tmp_path / "reconciler.toml"
        path.write_bytes(b"\xef\xbb\xbfbatch_size = 3\n")
        assert "byte order mark" in refused(path)

    def test_empty_kind_pattern(self, tmp_path: Path) -> None:
        """`[kinds.""]` matches no kind: refused, naming the table."""
        message = refused(write(tmp_path, '[kinds.""]\neffect = "pure"\n'))
        assert '[kinds.""]' in message
        assert "empty" in message

    def test_empty_config_path(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """`--config ""` is refused, never a silent fall back to the defaults."""
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ConfigError, match="no file"):
            load_config("")
        assert not (tmp_path / "reconciler.db").exists()

    def test_a_directory(self, tmp_path: Path) -> None:
        """A path naming a folder cannot be read: one line."""
        assert "cannot be read" in refused(tmp_path)


class TestSourceModels:
    """Every [source] model validates on construction, by the loader and by code alike."""

    def test_source_defaults_to_native_and_is_never_none(self, tmp_path: Path) -> None:
        """No [source] table: the native source."""
        config = load_config(write(tmp_path, "batch_size = 3\n"))
        assert config.source == NativeConfig()
        assert config.source_entry.kind == "native"

    def test_a_model_built_in_code_is_checked_too(self) -> None:
        """A table config built by hand refuses what the file would."""
        with pytest.raises(ValueError, match="plain SQL name"):
            TableConfig(table="jobs; drop", id_column="id", status_column="s",
                        processing="p", queued="q", failed="f")
