"""runtime.bindings: the checks of every binding (errors that name the binding and its expected
shape) and the tensor values a spec reads. No kernel runs here: every call below fails its
checks or runs on the reference."""

from __future__ import annotations

import re

import pytest
import torch

import flexspec
from flexspec import BindingError, ir
from flexspec.lang.library import load_text
from flexspec.runtime.bindings import (Tensors, contiguous, implied_sizes, rows_between,
                                       sizes_tensors_read)
from flexspec.testing import Shape, document_ids

BINDINGS = load_text("""
mask behind(t: float[KV_LEN]) = t[q - 1] > 0.0
mask fixed4(t: int[4, KV_LEN]) = t[0, kv] >= 0
mask flags(f: bool[KV_LEN]) = f[kv]
score biased(u: float[KV_LEN]) = score + u[kv]
spec doc_and_bias = causal & document + biased
""")


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


def test_contiguous_copies_only_strided_views():
    t = torch.arange(10)
    assert contiguous(t) is t
    strided = t[::2]
    copy = contiguous(strided)
    assert copy.is_contiguous() and torch.equal(copy, torch.tensor([0, 2, 4, 6, 8]))


def test_the_same_unchanged_strided_view_gets_the_same_copy():
    """A decode loop passes doc_ids[:, :length] anew at every step: the copy is kept by the
    view's identity, so the block-mask cache (keyed by identity) recognises it."""
    t = torch.arange(12).view(3, 4)
    first = contiguous(t[:, :3])
    assert contiguous(t[:, :3]) is first
    assert contiguous(t[:, :2]) is not first  # another view
    t[0, 0] = 100  # an in-place change is a new version: a new copy, with the new value
    changed = contiguous(t[:, :3])
    assert changed is not first and changed[0, 0] == 100 and first[0, 0] == 0


def test_a_strided_view_of_the_same_memory_as_another_dtype_gets_its_own_copy():
    """A copy is kept by the view's identity, dtype included: a bool mask and its uint8 view
    share memory, layout and version, and each gets a copy of its own dtype."""
    mask = torch.tensor([[True, False, True, True]] * 3)[:, ::2]
    assert contiguous(mask).dtype == torch.bool
    assert contiguous(mask.view(torch.uint8)).dtype == torch.uint8


def test_strided_views_that_need_their_graph_or_hide_their_changes_are_copied_every_time():
    grad = torch.randn(4, 4, requires_grad=True)
    assert contiguous(grad[:, :2]) is not contiguous(grad[:, :2])
    with torch.inference_mode():
        frozen = torch.arange(12).view(3, 4)
        assert contiguous(frozen[:, :3]) is not contiguous(frozen[:, :3])


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


def test_builtin_tensors_are_computed_at_the_call_s_sizes():
    # alibi_slopes(H) = 2 ** (-8 (h + 1) / H) (docs/language.md), here at H = 4
    spec = flexspec.parse("causal + alibi").ir
    key = next(ir.tensor_key(t) for t in spec.tensors() if t.origin == "builtin")
    values, _ = Tensors(spec).gather({"B": 1, "H": 4, "Q_LEN": 8, "KV_LEN": 8}, {},
                                     torch.device("cpu"))
    assert torch.equal(values[key], torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]))


def test_a_fresh_learnable_table_made_in_inference_mode_serves_grad_mode_calls():
    # the initial table is kept for calls of every mode, so it is never an inference tensor
    spec = flexspec.parse("causal + rel_bias(max_distance=2)").ir
    key = next(ir.tensor_key(t) for t in spec.tensors() if t.origin == "learnable")
    with torch.inference_mode():
        table = Tensors(spec).gather({"B": 1, "H": 2, "Q_LEN": 8, "KV_LEN": 8}, {},
                                     torch.device("cpu"))[0][key]
    assert not table.is_inference()
    weight = torch.ones(2, 5, requires_grad=True)
    (table * weight).sum().backward()  # an inference tensor cannot be saved for backward
    assert torch.equal(weight.grad, torch.zeros(2, 5))


def test_implied_sizes_are_read_off_the_bindings_shapes():
    # doc_and_bias reads doc_ids: int[B, KV_LEN] and u: float[KV_LEN]
    spec = flexspec.parse("doc_and_bias", library=BINDINGS).ir
    none = {"B": None, "H": None, "Q_LEN": None, "KV_LEN": None}
    ids = torch.zeros(2, 4096, dtype=torch.int64)
    # doc_ids of shape [2, 4096] gives B=2, KV_LEN=4096; the sizes nobody needs default to 1
    assert implied_sizes(spec, none, {"doc_ids": ids}, {"KV_LEN"}) == (
        {"B": 2, "H": 1, "Q_LEN": 1, "KV_LEN": 4096}, torch.device("cpu"))
    # a size given wins over the bindings' shapes
    assert implied_sizes(spec, {**none, "B": 3}, {"doc_ids": ids}, set())[0] == {
        "B": 3, "H": 1, "Q_LEN": 1, "KV_LEN": 4096}
    # a binding with fewer dimensions than declared has its leading ones left out
    assert implied_sizes(spec, none, {"doc_ids": torch.zeros(7, dtype=torch.int64)},
                         {"KV_LEN"})[0] == {"B": 1, "H": 1, "Q_LEN": 1, "KV_LEN": 7}
    # a binding that is not given (or not a tensor) gives nothing; the next ones still do
    assert implied_sizes(spec, none, {"doc_ids": [0, 0], "u": torch.zeros(5)},
                         {"KV_LEN"})[0] == {"B": 1, "H": 1, "Q_LEN": 1, "KV_LEN": 5}
    # no binding that is a tensor: no device
    assert implied_sizes(spec, {"B": 1, "H": 1, "Q_LEN": 4, "KV_LEN": 4}, {}, set()) == (
        {"B": 1, "H": 1, "Q_LEN": 4, "KV_LEN": 4}, None)


def test_implied_sizes_name_the_sizes_still_missing():
    spec = flexspec.parse("doc_and_bias", library=BINDINGS).ir
    none = {"B": None, "H": None, "Q_LEN": None, "KV_LEN": None}
    ids = torch.zeros(2, 16, dtype=torch.int64)
    with pytest.raises(BindingError, match="^" + re.escape(
            "this spec needs Q_LEN; pass q_len=...") + "$"):
        implied_sizes(spec, none, {"doc_ids": ids}, {"Q_LEN", "KV_LEN"})
    with pytest.raises(BindingError, match="^" + re.escape(
            "this spec needs H, Q_LEN; pass heads=..., q_len=...") + "$"):
        implied_sizes(spec, none, {"doc_ids": ids}, {"Q_LEN", "H", "B"})
    # a dimension of size 1 broadcasts, so it does not tell the size
    with pytest.raises(BindingError, match="^" + re.escape(
            "this spec needs B; pass batch=...") + "$"):
        implied_sizes(spec, none, {"doc_ids": torch.zeros(1, 16, dtype=torch.int64)}, {"B"})


def test_the_sizes_a_spec_s_tensors_need():
    # a binding broadcasts over B and H; computed and learnable tensors need every size
    # their shape reads
    heads = load_text("score by_head(t: float[B, H, KV_LEN]) = score + t[b, h, kv]")
    assert sizes_tensors_read(flexspec.parse("causal").ir) == set()
    assert sizes_tensors_read(flexspec.parse("by_head", library=heads).ir) == {"KV_LEN"}
    assert sizes_tensors_read(flexspec.parse("causal & document + alibi").ir) == {
        "KV_LEN", "H"}
    assert sizes_tensors_read(flexspec.parse("causal + rel_bias(max_distance=2)").ir) == {"H"}


def test_a_built_in_tensor_is_made_once_per_argument_and_device_and_outside_any_mode():
    """alibi's slopes are made once per number of heads and device, not at every new length
    (a growing cache plans at every step), equal the tensor made anew, and are made outside
    inference mode, so a later call that needs gradients may read them."""
    from flexspec.kernels.tensors import builtin_tensor
    tensors = flexspec.compile("causal + alibi")._calls.placement.tensors_for({})
    slopes = next(t for t in tensors.ir.tensors() if t.origin == "builtin")
    sizes = {"B": 1, "H": 4, "Q_LEN": 8, "KV_LEN": 8}
    with torch.inference_mode():
        first, _ = tensors.gather(sizes, {}, torch.device("cpu"))
    again, _ = tensors.gather({**sizes, "KV_LEN": 20}, {}, torch.device("cpu"))
    other, _ = tensors.gather({**sizes, "H": 6}, {}, torch.device("cpu"))
    key = ir.tensor_key(slopes)
    assert again[key] is first[key] and not first[key].is_inference()
    assert torch.equal(first[key], builtin_tensor(slopes, sizes))
    assert other[key].shape == (6,) and torch.equal(other[key],
                                                    builtin_tensor(slopes, {**sizes, "H": 6}))


def test_rows_between_cuts_per_row_values_and_leaves_the_rest():
    """bindings.rows_between (the rows of a run of a call's batch rows, and of a mixed batch's
    part): a value with a row per batch row gives the rows' view; an int, a 0-d tensor, a batch
    dimension of one (broadcast) and a batch of one pass as they are."""
    per_row = torch.arange(12).view(4, 3)
    cut = rows_between(per_row, 1, 3, 4)
    assert cut.tolist() == [[3, 4, 5], [6, 7, 8]] and cut.data_ptr() == per_row[1].data_ptr()
    assert rows_between(torch.arange(4), 1, 3, 4).tolist() == [1, 2]  # offsets, lengths
    assert rows_between(torch.arange(2), 1, 2, 2).tolist() == [1]  # a batch of two
    assert rows_between(7, 1, 3, 4) == 7
    scalar, broadcast = torch.tensor(5), torch.arange(3).view(1, 3)
    assert rows_between(scalar, 1, 3, 4) is scalar
    assert rows_between(broadcast, 1, 3, 4) is broadcast
    one = torch.arange(3).view(1, 3)
    assert rows_between(one, 0, 1, 1) is one
