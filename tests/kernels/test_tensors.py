"""Tests of flexspec.kernels.tensors: keys, shape expressions, builtin and learnable values, specialize."""

import pytest
import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.ir import tensor_key
from flexspec.ir.specialize import eval_size_expr, specialize, specialize_ir
from flexspec.kernels.tensors import add_leading_dims, builtin_tensor, init_learnable, prepare
from ir_examples import (B, BIAS, DOC_IDS, DOCUMENT, H, KV_LEN, LENGTHS, Q_LEN, SLOPES, C, b, call,
                         h, kv, lookup, op, q, spec)

SIZES = {"B": 2, "H": 8, "Q_LEN": 100, "KV_LEN": 300}


def test_tensor_keys():
    assert tensor_key(DOC_IDS) == "doc_ids"
    assert tensor_key(BIAS) == "bias"
    assert tensor_key(SLOPES) == "alibi_slopes(H)"
    other = ir.Tensor("alibi_slopes", (C(4),), origin="builtin", builtin="alibi_slopes",
                      args=(C(4),))
    assert tensor_key(other) == "alibi_slopes(4)"


@pytest.mark.parametrize("expr, value", [
    (C(7), 7),
    (KV_LEN, 300),
    (op("+", Q_LEN, KV_LEN), 400),
    (op("-", op("*", B, H), C(1)), 15),
    (op("//", KV_LEN, C(128)), 2),
    (op("%", op("-", C(0), KV_LEN), C(128)), 84),  # Python's modulo: the divisor's sign
    (call("min", Q_LEN, KV_LEN), 100),
    (call("max", Q_LEN, op("//", KV_LEN, C(2))), 150),
    (ir.Unary("neg", H), -8),
])
def test_eval_size_expr(expr, value):
    assert eval_size_expr(expr, SIZES) == value


@pytest.mark.parametrize("expr", [op("/", KV_LEN, C(2)), C(1.5), q, call("abs", H), C(True)])
def test_eval_size_expr_rejects(expr):
    with pytest.raises(SpecError):
        eval_size_expr(expr, SIZES)


@pytest.mark.parametrize("heads", [1, 8, 12])
def test_alibi_slopes(heads):
    slopes = builtin_tensor(SLOPES, {"H": heads}, "cpu", dtype=torch.float64)
    expected = [2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]
    assert slopes.dtype == torch.float64 and slopes.shape == (heads,)
    assert slopes.tolist() == pytest.approx(expected, rel=1e-15)
    assert builtin_tensor(SLOPES, {"H": heads}).dtype == torch.float32


def test_alibi_slopes_power_of_two_are_the_paper_values():
    assert builtin_tensor(SLOPES, {"H": 8}).tolist() == [1 / 2 ** i for i in range(1, 9)]


def test_unknown_builtin():
    t = ir.Tensor("rope", (H,), origin="builtin", builtin="rope", args=(H,))
    with pytest.raises(SpecError, match="rope"):
        builtin_tensor(t, SIZES)


def test_init_learnable():
    table = ir.Tensor("rel", (H, op("-", op("+", Q_LEN, KV_LEN), C(1))), origin="learnable",
                      init="zeros")
    zeros = init_learnable(table, SIZES)
    assert zeros.shape == (8, 399) and not zeros.any() and zeros.dtype == torch.float32
    normal = init_learnable(BIAS, SIZES, dtype=torch.float64)
    assert normal.shape == (8,) and normal.dtype == torch.float64
    assert 0 < normal.abs().max() < 0.2
    with pytest.raises(SpecError, match="uniform"):
        init_learnable(ir.Tensor("x", (H,), origin="learnable", init="uniform"), SIZES)


def test_specialize_size_one_dimension_reads_index_zero():
    expr = DOCUMENT
    assert specialize(expr, {"doc_ids": (1, 300)}) == op(
        "==", lookup(DOC_IDS, C(0), q), lookup(DOC_IDS, C(0), kv))
    assert not ir.depends_on(specialize(expr, {"doc_ids": (1, 300)}), "b")
    # Fewer dimensions than declared: the leading ones count as size 1.
    assert specialize(expr, {"doc_ids": (300,)}) == specialize(expr, {"doc_ids": (1, 300)})


def test_specialize_leaves_full_tensors_and_unknown_keys_alone():
    assert specialize(DOCUMENT, {"doc_ids": (2, 300)}) is DOCUMENT
    assert specialize(DOCUMENT, {}) is DOCUMENT
    nested = lookup(DOC_IDS, lookup(LENGTHS, b), kv)
    assert specialize(nested, {"lengths": (1,), "doc_ids": (2, 1)}) == lookup(
        DOC_IDS, lookup(LENGTHS, C(0)), C(0))


def test_specialize_ir():
    result = specialize_ir(spec(DOCUMENT), {"doc_ids": (1, 300)})
    assert result.mask == specialize(DOCUMENT, {"doc_ids": (1, 300)})
    assert result.score == ir.SCORE


def test_add_leading_dims():
    assert add_leading_dims(torch.zeros(5), 3).shape == (1, 1, 5)
    assert add_leading_dims(torch.zeros(2, 5), 2).shape == (2, 5)
    with pytest.raises(SpecError):
        add_leading_dims(torch.zeros(1, 2, 5), 2)


def test_prepare():
    mask = ir.And((DOCUMENT, op("<", kv, lookup(LENGTHS, b))))
    score = op("+", op("-", ir.SCORE, lookup(SLOPES, h)), lookup(BIAS, h))
    bias = torch.ones(8)
    values = prepare(spec(mask, score), SIZES,
                     {"doc_ids": torch.zeros(300, dtype=torch.long), "lengths": [5, 6]},
                     learnables={"bias": bias})
    assert list(values) == ["doc_ids", "lengths", "alibi_slopes(H)", "bias"]
    assert values["doc_ids"].shape == (1, 300)
    assert values["lengths"].tolist() == [5, 6]
    assert values["alibi_slopes(H)"].shape == (8,)
    assert values["bias"] is bias


def test_tables_beyond_the_allocation_limit_are_a_spec_error():
    """Red-team and fuzzer finding: rel_bias(max_distance=2**40) asked the allocator for 8 TB
    (a raw RuntimeError). The size is checked before allocating."""
    import flexspec
    attn = flexspec.compile("causal + rel_bias(max_distance=1099511627776)")
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(flexspec.SpecError, match="would hold 4,398,046,511,106 entries"):
        attn.reference(q, q, q)


def test_negative_dimensions_and_head_counts_are_spec_errors():
    import flexspec
    from flexspec.lang.library import load_text
    attn = flexspec.compile(load_text("mask m(t: int[-1]) = t[0] > 0\nspec s = m\n")["s"])
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(flexspec.SpecError, match=r"declared as \[-1\].*cannot be negative"):
        attn.reference(q, q, q, t=torch.ones(1, dtype=torch.long))
    slopes = ir.Tensor("alibi_slopes(-1)", (ir.Const(1),), "float", "builtin",
                       builtin="alibi_slopes", args=(ir.Const(-1),))
    with pytest.raises(flexspec.SpecError, match="positive number of heads"):
        builtin_tensor(slopes, {"B": 1, "H": 2, "Q_LEN": 8, "KV_LEN": 8})


def test_specialize_ir_is_the_spec_itself_without_broadcasts_and_made_once_per_pattern():
    """A growing cache specializes at every step: the IR is made once per pattern of broadcast
    dimensions (the same at every length), and a spec with none is its own specialization."""
    whole = spec(DOCUMENT)
    assert specialize_ir(whole, {"doc_ids": (2, 300)}, SIZES) is whole
    first = specialize_ir(whole, {"doc_ids": (1, 300)}, {**SIZES, "KV_LEN": 300})
    later = specialize_ir(whole, {"doc_ids": (1, 301)}, {**SIZES, "KV_LEN": 301})
    assert first is later and first.mask == specialize(DOCUMENT, {"doc_ids": (1, 300)})
    # B = 1 declared and given: not a broadcast (FLASH compiles b where it failed on 0)
    assert specialize_ir(whole, {"doc_ids": (1, 300)}, {**SIZES, "B": 1, "KV_LEN": 300}) is whole


@pytest.mark.parametrize("shapes", [{"doc_ids": (1, 300), "lengths": (1,)},
                                    {"doc_ids": (300,), "lengths": (2,)},
                                    {"doc_ids": (2, 1), "lengths": (1,)}, {}])
def test_specialize_ir_equals_specializing_each_half(shapes):
    mask = ir.And((DOCUMENT, op("<", kv, lookup(LENGTHS, b))))
    score = op("+", ir.SCORE, lookup(DOC_IDS, lookup(LENGTHS, b), kv))
    whole = ir.AttentionIR(mask, score)
    for sizes in (None, {**SIZES, "B": 2, "KV_LEN": 300}):
        got = specialize_ir(whole, shapes, sizes)
        assert got == ir.AttentionIR(specialize(mask, shapes, sizes),
                                     specialize(score, shapes, sizes))
