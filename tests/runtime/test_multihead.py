"""flexspec.MultiheadAttention against torch.nn.MultiheadAttention with the same weights (full and
causal attention, key padding, both layouts), grouped-query heads against a manual computation,
learnable tables that train, and clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flexspec

pytestmark = pytest.mark.filterwarnings("ignore:.*reference path")


def torch_pair(spec: str, batch_first: bool, bias: bool = True):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(32, 4, bias=bias, batch_first=batch_first).eval()
    ours = flexspec.MultiheadAttention(32, 4, spec, bias=bias, batch_first=batch_first).eval()
    weight = theirs.in_proj_weight.detach()
    with torch.no_grad():
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.weight.copy_(weight[32 * i:32 * (i + 1)])
            if bias:
                proj.bias.copy_(theirs.in_proj_bias[32 * i:32 * (i + 1)])
        ours.out_proj.load_state_dict(theirs.out_proj.state_dict())
    return theirs, ours


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("spec", ["full", "causal"])
def test_matches_torch_multihead_attention(spec, batch_first):
    theirs, ours = torch_pair(spec, batch_first)
    x = torch.randn(2, 21, 32) if batch_first else torch.randn(21, 2, 32)
    padding = torch.zeros(2, 21, dtype=torch.bool)
    padding[1, 17:] = True  # the second sequence is 17 tokens, padded on the right
    causal = torch.ones(21, 21, dtype=torch.bool).triu(1) if spec == "causal" else None
    with torch.no_grad():
        expected, _ = theirs(x, x, x, key_padding_mask=padding, attn_mask=causal,
                             need_weights=False)
        got, weights = ours(x, key_padding_mask=padding)
        plain, _ = theirs(x, x, x, attn_mask=causal, need_weights=False)
        got_plain, _ = ours(x)
    assert weights is None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_plain, plain, rtol=1e-5, atol=1e-5)


def test_grouped_query_heads_and_learnable_tables_train():
    module = flexspec.MultiheadAttention(32, 4, "causal + rel_bias(max_distance=8)",
                                         num_kv_heads=2, batch_first=True)
    x = torch.randn(2, 12, 32, requires_grad=True)
    out, _ = module(x)
    assert out.shape == (2, 12, 32)
    out.square().sum().backward()
    table = module.attention.tables["rel_bias_table"]
    assert table.shape == (4, 17) and table.grad is not None and table.grad.abs().sum() > 0
    assert module.k_proj.weight.shape == (16, 32)  # 2 KV heads of 8
    # the same attention by hand: heads repeated, the table added, causal
    q = module.q_proj(x).view(2, 12, 4, 8).transpose(1, 2)
    k = module.k_proj(x).view(2, 12, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    v = module.v_proj(x).view(2, 12, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    position = torch.arange(12)
    distance = (position[None, :] - position[:, None]).clamp(-8, 8) + 8
    scores = q @ k.transpose(-2, -1) / 8 ** 0.5 + table.detach()[:, distance]
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    manual = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 12, 32)
    torch.testing.assert_close(out.detach(), module.out_proj(manual).detach(), rtol=1e-4,
                               atol=1e-4)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(flexspec.SpecError, match="multiple of num_heads"):
        flexspec.MultiheadAttention(30, 4)
    module = flexspec.MultiheadAttention(32, 4, batch_first=True)
    with pytest.raises(flexspec.SpecError, match="need_weights=False"):
        module(torch.randn(1, 3, 32), need_weights=True)
    with pytest.raises(flexspec.BindingError, match=r"query must be \(N, L, E\) with E = 32"):
        module(torch.randn(1, 3, 16))
    with pytest.raises(flexspec.BindingError, match="must share the batch size"):
        module(torch.randn(2, 3, 32), torch.randn(1, 5, 32))
    with pytest.raises(flexspec.BindingError, match="key_padding_mask must be a bool tensor"):
        module(torch.randn(1, 3, 32), key_padding_mask=torch.zeros(1, 3))


def test_cross_attention_with_distinct_key_and_value_matches_torch():
    """Blind spot (red-team 2026-12-02): no test passed key and value apart. Value defaults to
    key, key to query, as in nn.MultiheadAttention."""
    theirs, ours = torch_pair("full", batch_first=True)
    generator = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(2, n, 32, generator=generator) for n in (7, 11, 11))
    with torch.no_grad():
        expected, _ = theirs(query, key, value, need_weights=False)
        got, _ = ours(query, key, value)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # value left out is the key, not the query
        expected_key, _ = theirs(query, key, key, need_weights=False)
        torch.testing.assert_close(ours(query, key)[0], expected_key, rtol=1e-5, atol=1e-5)


def test_torch_habits_get_errors_that_say_the_flexspec_way():
    """First-hour review: dropout=0.1 raised a TypeError naming SpecAttention.__init__, a
    positional float third argument 'expected spec text', attn_mask= and is_causal= 'unexpected
    binding'. Each now says what flexspec takes instead; what torch means and flexspec does
    anyway (dropout 0, is_causal on a causal spec) is accepted."""
    with pytest.raises(TypeError, match="third argument of flexspec.MultiheadAttention is the "
                                        "spec .* not dropout"):
        flexspec.MultiheadAttention(32, 4, 0.1)
    with pytest.raises(flexspec.SpecError, match="no attention dropout \\(dropout=0.1\\)"):
        flexspec.MultiheadAttention(32, 4, dropout=0.1)
    with pytest.raises(flexspec.SpecError, match="no add_bias_kv or add_zero_attn"):
        flexspec.MultiheadAttention(32, 4, add_bias_kv=True)
    layer = flexspec.MultiheadAttention(32, 4, "causal & window(3)", dropout=0.0,
                                        batch_first=True)
    x = torch.randn(1, 5, 32)
    with pytest.raises(flexspec.SpecError, match="takes its pattern as a spec, not an attn_mask"):
        layer(x, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    torch.testing.assert_close(layer(x, is_causal=True)[0], layer(x)[0])
    with pytest.raises(flexspec.SpecError, match="is_causal=True, but this layer's spec is "
                                                 "'full', which is not causal"):
        flexspec.MultiheadAttention(32, 4, "full")(x.transpose(0, 1), is_causal=True)


def test_kdim_and_vdim_match_torch():
    torch.manual_seed(4)
    theirs = nn.MultiheadAttention(32, 4, kdim=12, vdim=20, batch_first=True).eval()
    ours = flexspec.MultiheadAttention(32, 4, "full", kdim=12, vdim=20, batch_first=True).eval()
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.q_proj_weight)
        ours.k_proj.weight.copy_(theirs.k_proj_weight)
        ours.v_proj.weight.copy_(theirs.v_proj_weight)
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.bias.copy_(theirs.in_proj_bias[32 * i:32 * (i + 1)])
        ours.out_proj.load_state_dict(theirs.out_proj.state_dict())
        query, key, value = torch.randn(2, 7, 32), torch.randn(2, 9, 12), torch.randn(2, 9, 20)
        torch.testing.assert_close(ours(query, key, value)[0],
                                   theirs(query, key, value, need_weights=False)[0],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["causal", "causal & window(3) + alibi"])
def test_decoding_with_a_cache_equals_the_whole_sequence(spec):
    """A KVCache keeps the projected keys and values: token by token (and a prompt first), each
    step projects only its new tokens, and the outputs are the rows of one call over the whole
    sequence (first-hour review: there was no way to decode without re-projecting)."""
    torch.manual_seed(6)
    layer = flexspec.MultiheadAttention(32, 4, spec, num_kv_heads=2, batch_first=True).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        whole, _ = layer(x)
        cache = flexspec.KVCache()
        steps = [layer(x[:, :4], cache=cache)[0]]
        steps += [layer(x[:, i:i + 1], cache=cache)[0] for i in range(4, 9)]
    assert cache.length == 9 and cache.k.shape == (2, 2, 9, 8)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(flexspec.BindingError, match="use one cache per layer and batch"):
        layer(x[:1, :1], cache=cache)
    with pytest.raises(TypeError, match="cache must be a flexspec.KVCache"):
        layer(x, cache={})
