"""runtime.serving.jagged (issue 27, item 3): q, k, v as nested tensors of the jagged layout, each
sequence equal to its call alone (forward and backward, Q_LEN != KV_LEN per sequence, grouped
heads), never attending across sequences, with no padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec.ir import rewrites
from flexspec.runtime.serving.jagged import why_not_packed
from flexspec.testing import spec_texts

HEADS, KV_HEADS, DIM = 4, 2, 8


def jagged(parts: list) -> torch.Tensor:
    """A jagged ``(B, H, j, D)`` nested tensor of ``(H, n, D)`` parts."""
    return torch.nested.as_nested_tensor([p.transpose(0, 1) for p in parts],
                                         layout=torch.jagged).transpose(1, 2)


def sequences(q_lengths, kv_lengths, seed, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)

    def make(heads, n):
        return torch.randn(heads, n, DIM, generator=generator).requires_grad_(requires_grad)
    return ([make(HEADS, n) for n in q_lengths], [make(KV_HEADS, n) for n in kv_lengths],
            [make(KV_HEADS, n) for n in kv_lengths])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts(), st.lists(st.tuples(st.integers(1, 12), st.integers(0, 6)), min_size=1,
                              max_size=4), st.integers(0, 2**31 - 1))
def test_each_sequence_of_a_jagged_batch_equals_its_call_alone(text, lengths, seed):
    """Random registry specs over 1-4 sequences, each with its own query and key lengths (keys
    at least as many as queries, up to 6 more): every sequence's rows equal the float64
    reference of that sequence alone."""
    attn = flexspec.compile(text, backend="reference")
    assume(why_not_packed(attn.ir) is None)
    q_lengths = [n for n, _ in lengths]
    kv_lengths = [n + extra for n, extra in lengths]
    qs, ks, vs = sequences(q_lengths, kv_lengths, seed)
    try:
        alone = [attn.reference(q[None], k[None], v[None]) for q, k, v in zip(qs, ks, vs)]
    except flexspec.SpecError as error:  # refused alone (a lookup out of range...): refused too
        with pytest.raises(type(error)):
            attn(jagged(qs), jagged(ks), jagged(vs))
        return
    out = attn(jagged(qs), jagged(ks), jagged(vs))
    assert out.is_nested and out.shape[0] == len(qs)
    for row, want in enumerate(alone):
        torch.testing.assert_close(out[row], want[0].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text", ["causal & window(3) + alibi", "causal_bottom_right + rel_bias",
                                  "prefix_lm(2) + softcap(5.0)"])
def test_gradients_of_a_jagged_batch_equal_each_sequence_s(text):
    attn = flexspec.compile(text)
    qs, ks, vs = sequences([5, 9, 2], [7, 9, 4], 1, requires_grad=True)
    out = attn(jagged(qs), jagged(ks), jagged(vs))
    weights = [torch.randn(q.shape) for q in qs]
    sum((out[row] * weights[row]).sum() for row in range(3)).backward()
    got = [[t.grad.clone() for t in part] for part in (qs, ks, vs)]
    for part in (qs, ks, vs):
        for t in part:
            t.grad = None
    sum((attn.reference(q[None], k[None], v[None])[0] * w).sum()
        for q, k, v, w in zip(qs, ks, vs, weights)).backward()
    for part, grads in zip((qs, ks, vs), got):
        for t, grad in zip(part, grads):
            torch.testing.assert_close(grad, t.grad, rtol=1e-5, atol=1e-5)


def test_a_jagged_batch_never_attends_across_sequences():
    """A huge value in one sequence leaves the others' outputs unchanged."""
    attn = flexspec.compile("full", backend="reference")
    qs, ks, vs = sequences([3, 4], [3, 4], 2)
    before = attn(jagged(qs), jagged(ks), jagged(vs))
    vs[1] = vs[1] * 1e6
    after = attn(jagged(qs), jagged(ks), jagged(vs))
    torch.testing.assert_close(after[0], before[0])


def test_a_jagged_batch_on_the_flex_path(eager_kernels):
    """The packed call on FlexAttention (130+ rows on the CPU)."""
    attn = flexspec.compile("causal & (window(40) | sink(2)) + alibi", backend="flex")
    qs, ks, vs = sequences([70, 100, 3], [70, 120, 3], 3)
    with torch.no_grad():
        out = attn(jagged(qs), jagged(ks), jagged(vs))
    for row, (q, k, v) in enumerate(zip(qs, ks, vs)):
        want = attn.reference(q[None], k[None], v[None])
        torch.testing.assert_close(out[row], want[0], rtol=1e-4, atol=1e-4)


def test_the_log_sum_exp_of_a_jagged_batch_is_jagged_too():
    attn = flexspec.compile("causal & window(4) + alibi")
    qs, ks, vs = sequences([5, 2], [7, 2], 6)
    out, lse = attn(jagged(qs), jagged(ks), jagged(vs), return_lse=True)
    assert lse.is_nested and lse.shape[0] == 2
    for row, (q, k, v) in enumerate(zip(qs, ks, vs)):
        want, want_lse = attn.reference(q[None], k[None], v[None], return_lse=True)
        torch.testing.assert_close(out[row], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[row], want_lse[0], rtol=1e-5, atol=1e-5)


def test_a_module_runs_a_jagged_batch_with_its_tables():
    module = flexspec.SpecAttention("causal + rel_bias", num_heads=HEADS)
    with torch.no_grad():
        module.tables["rel_bias_table"].normal_()
    qs, ks, vs = sequences([4, 6], [4, 6], 4)
    out = module(jagged(qs), jagged(ks), jagged(vs))
    for row, (q, k, v) in enumerate(zip(qs, ks, vs)):
        torch.testing.assert_close(out[row], module(q[None], k[None], v[None])[0],
                                   rtol=1e-5, atol=1e-5)


def test_what_a_jagged_batch_cannot_take_is_refused_with_the_reason():
    qs, ks, vs = sequences([3, 4], [3, 4], 5)
    q, k, v = jagged(qs), jagged(ks), jagged(vs)
    with pytest.raises(flexspec.BindingError, match="reads the binding 'doc_ids'"):
        flexspec.compile("causal & doc")(q, k, v, doc_ids=torch.zeros(7, dtype=torch.long))
    with pytest.raises(flexspec.BindingError, match="takes no q_offset, kv_lengths or step"):
        flexspec.compile("causal")(q, k, v, q_offset=3)
    with pytest.raises(TypeError, match="k must be a nested tensor of layout torch.jagged"):
        flexspec.compile("causal")(q, torch.randn(2, 2, 4, DIM), v)
    with pytest.raises(flexspec.BindingError, match=r"shape \(B, H, j, D\), the ragged sequence "
                                                    r"dimension third"):
        flexspec.compile("causal")(q.transpose(1, 2), k, v)
    with pytest.raises(flexspec.BindingError, match="q holds 2 sequences, k 1"):
        flexspec.compile("causal")(q, jagged(ks[:1]), jagged(vs[:1]))
    with pytest.raises(flexspec.BindingError, match="k and v must hold sequences of the same"):
        flexspec.compile("causal")(q, k, jagged([vs[1], vs[0]]))
    assert "batch size B" in why_not_packed(flexspec.loads(
        "mask m = kv < B * 4\nspec s = m")["s"].ir)
    # a score that reads B counts as much as a mask: a batch laid end to end would see B = 1
    assert "batch size B" in why_not_packed(flexspec.loads(
        "score s(c: float = 1.0) = score + c * B\nspec t = causal + s")["t"].ir)


def test_the_packed_spec_reads_each_sequence_s_own_positions_and_lengths():
    spec = flexspec.parse("causal_bottom_right + alibi").ir
    packed = rewrites.packed(spec)
    assert packed.align == "start"
    text = str(packed)
    assert "jagged_q_sequence[q] == jagged_kv_sequence[kv]" in text
    assert "jagged_q_position[q] + (jagged_kv_length[q] - jagged_q_length[q])" in text
    assert "alibi_slopes(H)[h]" in text  # a table sized by H keeps its shape


def test_layouts_that_mix_or_are_strided_are_refused_saying_which():
    """Dense q with jagged k and v, nested tensors of the strided layout, and a jagged batch
    given to explain, reference or a paged call are flexspec errors that say what to give
    (torch's own errors came out: 'relation is indeterminate', a missing 'add')."""
    attn = flexspec.compile("causal")
    jagged = torch.nested.nested_tensor([torch.randn(3, 4, 16), torch.randn(5, 4, 16)],
                                        layout=torch.jagged).transpose(1, 2)
    dense = torch.randn(2, 4, 5, 16)
    with pytest.raises(flexspec.BindingTypeError, match="q must be a nested tensor of layout "
                                                        "torch.jagged like k and v, or q, k and "
                                                        "v all dense tensors"):
        attn(dense, jagged, jagged)
    with pytest.raises(flexspec.BindingTypeError, match="k must be a nested tensor of layout "
                                                        "torch.jagged like q, or"):
        attn(jagged, dense, dense)
    with pytest.warns(UserWarning):  # torch's own, about the strided layout
        strided = torch.nested.nested_tensor([torch.randn(3, 4, 16), torch.randn(5, 4, 16)])
    with pytest.raises(flexspec.BindingError, match="q is a nested tensor of the strided "
                                                    "layout: a call takes .* layout=torch.jagged"):
        attn(strided, strided, strided)
    with pytest.raises(flexspec.BindingError, match="explain takes dense q, k, v"):
        attn.explain(jagged, jagged, jagged)
    with pytest.raises(flexspec.BindingError, match="reference takes dense q, k, v"):
        attn.reference(jagged, jagged, jagged)
    cache = flexspec.PagedKVCache(pages=2, page_size=16, kv_heads=4, head_dim=16, slots=2,
                                  max_pages=1)
    with pytest.raises(flexspec.BindingError, match="q is a nested tensor: a paged call takes "
                                                    "dense q"):
        attn.paged(jagged, cache, torch.tensor([0, 1]))
    with pytest.raises(flexspec.BindingError, match="slots is empty"):
        attn.paged(dense[:0], cache, torch.zeros(0, dtype=torch.long))
