"""Rewrites of a whole spec's IR (flexspec.ir.rewrites): placement, scale, joined masks and score
modifiers, and the default offset of end-aligned specs. What a placed spec computes at given
offsets is checked against the reference in tests/runtime/test_positions.py."""

import pytest

from flexspec import ir, parse
from flexspec.ir import rewrites
from flexspec.lang.library import load_text


def test_placement_reads_the_offset_wherever_q_is_read():
    spec = parse("causal & window(4) + alibi").ir
    placed = rewrites.placed(spec, offset=True, lengths=False)
    position = ir.Binary("+", ir.Var("q"), ir.Lookup(rewrites.OFFSET_TENSOR, (ir.Var("b"),)))
    assert placed.mask == ir.substitute(spec.mask, {"q": position})
    assert placed.score == ir.substitute(spec.score, {"q": position})
    assert "q_offset[b]" in ir.to_text(placed.score)
    # nothing else changes
    assert rewrites.placed(spec, offset=False, lengths=False) == spec


def test_valid_lengths_join_the_mask():
    full = rewrites.placed(parse("alibi").ir, offset=False, lengths=True)
    assert ir.to_text(full.mask) == "kv < kv_lengths[b]"
    causal = rewrites.placed(parse("causal").ir, offset=True, lengths=True)
    assert ir.to_text(causal.mask) == "q + q_offset[b] >= kv & kv < kv_lengths[b]"


def test_an_offset_written_into_the_ir_places_it_at_the_start():
    end = parse("causal_bottom_right").ir
    assert end.align == "end"
    assert rewrites.placed(end, offset=True, lengths=False).align == "start"
    assert rewrites.placed(end, offset=False, lengths=True).align == "end"


def test_default_offset_puts_the_last_row_on_the_last_valid_key():
    assert rewrites.default_offset("start", 3, 10) is None
    assert rewrites.default_offset("end", 3, 10) == 7
    assert rewrites.default_offset("end", 3, 10, kv_lengths=5) == 2
    assert rewrites.default_offset("start", 3, 10, kv_lengths=5) is None


def test_reads_positions():
    assert rewrites.reads_positions(parse("causal").ir)
    assert rewrites.reads_positions(parse("alibi").ir)
    assert rewrites.reads_positions(parse("doc").ir)  # doc_ids[b, q]
    assert not rewrites.reads_positions(parse("full + softcap(5.0)").ir)


def test_scaled_multiplies_the_logit_before_the_score_pipeline():
    spec = rewrites.scaled(parse("causal + softcap(5.0)").ir)
    assert ir.to_text(spec.score) == "5.0 * tanh(score * scale[b] / 5.0)"
    assert spec.mask == parse("causal").ir.mask


LIBRARY = load_text("mask behind = causal_bottom_right\n")


@pytest.mark.parametrize("spec, mask, expected", [
    ("causal + alibi", "window(4)", "causal & window(4) + alibi"),
    ("alibi", "key_padding", "key_padding + alibi"),
    ("full", "doc", "doc"),
    ("causal | sink(2)", "doc", "(causal | sink(2)) & doc"),
    ("causal & causal", "causal", "causal"),
])
def test_join_mask_is_what_the_checker_makes_of_the_joined_text(spec, mask, expected):
    joined = rewrites.join_mask(parse(spec).ir, parse(mask).ir)
    assert joined == parse(expected).ir


def test_a_joined_end_aligned_mask_aligns_the_spec_at_the_end():
    joined = rewrites.join_mask(parse("alibi").ir, parse("behind", library=LIBRARY).ir)
    assert joined.align == "end"
    assert joined == parse("behind + alibi", library=LIBRARY).ir


@pytest.mark.parametrize("spec, modifier, expected", [
    ("causal", "softcap(30.0)", "causal + softcap(30.0)"),
    ("causal + scale(2.0)", "softcap(5.0) + alibi", "causal + scale(2.0) + softcap(5.0) + alibi"),
    ("full", "scale(0.5)", "scale(0.5)"),
])
def test_join_score_applies_the_modifier_after_the_spec_s_own(spec, modifier, expected):
    assert rewrites.join_score(parse(spec).ir, parse(modifier).ir) == parse(expected).ir
