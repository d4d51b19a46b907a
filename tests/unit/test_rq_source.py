"""The rq source's pure parts: the kind read from a job's payload without running it, the
versions read, RQ's keys as the installed RQ spells them, and its ``[source]`` table."""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

import pytest

from reconciler.config.loader import parse_source
from reconciler.config.settings import Settings
from reconciler.errors import ConfigError
from reconciler.sources.rq import RqConfig, keys
from reconciler.sources.rq.kinds import func_name
from reconciler.sources.rq.silence import utc_seconds

NAME = "app.reports.build"


class Exploding:
    """Unpickling this would run ``exec``: the kind must be read without it."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, ("raise SystemExit('unpickled')",))


class TestKind:
    @pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
    def test_the_function_name_of_every_pickle_protocol(self, protocol: int) -> None:
        data = pickle.dumps((NAME, None, (Exploding(),), {"x": Exploding()}), protocol)
        assert func_name(zlib.compress(data), "pickle") == NAME
        assert func_name(data, "pickle") == NAME  # stored uncompressed (RQ reads it too)

    def test_json(self) -> None:
        data = json.dumps([NAME, None, [1], {"a": 2}]).encode()
        assert func_name(zlib.compress(data), "json") == NAME

    @pytest.mark.parametrize(("data", "serializer"), [
        (None, "pickle"), (b"", "pickle"), (b"not a pickle", "pickle"),
        (pickle.dumps((None, None, (), {})), "pickle"),
        (pickle.dumps((Exploding(), None, (), {})), "pickle"),
        (pickle.dumps(42), "pickle"), (pickle.dumps(NAME)[:-8], "pickle"),
        (json.dumps([NAME]).encode(), "pickle"),
        (pickle.dumps((NAME, None, (), {})), "json"), (b"{}", "json"), (b"[1]", "json"),
        (json.dumps(["a\nb"]).encode(), "json"),
    ])
    def test_unreadable(self, data: bytes | None, serializer: str) -> None:
        assert func_name(data, serializer) is None


class TestVersions:
    @pytest.mark.parametrize("version", ["2.0.0", "2.4.1", "2.12.0", "2.99"])
    def test_in_range(self, version: str) -> None:
        assert keys.supported(version)

    @pytest.mark.parametrize("version", ["1.16.2", "3.0.0", "3.1", "", "x"])
    def test_refused_in_one_line_naming_the_range(self, version: str) -> None:
        with pytest.raises(ConfigError) as refused:
            keys.require_supported(version, "worker w1")
        assert "rq>=2.0,<3.0" in str(refused.value)
        assert "\n" not in str(refused.value)

    def test_the_installed_rq_is_in_range(self) -> None:
        assert keys.supported(keys.installed())


def test_the_keys_are_the_installed_rqs() -> None:
    """Each key as RQ's own classes build it."""
    from redis import Redis  # noqa: PLC0415
    from rq.executions import Execution  # noqa: PLC0415
    from rq.job import Job  # noqa: PLC0415
    from rq.queue import Queue  # noqa: PLC0415
    from rq.registry import FailedJobRegistry, StartedJobRegistry  # noqa: PLC0415
    from rq.results import Result  # noqa: PLC0415
    from rq.worker import Worker  # noqa: PLC0415

    lazy = Redis()  # never connected: the keys are computed, not read
    job = Job(id="j1", connection=lazy)
    job.origin = "q"
    assert keys.job_key("j1") == job.key
    assert keys.dependents_key("j1") == job.dependents_key
    assert keys.dependencies_key("j1") == job.dependencies_key
    assert keys.queue_key("q") == Queue("q", connection=lazy).key
    assert Queue.redis_queues_keys == keys.QUEUES
    assert keys.started_key("q") == StartedJobRegistry("q", connection=lazy).key
    assert keys.failed_key("q") == FailedJobRegistry("q", connection=lazy).key
    execution = Execution("e1", "j1", connection=lazy)
    assert keys.execution_key("j1", "e1") == execution.key
    assert keys.executions_key("j1") == job.execution_registry.key
    assert keys.results_key("j1") == Result.get_key("j1")
    assert keys.worker_key("w") == Worker.redis_worker_namespace_prefix + "w"


class TestConfig:
    def test_the_url_from_a_file(self, tmp_path: Path) -> None:
        secret = tmp_path / "url"
        secret.write_text("redis://:pw@r:6379/2\n")
        assert RqConfig(redis_url_file=str(secret)).url == "redis://:pw@r:6379/2"

    @pytest.mark.parametrize(("given", "said"), [
        ({}, "one of redis_url or redis_url_file"),
        ({"redis_url": "redis://r", "redis_url_file": "/x"}, "one of"),
        ({"redis_url": "amqp://u:secret@r"}, "amqp:"),
        ({"redis_url": "redis://r", "serializer": "msgpack"}, "pickle, json"),
        ({"redis_url": "redis://r", "queues": []}, "non-empty list"),
        ({"redis_url": "redis://r", "queues": "default"}, "non-empty list"),
    ])
    def test_refused_in_one_line(self, given: dict[str, object], said: str) -> None:
        """As the loader says it: one line, a password never echoed."""
        settings = Settings(database_url="sqlite:///x.db")
        with pytest.raises(ConfigError) as refused:
            parse_source({"kind": "rq", **given}, settings)
        assert said in str(refused.value)
        assert "secret" not in str(refused.value)
        assert "\n" not in str(refused.value)

    def test_queue_globs(self) -> None:
        config = RqConfig(redis_url="redis://r", queues=["default", "reports.*"])
        assert [q for q in ("default", "reports.daily", "mail") if config.watches(q)] == [
            "default", "reports.daily"]
        assert RqConfig(redis_url="redis://r").watches("anything")


@pytest.mark.parametrize(("text", "seconds"), [
    (b"2026-12-02T06:29:26.933066Z", 1796192966.933066), ("2026-12-02T06:29:26Z", 1796192966.0),
    (None, None), (b"", None), ("x", None), ("2026-12-02T06:29:26+01:00", None)])
def test_rq_times(text: bytes | str | None, seconds: float | None) -> None:
    """RQ's ``utcformat`` (with and without microseconds), else unread."""
    assert utc_seconds(text) == seconds
