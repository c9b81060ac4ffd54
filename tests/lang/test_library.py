"""flexspec.lang.library: .attn text and files checked into a Library (most of its checks are
tested through the checker, tests/lang/test_checker.py)."""

from __future__ import annotations

import pytest

import flexspec


def test_loads_checks_attn_text_without_a_file():
    library = flexspec.loads("mask m = q >= kv\nspec s = m & window(4)\n", "mine.attn")
    assert str(library["s"]) == "m & window(4)"
    with pytest.raises(flexspec.SpecError, match=r"mine\.attn:1:14: unexpected end of input"):
        flexspec.loads("mask m = q >=\n", "mine.attn")
    with pytest.raises(flexspec.SpecError, match="for a path use flexspec.load"):
        flexspec.loads(None)
