"""Command-line parsing: durations and the documented command lines, without a database."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from reconciler.cli import build_parser, main, parse_duration
from reconciler.core.vocabulary import JobStatus, Reason


def parse(*argv: str) -> argparse.Namespace:
    """Parse a command line the way ``reconciler`` does."""
    return build_parser().parse_args(list(argv))


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Parse a command line that must be refused with exit status 2; return the error text."""
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


class TestParseDuration:
    """``--since`` durations: plain seconds or a number with s, m, h or d."""

    @pytest.mark.parametrize(
        ("text", "seconds"),
        [
            ("90", 90.0),
            ("90s", 90.0),
            ("15m", 900.0),
            ("2h", 7200.0),
            ("7d", 604_800.0),
            ("1.5h", 5400.0),
            ("0.5m", 30.0),
            (" 2h ", 7200.0),
        ],
    )
    def test_durations_in_seconds(self, text: str, seconds: float) -> None:
        """A duration with or without a unit is converted to seconds."""
        assert parse_duration(text) == seconds

    @pytest.mark.parametrize(
        "text", ["", "h", "abc", "2x", "2hours", "-5m", "1.5.5h", "2h30m", "1e3", "2 h h"]
    )
    def test_bad_durations_are_refused(self, text: str) -> None:
        """Anything but a non-negative number with an optional s/m/h/d unit is refused."""
        with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
            parse_duration(text)

    def test_refusal_shows_examples(self) -> None:
        """The refusal quotes the input and shows the accepted forms."""
        with pytest.raises(argparse.ArgumentTypeError) as caught:
            parse_duration("soon")
        assert "'soon'" in str(caught.value)
        assert "15m" in str(caught.value)


class TestCommandLines:
    """The command lines of docs/cli.md parse to what the commands need."""

    def test_pass_dry_run_json(self) -> None:
        """`pass --dry-run --json` asks for a dry run with JSON output."""
        args = parse("pass", "--dry-run", "--json")
        assert (args.command, args.dry_run, args.json) == ("pass", True, True)

    def test_pass_defaults(self) -> None:
        """A bare `pass` writes its decisions and prints text."""
        args = parse("pass")
        assert (args.dry_run, args.json) == (False, False)

    def test_jobs_list_with_filters(self) -> None:
        """`jobs list --status queued --limit 5 --json` filters, limits and prints JSON."""
        args = parse("jobs", "list", "--status", "queued", "--limit", "5", "--json")
        assert (args.command, args.jobs_command) == ("jobs", "list")
        assert (args.status, args.limit, args.json) == ("queued", 5, True)

    def test_jobs_list_defaults(self) -> None:
        """`jobs list` lists every status, at most 100 jobs, as text."""
        args = parse("jobs", "list")
        assert (args.status, args.limit, args.json) == (None, 100, False)

    @pytest.mark.parametrize("status", [s.value for s in JobStatus])
    def test_jobs_list_accepts_every_job_status(self, status: str) -> None:
        """Every public job status can be listed."""
        assert parse("jobs", "list", "--status", status).status == status

    def test_jobs_show(self) -> None:
        """`jobs show 7 --json` shows job 7 as JSON (the id as text: the configured source
        parses it, a number for most, a UUID for pg-boss)."""
        args = parse("jobs", "show", "7", "--json")
        assert (args.jobs_command, args.job_id, args.json) == ("show", "7", True)

    def test_decisions_with_filters(self) -> None:
        """`decisions --reason resume_exhausted --since 2h --limit 3 --json` filters the audit."""
        args = parse("decisions", "--reason", "resume_exhausted", "--since", "2h",
                     "--limit", "3", "--json")
        assert args.command == "decisions"
        assert (args.reason, args.since, args.limit, args.json) == (
            "resume_exhausted", 7200.0, 3, True)

    def test_decisions_defaults(self) -> None:
        """A bare `decisions` has no reason or age filter and a limit of 100."""
        args = parse("decisions")
        assert (args.reason, args.since, args.limit, args.json) == (None, None, 100, False)

    @pytest.mark.parametrize("reason", [r.value for r in Reason])
    def test_decisions_accepts_every_reason(self, reason: str) -> None:
        """Every decision reason, including fence_lost and reconcile_error, can be filtered on."""
        assert parse("decisions", "--reason", reason).reason == reason

    def test_explain(self) -> None:
        """`explain` parses with no arguments."""
        assert parse("explain").command == "explain"

    def test_explain_markdown(self) -> None:
        """`explain --markdown`, which regenerates docs/decision-table.md, parses."""
        assert parse("explain", "--markdown").markdown is True

    def test_db_upgrade(self) -> None:
        """`db upgrade` parses."""
        args = parse("db", "upgrade")
        assert (args.command, args.db_command) == ("db", "upgrade")

    def test_setting_flags_stay_text_until_validated(self) -> None:
        """Setting flags are passed on as text (None when absent) for Settings to validate."""
        args = parse("pass", "--database-url", "sqlite:///x.db", "--batch-size", "abc")
        assert (args.database_url, args.batch_size) == ("sqlite:///x.db", "abc")
        assert args.stale_after_seconds is None

    @pytest.mark.parametrize(("argv", "shadow"), [
        (("pass",), None), (("pass", "--shadow"), True), (("pass", "--no-shadow"), False),
        (("run", "--shadow"), True), (("jobs", "list", "--shadow"), True)])
    def test_boolean_settings_are_switches(self, argv: tuple[str, ...],
                                           shadow: bool | None) -> None:
        """`--shadow` and `--no-shadow` take no value; absent, the environment decides."""
        assert parse(*argv).shadow is shadow

    @pytest.mark.parametrize(("argv", "shadow_only"), [
        (("decisions",), False), (("decisions", "--shadow"), True),
        (("decisions", "--shadow", "--reason", "lease_live", "--json"), True)])
    def test_decisions_shadow_is_a_filter_not_the_setting(
            self, argv: tuple[str, ...], shadow_only: bool) -> None:
        """`decisions --shadow` asks for shadow decisions only; it sets no shadow setting,
        so the environment's RECONCILER_SHADOW still decides that (and means nothing here)."""
        args = parse(*argv)
        assert args.shadow_only is shadow_only
        assert args.shadow is None

    def test_decisions_has_no_no_shadow(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`decisions --no-shadow` is a usage error: the filter is a plain switch."""
        assert "--no-shadow" in refused(capsys, "decisions", "--no-shadow")

    def test_verbose_flag(self) -> None:
        """`--verbose` is accepted after a command."""
        assert parse("explain", "--verbose").verbose is True


class TestGlobalOptionsBeforeTheCommand:
    """``--config``, every setting's flag and ``--verbose`` work before the command too."""

    @pytest.mark.parametrize("argv", [
        ("--config", "x.toml", "pass"), ("pass", "--config", "x.toml"),
        ("--config", "x.toml", "jobs", "list"), ("--config", "x.toml", "db", "upgrade")])
    def test_config_before_or_after_the_command(self, argv: tuple[str, ...]) -> None:
        assert parse(*argv).config == "x.toml"

    def test_a_setting_before_the_command(self) -> None:
        args = parse("--stale-after-seconds", "0", "pass", "--dry-run")
        assert (args.stale_after_seconds, args.dry_run) == ("0", True)

    def test_verbose_before_a_command_group(self) -> None:
        args = parse("--verbose", "jobs", "list")
        assert (args.verbose, args.jobs_command) == (True, "list")

    def test_a_switch_before_the_command(self) -> None:
        assert parse("--shadow", "pass").shadow is True

    def test_after_the_command_wins(self) -> None:
        """The flag nearest the command's own options is the one meant."""
        args = parse("--config", "a.toml", "--batch-size", "5", "pass", "--config", "b.toml")
        assert (args.config, args.batch_size) == ("b.toml", "5")

    def test_nothing_given_is_none_everywhere(self) -> None:
        """Absent, a setting is None (the environment and the file decide), wherever the
        flag could have been."""
        args = parse("jobs", "list")
        assert (args.config, args.stale_after_seconds, args.verbose) == (None, None, False)


class TestRefusedCommandLines:
    """Malformed command lines end with argparse's usage error and exit status 2."""

    def test_unknown_status(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`jobs list --status` with a status outside the vocabulary is refused."""
        err = refused(capsys, "jobs", "list", "--status", "stuck")
        assert "--status" in err

    def test_unknown_reason(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`decisions --reason` with an unknown reason is refused."""
        err = refused(capsys, "decisions", "--reason", "because")
        assert "--reason" in err

    @pytest.mark.parametrize("command", [("jobs", "list"), ("decisions",)])
    @pytest.mark.parametrize("limit", ["0", "-1", "ten", "2.5"])
    def test_bad_limit(self, capsys: pytest.CaptureFixture[str], command: tuple[str, ...],
                       limit: str) -> None:
        """A --limit that is not a whole number of at least 1 is refused."""
        err = refused(capsys, *command, "--limit", limit)
        assert "--limit" in err

    def test_bad_since(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`decisions --since` with a malformed duration is refused."""
        err = refused(capsys, "decisions", "--since", "yesterday")
        assert "not a duration" in err

    @pytest.mark.parametrize("command", ["show", "hold", "cancel"])
    def test_non_numeric_job_id(self, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch, command: str) -> None:
        """The native source's ids are numbers: `jobs show seven` ends in one line, exit 2,
        before any database is opened."""
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("RECONCILER_CONFIG", raising=False)
        note = [] if command == "show" else ["--note", "checked"]
        assert main(["jobs", command, "seven", *note]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "not a native job id: 'seven'" in err
        assert not (tmp_path / "reconciler.db").exists()

    def test_an_empty_job_id_is_refused(self, capsys: pytest.CaptureFixture[str]) -> None:
        """No source has a job with an empty id."""
        refused(capsys, "jobs", "show", "")

    def test_no_command(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A command is required."""
        refused(capsys)

    def test_unknown_command(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown command is refused."""
        refused(capsys, "frobnicate")

    @pytest.mark.parametrize("argv", [("db",), ("jobs",)])
    def test_command_groups_need_an_action(self, capsys: pytest.CaptureFixture[str],
                                           argv: tuple[str, ...]) -> None:
        """`db` and `jobs` alone are refused: they need an action."""
        refused(capsys, *argv)


class TestUnreadableConfig:
    """A config file the loader refuses ends the command in one line with exit 2."""

    @pytest.mark.parametrize(("content", "says"), [
        (b"\xff\xfe", "not UTF-8"),
        (b"\xef\xbb\xbfbatch_size = 3\n", "byte order mark"),
        (b'[kinds.""]\neffect = "pure"\n', "cannot be empty"),
        (b'[kinds."*"]\nstale_after_seconds = nan\n', "finite"),
    ])
    def test_one_line_exit_2(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             content: bytes, says: str) -> None:
        """No traceback, no database touched."""
        path = tmp_path / "reconciler.toml"
        path.write_bytes(content)
        assert main(["pass", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert says in err

    def test_empty_config_path(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
        """`--config ""` never falls back to reconciler.db in the current folder."""
        monkeypatch.chdir(tmp_path)
        assert main(["jobs", "list", "--config", ""]) == 2
        assert "no file" in capsys.readouterr().err
        assert not (tmp_path / "reconciler.db").exists()
