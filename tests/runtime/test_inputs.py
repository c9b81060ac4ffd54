"""runtime.inputs: the checks of q, k, v, the scale and every binding (errors that name the binding
and its expected shape), the tensor values a spec reads, the identity that keys the caches, and
the range checks of tensor lookups.

Lookups that interval analysis cannot prove in range are evaluated exactly at any length (in
chunks of bounded memory), and refused with the fix where that would take too long. Red-team
item 13: above 2^24 index points the check became a warning, then inductor's "index out of
bounds" error. No kernel runs here: every call below fails its checks or runs on the reference."""

from __future__ import annotations

import math
import re

import pytest
import torch

import flexspec
from flexspec import BindingError, ir, limits
from flexspec.lang.library import load_text
from flexspec.runtime.inputs import (Tensors, _index_range, as_device, check_qkv, check_scale,
                                     contiguous, given_sizes, identity, meta)
from flexspec.testing import Shape, document_ids

LIBRARY = ("score pick(bias: float[4], ids: int[KV_LEN]) = score + bias[ids[q]]\n"
           "score safe(bias: float[4], ids: int[KV_LEN]) = score + bias[clamp(ids[q], 0, 3)]\n"
           "spec s = causal + pick\nspec clamped = causal + safe\n")


def _call(name: str, ids: torch.Tensor):
    attn = flexspec.compile(flexspec.loads(LIBRARY)[name], backend="reference")
    q = torch.randn(1, 1, len(ids), 8, generator=torch.Generator().manual_seed(0))
    return attn(q, q, q, bias=torch.arange(4.0), ids=ids)


def test_an_index_beyond_one_chunk_is_still_checked_exactly(monkeypatch):
    monkeypatch.setattr(limits, "EXACT_INDEX_CHECK_LIMIT", 5)  # 64 points: 13 chunks
    ids = torch.zeros(64, dtype=torch.long)
    ids[50] = 9  # in a late chunk
    with pytest.raises(flexspec.BindingError, match=r"reaches 0\.\.9 for Q_LEN=64.* 4 entries"):
        _call("s", ids)
    ids[50] = 3
    out = _call("s", ids)
    monkeypatch.undo()
    assert torch.equal(out, _call("s", ids))


@pytest.mark.parametrize("limit, dims, parts", [(3, [1, 1, 13, 1], 5), (1, [1, 1, 13, 1], 13),
                                               (6, [1, 1, 13, 2], 5), (4, [2, 1, 1, 7], 4),
                                               (100, [1, 1, 13, 1], 1)])
def test_the_range_of_an_index_is_evaluated_in_slices_of_bounded_size(monkeypatch, limit, dims,
                                                                      parts):
    from flexspec.runtime import inputs

    sizes = []
    real = inputs.evaluate

    def evaluate(index, grid, values):
        sizes.append(math.prod(torch.broadcast_shapes(*(t.shape for t in grid.values()
                                                        if isinstance(t, torch.Tensor)))))
        return real(index, grid, values)

    monkeypatch.setattr(limits, "EXACT_INDEX_CHECK_LIMIT", limit)
    monkeypatch.setattr(inputs, "evaluate", evaluate)
    index = ir.Binary("+", ir.Binary("+", ir.Var("q"), ir.Var("kv")), ir.Var("b"))
    assert _index_range(index, dims, {}, "cpu") == (0, (dims[0] - 1) + (dims[2] - 1)
                                                    + (dims[3] - 1))
    assert len(sizes) == parts and sum(sizes) == math.prod(dims)
    assert max(sizes) <= max(limit, math.prod(dims) // max(dims))


def test_too_many_points_to_check_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(limits, "MAX_INDEX_CHECK_POINTS", 32)
    with pytest.raises(flexspec.BindingError, match="^" + re.escape(
            "cannot check that 'bias' stays in range in dimension 0: its index ids[q] is not "
            "bounded by the sizes, and checking it means evaluating it at 64 points for "
            "Q_LEN=64, KV_LEN=64 (flexspec evaluates at most 32); clamp the index into the "
            "tensor, as in clamp(ids[q], 0, 3), so it is proven in range, or use shorter "
            "sequences") + "$"):
        _call("s", torch.zeros(64, dtype=torch.long))
    # the fix works: a clamped index is proven in range and needs no evaluation
    assert _call("clamped", torch.full((64,), 9)).isfinite().all()


@pytest.mark.parametrize("limit", [1, 3, 7, 64, 10**6])
def test_chunked_range_equals_the_whole_range(monkeypatch, limit):
    monkeypatch.setattr(limits, "EXACT_INDEX_CHECK_LIMIT", limit)
    spec = flexspec.loads(LIBRARY)["s"].ir
    lookup = next(n for n in flexspec.ir.walk(spec.score) if isinstance(n, flexspec.ir.Lookup))
    index = lookup.index[0]
    ids = torch.randint(-50, 50, (13,), generator=torch.Generator().manual_seed(1))
    values = {flexspec.ir.tensor_key(t): ids for t in spec.tensors() if t.name == "ids"}
    assert _index_range(index, [1, 1, 13, 1], values, "cpu") == (int(ids.min()), int(ids.max()))


@pytest.mark.parametrize("text, backend", [("causal & window(3)", "auto"), ("causal", "auto"),
                                           ("causal + alibi", "reference")])
def test_meta_tensors_are_a_binding_error(text, backend):
    """Red-team item 9: all tensors on meta gave torch's nonzero/Tensor.item() errors."""
    q = torch.randn(1, 2, 200, 8, device="meta")
    with pytest.raises(flexspec.BindingError, match="meta device, which holds shapes but no "
                                                    "values"):
        flexspec.compile(text, backend=backend)(q, q, q)


# The spec and shapes of test_runtime.py's compiled calls; no call here gets past the checks.
SPEC = "document & ~causal + alibi + softcap(20.0)"
SHAPE = Shape(B=2, Hq=4, Hkv=2, Q_LEN=140, KV_LEN=150, D=16)


def doc_ids(bounds=((40, 90), (20,)), length=SHAPE.KV_LEN):
    return document_ids(bounds, length)


@pytest.fixture(scope="module")
def attn():
    return flexspec.compile(SPEC)


@pytest.fixture(scope="module")
def qkv():
    return SHAPE.qkv(seed=0)


# --- bindings ----------------------------------------------------------------------------


def binding_error(attn, qkv, **bindings) -> str:
    with pytest.raises(BindingError) as info:
        attn(*qkv, **bindings)
    return str(info.value)


def test_missing_binding(attn, qkv):
    message = binding_error(attn, qkv)
    assert "missing binding 'doc_ids'" in message
    assert "int[B, KV_LEN] = [2, 150]" in message


def test_unexpected_binding_suggests_the_right_name(attn, qkv):
    message = binding_error(attn, qkv, doc_ids=doc_ids(), doc_id=doc_ids())
    assert "unexpected binding 'doc_id'" in message
    assert "Did you mean 'doc_ids'?" in message


def test_binding_for_a_spec_without_tensors(qkv):
    message = binding_error(flexspec.compile("causal"), qkv, doc_ids=doc_ids())
    assert message == "unexpected binding 'doc_ids'. This spec takes no tensors"


def test_an_unexpected_binding_lists_what_the_spec_takes(qkv):
    attn = flexspec.compile("causal & document + biased", library=BINDINGS)
    message = binding_error(attn, qkv, doc_ids=doc_ids(), u=torch.zeros(150), zz=1)
    assert message == "unexpected binding 'zz'. This spec takes doc_ids, u"


@pytest.mark.parametrize("value, expected", [
    (torch.zeros(2, 149, dtype=torch.int64), "its dimension 1 should be 150"),
    (torch.zeros(3, 150, dtype=torch.int64), "its dimension 0 should be 2"),
    (torch.zeros(2, 1, 150, dtype=torch.int64), "has shape [2, 1, 150]"),
    # the shape as given, not with the leading dimension flexspec adds for broadcasting
    (torch.zeros(149, dtype=torch.int64), "has shape [149], expected int[B, KV_LEN] = [2, 150] "
                                          "(its dimension 0 should be 150)"),
])
def test_misshaped_binding(attn, qkv, value, expected):
    message = binding_error(attn, qkv, doc_ids=value)
    assert "'doc_ids'" in message and expected in message
    assert "int[B, KV_LEN] = [2, 150]" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_binding_with_the_wrong_dtype(attn, qkv, dtype):
    message = binding_error(attn, qkv, doc_ids=torch.zeros(2, 150, dtype=dtype))
    assert "'doc_ids'" in message and str(dtype) in message
    assert "int[B, KV_LEN] = [2, 150]" in message


def test_binding_that_is_not_a_tensor(attn, qkv):
    message = binding_error(attn, qkv, doc_ids=[[0] * 150] * 2)
    assert message == ("binding 'doc_ids' must be a torch.Tensor of int[B, KV_LEN] = [2, 150], "
                       "got list")


def test_binding_on_another_device(attn, qkv):
    # The meta device is always there: no second accelerator needed.
    message = binding_error(attn, qkv, doc_ids=doc_ids().to("meta"))
    assert "'doc_ids' is on meta" in message and "q is on cpu" in message


@pytest.mark.gpu
def test_binding_on_cuda_for_cpu_inputs(attn, qkv):
    message = binding_error(attn, qkv, doc_ids=doc_ids().to("cuda"))
    assert "'doc_ids' is on cuda" in message


def test_float_binding_of_the_wrong_shape_names_its_shape(qkv):
    attn = flexspec.compile("causal + head_bias")
    message = binding_error(attn, qkv, bias=torch.zeros(3))
    assert "'bias'" in message and "float[H] = [4]" in message


def test_document_mask_with_more_queries_than_keys():
    attn = flexspec.compile("causal & document")
    q = torch.randn(1, 2, 20, 8)
    k = torch.randn(1, 2, 12, 8)
    with pytest.raises(BindingError, match=r"'doc_ids' is indexed by q .* 0\.\.19 .*12 entries"):
        attn(q, k, k, doc_ids=torch.zeros(1, 12, dtype=torch.int64))
    with pytest.raises(BindingError, match="'doc_ids' is indexed by q"):
        attn.block_mask(20, 12, doc_ids=torch.zeros(12, dtype=torch.int64))



@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_lookup_one_past_the_end_is_refused_and_the_last_entry_is_not(backend):
    library = load_text("mask ahead(t: float[KV_LEN]) = t[q + 1] > 0.0\n")
    attn = flexspec.compile("ahead(t)", library=library, backend=backend)
    t = torch.randn(16)
    q = torch.randn(1, 1, 16, 8)
    # Q_LEN = KV_LEN = 16: row 15 reads t[16], one past the end (found by mutation testing)
    with pytest.raises(BindingError, match=r"'t' is indexed by q \+ 1"):
        attn(q, q, q, t=t)
    # Q_LEN = 15: row 14 reads t[15], the last entry
    short = q[:, :, :15]
    torch.testing.assert_close(attn(short, q, q, t=t), attn.reference(short, q, q, t=t))

# --- q, k, v ---------------------------------------------------------------------------


@pytest.mark.parametrize("q_shape, k_shape, dtypes, expected", [
    ((2, 10, 8), (1, 2, 10, 8), None, "q must have 4 dimensions"),
    ((1, 2, 10, 8), (2, 10, 8), None, "k must have 4 dimensions"),
    ((1, 3, 10, 8), (1, 2, 10, 8), None, "3 query heads must be a multiple of 2"),
    ((1, 2, 10, 8), (1, 2, 10, 8), (torch.float32, torch.float16), "must share one dtype"),
    ((1, 2, 10, 8), (1, 2, 10, 8), (torch.int64, torch.int64), "has dtype torch.int64"),
    ((2, 2, 10, 8), (1, 2, 10, 8), None, "batch sizes differ"),
    ((1, 2, 10, 8), (1, 2, 10, 4), None, "same head dimension"),
    ((1, 2, 0, 8), (1, 2, 10, 8), None, "at least one position"),
])
def test_qkv_validation(q_shape, k_shape, dtypes, expected):
    q_dtype, k_dtype = dtypes or (torch.float32, torch.float32)
    q = torch.zeros(q_shape, dtype=q_dtype)
    k = torch.zeros(k_shape, dtype=k_dtype)
    with pytest.raises(BindingError, match=expected):
        flexspec.compile("causal")(q, k, k)


def test_q_that_is_not_a_tensor():
    k = torch.zeros(1, 2, 10, 8)
    with pytest.raises(BindingError, match="q must be a torch.Tensor"):
        flexspec.compile("causal")(k.tolist(), k, k)


def test_k_and_v_must_agree():
    q = torch.zeros(1, 2, 10, 8)
    with pytest.raises(BindingError, match="must have the same heads and length"):
        flexspec.compile("causal")(q, q, torch.zeros(1, 2, 11, 8))



def test_a_head_dimension_of_zero_is_a_binding_error():
    q = torch.randn(1, 2, 200, 0)
    with pytest.raises(flexspec.BindingError, match="head dimension must be at least 1"):
        flexspec.compile("causal & window(3)")(q, q, q)


def test_float64_inputs_say_which_backend_runs_them(attn):
    """Red-team finding: the message listed float64 among the dtypes to use while refusing it."""
    q = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(flexspec.BindingError, match="only the reference backend runs") as error:
        attn(q, q, q, doc_ids=torch.zeros(1, 8, dtype=torch.int64))
    assert "the kernels take float32, float16 or bfloat16" in str(error.value)
    assert attn.reference(q, q, q, doc_ids=torch.zeros(1, 8, dtype=torch.int64)).dtype \
        == torch.float64


# --- q, k, v, the scale and the sizes, message by message -------------------------------------


def Z(*shape, **options):
    return torch.zeros(shape, **options)


F64 = torch.float64
QKV_ERRORS = [
    ((Z(1, 2, 10, 8).tolist(), Z(1, 2, 10, 8), Z(1, 2, 10, 8)), False,
     "q must be a torch.Tensor, got list"),
    ((Z(1, 2, 10, 8), "k", Z(1, 2, 10, 8)), False, "k must be a torch.Tensor, got str"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), None), False, "v must be a torch.Tensor, got NoneType"),
    ((Z(2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 8)), False,
     "q must have 4 dimensions (B, H, S, D), got shape [2, 10, 8]"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10)), False,
     "v must have 4 dimensions (B, H, S, D), got shape [1, 2, 10]"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8, dtype=F64), Z(1, 2, 10, 8)), False,
     "k has dtype torch.float64, which only the reference backend runs (compile(..., "
     "backend='reference'), or .reference(q, k, v)); the kernels take float32, float16 or "
     "bfloat16"),
    ((Z(1, 2, 10, 8, dtype=torch.int64),) * 3, False,
     "q has dtype torch.int64; use float32, float16, bfloat16"),
    ((Z(1, 2, 10, 8, dtype=torch.int64),) * 3, True,
     "q has dtype torch.int64; use float32, float16, bfloat16, float64"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8, dtype=torch.float16), Z(1, 2, 10, 8)), False,
     "q, k, v must share one dtype, got torch.float32, torch.float16, torch.float32"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 8, dtype=F64)), True,
     "q, k, v must share one dtype, got torch.float32, torch.float32, torch.float64"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 8, device="meta")), False,
     "q, k, v must be on one device, got cpu, cpu, meta"),
    ((Z(1, 2, 10, 8, device="meta"),) * 3, False,
     "q, k and v are on the meta device, which holds shapes but no values; flexspec reads "
     "values (block masks, checks of indices, tables), so run it on a real device (the "
     "output's shape is [B, Hq, Q_LEN, Dv])"),
    ((Z(2, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 8)), False, "batch sizes differ: q 2, k 1, v 1"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(2, 2, 10, 8)), False, "batch sizes differ: q 1, k 1, v 2"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 4), Z(1, 2, 10, 8)), False,
     "q and k must have the same head dimension, got 8 and 4"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 1, 10, 8)), False,
     "k [1, 2, 10, 8] and v [1, 1, 10, 8] must have the same heads and length"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 11, 8)), False,
     "k [1, 2, 10, 8] and v [1, 2, 11, 8] must have the same heads and length"),
    ((Z(1, 2, 10, 8), Z(1, 0, 10, 8), Z(1, 0, 10, 8)), False,
     "2 query heads must be a multiple of 0 key/value heads"),
    ((Z(1, 3, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 8)), False,
     "3 query heads must be a multiple of 2 key/value heads"),
    ((Z(1, 2, 0, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 8)), False,
     "q and k must have at least one position"),
    ((Z(1, 2, 10, 8), Z(1, 2, 0, 8), Z(1, 2, 0, 8)), False,
     "q and k must have at least one position"),
    ((Z(1, 2, 10, 0), Z(1, 2, 10, 0), Z(1, 2, 10, 8)), False,
     "the head dimension must be at least 1, got q/k 0 and v 8"),
    ((Z(1, 2, 10, 8), Z(1, 2, 10, 8), Z(1, 2, 10, 0)), False,
     "the head dimension must be at least 1, got q/k 8 and v 0"),
]


@pytest.mark.parametrize("args, allow_float64, message", QKV_ERRORS)
def test_each_fault_of_q_k_v_has_its_message(args, allow_float64, message):
    with pytest.raises(BindingError, match="^" + re.escape(message) + "$"):
        check_qkv(*args, allow_float64=allow_float64)


def test_float64_is_refused_unless_allowed():
    q = Z(1, 2, 10, 8, dtype=F64)
    with pytest.raises(BindingError, match="^q has dtype torch.float64, which only the reference"):
        check_qkv(q, q, q)


def test_the_sizes_of_a_call_are_read_off_q_and_k():
    q, k, v = Z(2, 4, 24, 8), Z(2, 2, 40, 8), Z(2, 2, 40, 12)
    assert check_qkv(q, k, v) == (2, 4, 24, 40)
    assert check_qkv(q, k, v).as_dict() == {"B": 2, "H": 4, "Q_LEN": 24, "KV_LEN": 40}
    assert check_qkv(q.double(), k.double(), v.double(), allow_float64=True) == (2, 4, 24, 40)
    for dtype in (torch.float16, torch.bfloat16):
        assert check_qkv(q.to(dtype), k.to(dtype), v.to(dtype)) == (2, 4, 24, 40)


@pytest.mark.parametrize("scale", [True, False, "1", float("inf"), -float("inf"), float("nan"),
                                   torch.tensor(0.5)])
def test_a_scale_must_be_a_finite_number(scale):
    with pytest.raises(BindingError, match="^" + re.escape(f"scale must be a finite number or "
                                                           f"None, got {scale!r}") + "$"):
        check_scale(scale)


@pytest.mark.parametrize("scale", [None, 0, 2, 0.125, -1.5])
def test_finite_scales_and_none_pass(scale):
    check_scale(scale)


@pytest.mark.parametrize("sizes, message", [
    ((0, 5, None, None), "Q_LEN must be a positive int, got 0"),
    ((5, -1, None, None), "KV_LEN must be a positive int, got -1"),
    ((5, 5, 0, None), "B must be a positive int, got 0"),
    ((5, 5, None, True), "H must be a positive int, got True"),
    ((5, 5, 1.5, 2), "B must be a positive int, got 1.5"),
    ((5, "5", 1, 2), "KV_LEN must be a positive int, got '5'"),
])
def test_given_sizes_must_be_positive_ints(sizes, message):
    with pytest.raises(BindingError, match="^" + re.escape(message) + "$"):
        given_sizes(*sizes)


def test_given_sizes_default_to_one_batch_row_and_head():
    assert given_sizes(3, 4, None, None) == (1, 1, 3, 4)
    assert given_sizes(3, 4, 2, 5) == (2, 5, 3, 4)
    assert given_sizes(1, 1, 1, 1) == (1, 1, 1, 1)


def test_a_device_is_named_as_tensors_report_it():
    assert as_device("cpu") == torch.device("cpu") and as_device(torch.device("cpu")).index is None
    assert as_device("meta") == torch.device("meta")
    with pytest.raises(BindingError, match=r"^cannot use device 'nope': .*nope$"):
        as_device("nope")


# --- identity and signatures ---------------------------------------------------------------


def test_only_a_cuda_device_is_captured_while_its_stream_captures(monkeypatch):
    from flexspec.runtime.inputs import capturing
    assert not capturing(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert capturing(torch.device("cuda")) and capturing(torch.device("cuda", 1))
    assert not capturing(torch.device("cpu")) and not capturing(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not capturing(torch.device("cuda"))


def test_the_identity_of_a_tensor_is_its_memory_layout_and_version():
    base = torch.arange(12).reshape(3, 4)
    assert identity(base) == identity(base) == identity(base.view(3, 4))
    assert identity(base) != identity(base.clone())           # other memory
    assert identity(base[0]) != identity(base[1])             # other offset
    assert identity(base[:2]) != identity(base[:1])           # other shape
    square = torch.zeros(3, 3)
    assert identity(square) != identity(square.t())           # other strides
    before = identity(base)
    base.add_(1)                                              # in place: a new version
    assert identity(base) != before
    assert identity(base) == identity(base)


def test_meta_is_what_guards_see_of_an_argument():
    t = torch.zeros(2, 3)
    assert meta(t) == meta(torch.ones(2, 3))
    others = [torch.zeros(3, 2), t.double(), t.to("meta"), torch.zeros(3, 2).t(),
              t.clone().requires_grad_()]
    assert all(meta(other) != meta(t) for other in others)
    assert meta(3) == meta(4) == (int,) and meta(3.0) == (float,) and meta(None) == (type(None),)


def test_contiguous_copies_only_strided_views():
    t = torch.arange(10)
    assert contiguous(t) is t
    strided = t[::2]
    copy = contiguous(strided)
    assert copy.is_contiguous() and torch.equal(copy, torch.tensor([0, 2, 4, 6, 8]))


# --- bindings and the tensors a spec reads -------------------------------------------------

BINDINGS = load_text("""
mask behind(t: float[KV_LEN]) = t[q - 1] > 0.0
mask fixed4(t: int[4, KV_LEN]) = t[0, kv] >= 0
mask flags(f: bool[KV_LEN]) = f[kv]
score biased(u: float[KV_LEN]) = score + u[kv]
spec doc_and_bias = causal & document + biased
""")


def test_a_lookup_before_the_first_entry_is_refused():
    attn = flexspec.compile("behind", library=BINDINGS, backend="reference")
    q = torch.zeros(1, 1, 16, 8)
    with pytest.raises(BindingError, match="^" + re.escape(
            "'t' is indexed by q - 1 in dimension 0, which reaches -1..14 for Q_LEN=16, "
            "KV_LEN=16, but that dimension has 16 entries") + "$"):
        attn(q, q, q, t=torch.ones(16))


def test_a_missing_leading_dimension_that_cannot_broadcast_is_named():
    attn = flexspec.compile("fixed4", library=BINDINGS, backend="reference")
    q = torch.zeros(1, 1, 16, 8)
    with pytest.raises(BindingError, match="^" + re.escape(
            "binding 't' has shape [16], expected int[4, KV_LEN] = [4, 16] (a leading dimension "
            "of size 4 is missing)") + "$"):
        attn(q, q, q, t=torch.zeros(16, dtype=torch.int64))
    attn(q, q, q, t=torch.zeros(4, 16, dtype=torch.int32))  # any integer dtype


@pytest.mark.parametrize("text, name, dtype, declared", [
    ("fixed4", "t", torch.float32, "int[4, KV_LEN] = [4, 16]"),
    ("fixed4", "t", torch.bool, "int[4, KV_LEN] = [4, 16]"),
    ("fixed4", "t", torch.complex64, "int[4, KV_LEN] = [4, 16]"),
    ("flags", "f", torch.int64, "bool[KV_LEN] = [16]"),
    ("behind", "t", torch.int64, "float[KV_LEN] = [16]"),
])
def test_a_binding_of_another_element_type_is_refused(text, name, dtype, declared):
    attn = flexspec.compile(text, library=BINDINGS, backend="reference")
    q = torch.zeros(1, 1, 16, 8)
    shape = (4, 16) if text == "fixed4" else (16,)
    with pytest.raises(BindingError, match="^" + re.escape(
            f"binding '{name}' has dtype {dtype}, but {declared.split('[')[0]} elements are "
            f"declared ({declared})") + "$"):
        attn(q, q, q, **{name: torch.zeros(shape, dtype=dtype)})


def test_a_block_mask_needs_only_the_bindings_of_the_mask():
    attn = flexspec.compile("doc_and_bias", library=BINDINGS)
    ids = torch.zeros(16, dtype=torch.int64)
    first = attn.block_mask(16, 16, doc_ids=ids)
    # the score's binding may be given, and is not checked there
    assert attn.block_mask(16, 16, doc_ids=ids, u=torch.zeros(3, dtype=torch.bool)) is first
    with pytest.raises(BindingError, match="^unexpected binding 'uu'. This spec takes doc_ids$"):
        attn.block_mask(16, 16, doc_ids=ids, uu=torch.zeros(16))
    with pytest.raises(BindingError, match="^" + re.escape(
            "missing binding 'doc_ids': int[B, KV_LEN] = [1, 16]; pass doc_ids=... to the "
            "call") + "$"):
        attn.block_mask(16, 16, u=torch.zeros(16))
    # a call needs both
    with pytest.raises(BindingError, match="^missing binding 'u': float"):
        attn.mods(q_len=16, kv_len=16, doc_ids=ids)


def test_a_block_mask_refuses_a_binding_named_like_a_builtin_tensor():
    # alibi_slopes is computed by flexspec, never passed: it is not a binding of the score
    attn = flexspec.compile("causal & document + alibi")
    with pytest.raises(BindingError, match="^unexpected binding 'alibi_slopes'"):
        attn.block_mask(16, 16, doc_ids=torch.zeros(16, dtype=torch.int64),
                        alibi_slopes=torch.ones(1))


def test_an_unused_learnable_table_is_made_once_per_shape_and_device():
    spec = flexspec.parse("causal + rel_bias(max_distance=2)").ir
    tensors = Tensors(spec)
    key = next(ir.tensor_key(t) for t in spec.tensors() if t.origin == "learnable")
    sizes = {"B": 1, "H": 2, "Q_LEN": 8, "KV_LEN": 8}
    first, _ = tensors.gather(sizes, {}, torch.device("cpu"))
    again, _ = tensors.gather(dict(sizes), {}, torch.device("cpu"))
    assert again[key] is first[key] and torch.equal(first[key], torch.zeros(2, 5))
    other, _ = tensors.gather({**sizes, "H": 3}, {}, torch.device("cpu"))
    assert other[key].shape == (3, 5)
    assert tensors.gather(sizes, {}, torch.device("cpu"))[0][key] is first[key]
    # given by the caller (a module's parameter) or by name, it is the caller's
    table = torch.randn(2, 5)
    assert tensors.gather(sizes, {}, torch.device("cpu"), {key: table})[0][key] is table
    by_name = tensors.gather(sizes, {"rel_bias_table": table}, torch.device("cpu"))[0][key]
    assert torch.equal(by_name, table)


@pytest.mark.parametrize("index, sizes, reach", [("q + b", dict(batch=9), "0..15"),
                                                 ("q + h", dict(heads=9), "0..15"),
                                                 ("kv + 1", {}, "1..8")])
def test_a_lookup_is_checked_over_every_batch_row_head_and_key(index, sizes, reach):
    # each index leaves the tensor only beyond b = 0, h = 0 or kv = 0; the longest axis (9
    # batch rows, 9 heads, 8 keys) is the one the check slices
    library = load_text(f"mask m(t: int[KV_LEN]) = t[{index}] >= 0\n")
    attn = flexspec.compile("m", library=library)
    with pytest.raises(BindingError, match="^" + re.escape(
            f"'t' is indexed by {index} in dimension 0, which reaches {reach} for Q_LEN=8, "
            "KV_LEN=8, but that dimension has 8 entries") + "$"):
        attn.block_mask(8, 8, t=torch.zeros(8, dtype=torch.int64), **sizes)


def test_a_mask_only_gather_keeps_the_spec_s_alignment():
    # the dense mask of an end-aligned spec places its last row on the last key
    for text, offset in (("causal", 0), ("causal_bottom_right", 2)):
        spec = flexspec.parse(text).ir
        _, gathered = Tensors(spec).gather({"B": 1, "H": 1, "Q_LEN": 3, "KV_LEN": 5}, {},
                                           torch.device("cpu"), mask_only=True)
        assert gathered.align == spec.align
        expected = torch.tensor([[kv <= q + offset for kv in range(5)] for q in range(3)])
        assert torch.equal(flexspec.compile(text).dense_mask(3, 5)[0, 0], expected)


def test_a_binding_s_batch_of_one_keeps_its_batch_index():
    # doc_ids[b, kv] reads row 0 of a broadcast [1, KV_LEN] binding, except at B = 1, where
    # the declared size is 1 too and the index stays b (FLASH could not compile the constant)
    spec = flexspec.parse("causal & document").ir
    ids = torch.zeros(1, 8, dtype=torch.int64)
    for batch, index in ((1, "doc_ids[b, "), (2, "doc_ids[0, ")):
        sizes = {"B": batch, "H": 1, "Q_LEN": 8, "KV_LEN": 8}
        _, specialized = Tensors(spec).gather(sizes, {"doc_ids": ids}, torch.device("cpu"))
        assert index in ir.to_text(specialized.mask)
