"""Per-kind rules: ``[kinds."<glob>"]`` tables resolved to one policy per job kind. Pure.

A job's kind is what its system names it by (a task name, a queue name, a job type). Each
``[kinds."<glob>"]`` table of the config file may set any of ``effect``,
``stale_after_seconds``, ``wedged_after_seconds``, ``max_run_seconds``, ``max_attempts``,
``crash_loop_after`` and ``reconcile``. For one kind, every key is taken from the **most
specific** matching pattern that sets it, else from the defaults (the settings), so
``[kinds."*"]`` can set a house rule that ``[kinds."reports.*"]`` refines key by key.

Specificity, compared in this order, higher wins:

1. more literal characters (a character that is not ``*``, ``?`` or a ``[...]`` class);
2. a longer literal prefix (the characters before the first wildcard);
3. fewer wildcards;
4. the pattern text that comes first in code point order (a fixed last resort, so the
   result never depends on the order of the file).

An exact name therefore beats every glob that matches the same kind (a glob can match with
as many literal characters only when its ``*`` matches nothing, and then it has more
wildcards). Patterns are matched with ``fnmatch.fnmatchcase``: case-sensitive, ``*``
crosses dots.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, fields
from fnmatch import fnmatchcase
from typing import Any

from reconciler.core.decisions import Thresholds
from reconciler.core.vocabulary import EffectKind


@dataclass(frozen=True, slots=True)
class KindRule:
    """One ``[kinds."<pattern>"]`` table: the keys it sets (None: not set here)."""

    pattern: str
    effect: EffectKind | None = None
    stale_after_seconds: float | None = None
    wedged_after_seconds: float | None = None
    max_run_seconds: float | None = None
    max_attempts: int | None = None
    crash_loop_after: int | None = None
    reconcile: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError("a kind pattern must be a non-empty string")
        if self.effect is not None:
            object.__setattr__(self, "effect", EffectKind(self.effect))

    def matches(self, kind: str) -> bool:
        """True when this pattern matches the kind."""
        return fnmatchcase(kind, self.pattern)

    @property
    def catches_all(self) -> bool:
        """True for a pattern of stars only (``"*"``), which matches every kind."""
        return set(self.pattern) == {"*"}


KIND_KEYS: tuple[str, ...] = tuple(f.name for f in fields(KindRule) if f.name != "pattern")
"""The keys a ``[kinds]`` table may set, in their declared order."""


@dataclass(frozen=True, slots=True)
class KindPolicy:
    """What the reconciler applies to jobs of one kind, every key resolved."""

    kind: str
    effect: EffectKind
    """The effect of a job's one step when the source records no steps of its own."""
    thresholds: Thresholds
    max_run_seconds: float | None
    """A promise that no healthy run lasts longer: the lease where a source has no liveness
    of its own. None: no promise; such a job is never reclaimed on time alone."""
    max_attempts: int
    """The attempt budget where the source keeps none."""
    reconcile: bool
    """False: the reconciler never touches jobs of this kind."""


def specificity(pattern: str) -> tuple[int, int, int, tuple[int, ...]]:
    """The sort key of a pattern's specificity: a larger key is more specific."""
    literal = wildcards = 0
    prefix: int | None = None
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char in "*?" or (char == "[" and pattern.find("]", i + 2) != -1):
            if prefix is None:
                prefix = literal
            wildcards += 1
            if char == "[":
                # fnmatch: a class runs to the first ']' after its first character.
                i = pattern.find("]", i + 2)
        else:
            literal += 1
        i += 1
    # Negated code points: the text first in code point order gets the larger key.
    return literal, literal if prefix is None else prefix, -wildcards, tuple(
        -ord(c) for c in pattern)


class KindRules:
    """Every ``[kinds]`` table and the defaults they refine; resolves a kind to its policy."""

    __slots__ = ("_defaults", "_ordered", "_resolve")

    def __init__(self, rules: Iterable[KindRule], *, stale_after_seconds: float,
                 wedged_after_seconds: float, max_attempts: int,
                 effect: EffectKind = EffectKind.EFFECTFUL,
                 crash_loop_after: int | None = None) -> None:
        ordered = sorted(rules, key=lambda r: specificity(r.pattern), reverse=True)
        patterns = [r.pattern for r in ordered]
        if len(set(patterns)) != len(patterns):
            raise ValueError("each kind pattern may appear once")
        self._ordered: tuple[KindRule, ...] = tuple(ordered)
        self._defaults = KindRule("*", effect=effect, stale_after_seconds=stale_after_seconds,
                                  wedged_after_seconds=wedged_after_seconds,
                                  max_attempts=max_attempts, reconcile=True,
                                  crash_loop_after=crash_loop_after)
        # Kinds are few (task and queue names): each is resolved once.
        self._resolve = functools.lru_cache(maxsize=4096)(self._resolve_uncached)

    @property
    def rules(self) -> tuple[KindRule, ...]:
        """The tables, most specific first."""
        return self._ordered

    def resolve(self, kind: str) -> KindPolicy:
        """The policy of one kind: each key from the most specific pattern that sets it."""
        return self._resolve(kind)

    def _resolve_uncached(self, kind: str) -> KindPolicy:
        matching = [r for r in self._ordered if r.matches(kind)]
        matching.append(self._defaults)

        def pick(key: str) -> Any:
            # The defaults set every key but max_run_seconds (and crash_loop_after when the
            # caller gives none), which may stay None.
            return next((v for r in matching if (v := getattr(r, key)) is not None), None)

        max_run = pick("max_run_seconds")
        crash_loop = pick("crash_loop_after")
        return KindPolicy(
            kind=kind, effect=pick("effect"),
            thresholds=Thresholds(float(pick("stale_after_seconds")),
                                  float(pick("wedged_after_seconds")),
                                  None if crash_loop is None else int(crash_loop)),
            max_run_seconds=None if max_run is None else float(max_run),
            max_attempts=int(pick("max_attempts")), reconcile=bool(pick("reconcile")),
        )

    def matching(self, kind: str) -> list[str]:
        """The patterns that match the kind, most specific first."""
        return [r.pattern for r in self._ordered if r.matches(kind)]

    def set_by(self, kind: str) -> dict[str, str | None]:
        """For each key, the pattern whose table gave the kind its value (None: the
        defaults, that is the settings)."""
        matching = [r for r in self._ordered if r.matches(kind)]
        return {key: next((r.pattern for r in matching if getattr(r, key) is not None), None)
                for key in KIND_KEYS}

    def unmatched(self, kinds: Iterable[str]) -> list[str]:
        """The patterns that match none of these kinds, most specific first. A catch-all
        (``"*"``) is never one: it has no spelling to get wrong, and matches whatever runs."""
        names = list(kinds)
        return [r.pattern for r in self._ordered
                if not r.catches_all and not any(r.matches(k) for k in names)]

    def resolve_defaults(self) -> KindPolicy:
        """The defaults as a policy (what ``[kinds]`` refines)."""
        d = self._defaults
        return KindPolicy(
            kind="*", effect=d.effect or EffectKind.EFFECTFUL,
            thresholds=Thresholds(float(d.stale_after_seconds or 0.0),
                                  float(d.wedged_after_seconds or 0.0), d.crash_loop_after),
            max_run_seconds=None, max_attempts=int(d.max_attempts or 1), reconcile=True)

    def scan_thresholds(self) -> Thresholds:
        """The thresholds a candidate scan uses: the defaults with the shortest wedged time
        any table sets, so a kind wedged sooner than the default is found (each candidate
        is then decided under its own kind's thresholds)."""
        base = self.resolve_defaults().thresholds
        shortest = min([base.wedged_after_seconds,
                        *(r.wedged_after_seconds for r in self._ordered
                          if r.wedged_after_seconds is not None)])
        return Thresholds(base.stale_after_seconds, shortest, base.crash_loop_after)

    def problems(self) -> list[str]:
        """Inconsistent resolutions, one line each: a pattern whose resolved wedged time is
        not above its resolved stale time (checked for each pattern taken as a kind)."""
        found = []
        for rule in self._ordered:
            policy = self.resolve(rule.pattern)
            if policy.thresholds.wedged_after_seconds <= policy.thresholds.stale_after_seconds:
                found.append(
                    f'[kinds."{rule.pattern}"]: wedged_after_seconds '
                    f"({policy.thresholds.wedged_after_seconds:g}) must be greater than "
                    f"stale_after_seconds ({policy.thresholds.stale_after_seconds:g})")
        return found

