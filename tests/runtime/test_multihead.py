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


# ---- mutation testing of runtime/multihead --------------------------------------------------


def whole(message: str) -> str:
    """A pattern that matches ``message`` and nothing longer or shorter."""
    import re
    return "^" + re.escape(message) + "$"


def test_every_refused_argument_of_the_layer_says_why_in_full():
    with pytest.raises(flexspec.SpecTypeError, match=whole(
            "the third argument of flexspec.MultiheadAttention is the spec (default 'causal'), "
            "not dropout as in torch.nn.MultiheadAttention (got 0.1): pass the pattern as "
            "text, e.g. MultiheadAttention(512, 8, 'causal & window(128)'); flexspec has no "
            "attention dropout")):
        flexspec.MultiheadAttention(32, 4, 0.1)
    with pytest.raises(flexspec.SpecTypeError, match="third argument"):
        flexspec.MultiheadAttention(32, 4, 0)  # an int is a number too
    # a bool is not taken for dropout: it is a spec of the wrong type
    with pytest.raises(flexspec.SpecTypeError, match="expected spec text") as error:
        flexspec.MultiheadAttention(32, 4, True)
    assert "dropout" not in str(error.value)
    with pytest.raises(flexspec.SpecError, match=whole(
            "flexspec has no attention dropout (dropout=0.5): use dropout=0.0, and an "
            "nn.Dropout on the layer's output if the model needs one")):
        flexspec.MultiheadAttention(32, 4, dropout=0.5)
    message = whole("flexspec.MultiheadAttention has no add_bias_kv or add_zero_attn: a key "
                    "every query sees is a spec's mask (e.g. 'causal | sink(1)')")
    for kwargs in ({"add_bias_kv": True}, {"add_zero_attn": True},
                   {"add_bias_kv": True, "add_zero_attn": True}):
        with pytest.raises(flexspec.SpecError, match=message):
            flexspec.MultiheadAttention(32, 4, **kwargs)


@pytest.mark.parametrize("name", ["embed_dim", "num_heads", "num_kv_heads", "kdim", "vdim"])
@pytest.mark.parametrize("bad", [0, -4, True, 4.0, "4"])
def test_every_size_of_the_layer_must_be_a_positive_int(name, bad):
    sizes = {"embed_dim": 32, "num_heads": 4}
    with pytest.raises(flexspec.SpecError, match=whole(f"{name} must be a positive int, "
                                                       f"got {bad!r}")):
        flexspec.MultiheadAttention(**{**sizes, name: bad})


def test_sizes_of_one_are_positive():
    layer = flexspec.MultiheadAttention(1, 1, "full", num_kv_heads=1, kdim=1, vdim=1,
                                        batch_first=True)
    assert layer(torch.randn(2, 3, 1))[0].shape == (2, 3, 1)


def test_heads_must_divide_the_embedding_and_kv_heads_the_heads():
    for embed_dim, num_heads, num_kv_heads in ((30, 4, 4), (32, 4, 3), (30, 4, 3)):
        with pytest.raises(flexspec.SpecError, match=whole(
                f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads}), and "
                f"num_heads of num_kv_heads ({num_kv_heads})")):
            flexspec.MultiheadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads)
    # num_kv_heads defaults to num_heads, kdim and vdim to embed_dim
    layer = flexspec.MultiheadAttention(32, 4)
    assert (layer.num_kv_heads, layer.kdim, layer.vdim, layer.head_dim) == (4, 32, 32, 8)
    assert layer.k_proj.weight.shape == layer.v_proj.weight.shape == (32, 32)
    layer = flexspec.MultiheadAttention(32, 4, num_kv_heads=1, kdim=6, vdim=10)
    assert (layer.num_kv_heads, layer.kdim, layer.vdim) == (1, 6, 10)
    assert (layer.k_proj.weight.shape, layer.v_proj.weight.shape) == ((8, 6), (8, 10))
    assert (layer.q_proj.weight.shape, layer.out_proj.weight.shape) == ((32, 32), (32, 32))


def test_the_layer_s_parameters_take_its_bias_device_and_dtype():
    layer = flexspec.MultiheadAttention(32, 4, "causal + rel_bias", bias=False)
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
        assert proj.bias is None
    assert layer.attention.tables["rel_bias_table"].dtype == torch.float32  # the default
    layer = flexspec.MultiheadAttention(32, 4, "causal + rel_bias", device="meta",
                                        dtype=torch.float64)
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
        for tensor in (proj.weight, proj.bias):
            assert (tensor.device.type, tensor.dtype) == ("meta", torch.float64)
    table = layer.attention.tables["rel_bias_table"]
    assert (table.device.type, table.dtype, table.shape) == ("meta", torch.float64, (4, 257))


def test_the_layer_s_options_reach_both_of_its_attentions():
    layer = flexspec.MultiheadAttention(32, 4, "causal & window(3)", backend="reference",
                                        block_size=64, block_masks="intervals")
    for attn in (layer._unpadded, layer.attention.attention):
        assert (attn.backend, attn.block_size, attn.block_masks) == \
            ("reference", (64, 64), "intervals")
    assert str(layer._unpadded.spec) == "causal & window(3)"
    assert str(layer.attention.attention.spec) == "causal & window(3) & key_padding"
    assert layer.attention.num_heads == 4


def test_the_layer_reads_its_spec_from_its_library():
    from flexspec.lang.library import load_text
    library = load_text("mask near = abs(q - kv) <= 1")
    layer = flexspec.MultiheadAttention(8, 2, "near", library=library, batch_first=True)
    x = torch.randn(1, 6, 8)
    padding = torch.zeros(1, 6, dtype=torch.bool)
    with torch.no_grad():
        out, _ = layer(x)
        padded, _ = layer(x, key_padding_mask=padding)
    torch.testing.assert_close(padded, out)
    assert layer._unpadded.dense_mask(6, 6)[0, 0].equal(
        (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs() <= 1)


def test_the_layer_s_repr_names_its_sizes():
    assert flexspec.MultiheadAttention(32, 4, num_kv_heads=2, batch_first=True).extra_repr() \
        == "embed_dim=32, num_heads=4, num_kv_heads=2, batch_first=True"


def test_every_refused_call_argument_says_why_in_full():
    layer = flexspec.MultiheadAttention(32, 4, "causal", batch_first=True)
    x = torch.randn(1, 5, 32)
    with pytest.raises(flexspec.SpecError, match=whole(
            "flexspec does not compute attention weights: call with need_weights=False (the "
            "default here)")):
        layer(x, need_weights=True)
    with pytest.raises(flexspec.SpecError, match=whole(
            "flexspec.MultiheadAttention takes its pattern as a spec, not an attn_mask: build "
            "the layer with it, e.g. MultiheadAttention(E, H, 'causal & window(128)'), or give "
            "a mask that changes per call as a binding of a spec that reads one "
            "(docs/howto.md, bindings)")):
        layer(x, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    full = flexspec.MultiheadAttention(32, 4, "full & window(2)", batch_first=True)
    with pytest.raises(flexspec.SpecError, match=whole(
            "is_causal=True, but this layer's spec is 'full & window(2)', which is not causal: "
            "the spec alone says which keys a query sees")):
        full(x, is_causal=True)
    full(x, is_causal=False)


@pytest.mark.parametrize("batch_first", [True, False])
def test_inputs_of_the_wrong_shape_say_the_layout_in_full(batch_first):
    layer = flexspec.MultiheadAttention(32, 4, "full", kdim=12, vdim=20, batch_first=batch_first)
    layout = "(N, L, E)" if batch_first else "(L, N, E)"
    good = {"query": torch.randn(2, 3, 32), "key": torch.randn(2, 3, 12),
            "value": torch.randn(2, 3, 20)}
    dims = {"query": 32, "key": 12, "value": 20}
    for name in good:
        for bad, shown in ((torch.randn(2, 3, 31), "[2, 3, 31]"), (torch.randn(3, 32), "[3, 32]"),
                           (torch.randn(1, 2, 3, 32), "[1, 2, 3, 32]"), ([1, 2], "[1, 2]")):
            with pytest.raises(flexspec.BindingError, match=whole(
                    f"{name} must be {layout} with E = {dims[name]}, got {shown}")):
                layer(**{**good, name: bad})
    layer(**good)


def test_query_key_and_value_must_share_the_batch_and_key_and_value_the_length():
    layer = flexspec.MultiheadAttention(32, 4, "full", batch_first=True)
    q = torch.randn(2, 3, 32)
    for key, value in ((torch.randn(1, 5, 32), torch.randn(1, 5, 32)),
                       (torch.randn(2, 5, 32), torch.randn(1, 5, 32)),
                       (torch.randn(2, 5, 32), torch.randn(2, 4, 32))):
        with pytest.raises(flexspec.BindingError, match=whole(
                f"query, key and value must share the batch size, and key and value the "
                f"length: got query [2, 3, 32], key {list(key.shape)}, value "
                f"{list(value.shape)} (as (N, L, E))")):
            layer(q, key, value)
    # the same in the (L, N, E) layout: the shapes are shown as (N, L, E)
    layer = flexspec.MultiheadAttention(32, 4, "full")
    with pytest.raises(flexspec.BindingError, match=whole(
            "query, key and value must share the batch size, and key and value the length: got "
            "query [2, 3, 32], key [1, 5, 32], value [1, 5, 32] (as (N, L, E))")):
        layer(torch.randn(3, 2, 32), torch.randn(5, 1, 32))


def test_a_key_padding_mask_of_the_wrong_shape_or_type_says_so_in_full():
    layer = flexspec.MultiheadAttention(32, 4, "full", batch_first=True)
    x = torch.randn(2, 3, 32)
    for bad, shown in ((torch.zeros(2, 4, dtype=torch.bool), "[2, 4]"),
                       (torch.zeros(1, 3, dtype=torch.bool), "[1, 3]"),
                       (torch.zeros(3, dtype=torch.bool), "[3]"), ([[False] * 3] * 2, None)):
        shown = shown or repr(bad)
        with pytest.raises(flexspec.BindingError, match=whole(
                f"key_padding_mask must be (2, 3) (True marks padding), got {shown}")):
            layer(x, key_padding_mask=bad)
    with pytest.raises(flexspec.BindingError, match=whole(
            "key_padding_mask must be a bool tensor (True marks padding), got torch.int64")):
        layer(x, key_padding_mask=torch.zeros(2, 3, dtype=torch.int64))


def reference_layer(layer, query, key, value, visible):
    """``layer``'s output computed by hand (batch first): projections, heads repeated for
    grouped queries, softmax over the keys ``visible`` (N, Lq, Lk) lets each query see."""
    n, lq, _ = query.shape
    lk = key.shape[1]
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.q_proj(query).view(n, lq, h, d).transpose(1, 2)
    k = layer.k_proj(key).view(n, lk, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    v = layer.v_proj(value).view(n, lk, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    scores = (q @ k.transpose(-2, -1) / d ** 0.5).masked_fill(~visible[:, None], float("-inf"))
    return layer.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(n, lq, h * d))


def test_a_cached_step_stands_after_the_cache_unless_q_offset_places_it():
    torch.manual_seed(7)
    layer = flexspec.MultiheadAttention(16, 2, "causal", num_kv_heads=1, batch_first=True)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        cache = flexspec.KVCache()
        assert cache.length == 0 and cache.k is None and cache.v is None
        layer(x[:, :4], cache=cache)
        assert cache.length == 4
        # the new query placed at position 1 sees the first two of the five keys
        out, _ = layer(x[:, 4:5], cache=cache, q_offset=1)
        visible = torch.tensor([True, True, False, False, False]).expand(2, 1, 5)
        torch.testing.assert_close(out, reference_layer(layer, x[:, 4:5], x[:, :5], x[:, :5],
                                                        visible), rtol=1e-5, atol=1e-5)
        # without q_offset it stands after the five cached keys and sees all six
        out, _ = layer(x[:, 5:6], cache=cache)
        visible = torch.ones(2, 1, 6, dtype=torch.bool)
        torch.testing.assert_close(out, reference_layer(layer, x[:, 5:6], x, x, visible),
                                   rtol=1e-5, atol=1e-5)
    # the cache holds the projected keys and values of every step, in order
    with torch.no_grad():
        k = layer.k_proj(x).view(2, 6, 1, 8).transpose(1, 2)
        v = layer.v_proj(x).view(2, 6, 1, 8).transpose(1, 2)
    torch.testing.assert_close(cache.k, k)
    torch.testing.assert_close(cache.v, v)


def test_a_key_padding_mask_with_a_cache_covers_the_cached_positions():
    torch.manual_seed(8)
    layer = flexspec.MultiheadAttention(16, 2, "causal", batch_first=True)
    x = torch.randn(2, 5, 16)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 1] = padding[1, 0] = True  # one cached position of each row is padding
    with torch.no_grad():
        cache = flexspec.KVCache()
        layer(x[:, :4], cache=cache)
        out, _ = layer(x[:, 4:], cache=cache, key_padding_mask=padding)
        with pytest.raises(flexspec.BindingError, match=r"key_padding_mask must be \(2, 6\)"):
            layer(x[:, 4:], cache=cache, key_padding_mask=padding)
    visible = (~padding)[:, None, :]
    torch.testing.assert_close(out, reference_layer(layer, x[:, 4:], x, x, visible),
                               rtol=1e-5, atol=1e-5)


def test_a_cache_refuses_keys_of_another_batch_head_count_or_head_size_in_full():
    cache = flexspec.KVCache()
    k = torch.randn(2, 3, 4, 8)
    assert cache.append(k, k + 1)[0] is k
    for other in (torch.randn(1, 3, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 3, 1, 4)):
        with pytest.raises(flexspec.BindingError, match=whole(
                f"this cache holds keys of shape [2, 3, 4, 8] (N, Hkv, L, D); the call's keys "
                f"are {list(other.shape)}: use one cache per layer and batch")):
            cache.append(other, other)
    assert cache.length == 4
    more = torch.randn(2, 3, 2, 8)
    keys, values = cache.append(more, more * 2)
    assert torch.equal(keys, torch.cat((k, more), dim=2))
    assert torch.equal(values, torch.cat((k + 1, more * 2), dim=2))
    assert cache.length == 6 and keys is cache.k and values is cache.v


def test_a_cache_of_another_type_is_refused_with_its_type_named():
    layer = flexspec.MultiheadAttention(16, 2, "causal", batch_first=True)
    x = torch.randn(1, 3, 16)
    for bad, name in (({}, "dict"), ([], "list"), (object(), "object")):
        with pytest.raises(flexspec.SpecTypeError, match=whole(
                f"cache must be a flexspec.KVCache, got {name}")):
            layer(x, cache=bad)


@pytest.mark.parametrize("padded", [False, True])
def test_bindings_reach_the_spec_with_and_without_key_padding(padded):
    torch.manual_seed(9)
    layer = flexspec.MultiheadAttention(16, 2, "causal & document", num_kv_heads=1,
                                        batch_first=True)
    x = torch.randn(2, 7, 16)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]])
    padding = torch.zeros(2, 7, dtype=torch.bool)
    if padded:
        padding[0, 4] = padding[1, 1] = True  # every query still sees a key
    with torch.no_grad():
        out, _ = layer(x, doc_ids=ids, key_padding_mask=padding if padded else None)
        position = torch.arange(7)
        visible = ((position[None, :, None] >= position[None, None, :])
                   & (ids[:, :, None] == ids[:, None, :]) & ~padding[:, None, :])
        expected = reference_layer(layer, x, x, x, visible)
    assert visible.any(-1).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_refused_call_keeps_nothing_in_the_cache():
    """A call the layer refuses after projecting (a key_padding_mask of the wrong length, a
    missing binding) leaves the cache as it was, so the corrected retry runs on the cached keys
    and its own (it ran on them twice: 12 keys instead of 6); keys of another dtype (a float32
    prefill, then a step under bf16 autocast) are refused naming both, the cache unchanged."""
    torch.manual_seed(0)
    layer = flexspec.MultiheadAttention(16, 2, "causal", batch_first=True)
    cache = flexspec.KVCache()
    prompt, token = torch.randn(1, 5, 16), torch.randn(1, 1, 16)
    with torch.no_grad():
        layer(prompt, cache=cache)
        before = (cache.k, cache.v)
        with pytest.raises(flexspec.BindingError):
            layer(token, cache=cache, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
        assert (cache.k, cache.v) == before and cache.length == 5
        got, _ = layer(token, cache=cache)
        whole, _ = layer(torch.cat([prompt, token], dim=1))
        torch.testing.assert_close(got[0, 0], whole[0, 5], rtol=1e-5, atol=1e-5)
        assert cache.length == 6
        with pytest.raises(flexspec.BindingError, match="holds torch.float32 keys on cpu; the "
                                                        "call's are torch.bfloat16"):
            cache.joined(*(t.bfloat16() for t in (cache.k, cache.v)))
        assert cache.length == 6
    documents = flexspec.MultiheadAttention(16, 2, "causal & doc", batch_first=True)
    kept = flexspec.KVCache()
    with torch.no_grad(), pytest.raises(flexspec.BindingError, match="doc_ids"):
        documents(prompt, cache=kept)
    assert kept.length == 0
