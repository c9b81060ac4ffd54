"""Tests of flexspec.kernels.reference against definitions written out by hand in plain Python."""

import math
import re

import pytest
import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.kernels.reference import MAX_BYTES, dense_mask, dense_scores, reference_attention
from flexspec.kernels.tensors import builtin_tensor
from ir_examples import (ALIBI, CAUSAL, CAUSAL_BR, DILATED, DOC_IDS, DOCUMENT, PADDING, SCORE,
                         SLOPES, C, b, call, distance, kv, lookup, op, q, sliding_window,
                         softcap, spec, window)


def python_mask(fn, batch, heads, q_len, kv_len):
    """The mask of a plain-Python predicate, as nested lists turned into a tensor."""
    return torch.tensor([[[[bool(fn(bi, hi, qi, ki)) for ki in range(kv_len)]
                           for qi in range(q_len)] for hi in range(heads)] for bi in range(batch)])


def python_attention(q, k, v, allowed, modify, scale, with_lse=False):
    """Textbook attention in plain Python floats: a row with nothing allowed gives zeros. With
    ``with_lse``, also the log of the sum of exp of each row's allowed scores (-inf for none)."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len, dv = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    q, k, v = q.tolist(), k.tolist(), v.tolist()
    out = [[[[0.0] * dv for _ in range(q_len)] for _ in range(heads)] for _ in range(batch)]
    lse = [[[-math.inf] * q_len for _ in range(heads)] for _ in range(batch)]
    for bi in range(batch):
        for hi in range(heads):
            kh = hi // group
            for qi in range(q_len):
                logits = {}
                for ki in range(kv_len):
                    if allowed(bi, hi, qi, ki):
                        raw = sum(a * c for a, c in zip(q[bi][hi][qi], k[bi][kh][ki])) * scale
                        logits[ki] = modify(raw, bi, hi, qi, ki)
                if not logits:
                    continue
                top = max(logits.values())
                weights = {ki: math.exp(s - top) for ki, s in logits.items()}
                total = sum(weights.values())
                lse[bi][hi][qi] = top + math.log(total)
                for d in range(dv):
                    out[bi][hi][qi][d] = sum(w * v[bi][kh][ki][d]
                                             for ki, w in weights.items()) / total
    out = torch.tensor(out, dtype=torch.float64)
    return (out, torch.tensor(lse, dtype=torch.float64)) if with_lse else out


def unmodified(s, bi, hi, qi, ki):
    return s


def alibi_slope(hi, heads):
    return 2.0 ** (-8.0 * (hi + 1) / heads)


# --- masks ---------------------------------------------------------------------------------


def test_causal():
    expected = python_mask(lambda b_, h_, q_, k_: q_ >= k_, 2, 3, 37, 37)
    assert torch.equal(dense_mask(spec(CAUSAL), 2, 3, 37, 37), expected)


def test_causal_with_q_len_different_from_kv_len():
    # Top-left alignment: query 0 sees key 0 only, whatever KV_LEN is.
    expected = python_mask(lambda b_, h_, q_, k_: q_ >= k_, 1, 1, 5, 11)
    assert torch.equal(dense_mask(spec(CAUSAL), 1, 1, 5, 11), expected)
    expected = python_mask(lambda b_, h_, q_, k_: q_ + 11 - 5 >= k_, 1, 1, 5, 11)
    assert torch.equal(dense_mask(spec(CAUSAL_BR), 1, 1, 5, 11), expected)


@pytest.mark.parametrize("n", [0, 1, 4, 200])
def test_window_and_sliding_window(n):
    expected = python_mask(lambda b_, h_, q_, k_: abs(q_ - k_) <= n, 1, 1, 23, 29)
    assert torch.equal(dense_mask(spec(window(n)), 1, 1, 23, 29), expected)
    expected = python_mask(lambda b_, h_, q_, k_: 0 <= q_ - k_ <= n, 1, 1, 23, 29)
    got = dense_mask(spec(sliding_window(n)), 1, 1, 23, 29)
    assert torch.equal(got, expected)
    # sliding_window(n) sees n + 1 keys once the query is far enough from the start.
    assert got[0, 0, -1].sum().item() == min(n + 1, 23)


def test_document_mask_is_batch_dependent():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 3]])
    ids = doc_ids.tolist()
    mask = ir.And((CAUSAL, DOCUMENT))
    expected = python_mask(lambda b_, h_, q_, k_: q_ >= k_ and ids[b_][q_] == ids[b_][k_],
                           2, 2, 9, 9)
    got = dense_mask(spec(mask), 2, 2, 9, 9, {"doc_ids": doc_ids})
    assert torch.equal(got, expected)
    assert not torch.equal(got[0], got[1])


def test_lookup_broadcasts_size_one_dimensions():
    ids = [0, 0, 1, 1, 1, 2]
    expected = python_mask(lambda b_, h_, q_, k_: ids[q_] == ids[k_], 3, 1, 6, 6)
    for value in (torch.tensor([ids]), torch.tensor(ids)):
        assert torch.equal(dense_mask(spec(DOCUMENT), 3, 1, 6, 6, {"doc_ids": value}), expected)


def test_head_dependent_mask():
    expected = python_mask(lambda b_, h_, q_, k_: q_ >= k_ and (q_ - k_) % (h_ + 1) == 0,
                           1, 4, 19, 19)
    got = dense_mask(spec(DILATED), 1, 4, 19, 19)
    assert torch.equal(got, expected)
    assert got[0, 0].all(dim=-1).sum() == 1 and not torch.equal(got[0, 1], got[0, 2])


def test_padding_mask_uses_batch_lengths():
    lengths = [3, 7]
    expected = python_mask(lambda b_, h_, q_, k_: q_ < lengths[b_] and k_ < lengths[b_],
                           2, 1, 7, 7)
    got = dense_mask(spec(PADDING), 2, 1, 7, 7, {"lengths": torch.tensor(lengths)})
    assert torch.equal(got, expected)


def test_no_mask_is_all_true():
    assert dense_mask(spec(), 2, 3, 4, 5).all()
    assert dense_mask(spec(), 2, 3, 4, 5).shape == (2, 3, 4, 5)


def test_out_of_range_lookup_is_an_error():
    with pytest.raises(SpecError, match="outside"):
        dense_mask(spec(DOCUMENT), 1, 1, 8, 8, {"doc_ids": torch.zeros(1, 4, dtype=torch.long)})


def test_missing_tensor_is_an_error():
    with pytest.raises(SpecError, match="doc_ids"):
        dense_mask(spec(DOCUMENT), 1, 1, 8, 8, {})


# --- attention -----------------------------------------------------------------------------


def qkv(batch, heads, q_len, kv_len, dim, kv_heads=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    return (torch.randn(batch, heads, q_len, dim, generator=gen, dtype=dtype),
            torch.randn(batch, kv_heads, kv_len, dim, generator=gen, dtype=dtype),
            torch.randn(batch, kv_heads, kv_len, dim, generator=gen, dtype=dtype))


def test_full_attention_matches_torch_sdpa():
    q_, k_, v_ = qkv(2, 3, 33, 47, 8, dtype=torch.float64)
    got = reference_attention(spec(), q_, k_, v_)
    expected = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_)
    assert got.dtype == torch.float64 and torch.allclose(got, expected, atol=1e-12)


def test_causal_alibi_softcap_against_python():
    heads = 3
    q_, k_, v_ = qkv(1, heads, 13, 13, 4)
    slopes = builtin_tensor(SLOPES, {"H": heads})
    spec_ = spec(CAUSAL, softcap(5.0, ALIBI))

    def modify(s, bi, hi, qi, ki):
        return 5.0 * math.tanh((s - alibi_slope(hi, heads) * abs(qi - ki)) / 5.0)

    got = reference_attention(spec_, q_, k_, v_, tensors={"alibi_slopes(H)": slopes})
    expected = python_attention(q_, k_, v_, lambda bi, hi, qi, ki: qi >= ki, modify, 0.5)
    assert got.dtype == torch.float32
    # The slopes are float32 values; the Python loop uses exact ones.
    assert torch.allclose(got.double(), expected, atol=1e-6)


def test_fully_masked_rows_are_zero_not_nan():
    lengths = [4, 9]
    q_, k_, v_ = qkv(2, 2, 9, 9, 4)
    got = reference_attention(spec(PADDING), q_, k_, v_,
                              tensors={"lengths": torch.tensor(lengths)})
    assert not got.isnan().any()
    assert (got[0, :, 4:] == 0).all() and (got[1] != 0).any(dim=-1).all()
    expected = python_attention(q_, k_, v_,
                                lambda bi, hi, qi, ki: qi < lengths[bi] and ki < lengths[bi],
                                unmodified, 0.5)
    assert torch.allclose(got.double(), expected, atol=1e-6)


def test_score_that_sends_a_row_to_minus_infinity_gives_zeros():
    # The score pipeline alone can mask: where(q == 0, -inf, score).
    minus_inf = call("where", op("==", q, C(0)), C(-math.inf), SCORE)
    q_, k_, v_ = qkv(1, 1, 6, 6, 4)
    got = reference_attention(spec(score=minus_inf), q_, k_, v_)
    assert (got[0, 0, 0] == 0).all() and not got.isnan().any()


def test_grouped_query_attention_with_a_head_dependent_mask():
    q_, k_, v_ = qkv(1, 4, 21, 21, 4, kv_heads=2)
    got = reference_attention(spec(DILATED), q_, k_, v_, scale=0.3)
    expected = python_attention(
        q_, k_, v_, lambda bi, hi, qi, ki: qi >= ki and (qi - ki) % (hi + 1) == 0,
        unmodified, 0.3)
    assert torch.allclose(got.double(), expected, atol=1e-6)


@pytest.mark.parametrize("rows", [None, [4, 0, 2]], ids=["every row", "some rows"])
def test_grouped_heads_read_their_own_key_head_in_every_batch_row(rows):
    """Four query heads per key head, two batch rows, a mask and a score that differ per head
    and per batch row, a value dimension of its own: each query head reads key head
    ``h // 4`` of its own batch row (the reference stacks a group's rows on its key head)."""
    q_, k_, v_ = qkv(2, 8, 5, 9, 4, kv_heads=2, dtype=torch.float64)
    v_ = torch.randn(2, 2, 9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = ir.Or((op(">=", op("+", q, op("*", b, C(2))), kv),
                  op("==", op("%", kv, C(8)), op("%", op("+", q, C(1)), C(8)))))
    score = op("-", SCORE, op("*", op("*", C(0.1), op("+", call("abs", op("-", q, kv)), C(1))),
                                 op("+", ir.Var("h"), C(1))))
    got = reference_attention(spec(mask, score), q_, k_, v_, scale=0.7, rows=rows)
    expected = python_attention(
        q_, k_, v_, lambda bi, hi, qi, ki: qi + 2 * bi >= ki or ki % 8 == (qi + 1) % 8,
        lambda s, bi, hi, qi, ki: s - 0.1 * (abs(qi - ki) + 1) * (hi + 1), 0.7)
    expected = expected if rows is None else expected[:, :, rows]
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


def test_bottom_right_causal_with_kv_cache_and_document_ids():
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    ids = doc_ids[0].tolist()
    mask = ir.And((CAUSAL_BR, op("==", lookup(DOC_IDS, b, op("+", q, C(6))),
                                 lookup(DOC_IDS, b, kv))))
    q_, k_, v_ = qkv(1, 2, 5, 11, 4)
    got = reference_attention(spec(mask), q_, k_, v_, tensors={"doc_ids": doc_ids})
    expected = python_attention(
        q_, k_, v_, lambda bi, hi, qi, ki: qi + 6 >= ki and ids[qi + 6] == ids[ki],
        unmodified, 0.5)
    assert torch.allclose(got.double(), expected, atol=1e-6)


def test_lengths_that_are_not_multiples_of_128():
    q_, k_, v_ = qkv(1, 2, 130, 257, 8, dtype=torch.float64)
    got = reference_attention(spec(sliding_window(16)), q_, k_, v_)
    mask = dense_mask(spec(sliding_window(16)), 1, 2, 130, 257)
    expected = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)
    assert torch.allclose(got, expected, atol=1e-12)


def test_result_keeps_the_input_dtype():
    q_, k_, v_ = qkv(1, 1, 8, 8, 4, dtype=torch.bfloat16)
    assert reference_attention(spec(CAUSAL), q_, k_, v_).dtype == torch.bfloat16


def test_mismatched_heads_are_refused():
    q_, k_, v_ = qkv(1, 3, 8, 8, 4, kv_heads=2)
    with pytest.raises(SpecError, match="3 query heads"):
        reference_attention(spec(), q_, k_, v_)


def test_int_ranges_are_checked_once_per_doubling_and_exactly_where_that_is_too_loose():
    """The int64 check of each call: a decode growing by one key checks once per doubling of
    its length (the proof over the bucket is cached); a spec that fits the exact lengths but
    not their bucket still runs, and one that overflows at the exact lengths is refused."""
    from flexspec.ir import overflow
    factor = 9_200_000_000_000_000  # kv * factor fits int64 for kv < 1002, not up to 1023
    mask = op(">=", op("*", kv, C(factor)), C(0))
    overflow.fits_int_ranges.cache_clear()
    for kv_len in range(600, 640):
        dense_mask(spec(CAUSAL), 1, 2, 1, kv_len, q_offset=kv_len - 1)
    assert overflow.fits_int_ranges.cache_info().misses == 1
    assert dense_mask(spec(mask), 1, 1, 2, 1000).all()  # exact: 999 * factor fits
    with pytest.raises(SpecError, match="KV_LEN=1100, beyond the 64-bit ints"):
        dense_mask(spec(mask), 1, 1, 2, 1100)


def test_memory_budget():
    assert MAX_BYTES == 2 * 1024**3
    with pytest.raises(SpecError) as caught:
        dense_mask(spec(CAUSAL), 4, 16, 32768, 32768)
    assert str(caught.value) == (
        "the dense reference would need 512.0 GiB per score array for B=4, H=16, Q_LEN=32768, "
        "KV_LEN=32768 (limit 2.0 GiB per array; the computation holds about 4 such arrays at "
        "once); use smaller shapes")
    with pytest.raises(SpecError, match="limit 0.0 GiB"):
        reference_attention(spec(), *qkv(1, 1, 64, 64, 4), max_bytes=1000)
    assert dense_mask(spec(CAUSAL), 1, 1, 10, 10, max_bytes=800).shape == (1, 1, 10, 10)


def test_max_bytes_bounds_every_dense_array():
    with pytest.raises(SpecError, match="limit 0.0 GiB"):
        dense_mask(spec(CAUSAL), 1, 1, 10, 10, max_bytes=799)
    logits = torch.zeros(1, 1, 10, 10, dtype=torch.float64)
    with pytest.raises(SpecError, match="limit 0.0 GiB"):
        dense_scores(spec(), logits, max_bytes=799)
    assert dense_scores(spec(), logits, max_bytes=800).shape == (1, 1, 10, 10)


@pytest.mark.parametrize("shapes", [
    ((2, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)),   # batch
    ((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 5, 8)),   # v's length
    ((1, 1, 4, 8), (1, 1, 4, 6), (1, 1, 4, 6)),   # head dimension of q and k
])
def test_q_k_v_that_do_not_fit_are_refused(shapes):
    q_, k_, v_ = (torch.zeros(shape) for shape in shapes)
    message = (f"q {list(shapes[0])}, k {list(shapes[1])} and v {list(shapes[2])} do not fit "
               "together")
    with pytest.raises(SpecError, match=f"^{re.escape(message)}$"):
        reference_attention(spec(), q_, k_, v_)


# --- call arguments: q_offset, kv_lengths, rows, return_lse --------------------------------

# A score that reads the query position, so that where the rows stand shows in the scores too.
DECAY = op("-", SCORE, op("*", C(0.25), distance()))


def decay(at):
    """DECAY in plain Python, with row ``qi`` of batch row ``bi`` at position ``at(bi, qi)``."""
    return lambda s, bi, hi, qi, ki: s - 0.25 * abs(at(bi, qi) - ki)


def python_scores(logits, modify):
    batch, heads, q_len, kv_len = logits.shape
    return torch.tensor([[[[modify(logits[bi, hi, qi, ki].item(), bi, hi, qi, ki)
                            for ki in range(kv_len)] for qi in range(q_len)]
                          for hi in range(heads)] for bi in range(batch)], dtype=torch.float64)


@pytest.mark.parametrize("q_offset, offsets", [
    (3, [3, 3]),
    (torch.tensor([3]), [3, 3]),
    (torch.tensor([2, 6], dtype=torch.int32), [2, 6]),
])
def test_q_offset_places_the_rows(q_offset, offsets):
    def at(bi, qi):
        return offsets[bi] + qi

    def allowed(bi, hi, qi, ki):
        return at(bi, qi) >= ki

    mask = dense_mask(spec(CAUSAL), 2, 1, 4, 9, q_offset=q_offset)
    assert torch.equal(mask, python_mask(allowed, 2, 1, 4, 9))
    logits = torch.randn(2, 1, 4, 9, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))
    got = dense_scores(spec(score=DECAY), logits, q_offset=q_offset)
    assert torch.allclose(got, python_scores(logits, decay(at)), rtol=0, atol=1e-12)
    q_, k_, v_ = qkv(2, 2, 4, 9, 4, dtype=torch.float64)
    out, lse = reference_attention(spec(CAUSAL, DECAY), q_, k_, v_, q_offset=q_offset,
                                   return_lse=True)
    want, want_lse = python_attention(q_, k_, v_, allowed, decay(at), 0.5, with_lse=True)
    assert torch.allclose(out, want, rtol=0, atol=1e-12)
    assert torch.allclose(lse, want_lse, rtol=0, atol=1e-12)
    rows = [3, 0, 2]
    part = reference_attention(spec(CAUSAL, DECAY), q_, k_, v_, q_offset=q_offset, rows=rows)
    assert torch.allclose(part, want[:, :, rows], rtol=0, atol=1e-12)


END = ir.AttentionIR(CAUSAL, DECAY, align="end")


@pytest.mark.parametrize("kv_lengths, lengths", [
    (torch.tensor([5, 9]), [5, 9]),
    ([3, 8], [3, 8]),
    (torch.tensor([6], dtype=torch.int32), [6, 6]),
])
def test_kv_lengths_hide_the_keys_past_each_rows_length(kv_lengths, lengths):
    # No mask: the lengths alone hide keys.
    expected = python_mask(lambda b_, h_, q_, k_: k_ < lengths[b_], 2, 2, 3, 9)
    assert torch.equal(dense_mask(spec(), 2, 2, 3, 9, kv_lengths=kv_lengths), expected)
    # An end-aligned spec places the rows at each batch row's own end, unless q_offset says.
    for q_offset, at in ((None, lambda bi, qi: lengths[bi] - 3 + qi),
                         (1, lambda bi, qi: 1 + qi)):
        def allowed(bi, hi, qi, ki, at=at):
            return at(bi, qi) >= ki and ki < lengths[bi]
        got = dense_mask(END, 2, 2, 3, 9, q_offset=q_offset, kv_lengths=kv_lengths)
        assert torch.equal(got, python_mask(allowed, 2, 2, 3, 9))
        q_, k_, v_ = qkv(2, 2, 3, 9, 4, dtype=torch.float64)
        out, lse = reference_attention(END, q_, k_, v_, q_offset=q_offset,
                                       kv_lengths=kv_lengths, return_lse=True)
        want, want_lse = python_attention(q_, k_, v_, allowed, decay(at), 0.5, with_lse=True)
        assert torch.allclose(out, want, rtol=0, atol=1e-12)
        assert torch.allclose(lse, want_lse, rtol=0, atol=1e-12)


def test_an_end_aligned_spec_without_lengths_ends_at_the_last_key():
    def at(bi, qi):
        return 9 - 3 + qi

    expected = python_mask(lambda b_, h_, q_, k_: at(b_, q_) >= k_, 1, 1, 3, 9)
    assert torch.equal(dense_mask(END, 1, 1, 3, 9), expected)
    logits = torch.randn(1, 1, 3, 9, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(2))
    assert torch.allclose(dense_scores(END, logits), python_scores(logits, decay(at)),
                          rtol=0, atol=1e-12)
    q_, k_, v_ = qkv(1, 2, 3, 9, 4, dtype=torch.float64)
    want = python_attention(q_, k_, v_, lambda bi, hi, qi, ki: at(bi, qi) >= ki, decay(at), 0.5)
    assert torch.allclose(reference_attention(END, q_, k_, v_), want, rtol=0, atol=1e-12)


def test_rows_compute_only_those_rows():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1, 1]])
    ids = doc_ids.tolist()
    spec_ = spec(ir.And((CAUSAL, DOCUMENT)), DECAY)
    tensors = {"doc_ids": doc_ids}
    gen = torch.Generator().manual_seed(3)
    q_ = torch.randn(2, 2, 6, 4, generator=gen, dtype=torch.float64)
    k_ = torch.randn(2, 2, 7, 4, generator=gen, dtype=torch.float64)
    v_ = torch.randn(2, 2, 7, 3, generator=gen, dtype=torch.float64)  # v's own last dimension
    want, want_lse = python_attention(
        q_, k_, v_, lambda bi, hi, qi, ki: qi >= ki and ids[bi][qi] == ids[bi][ki],
        decay(lambda bi, qi: qi), 0.5, with_lse=True)
    # row numbers as a list, an int32 tensor (read through doc_ids[b, q]: int64 indices), one row
    for rows in ([5, 0, 3, 3], torch.tensor([1, 4], dtype=torch.int32), torch.tensor(2)):
        index = torch.as_tensor(rows).reshape(-1).long()
        out, lse = reference_attention(spec_, q_, k_, v_, tensors=tensors, rows=rows,
                                       return_lse=True)
        assert out.shape == (2, 2, len(index), 3) and lse.shape == (2, 2, len(index))
        assert torch.allclose(out, want[:, :, index], rtol=0, atol=1e-12)
        assert torch.allclose(lse, want_lse[:, :, index], rtol=0, atol=1e-12)
    out, lse = reference_attention(spec_, q_, k_, v_, tensors=tensors, rows=[], return_lse=True)
    assert out.shape == (2, 2, 0, 3) and lse.shape == (2, 2, 0)
    for rows in ([-1], [6], [0, 6]):
        with pytest.raises(SpecError, match=r"^rows must lie in 0\.\.5$"):
            reference_attention(spec_, q_, k_, v_, tensors=tensors, rows=rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lse_is_the_log_sum_exp_of_the_visible_scores(dtype):
    # causal & padding: row 0 sees one key (a sum of exactly one exp), the rows of batch row 0
    # past its length see none (-inf)
    lengths = [3, 6]
    q_, k_, v_ = qkv(2, 2, 6, 6, 4, dtype=dtype)
    out, lse = reference_attention(spec(ir.And((CAUSAL, PADDING)), DECAY), q_, k_, v_,
                                   tensors={"lengths": torch.tensor(lengths)}, return_lse=True)
    want, want_lse = python_attention(
        q_, k_, v_, lambda bi, hi, qi, ki: qi >= ki and qi < lengths[bi] and ki < lengths[bi],
        decay(lambda bi, qi: qi), 0.5, with_lse=True)
    assert out.dtype == dtype and out.shape == (2, 2, 6, 4)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (2, 2, 6)
    assert (lse[0, :, 3:] == -math.inf).all() and lse[1].isfinite().all()
    assert torch.allclose(lse.double(), want_lse, rtol=1e-6, atol=0)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6  # out is rounded to q's dtype
    assert torch.allclose(out.double(), want, rtol=0, atol=tolerance)


def test_softmax_is_stable_in_each_row():
    # Scores near 800 * q: exp without subtracting each row's maximum overflows, and one maximum
    # for the whole tensor would send every row but the last to zeros.
    score = op("+", SCORE, op("*", C(800.0), q))
    q_, k_, v_ = qkv(1, 2, 4, 5, 4, dtype=torch.float64)
    out, lse = reference_attention(spec(score=score), q_, k_, v_, return_lse=True)
    want, want_lse = python_attention(q_, k_, v_, lambda bi, hi, qi, ki: True,
                                      lambda s, bi, hi, qi, ki: s + 800.0 * qi, 0.5,
                                      with_lse=True)
    assert torch.allclose(out, want, rtol=0, atol=1e-12)
    assert torch.allclose(lse, want_lse, rtol=1e-14, atol=0)


def test_int64_ranges_are_checked_at_the_call_s_query_positions():
    # q * 2**56 fits int64 up to query position 127 (2**63 - 2**56) and overflows at 128.
    big = op("*", q, C(2**56))
    mask, score = spec(op(">=", big, kv)), spec(score=op("+", SCORE, big))

    def calls(q_len, kv_len, batch=1, **where):
        yield lambda: dense_mask(mask, batch, 1, q_len, kv_len, **where)
        yield lambda: dense_scores(score, torch.zeros(batch, 1, q_len, kv_len,
                                                      dtype=torch.float64), **where)
        yield lambda: reference_attention(mask, *qkv(batch, 1, q_len, kv_len, 2), **where)

    def refused(where, q_len, kv_len, batch=1, **call):
        text = f"for B={batch}, H=1, Q_LEN={q_len}, KV_LEN={kv_len}{where}, beyond"
        for run in calls(q_len, kv_len, batch, **call):
            with pytest.raises(SpecError, match=re.escape(text)):
                run()

    for run in (*calls(128, 2), *calls(4, 2, q_offset=124),
                *calls(4, 2, 2, q_offset=torch.tensor([0, 124]))):
        run()
    refused("", 129, 2)
    refused(" and query positions from 125", 4, 2, q_offset=125)
    refused(" and query positions from 0", 4, 2, 2, q_offset=torch.tensor([0, 125]))
    # an end-aligned spec's rows stand at KV_LEN - Q_LEN + i
    end = ir.AttentionIR(mask.mask, align="end")
    dense_mask(end, 1, 1, 4, 128)
    with pytest.raises(SpecError, match=re.escape("Q_LEN=4, KV_LEN=129 and query positions "
                                                  "from 125, beyond")):
        dense_mask(end, 1, 1, 4, 129)
