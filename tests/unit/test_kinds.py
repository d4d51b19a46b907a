"""Per-kind rules: the most specific matching pattern wins, key by key; pure."""

from __future__ import annotations

import pytest

from reconciler.core.decisions import Thresholds
from reconciler.core.kinds import KindRule, KindRules, specificity
from reconciler.core.vocabulary import EffectKind

DEFAULTS = {"stale_after_seconds": 60.0, "wedged_after_seconds": 3600.0, "max_attempts": 3}


def rules(*tables: KindRule) -> KindRules:
    return KindRules(tables, **DEFAULTS)


class TestDefaults:
    """With no table at all, every kind gets the settings' values and the safe effect."""

    def test_unconfigured_kind_gets_the_defaults(self) -> None:
        """A kind no pattern matches is effectful, reconciled, with no run-time promise."""
        policy = rules().resolve("anything")
        assert policy.effect is EffectKind.EFFECTFUL
        assert policy.thresholds == Thresholds(60.0, 3600.0)
        assert policy.max_run_seconds is None
        assert policy.max_attempts == 3
        assert policy.reconcile is True
        assert policy.kind == "anything"


class TestMatching:
    """fnmatch over the kind: case-sensitive, '*' crosses dots, exact names work."""

    def test_glob_matches_across_dots(self) -> None:
        """'reports.*' matches nested names too."""
        table = rules(KindRule("reports.*", effect=EffectKind.IDEMPOTENT))
        assert table.resolve("reports.daily.eu").effect is EffectKind.IDEMPOTENT
        assert table.resolve("report").effect is EffectKind.EFFECTFUL

    def test_matching_is_case_sensitive(self) -> None:
        """'Reports.*' does not match 'reports.daily' on any platform."""
        table = rules(KindRule("Reports.*", effect=EffectKind.PURE))
        assert table.resolve("reports.daily").effect is EffectKind.EFFECTFUL

    def test_question_mark_and_class(self) -> None:
        """'?' is one character, '[ab]' one of a set."""
        table = rules(KindRule("job-?", max_attempts=5), KindRule("q[12]", max_attempts=7))
        assert table.resolve("job-1").max_attempts == 5
        assert table.resolve("job-12").max_attempts == 3
        assert table.resolve("q2").max_attempts == 7
        assert table.resolve("q3").max_attempts == 3


class TestSpecificity:
    """The most specific pattern wins; specific is defined and total."""

    def test_exact_name_beats_every_glob(self) -> None:
        """An exact name wins over a glob that matches the same kind with as many literals."""
        table = rules(KindRule("send*", effect=EffectKind.PURE),
                      KindRule("send", effect=EffectKind.IDEMPOTENT))
        assert table.resolve("send").effect is EffectKind.IDEMPOTENT
        assert table.resolve("sendmail").effect is EffectKind.PURE

    def test_more_literal_characters_win(self) -> None:
        """'reports.daily*' is more specific than 'reports.*', which beats '*'."""
        table = rules(KindRule("*", max_attempts=2), KindRule("reports.*", max_attempts=4),
                      KindRule("reports.daily*", max_attempts=6))
        assert table.resolve("reports.daily").max_attempts == 6
        assert table.resolve("reports.weekly").max_attempts == 4
        assert table.resolve("mail").max_attempts == 2

    def test_longer_literal_prefix_breaks_a_tie(self) -> None:
        """'a*' and '*a' both match 'aa' with one literal: the prefix decides."""
        table = rules(KindRule("*a", max_attempts=2), KindRule("a*", max_attempts=4))
        assert table.resolve("aa").max_attempts == 4

    def test_fewer_wildcards_break_a_tie(self) -> None:
        """Equal literals and prefix: the pattern with fewer wildcards wins."""
        table = rules(KindRule("ab*", max_attempts=2), KindRule("ab**", max_attempts=4))
        assert table.resolve("abc").max_attempts == 2

    def test_last_resort_is_text_order_not_file_order(self) -> None:
        """Fully tied patterns resolve by text order, whatever order the file lists them in."""
        # 'a?' and 'a[bc]': one literal, prefix 1, one wildcard each; 'a?' sorts first.
        tied_a = rules(KindRule("a[bc]", max_attempts=2), KindRule("a?", max_attempts=4))
        tied_b = rules(KindRule("a?", max_attempts=4), KindRule("a[bc]", max_attempts=2))
        assert tied_a.resolve("ab").max_attempts == 4
        assert tied_b.resolve("ab").max_attempts == 4

    def test_specificity_key_orders_as_documented(self) -> None:
        """The key ranks literals, then prefix, then fewer wildcards."""
        assert specificity("send") > specificity("send*")
        assert specificity("reports.daily*") > specificity("reports.*") > specificity("*")
        assert specificity("a*") > specificity("*a")
        assert specificity("ab*") > specificity("ab**")


class TestCascade:
    """Each key comes from the most specific pattern that sets it."""

    def test_general_pattern_fills_keys_a_specific_one_leaves_unset(self) -> None:
        """'*' sets max_run_seconds for all; 'reports.*' refines only the effect."""
        table = rules(KindRule("*", max_run_seconds=900.0, max_attempts=5),
                      KindRule("reports.*", effect=EffectKind.IDEMPOTENT,
                               stale_after_seconds=300.0))
        policy = table.resolve("reports.daily")
        assert policy.effect is EffectKind.IDEMPOTENT
        assert policy.max_run_seconds == 900.0
        assert policy.max_attempts == 5
        assert policy.thresholds == Thresholds(300.0, 3600.0)

    def test_reconcile_false_can_be_lifted_by_a_more_specific_pattern(self) -> None:
        """'*' opts out everything; 'billing.*' opts back in."""
        table = rules(KindRule("*", reconcile=False), KindRule("billing.*", reconcile=True))
        assert table.resolve("billing.charge").reconcile is True
        assert table.resolve("mail").reconcile is False


class TestValidation:
    """Inconsistent tables are found before a pass ever runs."""

    def test_pattern_with_wedged_below_stale_is_a_problem(self) -> None:
        """A pattern whose resolved wedged time is not above its stale time is reported."""
        table = rules(KindRule("slow.*", stale_after_seconds=7200.0))
        [problem] = table.problems()
        assert "slow.*" in problem
        assert "wedged_after_seconds" in problem

    def test_consistent_tables_have_no_problems(self) -> None:
        """Raising both thresholds together is fine."""
        table = rules(KindRule("slow.*", stale_after_seconds=7200.0,
                               wedged_after_seconds=14400.0))
        assert table.problems() == []

    def test_duplicate_pattern_is_refused(self) -> None:
        """Two tables with one pattern cannot both win."""
        with pytest.raises(ValueError, match="once"):
            rules(KindRule("a"), KindRule("a"))

    def test_unknown_effect_is_refused(self) -> None:
        """An effect outside the vocabulary is a ValueError."""
        with pytest.raises(ValueError, match="maybe"):
            KindRule("a", effect="maybe")  # type: ignore[arg-type]

    def test_empty_pattern_is_refused(self) -> None:
        """A pattern must say something."""
        with pytest.raises(ValueError, match="non-empty"):
            KindRule("")
