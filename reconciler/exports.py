"""Lists of decisions and jobs leaving the reconciler as CSV or JSON: ``reconciler decisions
--format csv``, ``reconciler jobs list --format csv`` and the console's export links.

Each export is the public view's records (``reconciler.views``: the same redaction as the
pages), written as they are read, a page at a time, so that an export of a million
decisions holds one page in memory and no long transaction. A spreadsheet obeys a cell
that begins with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return as a formula: such
a text cell (a job kind, an operator's note) is written with a leading ``'``, as OWASP
advises, so that opening an export never runs what a job's data says.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator
from typing import Any

DECISION_COLUMNS = (
    "decision_id", "decided_at", "pass_id", "job_source", "job_id", "job_kind",
    "disposition", "decision_reason", "resume_step_index", "generation_before",
    "generation_after", "shadow", "decision_evidence",
)
"""The decisions' CSV columns, in order: a decision record's (``decisions --json``)."""
JOB_COLUMNS = (
    "job_id", "job_kind", "status", "source_status", "reason", "attempts_used",
    "max_attempts", "max_attempts_from", "resume_step_index", "operator_hold",
    "created_at", "updated_at", "finished_at",
)
"""The jobs' CSV columns, in order: a ``jobs list --json`` item's (steps left out: one job's
steps are ``jobs show``'s)."""
FORMATS = ("text", "json", "csv")
"""What ``--format`` takes (``--json`` is ``--format json``)."""

_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> str:
    """One value as a CSV cell: nothing for null, JSON for a list or a mapping (evidence),
    ``true``/``false`` as in the JSON, a text that a spreadsheet would run quoted with
    ``'``; numbers as they are."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if isinstance(value, int | float):
        return str(value)
    text = str(value)
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def csv_chunks(columns: tuple[str, ...], pages: Iterable[list[dict[str, Any]]]
               ) -> Iterator[str]:
    """The header, then each page of records as CSV text (RFC 4180: CRLF line ends,
    quoted where a cell needs it), one chunk per page."""
    yield _csv_text([list(columns)])
    for records in pages:
        if records:
            yield _csv_text([[csv_cell(r.get(c)) for c in columns] for r in records])


def json_chunks(pages: Iterable[list[dict[str, Any]]]) -> Iterator[str]:
    """A JSON array of every record, one chunk per page: ``decisions --json``'s shape,
    written as it is read."""
    first = True
    for records in pages:
        for record in records:
            yield ("[\n" if first else ",\n") + json.dumps(record, default=str)
            first = False
    yield "[]\n" if first else "\n]\n"


def _csv_text(rows: list[list[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows(rows)
    return out.getvalue()
