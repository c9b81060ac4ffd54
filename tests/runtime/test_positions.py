"""Absolute query positions (q_offset), end alignment (causal_bottom_right), valid cache lengths
(kv_lengths) and the log-sum-exp (return_lse): the decoding invariant as a property over random
specs, shapes and bindings, checked on the reference and on FlexAttention with flexspec's mods and
block masks; then worked examples through the runtime."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

import flexspec
from flexspec import ir
from flexspec.kernels.reference import dense_mask, dense_scores
from flexspec.testing import KINDS, Shape, bindings, lookups_fit, specs

PROPERTY = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
EAGER = settings(max_examples=8, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def reads(spec, name: str) -> bool:
    return name in ir.free_vars(spec.ir.mask) | ir.free_vars(spec.ir.score)


@st.composite
def decoding_cases(draw, max_len: int = 90):
    """A spec that does not read Q_LEN, a square shape (the whole sequence), its bindings, and
    how many of the last queries to decode (1, or more for speculative decoding)."""
    spec = draw(specs(kinds=KINDS))
    assume(not reads(spec, "Q_LEN"))
    length = draw(st.integers(1, max_len))
    kv_heads = draw(st.integers(1, 2))
    shape = Shape(draw(st.integers(1, 2)), kv_heads * draw(st.integers(1, 2)), kv_heads,
                  length, length, draw(st.sampled_from((8, 16))))
    assume(lookups_fit(spec, shape))
    values = draw(bindings(spec, shape, learnables=True))
    last = draw(st.one_of(st.just(1), st.integers(1, length)))
    return spec, shape, values, last


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


# ---- the decoding invariant -----------------------------------------------------------------


@PROPERTY
@given(decoding_cases(), st.integers(0, 2**31 - 1))
def test_the_last_queries_at_their_offset_equal_the_last_rows_of_full_attention(case, seed):
    spec, shape, values, last = case
    attn = flexspec.compile(spec)
    q, k, v = shape.qkv(seed)
    start = shape.Q_LEN - last
    full = attn.reference(q, k, v, **values)
    part = attn.reference(q[:, :, start:], k, v, q_offset=start, **values)
    close(part, full[:, :, start:], f"{spec} {shape} last {last}")
    # one offset per batch row: each row as if it had been called alone
    offsets = torch.tensor([start] * shape.B)
    close(attn.reference(q[:, :, start:], k, v, q_offset=offsets, **values), part,
          f"{spec} per-row offsets")


@PROPERTY
@given(decoding_cases(), st.data())
def test_a_chunk_of_queries_against_the_keys_up_to_its_end_equals_those_rows(case, data):
    """Chunked prefill: queries a..b-1 at offset a against keys 0..b-1, for masks under which
    those queries see no later key (causal ones)."""
    spec, shape, values, _ = case
    assume(not reads(spec, "KV_LEN"))
    attn = flexspec.compile(spec)
    q, k, v = shape.qkv(data.draw(st.integers(0, 2**31 - 1)))
    end = data.draw(st.integers(1, shape.KV_LEN))
    begin = data.draw(st.integers(0, end - 1))
    mask = attn.dense_mask(shape.Q_LEN, shape.KV_LEN, batch=shape.B, heads=shape.Hq,
                           **{n: t for n, t in values.items() if n in attn.bindings})
    assume(not mask[:, :, begin:end, end:].any())
    full = attn.reference(q, k, v, **values)
    cut = {name: _keys_up_to(spec, name, value, end) for name, value in values.items()}
    chunk = attn.reference(q[:, :, begin:end], k[:, :, :end], v[:, :, :end], q_offset=begin,
                           **cut)
    close(chunk, full[:, :, begin:end], f"{spec} {shape} chunk {begin}..{end}")


def _keys_up_to(spec, name: str, value: torch.Tensor, end: int) -> torch.Tensor:
    """A binding cut to the first ``end`` keys along its KV_LEN dimensions."""
    tensor = next(t for t in spec.ir.tensors() if t.name == name)
    dims = tensor.shape[len(tensor.shape) - value.dim():]
    index = tuple(slice(0, end) if d == ir.Var("KV_LEN") else slice(None) for d in dims)
    return value[index]


@EAGER
@given(decoding_cases(max_len=70), st.integers(0, 2**31 - 1))
def test_flex_attention_with_offset_mods_and_block_masks_decodes_like_the_reference(case, seed):
    """The lowering and the block masks place the queries as the reference does."""
    spec, shape, values, last = case
    attn = flexspec.compile(spec)
    q, k, v = shape.qkv(seed)
    start = shape.Q_LEN - last
    sizes = dict(q_len=last, kv_len=shape.KV_LEN, batch=shape.B, heads=shape.Hq)
    _, score_mod = attn.mods(q_offset=start, **sizes, **values)
    block_mask = attn.block_mask(last, shape.KV_LEN, batch=shape.B, heads=shape.Hq,
                                 q_offset=start, **values)
    out = flex_attention(q[:, :, start:], k, v, score_mod=score_mod, block_mask=block_mask,
                         enable_gqa=shape.Hq != shape.Hkv)
    close(out, attn.reference(q, k, v, **values)[:, :, start:], f"{spec} {shape} last {last}")


# ---- end alignment --------------------------------------------------------------------------


def softmax_rows(q_len, kv_len, heads, bias_of):
    """Expected output when logits are 0 and v is the identity: softmax of the bias per row."""
    bias = torch.tensor([[[bias_of(h, i, j) for j in range(kv_len)] for i in range(q_len)]
                         for h in range(heads)], dtype=torch.float64)
    return torch.softmax(bias, -1).unsqueeze(0)


def probe(heads, q_len, kv_len):
    """q of zeros (every logit 0) and v the identity: the output rows are the weights."""
    q = torch.zeros(1, heads, q_len, kv_len, dtype=torch.float64)
    k = torch.zeros(1, heads, kv_len, kv_len, dtype=torch.float64)
    v = torch.eye(kv_len, dtype=torch.float64).expand(1, heads, kv_len, kv_len)
    return q, k, v


def test_alibi_decodes_at_the_end_with_causal_bottom_right():
    """The issue's example: at Q_LEN=1, KV_LEN=4 the newest token's ALiBi bias is
    -slope * [3, 2, 1, 0], not the top-left [0, 1, 2, 3]."""
    heads = 8
    attn = flexspec.compile("causal_bottom_right + alibi", backend="reference")
    slope = lambda h: 2.0 ** (-8.0 * (h + 1) / heads)  # noqa: E731
    want = softmax_rows(1, 4, heads, lambda h, i, j: -slope(h) * abs(3 - j))
    got = attn(*probe(heads, 1, 4))
    torch.testing.assert_close(got, want)
    assert torch.allclose(got[0, 0, 0], torch.softmax(torch.tensor([-1.5, -1.0, -0.5, 0.0],
                                                                    dtype=torch.float64), -1))
    # causal + alibi at the same offset says the same thing
    explicit = flexspec.compile("causal + alibi", backend="reference")
    torch.testing.assert_close(explicit(*probe(heads, 1, 4), q_offset=3), want)


def test_end_alignment_is_one_setting_for_the_whole_spec():
    for text in ("causal_bottom_right + alibi", "alibi + causal_bottom_right",
                 "causal_bottom_right & window(2)", "window(2) & causal_bottom_right"):
        assert flexspec.parse(text).ir.align == "end", text
    assert flexspec.parse("causal & window(2) + alibi").ir.align == "start"
    lib = flexspec.lang.library.load_text("mask recent(n: int) = causal_bottom_right & window(n)\n"
                                          "spec decode = recent(4) + alibi\n")
    assert lib["decode"].ir.align == "end"
    assert "align: end" in flexspec.parse("causal_bottom_right").explain()


@pytest.mark.parametrize("text", ["causal_bottom_right", "causal_bottom_right & window(3)",
                                  "causal_bottom_right + alibi"])
def test_an_end_aligned_spec_is_the_start_aligned_one_at_offset_kv_minus_q(text):
    start_aligned = text.replace("causal_bottom_right", "causal")
    end, plain = flexspec.compile(text), flexspec.compile(start_aligned)
    for q_len, kv_len in ((1, 9), (5, 9), (9, 9), (12, 9)):
        assert torch.equal(end.dense_mask(q_len, kv_len),
                           plain.dense_mask(q_len, kv_len, q_offset=kv_len - q_len))
        q, k, v = Shape(1, 8, 8, q_len, kv_len, 8).qkv(0)
        torch.testing.assert_close(end.reference(q, k, v),
                                   plain.reference(q, k, v, q_offset=kv_len - q_len))
    # an explicit offset wins over the alignment
    assert torch.equal(end.dense_mask(3, 9, q_offset=2), plain.dense_mask(3, 9, q_offset=2))


# ---- kv_lengths -----------------------------------------------------------------------------


def test_kv_lengths_hide_the_unused_tail_of_a_preallocated_cache():
    attn = flexspec.compile("causal_bottom_right", backend="reference")
    q, k, v = Shape(3, 2, 2, 1, 16, 8).qkv(1)
    lengths = torch.tensor([5, 16, 1])
    out = attn(q, k, v, kv_lengths=lengths)
    for row, n in enumerate(lengths.tolist()):
        # the same as a cache of exactly n keys with the newest token last
        alone = attn(q[row:row + 1], k[row:row + 1, :, :n], v[row:row + 1, :, :n])
        torch.testing.assert_close(out[row:row + 1], alone)
    mask = attn.dense_mask(1, 16, batch=3, kv_lengths=lengths)
    assert mask.sum(-1).flatten().tolist() == [5, 16, 1]


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"q_offset": 1.5}, "q_offset must be an int or an int tensor"),
    ({"q_offset": True}, "q_offset must be an int or an int tensor"),
    ({"q_offset": torch.tensor([1.0])}, "q_offset must hold ints"),
    ({"q_offset": torch.tensor([1, 2, 3])}, "of shape [2] (one per batch row) or [1]"),
    ({"q_offset": 2**63}, "out of range"),
    ({"kv_lengths": torch.tensor([3, 99])}, "kv_lengths must lie in 0..20"),
    ({"kv_lengths": [3, 4]}, "kv_lengths must be an int or an int tensor"),
    ({"return_lse": "yes"}, "return_lse must be True or False"),
])
def test_bad_positions_are_binding_errors(kwargs, message):
    attn = flexspec.compile("causal & window(3)", backend="reference")
    q, k, v = Shape(2, 2, 2, 4, 20, 8).qkv(0)
    with pytest.raises(flexspec.BindingError, match=re.escape(message)):
        attn(q, k, v, **kwargs)


@pytest.mark.parametrize("backend, length", [("reference", 8), ("auto", 200)])
def test_a_tensor_offset_that_would_wrap_is_refused_with_the_range(backend, length):
    """Red-team 2026-12-02, item 1: a tensor q_offset of 2**63 - 1 ran, and row 1 wrapped to
    -2**63 and saw nothing; `q * 4 >= kv` at 2**61 likewise. Offsets (int or tensor) must keep
    every row where the spec's integer arithmetic fits the kernels' ints."""
    library = flexspec.loads("mask m = q * 4 >= kv\n")
    q, k, v = Shape(1, 2, 2, 2, length, 8).qkv(0)
    causal = flexspec.compile("causal", backend=backend)
    for offset in (torch.tensor([2**63 - 1]), torch.tensor([2**62]), torch.tensor([0, 2**62])[1:]):
        with pytest.raises(flexspec.BindingError, match=r"q_offset must lie in "):
            causal(q, k, v, q_offset=offset)
    times_four = flexspec.compile("m", library=library, backend=backend)
    with pytest.raises(flexspec.BindingError, match=r"must lie in -?\d+\.\.\d+, so that rows "
                                                    r"stay at positions .* int64"):
        times_four(q, k, v, q_offset=torch.tensor([2**61]))
    # inside the range the call runs, and equals the reference at that offset
    for attn in (causal, times_four):
        offset = torch.tensor([2**40])
        close(attn(q, k, v, q_offset=offset), attn.reference(q, k, v, q_offset=offset),
              f"{attn} at 2**40")


def test_off_the_host_offsets_and_lengths_are_bounded_on_the_device():
    """Where reading a tensor would cost a host synchronisation (a GPU), values are clamped
    into their range instead of refused."""
    from flexspec.runtime.positions import _bounded
    values = torch.tensor([-5, 3, 99])
    assert _bounded(values, 0, 20, "kv_lengths", "0..20", host_reads=False).tolist() == [0, 3, 20]
    with pytest.raises(flexspec.BindingError, match=r"^kv_lengths must lie in 0\.\.20; got "
                                                    r"-5\.\.99$"):
        _bounded(values, 0, 20, "kv_lengths", "0..20", host_reads=True)
    assert _bounded(values, -10, 100, "q_offset", "", host_reads=True) is values


def test_a_repeated_offset_keeps_its_tensor_so_the_block_mask_is_found_again(monkeypatch):
    """A decode step repeated at one offset must present the block-mask cache the same tensor:
    an int offset its kept tensor, a device tensor its clamp kept by identity. (A clamp made anew
    each call rebuilt the block mask on every warm GPU call, 3-4x the kernel's time.)"""
    from flexspec.runtime import positions
    bounded = positions._bounded
    # as on a GPU: nothing given is read on the host
    monkeypatch.setattr(positions, "_bounded",
                        lambda *args, **kwargs: bounded(*args, **kwargs, host_reads=False))
    spec = flexspec.parse("sliding_window(8)").ir
    sizes = {"B": 2, "H": 1, "Q_LEN": 1, "KV_LEN": 300}
    cpu = torch.device("cpu")
    first = positions.call_tensors(spec, 299, None, sizes, cpu)["q_offset"]
    assert positions.call_tensors(spec, 299, None, sizes, cpu)["q_offset"] is first
    times_four = flexspec.parse("m", library=flexspec.loads("mask m = q * 4 >= kv\n")).ir
    with pytest.raises(flexspec.BindingError, match=r"^q_offset must lie in .*; got 2305843009"):
        positions.call_tensors(times_four, 2**61, None, sizes, cpu)
    offset, lengths = torch.tensor([5, 299]), torch.tensor([6, 300])
    placed = positions.call_tensors(spec, offset, lengths, sizes, cpu)
    again = positions.call_tensors(spec, offset, lengths, sizes, cpu)
    assert again["q_offset"] is placed["q_offset"] and again["kv_lengths"] is placed["kv_lengths"]
    lengths += 1  # changed in place: clamped anew, with the new contents
    moved = positions.call_tensors(spec, offset, lengths, sizes, cpu)["kv_lengths"]
    assert moved is not placed["kv_lengths"] and moved.tolist() == [7, 300]
    with torch.inference_mode():  # no version counter: nothing kept, every call clamps
        fresh = torch.tensor([5, 299])
        assert (positions.call_tensors(spec, fresh, None, sizes, cpu)["q_offset"]
                is not positions.call_tensors(spec, fresh, None, sizes, cpu)["q_offset"])


def test_a_placement_makes_the_tensors_of_an_int_offset_once_and_refuses_bad_ones_every_time():
    placement = flexspec.compile("causal & window(8)")._calls.placement
    q, k = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 300, 8)
    first = placement.for_call(q, k, {}, 290, None)
    again = placement.for_call(q, k, {"x": q}, 290, None)
    assert again["q_offset"] is first["q_offset"] and again["x"] is q
    assert placement.for_call(q, k, {}, 291, None)["q_offset"].tolist() == [291, 291]
    assert placement.for_call(q[:1], k[:1], {}, 290, None)["q_offset"].tolist() == [290]
    for _ in range(2):
        with pytest.raises(flexspec.BindingError, match="q_offset = 4611686018427387904"):
            placement.for_call(q, k, {}, 2**62, None)


def test_the_position_range_holds_the_lengths_and_is_one_sided_where_negatives_divide_by_zero():
    from flexspec.ir.overflow import position_range
    sizes = (("B", 1), ("H", 1), ("KV_LEN", 300), ("Q_LEN", 200))
    assert position_range(flexspec.parse("causal").ir, sizes, "int64") == (-2**62, 2**62)
    assert position_range(flexspec.parse("causal").ir, sizes, "int32") == (-2**30, 2**30)
    library = flexspec.loads("mask d = kv // (q + 1) == 0\nmask big = q * 1099511627776 >= kv\n")
    low, high = position_range(flexspec.parse("d", library=library).ir, sizes, "int64")
    assert low == 0 and high == 2**62
    assert position_range(flexspec.parse("big", library=library).ir, sizes, "int32") is None


def test_positions_must_keep_lookups_in_range():
    attn = flexspec.compile("causal & doc", backend="reference")
    q, k, v = Shape(1, 1, 1, 2, 6, 8).qkv(0)
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    attn(q, k, v, q_offset=4, doc_ids=ids)  # rows at 4 and 5: inside doc_ids
    with pytest.raises(flexspec.SpecError, match="doc_ids"):
        attn(q, k, v, q_offset=5, doc_ids=ids)  # row 1 at 6 reads past the end


# ---- the log-sum-exp ------------------------------------------------------------------------


def expected_lse(attn, q, k, scale, values, q_offset=None):
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = dense_scores(attn.ir, logits, values, q_offset=q_offset)
    mask = dense_mask(attn.ir, *logits.shape, values, q_offset=q_offset)
    return torch.logsumexp(torch.where(mask, scores, -math.inf), -1)


@pytest.mark.parametrize("text", ["causal & window(2)", "causal + softcap(5.0)", "~full"])
def test_reference_lse_is_the_log_sum_exp_of_the_visible_scores(text):
    attn = flexspec.compile(text, backend="reference")
    q, k, v = Shape(1, 2, 2, 7, 7, 4).qkv(3)
    out, lse = attn(q, k, v, q_offset=2, return_lse=True)
    assert lse.shape == (1, 2, 7) and lse.dtype == torch.float32
    torch.testing.assert_close(out, attn(q, k, v, q_offset=2))
    want = expected_lse(attn, q, k, 0.5, {}, q_offset=2).float()
    torch.testing.assert_close(lse, want)
    if text == "~full":
        assert torch.isneginf(lse).all()  # a row that sees no key


def test_two_partial_attentions_merge_exactly_through_their_lse():
    """Split-KV: attention over keys 0..n-1 from the halves' outputs weighted by exp(lse)."""
    attn = flexspec.compile("softcap(5.0)", backend="reference")
    q, k, v = Shape(2, 4, 2, 3, 40, 8).qkv(5)
    out_a, lse_a = attn(q, k[:, :, :25], v[:, :, :25], return_lse=True)
    out_b, lse_b = attn(q, k[:, :, 25:], v[:, :, 25:], return_lse=True)
    lse = torch.logaddexp(lse_a, lse_b)
    merged = (torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b)
    out, want_lse = attn(q, k, v, return_lse=True)
    torch.testing.assert_close(merged, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("text, offset, unmasked", [
    ("causal", 299, True), ("causal_bottom_right", None, True),
    ("sliding_window(400)", 299, True),
    # the call reads only the keys the token may see (0..298; 199..299), and sees them all
    ("causal", 298, True), ("sliding_window(100)", 299, True),
    ("causal & (window(100) | sink(4))", 299, False),  # keys 4..198 are not seen
    ("causal + alibi", 299, False),  # the score reads positions: the mask stays
])
def test_a_decoded_token_that_sees_every_key_runs_as_plain_attention(text, offset, unmasked):
    """A single new token under `causal` sees the whole cache: the call drops the mask and runs
    on plain attention (SDPA on this CPU), with the reference's result."""
    attn = flexspec.compile(text)
    q, k, v = Shape(2, 8, 2, 1, 300, 16).qkv(2)
    if offset is not None:
        kwargs = {"q_offset": offset}
    else:
        kwargs = {}
    explanation = attn.explain(q, k, v, **kwargs)
    assert (explanation.mask == "true") == unmasked
    assert (explanation.choice.backend == "sdpa") == unmasked
    torch.testing.assert_close(attn(q, k, v, **kwargs), attn.reference(q, k, v, **kwargs),
                               rtol=1e-5, atol=1e-5)


@PROPERTY
@given(decoding_cases(max_len=60), st.integers(0, 2**31 - 1), st.integers(-3, 3))
def test_the_runtime_places_rows_as_the_reference_does(case, seed, shift):
    """Through the runtime (the reference backend here: no compiles) and through the reference,
    with the spec's own placement (end-aligned specs at Q_LEN != KV_LEN) and with an explicit
    offset. Scores that read positions are not shift-invariant only up to softmax: compare
    outputs with Q_LEN != KV_LEN, where a wrong placement changes which keys a row sees."""
    spec, shape, values, last = case
    # at KV_LEN = 1 the reference reads a [B, KV_LEN] tensor's size-1 dimension as a broadcast,
    # where the runtime (rightly) refuses an index past it: a known difference of that edge
    assume(shape.KV_LEN > 1)
    attn = flexspec.compile(spec, backend="reference")
    q, k, v = shape.qkv(seed)
    rows = q[:, :, shape.Q_LEN - last:]
    try:
        want = attn.reference(rows, k, v, **values)
    except flexspec.SpecError:
        assume(False)  # the spec's own placement reads past a tensor at this shape
    close(attn(rows, k, v, **values), want, f"{spec} {shape} last {last}")
    offset = max(0, shape.Q_LEN - last + shift)
    try:
        want = attn.reference(rows, k, v, q_offset=offset, **values)
    except flexspec.SpecError:
        return
    close(attn(rows, k, v, q_offset=offset, **values), want, f"{spec} offset {offset}")


def test_an_end_aligned_position_score_is_placed_once():
    """A mutation that placed end-aligned rows twice hid behind softmax's shift invariance at
    Q_LEN=1; at Q_LEN=3 against 5 keys the rows see different keys."""
    attn = flexspec.compile("causal_bottom_right + alibi", backend="reference")
    q, k, v = Shape(1, 2, 2, 3, 5, 8).qkv(0)
    close(attn(q, k, v), attn.reference(q, k, v), "end-aligned, Q_LEN=3, KV_LEN=5")
    close(attn(q, k, v), flexspec.compile("causal + alibi").reference(q, k, v, q_offset=2),
          "the same as causal at offset KV_LEN - Q_LEN")


@pytest.mark.parametrize("text", ["causal & doc", "causal + alibi"])
def test_an_offset_of_zero_runs_the_spec_as_written(text):
    """q_offset=0 is where a start-aligned spec's queries stand anyway (the transformers
    integration passes it on every call): the call plans the spec as written, with no position
    tensors, so forms that read the spec's structure (fa4's documents, SDPA's causal) apply."""
    attn = flexspec.compile(text)
    q, k, v = Shape(2, 4, 4, 70, 70, 16).qkv(1)
    ids = torch.arange(70).div(20, rounding_mode="floor").expand(2, 70)
    values = {"doc_ids": ids} if "doc" in text else {}
    plain, at_zero = attn.explain(q, k, v, **values), attn.explain(q, k, v, q_offset=0, **values)
    assert at_zero.mask == plain.mask and at_zero.score == plain.score
    assert "q_offset" not in at_zero.mask + at_zero.score
    at_one = attn.explain(q[:, :, 1:], k, v, q_offset=1, **values)
    assert "q_offset" in at_one.mask + at_one.score
    close(attn(q, k, v, q_offset=0, **values), attn.reference(q, k, v, **values), text)


@pytest.mark.parametrize("backend, rows", [("reference", 3), ("auto", 130)])
def test_an_explicit_offset_of_zero_places_an_end_aligned_spec_at_the_start(backend, rows):
    """Blind spot: q_offset=0 given to an end-aligned spec with Q_LEN < KV_LEN must place row
    0 at position 0, not where the spec's own alignment would (KV_LEN - Q_LEN)."""
    attn = flexspec.compile("causal_bottom_right & window(20) + alibi", backend=backend)
    q, k, v = Shape(1, 2, 2, rows, 200, 8).qkv(3)
    at_zero = attn(q, k, v, q_offset=0)
    close(at_zero, attn.reference(q, k, v, q_offset=0), "q_offset=0")
    close(attn(q, k, v), attn.reference(q, k, v), "the spec's own placement")
    assert not torch.allclose(at_zero, attn(q, k, v))


def test_the_answer_that_a_token_sees_every_key_is_kept_per_key_length():
    """Blind spot: the unmasked fast path keyed without KV_LEN would serve a call with more keys
    the first call's answer (a row at 99 sees all of 100 keys, not all of 200). The sink keeps
    the call on the whole cache (under `causal` it would read keys 0..99 only)."""
    attn = flexspec.compile("causal & (window(1000) | sink(4))")
    q = torch.randn(1, 2, 1, 16)
    for kv_len in (100, 200, 100):
        k, v = (torch.randn(1, 2, kv_len, 16) for _ in range(2))
        close(attn(q, k, v, q_offset=99), attn.reference(q, k, v, q_offset=99), f"KV {kv_len}")
    assert attn.explain(q, k, v, q_offset=99).mask == "true"
    k, v = (torch.randn(1, 2, 200, 16) for _ in range(2))
    assert attn.explain(q, k, v, q_offset=99).mask != "true"


@pytest.mark.parametrize("text", ["full + alibi", "document"])
def test_kv_lengths_hide_the_tail_of_specs_that_are_not_causal_on_the_kernel(text):
    """Blind spot: kv_lengths were tested with causal_bottom_right (whose mask hides the first
    unused slot anyway) or on the reference; here a full and a document mask, compiled."""
    attn = flexspec.compile(text)
    q, k, v = Shape(2, 2, 2, 130, 200, 8).qkv(6)
    lengths = torch.tensor([200, 150])
    bindings = {"doc_ids": torch.arange(200) // 70} if "document" in text else {}
    assert attn.explain(q, k, v, kv_lengths=lengths, **bindings).choice.backend == "flex"
    close(attn(q, k, v, kv_lengths=lengths, **bindings),
          attn.reference(q, k, v, kv_lengths=lengths, **bindings), text)


# ---- calls that read only the keys their rows may see --------------------------------------------


def test_a_decoded_token_under_a_window_reads_only_its_window():
    """The call runs on the keys the window lets the token see (its time follows the window, not
    the cache), equals the reference on the whole cache, and sends gradients to those keys
    only; explain says which keys it reads."""
    attn = flexspec.compile("sliding_window(300)")
    q = torch.randn(2, 4, 1, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 1000, 16, requires_grad=True) for _ in range(2))
    explained = attn.explain(q, k, v, q_offset=999)
    assert explained.keys == (699, 1000, 1000) and explained.sizes["KV_LEN"] == 1000
    assert "keys:     only 699:1000 of the 1000 keys are read" in str(explained)
    assert explained.density == 301 / 1000 and explained.tile_density == 3 / 8
    out = attn(q, k, v, q_offset=999)
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attn.reference(q64, k64, v64, q_offset=999)
    ref.sum().backward()
    close(out.double(), ref, "output")
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        close(got.double(), want, "gradient")
    assert not k.grad[:, :, :699].any() and k.grad[:, :, 699:].abs().sum() > 0
    # early on, before the window fills, the token reads keys 0..offset
    assert attn.explain(q, k, v, q_offset=40).keys == (0, 41, 1000)


def test_a_chunk_under_a_window_runs_compiled_on_its_slice():
    """A prefill chunk of 130 rows at offset 500 of a 1000-key cache reads keys 300..629 and
    runs on the compiled kernel (130 x 330 positions), equal to the reference."""
    attn = flexspec.compile("causal & window(200) + alibi")
    q = torch.randn(1, 2, 130, 16)
    k, v = (torch.randn(1, 2, 1000, 16) for _ in range(2))
    explained = attn.explain(q, k, v, q_offset=500)
    assert explained.keys == (300, 630, 1000) and explained.choice.backend == "flex"
    with torch.no_grad():
        close(attn(q, k, v, q_offset=500), attn.reference(q, k, v, q_offset=500), "chunk")


@pytest.mark.parametrize("text, kwargs", [
    ("causal & (window(50) | sink(4))", {"q_offset": 999}),   # sink reads absolute keys
    ("causal & doc", {"q_offset": 999}),                         # documents too
    ("sliding_window(50)", {"q_offset": torch.tensor([999, 999])}),   # not known on the host
    ("sliding_window(50)", {"kv_lengths": torch.tensor([1000, 900])}),
    ("causal", {"q_offset": 999}),                               # every key is seen anyway
])
def test_calls_whose_keys_the_host_cannot_bound_read_the_whole_cache(text, kwargs):
    attn = flexspec.compile(text)
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1000, 8)
    assert attn._calls.placement.visible_keys(q, k, k, kwargs.get("q_offset"),
                                              kwargs.get("kv_lengths")) is None


@pytest.mark.parametrize("v", [None, "values", torch.randn(2, 2, 1000), torch.randn(2, 2, 999, 8)])
def test_a_window_call_with_values_that_do_not_fit_gets_the_checks_error(v):
    """The slice is taken only of inputs a call takes: others reach the checks, which name them
    (no raw IndexError from slicing)."""
    attn = flexspec.compile("sliding_window(50)")
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1000, 8)
    with pytest.raises(flexspec.SpecError, match=r"\bv\b"):
        attn(q, k, v, q_offset=999)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_windowed_specs_decode_on_their_slice_like_the_reference(data):
    """Random specs with a window joined: at any int offset (negative, inside, past the cache)
    and any number of rows, the call (on the slice its rows may see) equals the reference on
    the whole cache."""
    from flexspec.lang.api import with_mask
    from flexspec.testing.specs import spec_texts
    text = data.draw(spec_texts(kinds=("static", "binding")))
    window = data.draw(st.integers(1, 60))
    try:
        spec = with_mask(flexspec.parse(text), f"sliding_window({window})")
    except flexspec.SpecError:
        assume(False)
    kv_heads = data.draw(st.integers(1, 2))
    shape = Shape(data.draw(st.integers(1, 2)), kv_heads * data.draw(st.integers(1, 2)), kv_heads,
                  data.draw(st.integers(1, 20)), data.draw(st.integers(1, 200)), 8)
    assume(lookups_fit(spec, shape))
    values = data.draw(bindings(spec, shape))
    offset = data.draw(st.integers(-10, shape.KV_LEN + 10))
    attn = flexspec.compile(spec)
    q, k, v = shape.qkv(data.draw(st.integers(0, 2**31 - 1)))
    try:
        want = attn.reference(q, k, v, q_offset=offset, **values)
    except flexspec.SpecError:  # a lookup out of range there: the call refuses it too
        with pytest.raises(flexspec.SpecError):
            attn(q, k, v, q_offset=offset, **values)
        return
    with torch.no_grad():
        got = attn(q, k, v, q_offset=offset, **values)
    close(got, want, f"{spec} {shape} at {offset}")


# ---- mutation testing of runtime/positions (2026-12-02): what its survivors showed untested -----


def test_host_read_bounds_take_both_ends_and_refuse_one_past_either():
    from flexspec.runtime.positions import _bounded
    edges = torch.tensor([0, 20])
    assert _bounded(edges, 0, 20, "kv_lengths", "0..20", host_reads=True) is edges
    for outside in ([-1, 20], [0, 21]):
        with pytest.raises(flexspec.BindingError, match="kv_lengths must lie in 0..20"):
            _bounded(torch.tensor(outside), 0, 20, "kv_lengths", "0..20", host_reads=True)


@pytest.fixture
def fresh_clamps(monkeypatch):
    from flexspec.runtime import positions
    monkeypatch.setattr(positions, "_clamped_kept",
                        positions.KeptByIdentity(positions._CLAMPED_KEPT))
    return positions


def test_device_clamps_are_right_in_every_mode_and_never_kept_as_inference_tensors(fresh_clamps):
    clamped = fresh_clamps._clamped
    with torch.inference_mode():
        fresh = torch.tensor([-5, 3, 99])
        assert clamped(fresh, 0, 20).tolist() == [0, 3, 20]  # an inference tensor: not kept
    outside = torch.tensor([-5, 3, 99])
    with torch.inference_mode():  # a tensor made outside, clamped inside: kept for every mode
        kept = clamped(outside, 0, 20)
    assert kept.tolist() == [0, 3, 20] and not kept.is_inference()
    assert clamped(outside, 0, 20) is kept and clamped(outside, 0, 30) is not kept


def test_device_clamps_inside_a_capture_are_made_each_time(fresh_clamps, monkeypatch):
    """A clamp recorded in a CUDA graph must run on every replay: never served from the kept
    ones (capturing() is true only on a GPU; here it is made to say so)."""
    monkeypatch.setattr(fresh_clamps, "in_graph_memory", lambda device: True)
    value = torch.tensor([-5, 3, 99])
    first = fresh_clamps._clamped(value, 0, 20)
    assert first.tolist() == [0, 3, 20] and fresh_clamps._clamped(value, 0, 20) is not first


def test_the_kept_clamps_are_bounded_and_the_oldest_goes_first(fresh_clamps):
    clamped, kept = fresh_clamps._clamped, fresh_clamps._CLAMPED_KEPT
    values = [torch.tensor([n]) for n in range(kept + 1)]
    results = [clamped(value, 0, 1000) for value in values[:kept]]
    assert all(clamped(value, 0, 1000) is result for value, result in zip(values, results))
    newest = clamped(values[kept], 0, 1000)  # one more: the least recently used goes
    assert clamped(values[kept], 0, 1000) is newest
    assert clamped(values[1], 0, 1000) is results[1]
    assert clamped(values[0], 0, 1000) is not results[0]


@pytest.mark.parametrize("text", ["causal + alibi", "causal"])
@pytest.mark.parametrize("bad, message", [
    ((["q"], None, None), r"^q must be a torch\.Tensor, got list$"),
    ((None, ["k"], None), r"^k must be a torch\.Tensor, got list$"),
    (("3d", None, None), r"^q must have 4 dimensions \(B, H, S, D\), got shape \[1, 1, 10\]$"),
])
def test_a_positioned_call_with_inputs_that_are_not_tensors_gets_the_checks_error(text, bad,
                                                                                  message):
    k = torch.randn(1, 1, 10, 8)
    q_bad, k_bad, _ = bad
    q = torch.randn(1, 1, 10) if q_bad == "3d" else (q_bad if q_bad is not None else k)
    with pytest.raises(flexspec.SpecError, match=message):
        flexspec.compile(text)(q, k_bad if k_bad is not None else k, k, q_offset=5)


def test_an_end_aligned_spec_places_a_chunk_shorter_than_the_cache_at_its_end():
    """On the compiled kernel (130 x 300 positions), which places rows only as the runtime's
    position tensors say (the reference would place an end-aligned spec's rows itself)."""
    attn = flexspec.compile("causal_bottom_right + alibi")
    q, k, v = Shape(1, 2, 2, 130, 300, 8).qkv(4)
    with torch.no_grad():
        close(attn(q, k, v), attn.reference(q, k, v, q_offset=170), "rows at 170..299")


def test_the_offset_range_counts_the_heads_a_spec_multiplies_by():
    """The kernels' range depends on every size the spec's arithmetic reads (H here)."""
    library = flexspec.loads("mask m = q * H <= kv + 5\n")  # never all keys: stays masked
    attn = flexspec.compile("m", library=library)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 10, 8)
    with pytest.raises(flexspec.BindingError, match="q_offset must lie in"):
        attn(q, k, k, q_offset=2**61)  # 2**61 * 4 leaves int64's safe range; 2**61 * 1 would not


def test_a_batch_row_that_sees_nothing_keeps_the_call_masked():
    """Whether a decoded token sees every key is asked of every batch row: the second row
    here sees nothing (B=2, one head), so the call cannot drop the mask."""
    library = flexspec.loads("mask first_row_causal = q >= kv & b < 1\n")
    attn = flexspec.compile("first_row_causal", library=library)
    q, k, v = Shape(2, 1, 1, 1, 10, 8).qkv(6)
    out = attn(q, k, v, q_offset=9)
    close(out, attn.reference(q, k, v, q_offset=9), "per-row visibility")
    assert not out[1].any()


@pytest.mark.parametrize("kv_len", [2, 10])
def test_rows_at_their_own_place_are_not_taken_for_rows_at_the_end(kv_len):
    """No q_offset on a start-aligned spec: the row stands at 0 and sees key 0 only; read as
    standing at the end it would see every key and drop the mask (the sink keeps the call on
    the whole cache, so the unmasked answer is asked for these very positions)."""
    attn = flexspec.compile("causal & (window(100) | sink(4))")
    q, k, v = Shape(1, 2, 2, 1, kv_len, 8).qkv(7)
    close(attn(q, k, v), attn.reference(q, k, v), f"KV {kv_len}")


def test_every_row_of_a_chunk_must_see_every_key_to_drop_the_mask():
    attn = flexspec.compile("causal & (window(100) | sink(4))")
    q, k, v = Shape(1, 2, 2, 2, 10, 8).qkv(8)  # rows at 8 and 9: row 8 does not see key 9
    close(attn(q, k, v, q_offset=8), attn.reference(q, k, v, q_offset=8), "rows 8, 9")


def test_a_head_that_sees_nothing_keeps_the_call_masked():
    library = flexspec.loads("mask first_head_causal = q >= kv & h < 1\n")
    attn = flexspec.compile("first_head_causal", library=library)
    q, k, v = Shape(1, 2, 2, 1, 10, 8).qkv(9)
    out = attn(q, k, v, q_offset=9)
    close(out, attn.reference(q, k, v, q_offset=9), "per-head visibility")
    assert not out[:, 1].any()


@pytest.mark.parametrize("text, kwargs, keys", [
    ("sliding_window(3)", {}, (0, 1, 100)),               # no offset: the row stands at 0
    ("window(5)", {"q_offset": 20}, (15, 26, 100)),       # a window on both sides
    ("causal_bottom_right & window(5)", {}, (94, 100, 100)),
])
def test_the_slice_follows_the_rows_place_and_both_sides_of_the_window(text, kwargs, keys):
    attn = flexspec.compile(text)
    q, k, v = Shape(1, 2, 2, 1, 100, 8).qkv(10)
    assert attn.explain(q, k, v, **kwargs).keys == keys
    close(attn(q, k, v, **kwargs), attn.reference(q, k, v, **kwargs), text)


def test_kept_position_tensors_never_stand_for_other_lengths_or_changed_offsets(monkeypatch):
    """The tensors a Placement keeps for an int offset are for calls without kv_lengths and
    with that very int: a call with lengths, or with a tensor offset changed in place, gets its
    own (checked as on a GPU: device tensors clamped, not read on the host)."""
    from flexspec.runtime import positions
    bounded = positions._bounded
    monkeypatch.setattr(positions, "_bounded",
                        lambda *args, **kwargs: bounded(*args, **kwargs, host_reads=False))
    placement = flexspec.compile("causal & window(8) + alibi")._calls.placement
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 300, 8)
    assert "kv_lengths" not in placement.for_call(q, k, {}, 5, None)
    lengths = torch.tensor([100, 200])
    placed = placement.for_call(q, k, {}, 5, lengths)
    assert placed["kv_lengths"].tolist() == [100, 200]
    lengths[0] = 150
    assert placement.for_call(q, k, {}, 5, lengths)["kv_lengths"].tolist() == [150, 200]
    offset = torch.tensor([5, 6])
    assert placement.for_call(q, k, {}, offset, None)["q_offset"].tolist() == [5, 6]
    offset[0] = 7
    assert placement.for_call(q, k, {}, offset, None)["q_offset"].tolist() == [7, 6]


def test_an_end_aligned_spec_with_valid_lengths_stands_at_each_rows_own_end():
    attn = flexspec.compile("causal_bottom_right + alibi")
    q, k, v = Shape(2, 2, 2, 1, 10, 8).qkv(11)
    lengths = torch.tensor([6, 10])
    out = attn(q, k, v, kv_lengths=lengths)
    close(out[:1], attn.reference(q[:1], k[:1, :, :6], v[:1, :, :6]), "row 0 at key 5")
    close(out[1:], attn.reference(q[1:], k[1:], v[1:]), "row 1 at key 9")


def test_a_cache_row_may_hold_no_valid_key():
    attn = flexspec.compile("full")
    q, k, v = Shape(2, 2, 2, 1, 10, 8).qkv(12)
    out = attn(q, k, v, kv_lengths=torch.tensor([0, 10]))
    assert not out[0].any()
    close(out[1:], attn.reference(q[1:], k[1:], v[1:]), "a full row")


def test_mods_of_an_end_aligned_spec_place_its_rows_at_the_end():
    mask_mod, _ = flexspec.compile("causal_bottom_right").mods(q_len=2, kv_len=5)
    zero = torch.tensor(0)
    assert [bool(mask_mod(zero, zero, zero, torch.tensor(kv))) for kv in range(5)] == \
        [True, True, True, True, False]


def test_the_reference_checks_its_own_arithmetic_not_the_kernels_range():
    """The reference computes every position exactly: an offset is refused there by its own
    overflow check (which names the arithmetic), not by the kernels' range."""
    attn = flexspec.compile("m", library=flexspec.loads("mask m = q * 4 <= kv + 5\n"))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 10, 8)
    with pytest.raises(flexspec.SpecError, match=r"'q \* 4' reaches .* beyond the 64-bit ints"):
        attn.reference(q, k, k, q_offset=2**61)
    with pytest.raises(flexspec.BindingError, match="q_offset must lie in"):
        attn(q, k, k, q_offset=2**61)


LIMITS = flexspec.loads("mask ends_divide = causal_bottom_right & kv // (q + 1) == 0\n"
                        "mask divide = kv // (q + 1) == 0\nmask times_four = q * 4 <= kv + 5\n")


def test_an_end_aligned_offset_out_of_range_is_named_as_such():
    attn = flexspec.compile("ends_divide", library=LIMITS)  # rows below 0 would divide by zero
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 10, 8)
    with pytest.raises(flexspec.BindingError, match=r"^the end-aligned offset kv_lengths - Q_LEN "
                                                    r"must lie in 0\.\.\d+, .*; got -1\.\.-1$"):
        attn(q, k, k, kv_lengths=torch.tensor([0]))


def test_int_offsets_are_accepted_up_to_both_ends_of_the_kernels_range():
    from flexspec.runtime.positions import call_tensors
    cpu, sizes = torch.device("cpu"), {"B": 1, "H": 1, "Q_LEN": 3, "KV_LEN": 10}
    divide = flexspec.parse("divide", library=LIMITS).ir      # positions 0 .. 2**62
    times_four = flexspec.parse("times_four", library=LIMITS).ir  # positions +-2**60
    assert call_tensors(divide, 0, None, sizes, cpu)["q_offset"].tolist() == [0]
    last = 2**60 - 3 + 1  # the last row at 2**60
    assert call_tensors(times_four, last, None, sizes, cpu)["q_offset"].tolist() == [last]
    assert call_tensors(times_four, -2**60, None, sizes, cpu)["q_offset"].tolist() == [-2**60]
    for outside in (last + 1, -2**60 - 1):
        with pytest.raises(flexspec.BindingError, match=rf"must lie in -{2**60}\.\.{last}, so "):
            call_tensors(times_four, outside, None, sizes, cpu)
    with pytest.raises(flexspec.BindingError, match=r"must lie in 0\.\."):
        call_tensors(divide, -1, None, sizes, cpu)


def test_a_tensor_offset_of_a_spec_that_reads_no_position_is_bounded_at_both_ends():
    from flexspec.runtime.positions import call_tensors
    cpu, sizes = torch.device("cpu"), {"B": 1, "H": 1, "Q_LEN": 3, "KV_LEN": 10}
    full = flexspec.parse("full").ir
    for inside in (2**62 - 1, -2**62):
        assert call_tensors(full, torch.tensor([inside]), None, sizes, cpu) == {}
    for outside in (2**62, -2**62 - 1):
        with pytest.raises(flexspec.BindingError, match=r"^q_offset must lie in \+-2\*\*62 "
                                                        r"\(positions must stay well inside "
                                                        r"int64\); got "):
            call_tensors(full, torch.tensor([outside]), None, sizes, cpu)


@pytest.mark.parametrize("offset, error, message", [
    ([5], flexspec.BindingTypeError,
     r"^q_offset must be an int or an int tensor of shape \[2\], got list$"),
    (torch.tensor([True, False]), flexspec.BindingError, r"^q_offset must hold ints, got dtype "
                                                         r"torch\.bool$"),
    (torch.tensor([[5], [6]]), flexspec.BindingError, r"got shape \[2, 1\]$"),
    (torch.tensor([5, 6], device="meta"), flexspec.BindingError,
     r"^q_offset is on meta, but q is on cpu; move it with \.to\('cpu'\)$"),
])
def test_offsets_of_the_wrong_kind_say_what_a_call_takes(offset, error, message):
    attn = flexspec.compile("causal + alibi")
    q, k = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 10, 8)
    with pytest.raises(error, match=message):
        attn(q, k, k, q_offset=offset)


def test_a_one_entry_offset_serves_every_batch_row_and_any_int_dtype_is_int64():
    from flexspec.runtime.positions import call_tensors
    spec, cpu = flexspec.parse("causal + alibi").ir, torch.device("cpu")
    sizes = {"B": 2, "H": 1, "Q_LEN": 1, "KV_LEN": 10}
    placed = call_tensors(spec, torch.tensor([7], dtype=torch.int32), None, sizes, cpu)
    assert placed["q_offset"].dtype == torch.int64 and placed["q_offset"].tolist() == [7]
    attn = flexspec.compile("causal + alibi")
    q, k, v = Shape(2, 1, 1, 1, 10, 8).qkv(13)
    close(attn(q, k, v, q_offset=torch.tensor([7])), attn.reference(q, k, v, q_offset=7), "[1]")


def test_an_end_aligned_chunk_stands_at_the_end_when_it_asks_to_drop_the_mask():
    attn = flexspec.compile("causal_bottom_right & (window(100) | sink(4))")
    q, k, v = Shape(1, 2, 2, 2, 10, 8).qkv(14)  # rows at 8 and 9: row 8 does not see key 9
    close(attn(q, k, v), attn.reference(q, k, v), "rows 8, 9")


def test_an_offset_out_of_range_is_refused_where_the_call_would_drop_its_positions():
    """Found by the property test (2026-12-03): a spec whose mask always holds and whose score
    reads no position runs without its mask and without positions, so an int offset beyond
    +-2**62 went unchecked; the tensor offset was refused. Both are refused now, with the
    slice of a window decided from the offset too."""
    library = flexspec.loads("mask m = 0.5 < Q_LEN\nscore s = score + Q_LEN\nspec x = m + s")
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    for spec in (library["x"], flexspec.parse("causal & window(3)")):
        attn = flexspec.compile(spec)
        for offset in (-2**62 - 1, 2**62, torch.tensor([-2**62 - 1])):
            with pytest.raises(flexspec.BindingError, match="out of range|must lie in"):
                attn(q, k, k, q_offset=offset)
        torch.testing.assert_close(attn(q, k, k, q_offset=2**62 - 8),
                                   attn.reference(q, k, k, q_offset=2**62 - 8))


def test_whether_rows_see_every_key_is_answered_per_query_length():
    """A decoded row at position 4 of 5 keys under ``causal & window(4)`` sees every key, and
    runs without the mask; two rows at the same offset do not (the second stands at 5, out of
    the first key's window): kept without Q_LEN, the first answer ran them unmasked."""
    attn = flexspec.compile("causal & window(4)")
    generator = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 2, 5, 8, generator=generator) for _ in range(2))
    for q_len in (1, 2, 1):
        q = torch.randn(1, 2, q_len, 8, generator=generator)
        torch.testing.assert_close(attn(q, k, v, q_offset=4),
                                   attn.reference(q, k, v, q_offset=4))
