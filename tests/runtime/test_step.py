"""runtime.step: one model step's shared inputs (issue 26, "one plan per model step"). Every
layer of a step gets the positions, bindings and documents of the step, derives them once, and
equals the plain call; documents may be given as boundaries (cu_seqlens)."""

from __future__ import annotations

import pytest
import torch

import flexspec
from flexspec.runtime import positions
from flexspec.testing import Shape


def layers(count, shape, seed=0):
    """q, k, v of ``count`` layers of one step."""
    return [shape.qkv(seed + i) for i in range(count)]


@pytest.mark.parametrize("text", ["causal & doc + alibi", "causal_bottom_right & window(5)"])
def test_every_layer_of_a_step_equals_its_plain_call_and_derives_positions_once(text,
                                                                                 monkeypatch):
    attn = flexspec.compile(text)
    shape = Shape(2, 4, 2, 6, 30, 8)
    kwargs = {"q_offset": torch.tensor([20, 24]), "kv_lengths": torch.tensor([30, 26])}
    if "doc" in text:
        kwargs["doc_ids"] = torch.arange(30).div(9, rounding_mode="floor").expand(2, 30)
    inputs = layers(4, shape)
    expected = [attn.reference(q, k, v, **kwargs) for q, k, v in inputs]
    made = []
    real = positions.call_tensors
    monkeypatch.setattr(positions, "call_tensors", lambda *a, **k: made.append(1) or real(*a, **k))
    step = flexspec.Step(**kwargs)
    for (q, k, v), want in zip(inputs, expected):
        torch.testing.assert_close(attn(q, k, v, step=step), want)
    assert len(made) == 1  # the position tensors: once for the step's four layers
    made.clear()
    for q, k, v in inputs[:2]:
        attn(q, k, v, **kwargs)
    assert len(made) == 2  # without a step, once per call


def test_documents_given_as_boundaries():
    """cu_seqlens (document starts in the rows laid end to end, then the total) stand for
    doc_ids; the ids are made once per step, on the device."""
    attn = flexspec.compile("causal & doc")
    shape = Shape(2, 2, 2, 40, 40, 8)
    bounds = torch.tensor([0, 10, 40, 55, 80])  # row 0: 10 + 30; row 1: 15 + 25
    ids = torch.tensor([[0] * 10 + [1] * 30, [2] * 15 + [3] * 25])
    step = flexspec.Step(cu_seqlens=bounds, max_seqlen=30)
    assert torch.equal(step.bindings_for(2, 40)["doc_ids"], ids)
    assert step.bindings_for(2, 40)["doc_ids"] is step.bindings_for(2, 40)["doc_ids"]
    for q, k, v in layers(2, shape):
        torch.testing.assert_close(attn(q, k, v, step=step), attn.reference(q, k, v, doc_ids=ids))
    named = flexspec.Step(cu_seqlens=bounds, documents="ids")
    document = flexspec.compile("causal & document(doc_ids=ids)")
    q, k, v = shape.qkv(5)
    torch.testing.assert_close(document(q, k, v, step=named), document.reference(q, k, v, ids=ids))


def test_the_segments_of_boundaries_need_no_look_at_the_ids():
    step = flexspec.Step(cu_seqlens=torch.tensor([0, 3, 8]), max_seqlen=5)
    ids = step.bindings_for(1, 8)["doc_ids"]
    cumulative, longest = step.segments(ids)
    assert cumulative.dtype == torch.int32 and cumulative.tolist() == [0, 3, 8] and longest == 5
    assert step.segments(ids.clone()) is None  # only the very tensor the step made
    found = flexspec.Step(cu_seqlens=torch.tensor([0, 3, 8]))
    assert found.segments(found.bindings_for(1, 8)["doc_ids"])[1] == 5  # max_seqlen found


def test_step_errors_say_what_to_do():
    attn = flexspec.compile("causal & doc", backend="reference")
    q, k, v = Shape(1, 1, 1, 8, 8, 4).qkv(0)
    ids = torch.zeros(8, dtype=torch.int64)
    step = flexspec.Step(q_offset=0, doc_ids=ids)
    with pytest.raises(flexspec.BindingError, match="takes q_offset and kv_lengths from the step"):
        attn(q, k, v, step=step, q_offset=3)
    with pytest.raises(flexspec.BindingError, match="doc_ids given to the call and to its step"):
        attn(q, k, v, step=step, doc_ids=ids)
    with pytest.raises(TypeError, match="step must be a flexspec.Step, got dict"):
        attn(q, k, v, step={})
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int tensor"):
        flexspec.Step(cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(flexspec.BindingError, match="as cu_seqlens or as doc_ids"):
        flexspec.Step(cu_seqlens=torch.tensor([0, 8]), doc_ids=ids)
    with pytest.raises(flexspec.BindingError, match="max_seqlen goes with cu_seqlens"):
        flexspec.Step(max_seqlen=8)


def test_a_module_passes_its_step():
    module = flexspec.SpecAttention("causal + rel_bias", num_heads=2)
    q, k, v = Shape(1, 2, 2, 3, 9, 8).qkv(1)
    step = flexspec.Step(q_offset=6)
    torch.testing.assert_close(module(q, k, v, step=step), module(q, k, v, q_offset=6))


def test_a_decoded_token_of_a_step_that_sees_every_key_runs_unmasked():
    """The call drops its mask (the token sees the whole cache) and takes the step's bindings
    with it."""
    attn = flexspec.compile("causal + head_bias")
    q, k, v = Shape(1, 2, 2, 1, 50, 8).qkv(2)
    bias = torch.tensor([0.5, -0.25])
    assert attn.explain(q, k, v, q_offset=49, bias=bias).mask == "true"
    torch.testing.assert_close(attn(q, k, v, step=flexspec.Step(q_offset=49, bias=bias)),
                               attn.reference(q, k, v, q_offset=49, bias=bias))
