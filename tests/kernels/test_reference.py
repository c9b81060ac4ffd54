"""Tests of flexspec.kernels.reference against definitions written out by hand in plain Python."""

import math

import pytest
import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.kernels.reference import (MAX_BYTES, dense_mask, evaluate, index_grid,
                                reference_attention)
from flexspec.kernels.tensors import builtin_tensor
from ir_examples import (ALIBI, CAUSAL, CAUSAL_BR, DILATED, DOC_IDS, DOCUMENT, KV_LEN,
                         PADDING, Q_LEN, SCORE, SLOPES, C, b, call, h, kv, lookup, op, q,
                         sliding_window, softcap, spec, window)


def python_mask(fn, batch, heads, q_len, kv_len):
    """The mask of a plain-Python predicate, as nested lists turned into a tensor."""
    return torch.tensor([[[[bool(fn(bi, hi, qi, ki)) for ki in range(kv_len)]
                           for qi in range(q_len)] for hi in range(heads)] for bi in range(batch)])


def python_attention(q, k, v, allowed, modify, scale):
    """Textbook attention in plain Python floats: a row with nothing allowed gives zeros."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len, dv = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    q, k, v = q.tolist(), k.tolist(), v.tolist()
    out = [[[[0.0] * dv for _ in range(q_len)] for _ in range(heads)] for _ in range(batch)]
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
                for d in range(dv):
                    out[bi][hi][qi][d] = sum(w * v[bi][kh][ki][d]
                                             for ki, w in weights.items()) / total
    return torch.tensor(out, dtype=torch.float64)


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


# --- expression semantics ------------------------------------------------------------------


GRID = index_grid(2, 3, 5, 7)


def value_of(expr, **extra):
    return evaluate(expr, {**GRID, **extra}, {})


@pytest.mark.parametrize("expr, fn", [
    (op("//", op("-", q, kv), C(3)), lambda q_, k_: (q_ - k_) // 3),
    (op("%", op("-", q, kv), C(3)), lambda q_, k_: (q_ - k_) % 3),
    (op("%", op("-", q, kv), C(-4)), lambda q_, k_: (q_ - k_) % -4),
    (op("//", C(7), op("-", op("-", q, kv), C(10))), lambda q_, k_: 7 // (q_ - k_ - 10)),
    (call("sign", op("-", q, kv)), lambda q_, k_: (q_ > k_) - (q_ < k_)),
    (call("clamp", op("-", q, kv), C(-2), C(3)), lambda q_, k_: min(max(q_ - k_, -2), 3)),
    (call("min", q, op("*", kv, C(2))), lambda q_, k_: min(q_, 2 * k_)),
    (call("where", op(">", q, kv), q, kv), lambda q_, k_: q_ if q_ > k_ else k_),
    (call("floor", op("/", op("-", q, kv), C(2))), lambda q_, k_: math.floor((q_ - k_) / 2)),
    (call("ceil", op("/", op("-", q, kv), C(2))), lambda q_, k_: math.ceil((q_ - k_) / 2)),
    (op("-", KV_LEN, Q_LEN), lambda q_, k_: 2),
])
def test_integer_semantics_follow_python(expr, fn):
    got = value_of(expr)
    assert got.dtype == torch.int64
    expected = [[fn(qi, ki) for ki in range(7)] for qi in range(5)]
    assert got.expand(2, 3, 5, 7)[1, 2].tolist() == expected


@pytest.mark.parametrize("expr, fn", [
    (op("/", q, op("+", kv, C(1))), lambda q_, k_: q_ / (k_ + 1)),
    (call("tanh", op("/", q, C(3))), lambda q_, k_: math.tanh(q_ / 3)),
    (call("exp2", op("-", C(0), q)), lambda q_, k_: 2.0 ** -q_),
    (call("log", op("+", q, C(1))), lambda q_, k_: math.log(q_ + 1)),
    (call("log2", op("+", kv, C(1))), lambda q_, k_: math.log2(k_ + 1)),
    (call("sqrt", op("*", q, kv)), lambda q_, k_: math.sqrt(q_ * k_)),
    (call("sigmoid", op("-", q, kv)), lambda q_, k_: 1 / (1 + math.exp(k_ - q_))),
    (call("exp", op("*", C(0.5), q)), lambda q_, k_: math.exp(0.5 * q_)),
    (call("sin", op("/", q, C(3))), lambda q_, k_: math.sin(q_ / 3)),
    (call("cos", op("-", q, kv)), lambda q_, k_: math.cos(q_ - k_)),
    (call("log1p", op("*", q, C(0.5))), lambda q_, k_: math.log1p(0.5 * q_)),
    (call("erf", op("-", q, kv)), lambda q_, k_: math.erf(q_ - k_)),
    (op("*", call("abs", op("-", q, kv)), C(0.1)), lambda q_, k_: abs(q_ - k_) * 0.1),
])
def test_float_semantics_are_float64(expr, fn):
    got = value_of(expr)
    assert got.dtype == torch.float64
    expected = [fn(qi, ki) for qi in range(5) for ki in range(7)]
    assert got.expand(2, 3, 5, 7)[0, 0].flatten().tolist() == pytest.approx(expected, rel=1e-14)


def test_boolean_connectives():
    expr = ir.Or((ir.Unary("not", CAUSAL), ir.And((op("==", b, C(1)), op("==", h, C(2))))))
    got = value_of(expr).expand(2, 3, 5, 7)
    expected = python_mask(lambda b_, h_, q_, k_: not q_ >= k_ or (b_ == 1 and h_ == 2),
                           2, 3, 5, 7)
    assert got.dtype == torch.bool and torch.equal(got, expected)
    assert value_of(ir.And(())).item() is True and value_of(ir.Or(())).item() is False


def test_score_is_read_from_the_grid():
    score = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    got = value_of(softcap(2.0), score=score)
    assert torch.allclose(got, 2.0 * torch.tanh(score / 2.0))


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
