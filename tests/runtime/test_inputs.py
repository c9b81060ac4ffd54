"""runtime.inputs: the checks of q, k, v, the scale and every binding (errors that name the binding
and its expected shape), the tensor values a spec reads, the identity that keys the caches, and
the range checks of tensor lookups.

Lookups that interval analysis cannot prove in range are evaluated exactly at any length (in
chunks of bounded memory), and refused with the fix where that would take too long. Red-team
item 13: above 2^24 index points the check became a warning, then inductor's "index out of
bounds" error. No kernel runs here: every call below fails its checks or runs on the reference."""

from __future__ import annotations

import pytest
import torch

import flexspec
from flexspec import BindingError, limits
from flexspec.lang.library import load_text
from flexspec.runtime.inputs import _index_range
from flexspec.testing import Shape

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


def test_too_many_points_to_check_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(limits, "MAX_INDEX_CHECK_POINTS", 32)
    with pytest.raises(flexspec.BindingError, match=r"evaluating it at 64 points .* "
                                                    r"clamp\(ids\[q\], 0, 3\)"):
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
    rows = []
    for row in bounds:
        ids = torch.zeros(length, dtype=torch.int64)
        for start in row:
            ids[start:] += 1
        rows.append(ids)
    return torch.stack(rows)


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
    assert "unexpected binding 'doc_ids'" in message and "no tensors" in message


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
    assert "'doc_ids' must be a torch.Tensor of int[B, KV_LEN] = [2, 150]" in message


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
