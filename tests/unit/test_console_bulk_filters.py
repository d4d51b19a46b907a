"""The console's "retry these" / "cancel these" act on every filter of the decisions page
the command line's bulk form takes, disposition included: the preview and the
confirmation hand the desk one ``BulkFilter``, and the page's hidden fields carry them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Unpack, cast

import pytest

from reconciler.console.acting import BULK_LIMIT, Acting
from reconciler.console.pages import Page
from reconciler.console.params import DecisionQuery
from reconciler.console.port import ConsoleReads
from reconciler.core.operator_desk import ActionReport, BulkFilter
from reconciler.core.vocabulary import OperatorAction

pytestmark = pytest.mark.fast

NOW = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)


class Reads:
    """The one read the bulk form makes: the database's now."""

    def now(self) -> tuple[datetime, datetime | None]:
        return NOW, None


class Desk:
    """A desk that records the filters it is asked for and matches two jobs."""

    source = "native"

    def __init__(self) -> None:
        self.asked: list[tuple[int, BulkFilter]] = []

    def bulk_targets(self, action: OperatorAction, *, limit: int,
                     **filters: Unpack[BulkFilter]) -> list[str]:
        self.asked.append((limit, filters))
        return ["2", "1"]

    def act_on_chunk(self, action: OperatorAction, job_ids: list[str], *, actor: str,
                     note: str | None) -> list[ActionReport]:
        return [ActionReport(action, j, True, None, f"job {j}: applied") for j in job_ids]


def test_the_preview_and_the_confirmation_match_on_the_disposition_too() -> None:
    desk = Desk()
    acting = Acting(cast(Any, desk), cast(ConsoleReads, Reads()))
    form = {"csrf": ["t"], "action": ["retry"], "note": ["checked"],
            "disposition": ["terminalize"], "since": ["1h"]}
    preview = acting.post("/decisions/bulk", form, "alice")
    assert isinstance(preview, Page)
    assert preview.context["count"] == 2
    confirmed = acting.post("/decisions/bulk", {**form, "confirm": ["1"], "count": ["2"],
                                                "as_of": [NOW.isoformat()]}, "alice")
    assert not isinstance(confirmed, Page)
    expected = BulkFilter(reason=None, disposition="terminalize", kind=None,
                          since=NOW - timedelta(hours=1), until=NOW)
    assert desk.asked == [(BULK_LIMIT, expected), (BULK_LIMIT, expected)]


def test_the_filters_a_bulk_form_carries() -> None:
    """Given ones only, the page's place and source apart."""
    query = DecisionQuery(disposition="skip", kind="mail.*", source="native", before=9)
    assert query.bulk_filters() == {"disposition": "skip", "kind": "mail.*"}
    assert DecisionQuery(source="native").bulk_filters() == {}
