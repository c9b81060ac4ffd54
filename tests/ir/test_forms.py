"""Known forms read off the IR (flexspec.ir.forms): a constant factor, SDPA's form, FA4's
native form, the lookup queries and the band of distances a decoded token needs. What a native form computes is checked against the
reference in tests/runtime/test_native.py (an emulation of FA4's arguments)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec import ir, parse
from flexspec.ir.forms import (SdpaForm, constant_lookup, distance_bounds, distance_span,
                               is_causal_mask, logit_factor, native_form, nested_lookup,
                               same_document, sdpa_form, softcap_form)
from flexspec.lang.api import with_mask
from flexspec.lang.library import load_text
from flexspec.testing.specs import spec_texts

LIBRARY = load_text("score halve = score / 2.0\nscore twice = 2 * score\n"
                    "score flip = score * -1.0\nscore shifted = score + 1.0\n"
                    "mask strictly_causal = q - kv >= 1\nmask tall = q - kv <= KV_LEN\n"
                    "mask negated(n: int) = -(q - kv) >= -n\n")


@pytest.mark.parametrize("text, factor", [
    ("causal", 1.0), ("scale(0.5)", 0.5), ("halve + twice + scale(3.0)", 3.0),
    ("flip", None), ("scale(0.0)", None), ("shifted", None), ("softcap(5.0)", None),
    ("alibi", None),
])
def test_the_logit_times_a_positive_constant(text, factor):
    assert logit_factor(parse(text, library=LIBRARY).ir.score) == factor


def test_booleans_and_division_by_zero_are_not_factors():
    assert logit_factor(ir.Binary("*", ir.SCORE, ir.Const(True))) is None
    assert logit_factor(ir.Binary("/", ir.SCORE, ir.Const(0.0))) is None
    assert logit_factor(ir.Binary("*", ir.Const(1e308), ir.Binary("*", ir.SCORE,
                                                                    ir.Const(1e308)))) is None


# ---- SDPA's form -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, form", [
    ("full", SdpaForm(causal=False, factor=1.0)),
    ("causal", SdpaForm(causal=True, factor=1.0)),
    ("causal & causal", SdpaForm(causal=True, factor=1.0)),
    ("causal + scale(0.5)", SdpaForm(causal=True, factor=0.5)),
    ("scale(2.0) + scale(3.0)", SdpaForm(causal=False, factor=6.0)),
    ("causal & window(8)", None),
    ("causal_bottom_right", None),
    ("causal + alibi", None),
    ("causal + softcap(30)", None),
    ("causal + scale(-1.0)", None),  # a negative scale breaks the kernels' running maximum
    ("causal + scale(0.0)", None),
])
def test_sdpa_form(text, form):
    assert sdpa_form(parse(text).ir) == form


def test_sdpa_form_reads_division_and_left_constants():
    from flexspec.lang.library import load_text

    library = load_text("score halve = score / 2.0\nscore twice = 2.0 * score\n")
    assert sdpa_form(parse("causal + halve", library=library).ir).factor == 0.5
    assert sdpa_form(parse("twice", library=library).ir).factor == 2.0


# ---- FA4's native form ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["causal + alibi", "causal & prefix_lm(4)", "chunked(8)",
                                  "strictly_causal", "block_causal(2)", "causal_bottom_right",
                                  "softcap(2.0) + scale(2.0)", "causal + scale(-1.0)",
                                  "doc & key_padding", "tall", "causal | window(2)"])
def test_specs_outside_the_native_form(text):
    assert native_form(flexspec.parse(text, library=LIBRARY).ir) is None


def test_constant_factors_on_either_side_and_divisions_are_read():
    assert native_form(flexspec.parse("causal + halve + scale(3.0)",
                                      library=LIBRARY).ir).factor == 1.5


def test_the_form_of_the_common_specs():
    form = native_form(flexspec.parse("sliding_window(1024) + softcap(30)").ir)
    assert (form.left, form.right, form.softcap, form.causal) == (1024, 0, 30.0, False)
    assert form.window == (1024, 0)
    causal = native_form(flexspec.parse("causal & doc").ir)
    assert causal.causal and causal.window == (None, None) and causal.documents.name == "doc_ids"
    assert native_form(flexspec.parse("full").ir).window == (None, None)


def test_documents_must_be_read_in_the_same_row_at_q_and_kv():
    ids = ir.Tensor("doc_ids", (ir.Var("B"), ir.Var("KV_LEN")), "int")

    def same(left, right):
        return ir.AttentionIR(ir.Binary("==", ir.Lookup(ids, left), ir.Lookup(ids, right)))

    b, q, kv, zero = ir.Var("b"), ir.Var("q"), ir.Var("kv"), ir.Const(0)
    assert native_form(same((b, q), (b, kv))).documents == ids
    assert native_form(same((zero, kv), (zero, q))).documents == ids
    assert native_form(same((b, q), (zero, kv))) is None
    assert native_form(same((b, q), (b, q))) is None
    assert native_form(same((ir.Var("h"), q), (ir.Var("h"), kv))) is None


@pytest.mark.parametrize("text, window", [
    ("negated(4)", (4, None)),           # -(q - kv) >= -4 is q - kv <= 4
    ("strictly_causal", None),           # q - kv >= 1 hides the diagonal
    ("left_open(3)", (2, None)),         # q - kv < 3 is q - kv <= 2
])
def test_negated_and_strict_distance_bounds(text, window):
    library = load_text("mask negated(n: int) = -(q - kv) >= -n\n"
                        "mask strictly_causal = q - kv >= 1\n"
                        "mask left_open(n: int) = q - kv < n\n")
    form = native_form(parse(text, library=library).ir)
    assert (None if form is None else (form.left, form.right)) == window


def test_lookups_at_a_constant_index_and_lookups_inside_indices_are_found():
    ids = ir.Tensor("doc_ids", (ir.Var("B"), ir.Var("KV_LEN")), "int")
    offset = ir.Tensor("q_offset", (ir.Var("B"),), "int")
    b, q, kv = ir.Var("b"), ir.Var("q"), ir.Var("kv")
    broadcast = ir.AttentionIR(ir.Binary("==", ir.Lookup(ids, (ir.Const(0), q)),
                                         ir.Lookup(ids, (ir.Const(0), kv))))
    assert constant_lookup(broadcast) == "doc_ids[0, q]"
    assert nested_lookup(broadcast) is None
    shifted = ir.Binary("+", q, ir.Lookup(offset, (b,)))
    nested = ir.AttentionIR(ir.Binary("==", ir.Lookup(ids, (b, shifted)), ir.Lookup(ids, (b, kv))))
    assert nested_lookup(nested) == "doc_ids[b, q + q_offset[b]]"
    assert constant_lookup(nested) is None
    # the score's lookups count too
    score = ir.AttentionIR(score=ir.Binary("+", ir.SCORE, ir.Lookup(offset, (ir.Const(0),))))
    assert constant_lookup(score) == "q_offset[0]"
    assert constant_lookup(parse("causal & doc + alibi").ir) is None


def test_a_softcap_reads_only_a_cap_equal_to_its_divisor():
    """Blind spot: `30 * tanh(score / 10)` read as a cap of 30 would compute 30 tanh(x / 30)."""
    library = load_text("score odd = 30.0 * tanh(score / 10.0)\n"
                        "score even = 30.0 * tanh(score / 30.0)\n")
    assert native_form(parse("causal + odd", library=library).ir) is None
    assert native_form(parse("causal + even", library=library).ir).softcap == 30.0


# ---- the band of distances a decoded token needs -----------------------------------------------


@pytest.mark.parametrize("text, span", [
    ("sliding_window(1024)", (0, 1024)), ("causal", (0, math.inf)), ("window(3)", (-3, 3)),
    ("causal & window(5) + alibi + softcap(9.0)", (0, 5)), ("dilated(8, 2)", (-8, 8)),
    ("causal_bottom_right & window(9)", (0, 9)), ("strictly_causal", (1, math.inf)),
    ("causal & window(4) + head_bias", (0, 4)),
    # a key read at an absolute position, a lookup by position, KV_LEN, no bound: no band
    ("causal & (window(8) | sink(4))", None), ("causal & doc", None), ("prefix_lm(8)", None),
    ("chunked(8) & causal", None), ("tall", None), ("full", None), ("causal & tall", None),
])
def test_the_band_of_distances_outside_which_nothing_is_seen(text, span):
    found = distance_span(parse(text, library=LIBRARY).ir)
    assert found == span
    # ints or infinities
    assert found is None or all(type(n) is int or math.isinf(n) for n in found)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec_texts(kinds=("static",)), st.integers(1, 40), st.integers(1, 12), st.integers(0, 30),
       st.integers(-20, 60))
def test_a_band_bounds_every_visible_pair_and_moving_all_positions_changes_nothing(
        text, window, q_len, cut, offset):
    """Soundness against the dense reference: no visible pair outside the band, and the spec on
    keys cut:KV_LEN with its rows moved back by ``cut`` is the spec on all keys, there."""
    try:
        spec = with_mask(parse(text), f"window({window})")
    except flexspec.SpecError:  # a named spec with score modifiers takes no joined mask
        assume(False)
    span = distance_span(spec.ir)
    assume(span is not None)
    kv_len = q_len + 40
    attn = flexspec.compile(spec, backend="reference")
    assume(not attn.bindings)
    mask = attn.dense_mask(q_len, kv_len, batch=1, heads=2, q_offset=offset)
    q_pos = torch.arange(q_len).view(-1, 1) + offset
    distance = q_pos - torch.arange(kv_len).view(1, -1)
    outside = (distance < span[0]) | (distance > span[1])
    assert not (mask & outside).any(), spec
    moved = attn.dense_mask(q_len, kv_len - cut, batch=1, heads=2, q_offset=offset - cut)
    assert torch.equal(moved, mask[..., cut:]), spec
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (q_len, kv_len, kv_len))
    full = attn.reference(q, k, v, q_offset=offset)
    visible = mask[..., :cut].any(-1, keepdim=True)  # rows that see a key cut off differ
    part = attn.reference(q, k[:, :, cut:], v[:, :, cut:], q_offset=offset - cut)
    torch.testing.assert_close(torch.where(visible, 0.0, part), torch.where(visible, 0.0, full))


def _mask(text):
    return parse("m", library=load_text(f"mask m = {text}")).ir.mask


# (atom, low <= q - kv <= high exactly, worked out by hand; None: not a bound on the distance)
BOUNDS = [
    ("q - kv == 3", (3, 3)), ("q - kv > 2", (3, math.inf)), ("q - kv >= 2", (2, math.inf)),
    ("q - kv < 2", (-math.inf, 1)), ("q - kv <= 2", (-math.inf, 2)),
    ("kv - q > 2", (-math.inf, -3)), ("kv + 1 <= q", (1, math.inf)),
    ("q - kv != 2", None), ("q >= 3", None), ("q + q - kv >= 0", None),
    ("abs(q - kv) <= 4", (-4, 4)), ("abs(kv - q) <= 4", (-4, 4)),
    # sums of q - kv with factors other than one, or shifted inside abs
    ("q - kv + q - kv >= 4", (2, math.inf)), ("q - kv + (q - kv) <= 5", (-math.inf, 2)),
    ("abs(q - kv + (q - kv)) <= 4", (-2, 2)), ("abs(q - kv + 1) <= 4", (-5, 3)),
]


@pytest.mark.parametrize("text, exact", BOUNDS)
def test_a_distance_bound_is_exact_or_not_given(text, exact):
    """Where distance_bounds gives a band it is the atom's own (a narrower band would cut off
    keys a row sees); it may pass over one it does not read (None)."""
    bounds = distance_bounds(_mask(text))
    assert bounds is None or bounds == exact
    if text.startswith("q - kv") and "+" not in text and "!=" not in text:
        assert bounds == exact  # the plain comparisons are all read
    if exact is None:
        assert bounds is None


def test_a_mask_with_twice_the_distance_runs_on_the_keys_it_sees():
    """Found by mutation testing (2026-12-02): `q - kv + q - kv >= 4` (q - kv >= 2) was read as
    q - kv >= 8, and a decoded token at 19 ran on keys 0..11 only, losing 12..17."""
    library = load_text("mask twice_apart = q - kv + q - kv >= 4")
    assert distance_span(parse("twice_apart", library=library).ir) in (None, (2, math.inf))
    attn = flexspec.compile("twice_apart", library=library)
    q, k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8)
    torch.testing.assert_close(attn(q, k, v, q_offset=19), attn.reference(q, k, v, q_offset=19),
                               atol=1e-6, rtol=1e-5)


def test_a_negated_expression_that_is_not_a_distance_is_read_through():
    library = load_text("score negated = -(score * 2.0)")
    assert distance_span(parse("causal + negated", library=library).ir) == (0, math.inf)
    assert distance_span(parse("window(3) + negated", library=library).ir) == (-3, 3)


@pytest.mark.parametrize("text, causal", [
    ("causal", True), ("causal & window(8) + alibi", True), ("window(8) & causal", True),
    ("causal_kv", True), ("full", False), ("window(8)", False), ("causal_bottom_right", False),
])
def test_a_causal_mask_is_top_left_causal_joined_to_more(text, causal):
    library = load_text("mask causal_kv = kv <= q")
    assert is_causal_mask(parse(text, library=library).ir) is causal


def test_documents_are_two_lookups_of_one_tensor():
    ids = ir.Tensor("doc_ids", (ir.Var("B"), ir.Var("KV_LEN")), "int")
    b, q, kv = ir.Var("b"), ir.Var("q"), ir.Var("kv")
    assert same_document(ir.Binary("==", ir.Lookup(ids, (b, q)), ir.Lookup(ids, (b, kv)))) == ids
    assert same_document(ir.Binary("==", ir.Lookup(ids, (b, q)), ir.Const(0))) is None
    assert same_document(ir.Binary("==", ir.Const(0), ir.Lookup(ids, (b, kv)))) is None


@pytest.mark.parametrize("cap, form", [(30.0, (30.0, 1.0)), (math.inf, None), (-5.0, None),
                                       (0.0, None)])
def test_a_softcap_must_be_positive_and_finite(cap, form):
    constant = ir.Const(cap)
    score = ir.Binary("*", constant, ir.Call("tanh", (ir.Binary("/", ir.SCORE, constant),)))
    assert softcap_form(score) == form
