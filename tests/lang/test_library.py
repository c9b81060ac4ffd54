"""flexspec.lang.library: .attn text and files checked into a Library (most of its checks are
tested through the checker, tests/lang/test_checker.py)."""

from __future__ import annotations

import pytest

import flexspec
from flexspec.lang.fmt import format_attn
from flexspec.lang.library import check_text


def test_loads_checks_attn_text_without_a_file():
    library = flexspec.loads("mask m = q >= kv\nspec s = m & window(4)\n", "mine.attn")
    assert str(library["s"]) == "m & window(4)"
    with pytest.raises(flexspec.SpecError, match=r"mine\.attn:1:14: unexpected end of input"):
        flexspec.loads("mask m = q >=\n", "mine.attn")
    with pytest.raises(flexspec.SpecError, match="for a path use flexspec.load"):
        flexspec.loads(None)


BROKEN = ["# two errors, on lines 3 and 5", "mask ok = q >= kv", "mask a = q + kv", "",
          "spec s = ok & windw(3)  # a typo"]


@pytest.mark.parametrize("brk", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_errors_of_a_file_point_at_their_lines_whatever_its_line_breaks(brk):
    """Red-team finding: a file saved with "\\r" line breaks reported every error on line 1."""
    errors = check_text(brk.join(BROKEN) + brk, "m.attn")
    assert [(e.line, e.column) for e in errors] == [(3, 10), (5, 15)]
    assert str(errors[1]).splitlines()[1:] == ["    spec s = ok & windw(3)  # a typo",
                                               "                  ^^^^^^^^"]


@pytest.mark.parametrize("brk", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_syntax_errors_point_at_their_line_whatever_the_line_breaks(brk):
    text = brk.join(["# a comment ends at the line break", "mask ok = q >= kv",
                     "mask a = q >= >= kv", ""])
    [error] = check_text(text, "m.attn")
    assert (error.line, error.column) == (3, 15)
    assert str(error).splitlines()[1] == "    mask a = q >= >= kv"


@pytest.mark.parametrize("brk", ["\r\n", "\r"], ids=["CRLF", "CR"])
def test_format_keeps_comments_on_their_lines_whatever_the_line_breaks(brk):
    text = brk.join(["# head", "mask ok = q>=kv", "", "", "mask a = q >= kv  # tail",
                     "spec s = ok & window(3)", ""])
    assert format_attn(text) == ("# head\nmask ok = q >= kv\n\nmask a = q >= kv  # tail\n"
                                 "spec s = ok & window(3)\n")
