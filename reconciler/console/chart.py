"""Decisions per reason as a small horizontal bar chart, laid out here and drawn by the
template as inline SVG (no script, no inline style: the CSP allows neither)."""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core.decisions import RULES
from reconciler.core.vocabulary import Disposition

ROW_HEIGHT = 22
BAR_HEIGHT = 16
LABEL_WIDTH = 230
BAR_SPACE = 300
COUNT_WIDTH = 70

_DISPOSITION_OF = {rule.reason.value: rule.disposition.value for rule in RULES}


@dataclass(frozen=True, slots=True)
class Bar:
    """One reason's bar: where it sits, how long it is, and what it counts."""

    reason: str
    disposition: str
    count: int
    capped: bool
    y: int
    width: int


@dataclass(frozen=True, slots=True)
class Chart:
    """The whole chart's geometry."""

    bars: tuple[Bar, ...]
    width: int
    height: int
    label_width: int = LABEL_WIDTH
    bar_height: int = BAR_HEIGHT


def reason_chart(counts: dict[str, int], cap: int) -> Chart:
    """Bars for every reason with a count, largest first; a count at ``cap`` is shown as
    "at least"."""
    top = max(counts.values(), default=0)
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    bars = tuple(
        Bar(reason, _DISPOSITION_OF.get(reason, Disposition.SKIP.value), count,
            count >= cap, i * ROW_HEIGHT, max(1, round(BAR_SPACE * count / top)))
        for i, (reason, count) in enumerate(ordered))
    return Chart(bars, LABEL_WIDTH + BAR_SPACE + COUNT_WIDTH,
                 max(ROW_HEIGHT, len(bars) * ROW_HEIGHT))
