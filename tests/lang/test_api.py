"""flexspec.lang.api: parse (most of it is tested through the checker) and with_mask."""

from __future__ import annotations

import pytest

from flexspec.lang.api import parse, with_mask


@pytest.mark.parametrize("spec, mask, expected", [
    ("causal + alibi", "key_padding", "causal & key_padding + alibi"),
    ("alibi", "key_padding", "key_padding + alibi"),
    ("causal", "sliding_window(3) & key_padding", "causal & (sliding_window(3) & key_padding)"),
    ("full + softcap(20) + alibi", "doc", "full & doc + softcap(20) + alibi"),
    ("causal | sink(2)", "doc", "(causal | sink(2)) & doc"),
])
def test_with_mask_joins_the_mask_term_before_the_score_modifiers(spec, mask, expected):
    joined = with_mask(parse(spec), mask)
    assert joined == parse(expected)
    assert joined.ir.score == parse(spec).ir.score
