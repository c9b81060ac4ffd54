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


def test_with_mask_finds_the_mask_term_after_score_modifiers():
    # a mask may stand after score modifiers in a chain: the mask joins that term
    joined = with_mask(parse("alibi + causal"), "doc")
    assert joined == parse("alibi + causal & doc")


def test_with_mask_refuses_a_named_spec_with_scores_and_a_mask_with_scores():
    from flexspec.errors import SpecError
    from flexspec.lang.library import load_text

    library = load_text("spec layer = causal + alibi\n")
    with pytest.raises(SpecError, match="'layer' is a named spec with score modifiers"):
        with_mask(parse("layer", library=library), "doc", library=library)
    with pytest.raises(SpecError, match="with_mask joins a mask, but 'doc \\+ alibi'"):
        with_mask(parse("causal"), "doc + alibi")


def test_with_score_appends_a_modifier():
    from flexspec.errors import SpecError
    from flexspec.lang.api import with_score

    assert with_score(parse("causal & doc + alibi"), "softcap(30.0)") == \
        parse("causal & doc + alibi + softcap(30.0)")
    assert str(with_score(parse("causal"), "softcap(30.0)")) == "causal + softcap(30.0)"
    with pytest.raises(SpecError, match="has a mask"):
        with_score(parse("causal"), "doc")
