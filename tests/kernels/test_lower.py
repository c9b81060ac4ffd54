"""Tests of flexspec.kernels.lower: the generated source, and FlexAttention runs against the reference."""

import inspect
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.nn.attention.flex_attention import (_vmap_for_bhqkv, create_block_mask, create_mask,
                                               flex_attention)

from flexspec import ir
from flexspec.errors import BindingError, Source, SpecError
from flexspec.ir.simplify import simplify
from flexspec.lang.checker import Checker
from flexspec.lang.definitions import Definition, Scope
from flexspec.lang.parser import parse_expr
from flexspec.kernels.lower import lower
from flexspec.kernels.reference import dense_mask, dense_scores, reference_attention
from flexspec.ir.specialize import specialize_ir
from flexspec.kernels.tensors import builtin_tensor
from golden import pairs
from ir_examples import (ALIBI, BIAS, CAUSAL, CAUSAL_BR, DILATED, DOC_IDS, DOCUMENT, KV_LEN,
                         PADDING, Q_LEN, SCORE, SLOPES, B, C, H, b, call, h, kv, lookup, op, q,
                         sliding_window, softcap, spec, window)

# Eager flex_attention warns that it is not compiled; that is what these tests want.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def sizes(batch, heads, q_len, kv_len):
    return {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}


def _dialect(cute: bool) -> str:
    return "cute" if cute else "torch"


def lowered_mask(spec_, batch, heads, q_len, kv_len, tensors=None, cute=False):
    """The lowered mask_mod evaluated at every position by FlexAttention's own create_mask."""
    mask_mod, _ = lower(spec_, dialect=_dialect(cute)).make_mods(sizes(batch, heads, q_len, kv_len),
                                                    tensors or {})
    return create_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu")


TEMPERATURE = ir.Tensor("temperature", ())


def lowered_scores(spec_, logits, tensors=None, cute=False):
    """The lowered score_mod applied to ``logits [B, H, Q_LEN, KV_LEN]`` at every position, the
    way FlexAttention's create_mask maps a mod over the index grid."""
    batch, heads, q_len, kv_len = logits.shape
    _, score_mod = lower(spec_, dialect=_dialect(cute)).make_mods(sizes(batch, heads, q_len, kv_len),
                                                     tensors or {})
    grid = [torch.arange(n) for n in logits.shape]
    with TransformGetItemToIndex():
        return _vmap_for_bhqkv(score_mod, prefix=(0,))(logits, *grid)


def doc_ids(batch, length, docs=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, docs, (batch, length), generator=gen), dim=1).values


# --- source --------------------------------------------------------------------------------


def test_causal_source():
    lowered = lower(spec(CAUSAL))
    assert lowered.mask_source == ("def mask_mod(b, h, q_idx, kv_idx):\n"
                                   "    # q >= kv\n"
                                   "    return q_idx >= kv_idx\n")
    assert lowered.score_source is None


def test_sliding_window_and_softcap_source():
    lowered = lower(spec(sliding_window(128), softcap(30.0)))
    assert lowered.mask_source.splitlines()[-1] == (
        "    return (q_idx >= kv_idx) & (torch.abs(q_idx - kv_idx) <= 128)")
    assert lowered.score_source == ("def score_mod(score, b, h, q_idx, kv_idx):\n"
                                    "    # 30.0 * tanh(score / 30.0)\n"
                                    "    return 30.0 * torch.tanh(score / 30.0)\n")


def test_no_mask_no_score():
    lowered = lower(spec())
    assert lowered.mask_source is None and lowered.score_source is None
    assert lowered.make_mods(sizes(1, 1, 4, 4), {}) == (None, None)


def test_lowering_is_interned_by_ir_value():
    first = lower(spec(ir.And((CAUSAL, DOCUMENT)), ALIBI))
    assert lower(spec(ir.And((CAUSAL, DOCUMENT)), ALIBI)) is first
    assert lower(spec(ir.And((DOCUMENT, CAUSAL)), ALIBI)) is not first


def test_tensor_names_are_sanitized_and_unique():
    clash = ir.Tensor("q_idx", (H,), dtype="int")
    torch_named = ir.Tensor("torch", (H,), dtype="int")
    mask = ir.And((op("<", kv, lookup(clash, h)), op("<", q, lookup(torch_named, h)),
                   op(">", op("*", lookup(SLOPES, h), C(2.0)), C(0.0))))
    lowered = lower(spec(mask))
    assert dict(lowered.tensor_names) == {"q_idx": "q_idx_", "torch": "torch_",
                                          "alibi_slopes(H)": "alibi_slopes_H"}
    assert "q_idx_[h]" in lowered.mask_source and "torch_[h]" in lowered.mask_source


def test_free_names_are_only_what_the_source_reads():
    lowered = lower(spec(ir.And((CAUSAL_BR, DOCUMENT))))
    assert lowered.size_names == ("Q_LEN", "KV_LEN")
    assert dict(lowered.tensor_names) == {"doc_ids": "doc_ids"}
    header = lowered.source().splitlines()[2]
    assert header == "# free names: Q_LEN (int), KV_LEN (int), doc_ids (tensor 'doc_ids')"

    assert lower(spec(CAUSAL)).source().splitlines()[2] == "# free names: none"


def test_empty_and_or_lower_to_their_neutral_constant():
    # And(()) and Or(()) (no operand: true and false) lower to a constant mask
    assert lower(spec(ir.Or(()))).mask_source.splitlines()[-1] == (
        "    return torch.full_like(q_idx, False, dtype=torch.bool)")
    assert lower(spec(ir.And(()))).mask_source.splitlines()[-1] == (
        "    return torch.full_like(q_idx, True, dtype=torch.bool)")


def test_source_is_pasteable_python():
    lowered = lower(spec(ir.And((CAUSAL_BR, DOCUMENT)), softcap(20.0, ALIBI)))
    ids = doc_ids(2, 40)
    slopes = builtin_tensor(SLOPES, {"H": 3})
    namespace = {"Q_LEN": 30, "KV_LEN": 40, "doc_ids": ids, "alibi_slopes_H": slopes}
    exec(lowered.source(), namespace)
    pasted = create_mask(namespace["mask_mod"], 2, 3, 30, 40, device="cpu")
    made, _ = lowered.make_mods(sizes(2, 3, 30, 40), {"doc_ids": ids, "alibi_slopes(H)": slopes})
    assert torch.equal(pasted, create_mask(made, 2, 3, 30, 40, device="cpu"))


def test_missing_tensor_is_a_binding_error():
    with pytest.raises(BindingError, match="doc_ids"):
        lower(spec(DOCUMENT)).make_mods(sizes(1, 1, 8, 8), {})


# --- golden return expressions: tests/fixtures/lowering.txt -------------------------------


def _load_lowering_cases():
    return pairs("lowering.txt")


LOWERING_CASES = _load_lowering_cases()
CUTE_CASES = pairs("lowering_cute.txt")


def _golden_return(text: str, cute: bool) -> str:
    context = Definition("fixture", "score", (), None)
    expr = simplify(Checker(Scope()).expr(parse_expr(Source(text, "lowering.txt")),
                                          {"score": ir.SCORE}, context))
    lowered = lower(spec(expr) if expr.type == "bool" else spec(score=expr), dialect=_dialect(cute))
    source = lowered.mask_source if expr.type == "bool" else lowered.score_source
    return source.splitlines()[-1]


@pytest.mark.parametrize("line, text, expected", LOWERING_CASES,
                         ids=[f"{n}:{text}" for n, text, _ in LOWERING_CASES])
def test_lowering_fixture(line, text, expected):
    assert _golden_return(text, cute=False) == "    return " + expected, f"lowering.txt:{line}"


@pytest.mark.parametrize("line, text, expected", CUTE_CASES,
                         ids=[f"{n}:{text}" for n, text, _ in CUTE_CASES])
def test_lowering_cute_fixture(line, text, expected):
    assert _golden_return(text, cute=True) == "    return " + expected, \
        f"lowering_cute.txt:{line}"


# --- masks against the reference -----------------------------------------------------------


@pytest.mark.parametrize("mask, shape", [
    (CAUSAL, (1, 1, 100, 100)),
    (CAUSAL, (1, 1, 70, 190)),
    (CAUSAL_BR, (1, 1, 70, 190)),
    (window(3), (1, 1, 50, 61)),
    (sliding_window(16), (1, 1, 150, 150)),
    (DILATED, (1, 4, 40, 40)),
    (ir.Unary("not", ir.Or((window(2), op("==", op("//", kv, C(8)), op("//", q, C(8)))))),
     (1, 1, 40, 50)),
])
def test_masks_match_the_reference(mask, shape):
    assert torch.equal(lowered_mask(spec(mask), *shape), dense_mask(spec(mask), *shape))


def test_batch_dependent_masks_match_the_reference():
    tensors = {"doc_ids": doc_ids(3, 90), "lengths": torch.tensor([90, 17, 50])}
    mask = ir.And((CAUSAL, DOCUMENT, PADDING))
    got = lowered_mask(spec(mask), 3, 2, 90, 90, tensors)
    assert torch.equal(got, dense_mask(spec(mask), 3, 2, 90, 90, tensors))
    assert not torch.equal(got[0], got[1])


def test_broadcast_document_ids_give_a_mask_without_b():
    ids = doc_ids(1, 60)
    specialized = specialize_ir(spec(DOCUMENT), {"doc_ids": tuple(ids.shape)})
    lowered = lower(specialized)
    assert "doc_ids[0, q_idx] == doc_ids[0, kv_idx]" in lowered.mask_source
    got = lowered_mask(specialized, 3, 1, 60, 60, {"doc_ids": ids})
    assert torch.equal(got, dense_mask(spec(DOCUMENT), 3, 1, 60, 60, {"doc_ids": ids}))


@pytest.mark.parametrize("mask", [
    # Expressions over sizes only are Python numbers in the lowered code.
    call("where", op(">", Q_LEN, KV_LEN), op(">=", q, kv), op("<=", q, kv)),
    op(">=", call("where", op("<", Q_LEN, KV_LEN), op("-", q, kv), C(0)), C(0)),
    op("<", q, call("min", kv, op("//", KV_LEN, C(2)))),
    op("<", call("max", C(10), q), call("clamp", kv, C(5), op("-", KV_LEN, C(3)))),
    op("==", call("sign", op("-", Q_LEN, KV_LEN)), call("sign", op("-", q, kv))),
    op("<=", call("floor", op("/", q, C(3))), call("ceil", op("/", kv, C(4)))),
    op(">", call("floor", op("/", KV_LEN, C(4))), q),
    op("<", call("log2", op("+", q, C(1))), call("sqrt", call("exp2", C(3)))),
    op("<", call("sin", q), call("cos", op("-", KV_LEN, kv))),
    op(">", call("erf", op("/", op("-", q, kv), C(4))), call("sin", Q_LEN)),
    op("<", call("log1p", kv), op("+", call("log1p", q), call("cos", KV_LEN))),
    ir.And((op(">", KV_LEN, C(3)), ir.Unary("not", op("<", Q_LEN, C(2))), CAUSAL)),
    op(">", Q_LEN, C(1000)),
    ir.FALSE,
    # a conditional expression as the operand of the cute abs keeps its parentheses in the
    # condition (found by the random masks: `where(b if c else b < 0, ...)` took `b` as the
    # condition)
    op("<", b, call("abs", call("where", op("<", Q_LEN, C(30)), op("-", b, q), b))),
    # clamp of two sizes and a tensor: max(Q_LEN, 0) is a Python number, then a where
    op("<", q, call("clamp", op("-", Q_LEN, C(10)), C(0), kv)),
    # infinite constants, floor of an int (the int itself), one-operand and empty and/or, a
    # comparison of comparisons (parenthesised: Python would chain them), sign of sizes alone
    ir.Or((op("<", q, C(float("inf"))), op(">", kv, C(float("-inf"))))),
    op("<", call("floor", kv), q),
    ir.And((CAUSAL,)),
    ir.Or((ir.And((op("<", q, C(3)), op(">", kv, C(5)))), ir.And(()))),
    op("==", op("<", q, kv), op("<", kv, C(3))),
    op("<", call("sign", op("-", Q_LEN, KV_LEN)), C(0)),
    # where of two Python bools under a tensor condition
    call("where", op(">", kv, q), op(">", Q_LEN, C(3)), C(False)),
    call("where", op(">", kv, q), C(False), op(">", Q_LEN, C(3))),
    ir.And((call("where", op(">", kv, q), op(">", Q_LEN, C(3)), C(False)), op(">=", q, C(1)))),
])
@pytest.mark.parametrize("cute", [False, True], ids=["torch", "cute"])
def test_scalar_and_mixed_expressions_lower_correctly(mask, cute):
    got = lowered_mask(spec(mask), 2, 2, 24, 37, cute=cute)
    assert got.dtype == torch.bool
    assert torch.equal(got, dense_mask(spec(mask), 2, 2, 24, 37))


# Random integer expressions: precedence, floor division and modulo signs, scalar/tensor mixes.
_INT_LEAVES = st.sampled_from([b, h, q, kv, B, H, Q_LEN, KV_LEN] + [C(i) for i in range(-5, 6)])
_DIVISORS = st.sampled_from([C(3), C(-2), C(7), H, KV_LEN])


def _int_exprs():
    def extend(children):
        return st.one_of(
            st.builds(op, st.sampled_from(["+", "-", "*"]), children, children),
            st.builds(op, st.sampled_from(["//", "%"]), children, _DIVISORS),
            st.builds(lambda x: call("abs", x), children),
            st.builds(lambda x: ir.Unary("neg", x), children),
            st.builds(lambda x, y: call("min", x, y), children, children),
            st.builds(lambda x, y: call("max", x, y), children, children),
            st.builds(lambda x, lo, hi: call("clamp", x, lo, hi), children, children, children),
            st.builds(lambda x: call("floor", op("/", x, C(3))), children),
            st.builds(lambda c, x, y: call("where", op("<", c, C(2)), x, y),
                      children, children, children),
        )
    return st.recursive(_INT_LEAVES, extend, max_leaves=6)


def _masks():
    compare = st.builds(op, st.sampled_from(ir.COMPARE_OPS), _int_exprs(), _int_exprs())
    return st.recursive(compare, lambda children: st.one_of(
        st.builds(lambda xs: ir.And(tuple(xs)), st.lists(children, min_size=2, max_size=3)),
        st.builds(lambda xs: ir.Or(tuple(xs)), st.lists(children, min_size=2, max_size=3)),
        st.builds(lambda x: ir.Unary("not", x), children)), max_leaves=3)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_masks(), st.booleans())
def test_random_masks_match_the_reference(mask, cute):
    assert torch.equal(lowered_mask(spec(mask), 2, 3, 7, 9, cute=cute),
                       dense_mask(spec(mask), 2, 3, 7, 9))


# Found by mutation testing (docs/testing.md): each case below failed a one-line bug that the
# random masks above missed on most seeds.
@pytest.mark.parametrize("mask", [
    # floor division and modulo of negative dividends and by negative divisors, as Python
    # rounds them: `(kv - q) // 4 == -1` has 58 visible pairs at 17 x 23, truncation gives 46
    op("==", op("//", op("-", kv, q), C(4)), C(-1)),
    op("==", op("//", op("-", q, kv), C(-3)), C(-2)),
    op("==", op("%", op("-", kv, q), C(5)), C(3)),
    op("==", op("%", op("-", q, kv), C(-4)), C(-1)),
    op(">", op("//", op("-", KV_LEN, q), op("-", Q_LEN, KV_LEN)), op("//", kv, C(-5))),
    op("==", op("%", op("-", Q_LEN, KV_LEN), C(7)), op("%", kv, C(7))),
    # nested subtraction and division: the right operand keeps its parentheses
    op(">=", op("-", q, op("-", kv, C(4))), C(2)),
    op("<", op("-", op("-", q, kv), op("-", C(3), q)), C(0)),
    op("==", op("//", op("//", q, C(2)), op("//", C(7), C(2))), op("//", kv, C(3))),
    op("<", op("/", q, op("/", op("+", kv, C(1)), C(4))), C(2.5)),
    op(">", op("-", Q_LEN, op("-", KV_LEN, C(30))), q),
    op("<", op("/", kv, op("/", KV_LEN, C(4))), op("-", C(3.0), op("-", C(1.5), C(0.5)))),
])
@pytest.mark.parametrize("cute", [False, True], ids=["torch", "cute"])
def test_floor_division_modulo_and_nesting_lower_like_the_reference(mask, cute):
    assert torch.equal(lowered_mask(spec(mask), 1, 1, 17, 23, cute=cute),
                       dense_mask(spec(mask), 1, 1, 17, 23))


@pytest.mark.parametrize("mask", [
    # expressions of sizes only are Python numbers in the lowered code: each operator there
    # has its own Python form (`or`, math.exp), separate from the tensor one
    op("<", op("/", q, C(30)), call("sigmoid", op("/", Q_LEN, C(10)))),
    op(">", op("/", kv, C(40)), call("sigmoid", op("-", C(0), op("/", KV_LEN, C(10))))),
    call("where", ir.Or((op(">", Q_LEN, C(4)), op(">", KV_LEN, C(100)))), op(">=", q, kv),
         op("<=", q, kv)),
    call("where", ir.And((op(">", Q_LEN, C(4)), op(">", KV_LEN, C(100)))), op(">=", q, kv),
         op("<=", q, kv)),
    call("where", ir.Unary("not", ir.Or((op("<", Q_LEN, C(4)), op(">", KV_LEN, C(100))))),
         op(">=", q, kv), op("<=", q, kv)),
    call("where", ir.Unary("not", op(">", Q_LEN, C(4))), op(">=", q, kv), op("<=", q, kv)),
    ir.Or((op("==", op("//", op("-", Q_LEN, KV_LEN), C(5)), C(-3)), op("<", q, C(0)))),
])
@pytest.mark.parametrize("cute", [False, True], ids=["torch", "cute"])
def test_size_only_conditions_lower_like_the_reference(mask, cute):
    # Q_LEN = 24, KV_LEN = 37: Q_LEN > 4 holds and KV_LEN > 100 does not
    assert torch.equal(lowered_mask(spec(mask), 1, 1, 24, 37, cute=cute),
                       dense_mask(spec(mask), 1, 1, 24, 37))



@pytest.mark.parametrize("fn, arg", [
    ("log", op("-", Q_LEN, C(100))), ("log", op("-", Q_LEN, C(24))), ("log2", op("-", C(0), H)),
    ("log1p", op("-", C(-1), Q_LEN)), ("log1p", C(-1)), ("sqrt", op("-", H, KV_LEN)),
    ("exp", op("*", Q_LEN, C(100))), ("exp2", op("*", KV_LEN, C(100))),
    ("sigmoid", op("*", Q_LEN, C(-100))), ("sin", op("*", C(float("inf")), Q_LEN)),
    ("cos", op("*", C(float("-inf")), Q_LEN)), ("exp", op("*", C(float("-inf")), H)),
])
@pytest.mark.parametrize("cute", [False, True], ids=["torch", "cute"])
def test_float_functions_of_sizes_outside_their_domain_are_nan_or_infinite(fn, arg, cute):
    # Python's math raises for log(-76), sqrt(-35), exp(2400), sin(inf), where torch (the
    # reference, and the kernels for tensors) gives NaN or an infinity (found by the generators
    # of flexspec.testing.definitions)
    for mask in (op("<", q, call(fn, arg)), op(">=", q, call(fn, arg)),
                 ir.Or((op("!=", call(fn, arg), C(0.5)), op("<", kv, C(3))))):
        assert torch.equal(lowered_mask(spec(mask), 1, 2, 24, 37, cute=cute),
                           dense_mask(spec(mask), 1, 2, 24, 37)), ir.to_text(mask)

def test_a_score_of_sizes_only_matches_the_reference():
    # sigmoid(Q_LEN / 10) at Q_LEN = 24 is 0.917; a flipped sign gives 0.083
    score = op("+", SCORE, call("where", ir.Or((op(">", Q_LEN, C(4)), op(">", KV_LEN, C(100)))),
                                call("sigmoid", op("/", Q_LEN, C(10))), C(-1.0)))
    _, score_mod = lower(spec(score=score)).make_mods(sizes(1, 1, 24, 37), {})
    index = torch.tensor(0, dtype=torch.int32)
    got = score_mod(torch.tensor(0.5), index, index, index, index)
    assert got.item() == pytest.approx(0.5 + 1 / (1 + math.exp(-2.4)), rel=1e-6)


@pytest.mark.parametrize("score", [
    # min, max, clamp, abs and sign of tensors, of a tensor and a size, of sizes only
    op("+", SCORE, call("min", q, op("-", kv, C(3)))),
    op("+", SCORE, call("max", op("/", q, C(2)), KV_LEN)),
    op("-", SCORE, call("min", Q_LEN, op("*", C(0.5), kv))),
    op("+", SCORE, call("max", C(4), kv)),
    op("+", SCORE, call("clamp", op("-", q, kv), C(-3), C(4))),
    op("+", SCORE, call("clamp", q, kv, op("-", KV_LEN, C(20)))),
    op("+", SCORE, call("clamp", op("-", Q_LEN, C(10)), C(0), kv)),
    op("+", SCORE, call("clamp", C(5), q, op("+", kv, C(2)))),
    op("+", SCORE, op("*", call("abs", op("-", q, kv)), call("sign", op("-", q, op("/", kv, C(2)))))),
    op("+", SCORE, op("*", call("sign", op("-", kv, q)), call("abs", op("-", Q_LEN, KV_LEN)))),
    # an int score and a score that does not read the logits become floats
    op("-", q, kv),
    op("*", call("exp2", op("/", kv, C(-8))), op("//", q, C(3))),
    C(2.5),
    op("*", Q_LEN, C(2)),
    # float math of int tensors; where with a size condition and one tensor branch
    op("+", SCORE, op("*", call("log1p", kv), call("sqrt", op("+", q, C(1))))),
    op("+", SCORE, call("where", op(">", Q_LEN, C(10)), call("tanh", op("/", q, C(7))), C(-1.0))),
    op("+", SCORE, call("where", op("<", Q_LEN, C(10)), C(2), op("%", kv, C(3)))),
    op("+", SCORE, call("where", op("<", q, kv), op("/", SCORE, C(2)), call("floor", op("/", kv, C(3))))),
    softcap(20.0, ALIBI),
    # an int score that reads the logits (torch.where of ints is an int tensor)
    call("where", op(">", SCORE, C(0.0)), C(1), C(0)),
    # a 0-d tensor read without an index; abs of tensors inside sign (a tensor in the cute form)
    op("+", SCORE, call("sign", lookup(TEMPERATURE))),
    op("*", SCORE, lookup(TEMPERATURE)),
    op("+", SCORE, call("sign", op("-", call("abs", op("-", q, kv)), C(2)))),
    op("+", SCORE, call("clamp", op("-", q, C(5)), op("-", kv, C(3)), op("+", kv, C(3)))),
    # where of two Python scalars (the cute form multiplies by the converted condition): ints,
    # floats, a size, an infinite branch
    op("+", SCORE, call("where", op(">", kv, q), C(4), C(0))),
    op("+", SCORE, call("where", op(">", q, kv), C(1.5), C(-2.5))),
    op("+", SCORE, call("where", op(">", kv, q), C(-2), KV_LEN)),
    op("+", SCORE, call("where", op(">=", kv, q), C(0.0), C(float("-inf")))),
    op("+", SCORE, call("where", op(">=", kv, q), C(float("inf")), C(2))),
    op("+", SCORE, call("where", op(">=", kv, q), C(2), C(float("-inf")))),
    op("+", SCORE, call("where", op(">", kv, q), op("-", KV_LEN, C(3)), op("-", Q_LEN, C(2)))),
])
@pytest.mark.parametrize("cute", [False, True], ids=["torch", "cute"])
def test_score_mods_match_the_reference(score, cute):
    # B, H, Q_LEN, KV_LEN = 2, 3, 24, 37: KV_LEN > Q_LEN > 10
    logits = torch.randn(2, 3, 24, 37, generator=torch.Generator().manual_seed(0))
    tensors = {"alibi_slopes(H)": builtin_tensor(SLOPES, {"H": 3}), "temperature": torch.tensor(-0.7)}
    needed = {k: v for k, v in tensors.items() if k in lower(spec(score=score)).tensor_names}
    got = lowered_scores(spec(score=score), logits, needed, cute=cute)
    expected = dense_scores(spec(score=score), logits.double(), needed)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, atol=1e-5), ir.to_text(score)


def test_a_score_takes_the_dtype_of_the_logits():
    # a float score that does not read the logits is converted like an int one
    logits = torch.zeros(1, 1, 5, 7, dtype=torch.float64)
    for score in (op("/", q, C(3)), op("-", q, kv), C(0.25)):
        got = lowered_scores(spec(score=score), logits)
        assert got.dtype == torch.float64, ir.to_text(score)
        expected = dense_scores(spec(score=score), logits)
        assert torch.allclose(got, expected, atol=1e-6), ir.to_text(score)


def test_lowering_errors_name_what_cannot_be_lowered():
    with pytest.raises(SpecError, match=r"^the mask 'q - kv' is not a boolean expression$"):
        lower(spec(op("-", q, kv)))
    with pytest.raises(SpecError, match=r"^the score 'q >= kv' is not numeric$"):
        lower(spec(score=CAUSAL))
    param = ir.Param("n", "int")
    with pytest.raises(SpecError, match=r"^cannot lower 'n' to FlexAttention$"):
        lower(spec(op("<", q, param)))
    with pytest.raises(SpecError, match=r"^cannot lower function 'nosuch' to FlexAttention$"):
        lower(spec(op("<", q, ir.Call("nosuch", (kv,)))))
    table = ir.Param("t", "tensor", (KV_LEN,))
    with pytest.raises(SpecError, match=r"^tensor parameter 't' has no value to lower$"):
        lower(spec(op("<", q, ir.Lookup(table, (kv,)))))


def test_missing_sizes_and_tensors_are_named():
    lowered = lower(spec(ir.And((CAUSAL_BR, DOCUMENT, PADDING))))
    with pytest.raises(SpecError, match=r"^no value was given for size Q_LEN, KV_LEN$"):
        lowered.make_mods({"B": 1, "H": 1}, {"doc_ids": doc_ids(1, 8), "lengths": torch.ones(1)})
    with pytest.raises(BindingError, match=r"^no value was given for tensor 'doc_ids', 'lengths'$"):
        lowered.make_mods(sizes(1, 1, 8, 8), {})


def test_tensor_identifiers_for_awkward_names():
    keys = ["3d", "_x_", "()", "lambda", "a-b", "a.b", "a b", "Xy_"]
    tensors = [ir.Tensor(key, (), dtype="int") for key in keys]
    mask = ir.And(tuple(op("<", q, lookup(t)) for t in tensors))
    lowered = lower(spec(mask))
    assert dict(lowered.tensor_names) == {"3d": "t_3d", "_x_": "x", "()": "tensor",
                                          "lambda": "lambda_", "a-b": "a_b", "a.b": "a_b_2",
                                          "a b": "a_b_3", "Xy_": "Xy"}
    values = {key: torch.tensor(i + 2) for i, key in enumerate(keys)}
    got = lowered_mask(spec(mask), 1, 1, 5, 5, values)
    assert torch.equal(got, dense_mask(spec(mask), 1, 1, 5, 5, values))


def test_tracebacks_show_the_generated_source():
    # the source is registered with linecache line by line, so inspect (and tracebacks) see it
    lowered = lower(spec(ir.And((CAUSAL, window(3)))))
    mask_mod, _ = lowered.make_mods(sizes(1, 1, 4, 4), {})
    assert inspect.getsource(mask_mod) == "".join(
        "    " + line for line in lowered.mask_source.splitlines(True))


def test_long_chains_go_one_term_per_line_past_the_line_limit():
    # the return line of `q >= kv & q - kv <= N & kv >= M` is at most 96 characters or split;
    # N and M of 1 to 17 digits cross the limit one character at a time
    lengths = set()
    for digits in range(2, 34):
        n, m = C(int("9" * (digits // 2))), C(int("7" * (digits - digits // 2)))
        mask = ir.And((CAUSAL, op("<=", op("-", q, kv), n), op(">=", kv, m)))
        lines = lower(spec(mask)).mask_source.splitlines()[2:]
        if len(lines) == 1:
            one = lines[0]
        else:
            terms = [line.strip().removeprefix("& ") for line in lines[1:-1]]
            one = "    return " + " & ".join(terms)
            assert len(one) > 96 and lines[0] == "    return (" and lines[-1] == "    )"
        assert (len(lines) == 1) == (len(one) <= 96), one
        lengths.add(len(one))
    assert {96, 97} <= lengths
    # an & chain inside a split | chain needs no parentheses: & binds tighter
    n = C(int("9" * 30))
    mask = ir.Or((ir.And((op("<", q, kv), op("<", kv, C(3)))), op("==", q, n), op("==", kv, n)))
    assert lower(spec(mask)).mask_source.splitlines()[3] == "        (q_idx < kv_idx) & (kv_idx < 3)"


@pytest.mark.parametrize("mask, expected", [
    # and/or/not of Python bools are Python's own words; & binds tighter than |
    (call("where", ir.And((op(">", Q_LEN, C(4)), ir.Unary("not", op("<", KV_LEN, C(3))))),
          CAUSAL, op("<=", q, kv)),
     "q_idx >= kv_idx if Q_LEN > 4 and not KV_LEN < 3 else q_idx <= kv_idx"),
    (ir.Or((ir.And((op("<", q, kv), op("<", kv, C(3)))), op("==", q, kv))),
     "(q_idx < kv_idx) & (kv_idx < 3) | (q_idx == kv_idx)"),
    (call("where", ir.Or((ir.And((op(">", Q_LEN, C(4)), op(">", KV_LEN, C(3)))),
                          op(">", B, C(2)))), CAUSAL, op("<=", q, kv)),
     "q_idx >= kv_idx if Q_LEN > 4 and KV_LEN > 3 or B > 2 else q_idx <= kv_idx"),
    (op("==", ir.Or((op("<", q, kv), op("<", kv, C(3)))), op("<", kv, C(5))),
     "(q_idx < kv_idx) | (kv_idx < 3) == (kv_idx < 5)"),
    (ir.And((op("<", q, C(float("inf"))), op(">", kv, C(float("-inf"))))),
     "(q_idx < inf) & (kv_idx > -inf)"),
])
def test_parentheses_only_where_python_needs_them(mask, expected):
    assert lower(spec(mask)).mask_source.splitlines()[-1] == "    return " + expected
    assert torch.equal(lowered_mask(spec(mask), 3, 1, 6, 7), dense_mask(spec(mask), 3, 1, 6, 7))


def test_the_cute_form_has_no_minimum_maximum_clamp_abs_or_sign():
    """FLASH's form (CuTeDSL rejected torch.maximum): the same functions through where."""
    mask = op("<", call("abs", op("-", q, kv)), call("clamp", kv, C(5), op("-", KV_LEN, C(3))))
    score = op("+", SCORE, op("*", call("sign", op("-", q, kv)),
                              call("max", call("min", q, kv), C(2.5))))
    lowered = lower(spec(mask, score), dialect="cute")
    text = lowered.mask_source + lowered.score_source
    for name in ("torch.abs", "torch.clamp", "torch.minimum", "torch.maximum", "torch.sign"):
        assert name not in text
    assert "torch.where" in lowered.score_source


@pytest.mark.parametrize("fn, bucket", [("floor", -1), ("floor", 2), ("ceil", -1), ("ceil", 0),
                                        ("ceil", 3)])
def test_the_cute_floor_and_ceil_round_like_the_reference(fn, bucket):
    """FLASH's floor and ceil (a truncation corrected by one) at negative, positive and exact
    quotients: `fn((kv - q) / 4) == bucket` picks one band of distances."""
    mask = op("==", call(fn, op("/", op("-", kv, q), C(4))), C(bucket))
    expected = dense_mask(spec(mask), 1, 1, 19, 23)
    assert expected.any()
    assert torch.equal(lowered_mask(spec(mask), 1, 1, 19, 23, cute=True), expected)


# --- attention against the reference -------------------------------------------------------


def qkv(batch, heads, q_len, kv_len, dim=16, kv_heads=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    return (torch.randn(batch, heads, q_len, dim, generator=gen),
            torch.randn(batch, kv_heads, kv_len, dim, generator=gen),
            torch.randn(batch, kv_heads, kv_len, dim, generator=gen))


def flex(lowered, q_, k_, v_, tensors, attention=flex_attention):
    """FlexAttention with the lowered mods and a BlockMask built from the mask_mod."""
    batch, heads, q_len, kv_len = q_.shape[0], q_.shape[1], q_.shape[2], k_.shape[2]
    mask_mod, score_mod = lowered.make_mods(sizes(batch, heads, q_len, kv_len), tensors)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, batch, heads, q_len, kv_len, device=q_.device)
    return attention(q_, k_, v_, score_mod=score_mod, block_mask=block_mask,
                     enable_gqa=heads != k_.shape[1])


CASES = {
    "causal+alibi+softcap": (spec(CAUSAL, softcap(20.0, ALIBI)), (1, 4, 200, 200, None)),
    "document+bias, Q_LEN < KV_LEN": (
        spec(ir.And((CAUSAL_BR, op("==", lookup(DOC_IDS, b, op("+", q, op("-", KV_LEN, Q_LEN))),
                                  lookup(DOC_IDS, b, kv)))),
             op("+", SCORE, lookup(BIAS, h))),
        (2, 2, 100, 300, None)),
    "gqa, head-dependent": (spec(DILATED), (1, 4, 150, 150, 2)),
    "padding: fully masked rows": (spec(PADDING), (2, 2, 130, 130, None)),
    "score only": (spec(score=op("-", SCORE, op("*", C(0.05), call("abs", op("-", q, kv))))),
                   (1, 2, 100, 230, None)),
}


@pytest.mark.parametrize("cute", [False, True], ids=["torch", "cute"])
@pytest.mark.parametrize("name", list(CASES))
def test_eager_flex_attention_matches_the_reference(name, cute):
    spec_, (batch, heads, q_len, kv_len, kv_heads) = CASES[name]
    q_, k_, v_ = qkv(batch, heads, q_len, kv_len, kv_heads=kv_heads)
    tensors = {"alibi_slopes(H)": builtin_tensor(SLOPES, {"H": heads}),
               "doc_ids": doc_ids(batch, kv_len, seed=1),
               "bias": torch.linspace(-1.0, 1.0, heads),
               "lengths": torch.tensor([130, 77][:batch])}
    needed = {key: value for key, value in tensors.items() if key in lower(spec_).tensor_names}
    got = flex(lower(spec_, dialect=_dialect(cute)), q_, k_, v_, needed)
    expected = reference_attention(spec_, q_, k_, v_, tensors=needed)
    assert not got.isnan().any()
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    if name.startswith("padding"):
        assert (got[1, :, 77:] == 0).all()


# --- compilation ---------------------------------------------------------------------------

DOC_ALIBI = spec(ir.And((CAUSAL, DOCUMENT)), softcap(30.0, ALIBI))


def compiled_frames(backend, lowereds, device="cpu"):
    """Run torch.compile(flex_attention) once per Lowered, each time with fresh doc_ids, check
    each result against the reference, and return how many frames dynamo compiled."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(flex_attention, backend=counter)
    q_, k_, v_ = (x.to(device) for x in qkv(2, 2, 128, 128))
    slopes = builtin_tensor(SLOPES, {"H": 2}, device)
    try:
        for seed, lowered in enumerate(lowereds):
            tensors = {"doc_ids": doc_ids(2, 128, seed=seed).to(device), "alibi_slopes(H)": slopes}
            got = flex(lowered, q_, k_, v_, tensors, attention=compiled)
            expected = reference_attention(DOC_ALIBI, q_, k_, v_, tensors=tensors)
            assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
        return counter.frame_count
    finally:
        torch._dynamo.reset()


def test_fresh_tensors_do_not_recompile():
    # Dynamo's guards alone decide whether a call recompiles, so the cheap "eager" backend
    # measures what inductor would do (test_compiled_flex_attention_with_inductor checks it).
    assert compiled_frames("eager", [lower(DOC_ALIBI)] * 4) == 1
    # The control: the same text exec'd anew gives new code objects, and each one recompiles.
    # This is why a Lowered compiles its source once and make_mods only makes closures.
    assert compiled_frames("eager", [lower.__wrapped__(DOC_ALIBI) for _ in range(3)]) == 3


@pytest.mark.slow
def test_compiled_flex_attention_with_inductor():
    assert compiled_frames("inductor", [lower(DOC_ALIBI)] * 3) == 1


# Every lowering construct at once, for the compiled kernels (inductor on CPU and on CUDA).
EVERYTHING = spec(
    ir.And((CAUSAL_BR, DOCUMENT, ir.Or((
        window(40),
        op("==", op("%", kv, C(16)), C(0)),
        op(">", call("floor", op("/", q, C(3.0))), call("max", kv, op("//", KV_LEN, C(2)))),
        op("<", call("where", op(">", Q_LEN, C(10)), C(1), call("sign", kv)), C(0)),
        # functions of sizes are conditional Python expressions (torch's NaN and infinities)
        op("<", kv, op("*", call("sqrt", KV_LEN), call("log", op("-", Q_LEN, C(5))))))))),
    op("+", softcap(30.0, ALIBI), op("*", C(0.01), call("clamp", op("-", q, kv), C(-5),
                                                        call("min", C(7), H)))))


def everything_runs(device):
    lowered = lower(EVERYTHING)
    compiled = torch.compile(flex_attention)
    q_, k_, v_ = (x.to(device) for x in qkv(2, 2, 100, 230))
    tensors = {"doc_ids": doc_ids(2, 230, seed=3).to(device),
               "alibi_slopes(H)": builtin_tensor(SLOPES, {"H": 2}, device)}
    got = flex(lowered, q_, k_, v_, tensors, attention=compiled)
    expected = reference_attention(EVERYTHING, q_, k_, v_, tensors=tensors)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


@pytest.mark.slow
def test_every_construct_compiles_with_inductor():
    everything_runs("cpu")


@pytest.mark.gpu
def test_every_construct_compiles_on_cuda():
    everything_runs("cuda")
    assert compiled_frames("inductor", [lower(DOC_ALIBI)] * 3, device="cuda") == 1


def test_every_function_has_a_lowering_in_every_dialect():
    """A function the operator table leaves to the lowering (no tensor or no scalar form) has
    a special form by name, and a dialect replaces only functions that exist: a renamed
    function cannot silently lose its lowering."""
    from flexspec.ir.ops import FUNCTIONS
    from flexspec.kernels.lower import DIALECTS, SPECIAL_FORMS
    for name, fn in FUNCTIONS.items():
        if fn.tensor_form is None or fn.scalar_form is None:
            assert name in SPECIAL_FORMS, name
    assert set(SPECIAL_FORMS) <= set(FUNCTIONS)
    for dialect in DIALECTS.values():
        assert set(dialect.functions) <= set(FUNCTIONS), dialect.name
    with pytest.raises(SpecError, match="unknown dialect of the lowering 'triton'"):
        lower(spec(CAUSAL), dialect="triton")
