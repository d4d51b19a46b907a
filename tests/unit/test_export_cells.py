"""How one value becomes a CSV cell (``reconciler.exports``): inert in a spreadsheet,
readable back as the JSON says."""

from __future__ import annotations

import pytest

from reconciler.exports import csv_cell, csv_chunks, json_chunks

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(("value", "cell"), [
    (None, ""), (True, "true"), (False, "false"), (0, "0"), (-3, "-3"), (1.5, "1.5"),
    ("reports.build", "reports.build"), ("=1+1", "'=1+1"), ("+1", "'+1"), ("-1", "'-1"),
    ("@SUM(A1)", "'@SUM(A1)"), ("\tx", "'\tx"), ("\rx", "'\rx"),
    ({"b": 1, "a": [1, None]}, '{"a":[1,null],"b":1}'), ([1, 2], "[1,2]"),
])
def test_a_value_as_a_cell(value: object, cell: str) -> None:
    assert csv_cell(value) == cell


def test_chunks_are_a_header_then_a_page_each() -> None:
    pages = [[{"a": 1, "b": "x,y"}], [], [{"a": 2, "b": 'say "hi"\nthere'}]]
    assert list(csv_chunks(("a", "b"), iter(pages))) == [
        "a,b\r\n", '1,"x,y"\r\n', '2,"say ""hi""\nthere"\r\n']
    assert "".join(json_chunks(iter(pages))) == (
        '[\n{"a": 1, "b": "x,y"},\n{"a": 2, "b": "say \\"hi\\"\\nthere"}\n]\n')
    assert "".join(json_chunks(iter([]))) == "[]\n"
