"""The dramatiq source's pure parts: Dramatiq's key layout, the middleware's marks, a
message read without running anything, and the moves' new encodings (silence is timed in
Redis, by a script the worker and conformance tests run)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from reconciler.errors import ConfigError
from reconciler.sources.dramatiq.config import DramatiqConfig
from reconciler.sources.dramatiq.keys import Keys, Mark, canonical, require_supported, supported
from reconciler.sources.dramatiq.snapshot import read_message
from reconciler.sources.dramatiq.writes import DramatiqFence, _args, exc_text

BROKER = "9649773a-0a9f-429e-b59b-3ecf6ce60d66"


def message(**options: object) -> bytes:
    return json.dumps({"queue_name": "default", "actor_name": "charge", "args": [],
                       "kwargs": {}, "options": {"redis_message_id": "r1", **options},
                       "message_id": "m1", "message_timestamp": 1700000000000},
                      separators=(",", ":")).encode()


class TestKeys:
    def test_an_acks_key_names_its_broker_and_its_queue_dots_and_all(self) -> None:
        keys = Keys("dramatiq")
        assert keys.split_acks(keys.acks(BROKER, "reports.daily.DQ")) == (
            BROKER, "reports.daily.DQ")
        assert keys.split_acks(f"other:__acks__.{BROKER}.default") is None
        assert keys.split_acks("dramatiq:__acks__.nodot") is None

    def test_a_delay_queue_dead_letters_into_its_base_queue(self) -> None:
        keys = Keys("app")
        assert keys.dead("default.DQ") == keys.dead("default") == "app:default.XQ"
        assert canonical("default.DQ") == "default"

    def test_a_namespace_with_glob_characters_is_escaped_in_the_scan(self) -> None:
        assert Keys("a*b").acks_pattern == "a\\*b:__acks__.*"

    @pytest.mark.parametrize(("version", "read"), [
        ("2.0.0", True), ("2.2.1", True), ("1.17.1", False), ("3.0.0", False), ("x", False)])
    def test_the_versions_read(self, version: str, read: bool) -> None:
        assert supported(version) is read

    def test_a_version_outside_the_range_is_one_line(self) -> None:
        with pytest.raises(ConfigError, match=r"dramatiq 3\.0\.0, outside .*>=2\.0,<3\.0"):
            require_supported("3.0.0", "a worker")


class TestMarks:
    def test_a_mark_reads_back_as_written(self) -> None:
        mark = Mark(BROKER, True, 20, "dramatiq-results:abc", 600_000)
        assert Mark.decode(mark.encode()) == mark
        assert Mark.decode(mark.encode().encode()) == mark

    @pytest.mark.parametrize("raw", [
        None, b"", b"not json", b"[]", b'{"v": 2, "b": "x"}', b'{"v": 1}',
        b'{"v": 1, "b": "x", "m": -1}', b'{"v": 1, "b": "x", "m": true}'])
    def test_anything_else_is_no_mark(self, raw: bytes | None) -> None:
        assert Mark.decode(raw) is None


class TestMessages:
    def test_its_facts_are_read_from_dramatiqs_json(self) -> None:
        found = read_message(message(retries=2, max_retries=5), "r1")
        assert found is not None
        assert (found.job_id, found.kind, found.retries, found.max_retries,
                found.enqueued_ms) == ("m1", "charge", 2, 5, 1700000000000)

    @pytest.mark.parametrize("raw", [b"\x80\x04pickled", b"[1, 2]", b'{"actor_name": 7}',
                                     b'{"actor_name": "a", "message_id": "m",'
                                     b' "options": {"retries": "x"}}'])
    def test_an_unreadable_one_is_known_by_its_redis_id_and_has_no_kind(
            self, raw: bytes) -> None:
        found = read_message(raw, "r9")
        assert found is not None
        assert (found.job_id, found.kind) == ("r9", None)

    def test_one_gone_since_is_none(self) -> None:
        assert read_message(None, "r1") is None


class TestConfig:
    def test_a_bad_url_names_only_its_scheme(self) -> None:
        with pytest.raises(ValidationError) as raised:
            DramatiqConfig(redis_url="http://user:secret@host/0")
        [error] = raised.value.errors()
        assert "got http:" in error["msg"]
        assert "secret" not in error["msg"]

    def test_a_namespace_with_glob_characters_is_refused(self) -> None:
        with pytest.raises(ValidationError, match="namespace"):
            DramatiqConfig(redis_url="redis://h/0", namespace="dram*")

    def test_a_delay_queue_is_watched_with_its_queue(self) -> None:
        config = DramatiqConfig(redis_url="redis://h/0", queues=("reports.*",))
        assert config.watches("reports.daily.DQ")
        assert not config.watches("default.DQ")


class TestMoves:
    def fence(self, *, started: bool, mark: Mark | None = None) -> DramatiqFence:
        return DramatiqFence("default", "r1", BROKER, "sha", "" if mark is None
                             else mark.encode(), started, 1.0)

    def test_a_started_message_resumed_counts_a_retry(self) -> None:
        args = _args("resume", self.fence(started=True), message(retries=1), None)
        assert args is not None
        assert json.loads(args[0])["options"]["retries"] == 2

    def test_a_prefetched_message_goes_back_as_it_was(self) -> None:
        raw = message(retries=1)
        assert _args("resume", self.fence(started=False), raw, None) == (raw, None, "", 0)

    def test_a_terminalized_message_carries_our_reason_and_fails_its_result(self) -> None:
        mark = Mark(BROKER, False, 3, "results:key", 60_000)
        args = _args("terminalize", self.fence(started=True, mark=mark), message(),
                     "worker_died_mid_step")
        assert args is not None
        new, key, result, ttl = args
        options = json.loads(new)["options"]
        assert options["reconciler_reason"] == "worker_died_mid_step"
        assert options["traceback"] == exc_text("worker_died_mid_step")
        assert (key, ttl) == ("results:key", 60_000)
        assert json.loads(result) == {"__t": "dramatiq.results.Result", "exn": {
            "type": "WorkerDied", "msg": exc_text("worker_died_mid_step")}}

    def test_without_a_results_target_no_result_is_written(self) -> None:
        args = _args("terminalize", self.fence(started=True, mark=Mark(
            BROKER, False, 3, None, None)), message(), "crash_loop")
        assert args is not None
        assert args[1:] == (None, "", 0)


def test_a_moved_message_keeps_the_budget_its_worker_allowed() -> None:
    mark = Mark(BROKER, False, 20, None, None)
    fence = DramatiqFence("default", "r1", BROKER, "sha", mark.encode(), True, 1.0)
    args = _args("resume", fence, message(), None)
    assert args is not None
    moved = read_message(args[0], "r1")
    assert moved is not None
    assert (moved.retries, moved.max_retries) == (1, 20)
