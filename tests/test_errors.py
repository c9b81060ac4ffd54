"""flexspec.errors: where a character offset stands (line and column) and how an error is drawn,
for every convention of line breaks a file may be saved with."""

from __future__ import annotations

import pytest

from flexspec.errors import Source, Span, SpecError

BREAKS = {"LF": "\n", "CRLF": "\r\n", "CR": "\r"}


@pytest.mark.parametrize("brk", BREAKS.values(), ids=BREAKS.keys())
def test_lines_and_columns_count_every_kind_of_line_break(brk):
    lines = ["mask a = q", "", "mask bb = kv >= 0", "spec s = a"]
    text = brk.join(lines) + brk
    source = Source(text, "m.attn")
    for number, line in enumerate(lines, start=1):
        start = sum(len(previous) + len(brk) for previous in lines[:number - 1])
        assert source.line_col(start) == (number, 1)
        assert source.line_text(start) == line
        if line:
            last = start + len(line) - 1
            assert source.line_col(last) == (number, len(line))
            assert source.line_text(last) == line
            assert source.line_start(last) == start
        # the line break itself (both characters of "\r\n") belongs to the line it ends
        for k in range(len(brk)):
            assert source.line_col(start + len(line) + k) == (number, len(line) + 1 + k)
    assert source.line_col(len(text)) == (len(lines) + 1, 1)


def test_mixed_line_breaks_are_each_one_break():
    source = Source("a\r\nb\rc\nd", "m.attn")
    assert [source.line_col(source.text.index(c)) for c in "abcd"] == [
        (1, 1), (2, 1), (3, 1), (4, 1)]
    assert [source.line_text(source.text.index(c)) for c in "abcd"] == list("abcd")


def test_offsets_place_an_embedded_text_in_its_file():
    source = Source("x\ry", "p.yaml", line_offset=6, column_offset=12)
    assert source.line_col(0) == (7, 13)
    assert source.line_col(2) == (8, 1)


@pytest.mark.parametrize("brk", BREAKS.values(), ids=BREAKS.keys())
def test_the_caret_sits_under_the_span_on_its_own_line(brk):
    text = brk.join(["mask a = q >= kv", "mask b = q +  kv", ""])
    start = text.index("q +")
    error = SpecError("not a mask", Span(Source(text, "m.attn"), start, start + len("q +  kv")))
    assert (error.line, error.column) == (2, 10)
    assert str(error) == "m.attn:2:10: not a mask\n    mask b = q +  kv\n             ^^^^^^^"
