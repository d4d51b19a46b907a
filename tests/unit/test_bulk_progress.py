"""The bulk form's progress bar (``reconciler.cli.bulk.Progress``): drawn in place on a
terminal for a bulk of more than one chunk, cleared before any other line, never written
elsewhere."""

from __future__ import annotations

import io

import pytest

from reconciler.cli.bulk import Progress
from reconciler.core.operator_desk import BULK_CHUNK

pytestmark = pytest.mark.fast


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_redrawn_in_place_and_cleared() -> None:
    out = Terminal()
    bar = Progress(4 * BULK_CHUNK, out)
    bar.show(BULK_CHUNK)
    bar.clear()
    bar.show(4 * BULK_CHUNK)
    bar.clear()
    bar.clear()  # nothing drawn: nothing to clear
    assert out.getvalue() == (
        f"\r[#######.......................] {BULK_CHUNK}/{4 * BULK_CHUNK}\r\x1b[2K"
        f"\r[##############################] {4 * BULK_CHUNK}/{4 * BULK_CHUNK}\r\x1b[2K")


@pytest.mark.parametrize(("stream", "total"), [(io.StringIO(), 4 * BULK_CHUNK),
                                               (Terminal(), BULK_CHUNK)])
def test_no_bar_off_a_terminal_or_for_one_chunk(stream: io.StringIO, total: int) -> None:
    bar = Progress(total, stream)
    bar.show(total)
    bar.clear()
    assert stream.getvalue() == ""
