"""runtime.checks: the checks of q, k, v, the scale and the sizes a user gives, message by
message. No kernel runs here: every call below fails its checks."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import flexspec
from flexspec import BindingError
from flexspec.runtime.checks import as_device, check_qkv, checked_scale, given_sizes
from flexspec.testing import Shape


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


@pytest.fixture(scope="module")
def attn():
    return flexspec.compile(SPEC)


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
        checked_scale(scale)


@pytest.mark.parametrize("scale", [None, 0, 2, 0.125, -1.5])
def test_finite_scales_and_none_pass(scale):
    got = checked_scale(scale)
    assert got is None if scale is None else (type(got) is float and got == scale)


def test_numpy_scalars_are_numbers():
    """Red-team 2026-12-02, item 6: np.float32 and np.int64 scales were refused while
    np.float64 passed; all are numbers, and a call gives what the Python number gives."""
    numpy = pytest.importorskip("numpy")
    for scale in (numpy.float32(0.25), numpy.float64(0.25), numpy.int64(2), numpy.int32(2)):
        assert checked_scale(scale) == float(scale) and type(checked_scale(scale)) is float
    with pytest.raises(BindingError, match="scale must be a finite number"):
        checked_scale(numpy.float32("nan"))
    attn = flexspec.compile("causal + alibi", backend="reference")
    q, k, v = Shape(1, 2, 2, 8, 8, 4).qkv(seed=0)
    torch.testing.assert_close(attn(q, k, v, scale=numpy.float32(0.25)),
                               attn(q, k, v, scale=0.25))
    torch.testing.assert_close(attn(q, k, v, q_offset=numpy.int64(3)), attn(q, k, v, q_offset=3))


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


def test_inputs_of_the_wrong_type_are_type_errors_too():
    """torch users catch TypeError for an argument of the wrong type (first-hour review)."""
    attn = flexspec.compile("causal", backend="reference")
    q = torch.randn(1, 2, 8, 4)
    for bad in ([[1.0]], None, 3):
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            attn(bad, q, q)
    with pytest.raises(TypeError, match="q_offset must be an int"):
        attn(q, q, q, q_offset="3")
    with pytest.raises(flexspec.BindingError):  # still a flexspec error, and a ValueError
        attn([[1.0]], q, q)


def test_inputs_that_look_like_sequences_first_get_a_hint(monkeypatch):
    """A (B, S, H, D) tensor where (B, H, S, D) is read ran silently (first-hour review): where
    the heads do not divide, the error says how to pass the other layout; where a 'head'
    dimension is longer than any model's heads, a warning does."""
    from flexspec.runtime import notices
    monkeypatch.setattr(notices, "_warned", set())
    attn = flexspec.compile("causal", backend="reference")
    q = torch.randn(1, 9, 4, 8)   # (B, S=9, H=4, D) of a query
    k = torch.randn(1, 6, 2, 8)   # (B, S=6, Hkv=2, D) of keys
    with pytest.raises(BindingError, match=r"if they are \(B, S, H, D\), pass q.transpose\(1, 2\)"):
        attn(q, k, k)
    q = torch.randn(1, 300, 2, 4)
    with pytest.warns(UserWarning, match=r"k has shape \[1, 300, 2, 4\], read as \(B, H, S, D\)"):
        attn(q, q, q)
    with warnings.catch_warnings():  # a decoding step (one query, many heads) is not one
        warnings.simplefilter("error")
        attn(torch.randn(1, 32, 1, 4), torch.randn(1, 8, 20, 4), torch.randn(1, 8, 20, 4))


HINT = ("; q and k have more heads than positions: if they are (B, S, H, D), pass "
        "q.transpose(1, 2), k.transpose(1, 2) and v.transpose(1, 2)")


@pytest.mark.parametrize("q_shape, k_shape, hint", [
    ((1, 6, 4, 8), (1, 4, 8, 8), True),    # q has more heads than positions
    ((1, 6, 8, 8), (1, 4, 2, 8), True),    # k has
    ((1, 6, 6, 8), (1, 4, 4, 8), False),   # as many as positions: no hint
])
def test_the_layout_hint_is_given_where_q_or_k_has_more_heads_than_positions(q_shape, k_shape,
                                                                             hint):
    q, k = torch.randn(*q_shape), torch.randn(*k_shape)
    message = "6 query heads must be a multiple of 4 key/value heads" + (HINT if hint else "")
    with pytest.raises(BindingError, match="^" + re.escape(message) + "$"):
        check_qkv(q, k, k)


def test_the_layout_warning_is_given_once_per_shape_for_more_heads_than_any_model(monkeypatch):
    from flexspec.runtime import notices
    monkeypatch.setattr(notices, "_warned", set())
    k = torch.randn(1, 300, 2, 4)  # (B, S=300, H=2, D) read as 300 heads of 2 positions
    message = ("flexspec: k has shape [1, 300, 2, 4], read as (B, H, S, D): 300 heads of 2 "
               "positions. If it is (B, S, H, D), as projections give before their transpose, "
               "pass q.transpose(1, 2), k.transpose(1, 2) and v.transpose(1, 2) (views: no copy)")
    with pytest.warns(UserWarning, match="^" + re.escape(message) + "$"):
        check_qkv(k, k, k)
    other = torch.randn(1, 257, 3, 4)  # another shape warns too, once
    with pytest.warns(UserWarning, match=r"k has shape \[1, 257, 3, 4\]"):
        check_qkv(other, other, other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_qkv(k, k, k)  # warned before
        check_qkv(other, other, other)
        # at most 256 heads, or no more heads than positions (the head dimension is not one)
        for shape in ((1, 256, 10, 4), (1, 300, 300, 4), (1, 300, 400, 4)):
            t = torch.randn(*shape)
            check_qkv(t, t, t)
