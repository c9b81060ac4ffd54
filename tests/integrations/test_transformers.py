"""flexspec inside transformers models (flexspec.integrations.transformers), driven as users run
them: tiny randomly initialised models built from configs (no downloads), compared with the same
weights under transformers' own eager attention. Each model gets its own config object:
``set_attn_implementation`` writes to the config, so two models sharing one would both switch."""

from __future__ import annotations

import collections
import contextlib
import copy
import re

import pytest
import torch

import flexspec

transformers = pytest.importorskip("transformers")
from flexspec.integrations import transformers as integration  # noqa: E402

COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

MODELS = {
    "llama": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(**COMMON)),
    "mistral (sliding window)": lambda: (transformers.MistralForCausalLM,
                                         transformers.MistralConfig(sliding_window=16, **COMMON)),
    "qwen2 (full and sliding layers)": lambda: (
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config(sliding_window=16, use_sliding_window=True,
                                 layer_types=["full_attention", "sliding_attention"], **COMMON)),
    "gemma2 (softcap, sliding layers)": lambda: (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config(sliding_window=16, attn_logit_softcapping=20.0,
                                  final_logit_softcapping=30.0, head_dim=16, **COMMON)),
    "gpt-oss (attention sinks, sliding layers)": lambda: (
        transformers.GptOssForCausalLM,
        transformers.GptOssConfig(
            **{**COMMON, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


@pytest.fixture(scope="module")
def name():
    return integration.register("flexspec_test")


def pair(make, implementation: str):
    """The same random weights under eager attention and under ``implementation``."""
    cls, config = make()
    torch.manual_seed(0)
    eager = cls(copy.deepcopy(config)).eval()
    eager.set_attn_implementation("eager")
    ours = cls(copy.deepcopy(config)).eval()
    ours.load_state_dict(eager.state_dict())
    ours.set_attn_implementation(implementation)
    assert eager.config._attn_implementation == "eager"
    return eager, ours


def labels_past_the_padding(ids, mask):
    """Labels that leave the padding's rows out of the loss, and the first token after it (the
    labels shift by one): eager attention spreads a row that sees no key over all of them,
    flexspec gives it zeros, so only the other rows compare."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    return labels


def left_padded(length=40):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :5] = 0  # the second row is 5 tokens shorter, padded on the left
    return ids, mask


@pytest.mark.parametrize("model", list(MODELS))
def test_logits_and_generated_tokens_equal_eager_attention(model, name):
    eager, ours = pair(MODELS[model], name)
    ids, mask = left_padded()
    with torch.no_grad():
        expected, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        tokens = eager.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        ours_tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    valid = mask.bool()  # logits at padding positions are not used by anything
    assert (expected - got)[valid].abs().max() <= 1e-4
    assert torch.equal(tokens, ours_tokens)


def test_a_window_off_by_one_is_caught(monkeypatch):
    """The comparison above can fail: flexspec's sliding_window(W) (W + 1 keys) where the model
    means W keys changes the logits. (A registration of its own: a registration keeps the spec
    it compiled for each kind of layer.)"""
    monkeypatch.setattr(integration._Layers, "spec_for",
                        lambda self, window, softcap, padded, packed:
                        flexspec.parse(f"sliding_window({window})"))
    eager, ours = pair(MODELS["mistral (sliding window)"],
                       integration.register("flexspec_off_by_one"))
    ids, _ = left_padded()
    with torch.no_grad():
        assert (eager(ids).logits - ours(ids).logits).abs().max() > 1e-3


def test_packed_documents_equal_separate_documents():
    """Two documents packed in one row with doc_ids (spec 'causal & doc') give each document's
    logits as if it ran alone."""
    implementation = integration.register("flexspec_packed", spec="causal & doc")
    _, model = pair(MODELS["llama"], implementation)
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, 100, (1, n), generator=generator) for n in (17, 23))
    packed = torch.cat([first, second], dim=1)
    doc_ids = torch.tensor([[0] * 17 + [1] * 23])
    # positions restart with each document, as packed training sets them
    positions = torch.cat([torch.arange(17), torch.arange(23)])[None]
    with torch.no_grad():
        together = model(packed, position_ids=positions, doc_ids=doc_ids).logits
        alone = [model(doc, doc_ids=torch.zeros_like(doc)).logits for doc in (first, second)]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", ["llama", "gpt-oss (attention sinks, sliding layers)"])
def test_a_few_training_steps_lower_the_loss_with_and_without_sinks(model, name):
    """On the CPU the reference path computes the log-sum-exp with a gradient, so sinks train."""
    _, trained = pair(MODELS[model], name)
    trained.train()
    ids, mask = left_padded(24)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        loss = trained(ids, attention_mask=mask, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_sinks_train_when_only_the_value_projections_learn(name):
    """LoRA-style training of the value projections alone: the first layer's q and k need no
    gradient, so its log-sum-exp has none, and the sinks need none of it (it raised). The
    gradients equal the eager model's."""
    eager, ours = pair(MODELS["gpt-oss (attention sinks, sliding layers)"], name)
    ids, mask = left_padded(20)
    labels = labels_past_the_padding(ids, mask)
    for model in (eager, ours):
        for parameter_name, parameter in model.named_parameters():
            parameter.requires_grad_("v_proj" in parameter_name)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    learnt = [(n, p.grad) for n, p in ours.named_parameters() if p.requires_grad]
    assert learnt and all(grad is not None for _, grad in learnt)
    for (label, mine), theirs in zip(learnt, [p.grad for p in eager.parameters()
                                              if p.requires_grad]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{label}: {m}")


def test_what_flexspec_cannot_do_is_a_clear_error(name):
    cls, config = MODELS["llama"]()
    config.attention_dropout = 0.1
    model = cls(config).train()
    model.set_attn_implementation(name)
    ids, _ = left_padded(8)
    with pytest.raises(flexspec.SpecError, match=exactly(
            "flexspec has no attention dropout: set the config's attention_dropout to 0.0 (or "
            "run the model in eval mode)")):
        model(ids)
    for wrong in ("", None, 3):
        with pytest.raises(flexspec.SpecError, match="must be a non-empty str"):
            integration.register(wrong)
    _, model = pair(MODELS["llama"], name)
    with pytest.raises(flexspec.SpecError, match=exactly(
            "flexspec does not return attention weights (output_attentions): use "
            "attn_implementation='eager' for them")):
        model(ids, output_attentions=True)
    layers = integration._REGISTERED[name]
    q = torch.zeros(1, 2, 3, 8)
    for foreign in (torch.ones(1, 1, 3, 3, dtype=torch.bool), torch.ones(1, 3)):
        with pytest.raises(flexspec.SpecError, match=exactly(
                "the attention mask did not come from flexspec's mask function: register() "
                "both with transformers (it does) and build the model with attn_implementation "
                "set to the registered name")):
            layers.attention(None, q, q, q, foreign)


def exactly(message: str) -> str:
    """A pytest ``match`` for the whole message."""
    return "^" + re.escape(message) + "$"


def test_any_name_transformers_accepts_can_be_registered():
    """transformers takes any string as an attention implementation's name; so does register()
    (a name such as "flexspec-docs" was refused as not an identifier)."""
    implementation = integration.register("flexspec-docs")
    assert implementation == "flexspec-docs"
    eager, model = pair(MODELS["llama"], implementation)
    assert model.config._attn_implementation == "flexspec-docs"
    ids, _ = left_padded(8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_spec_with_scores_and_padding_keeps_each_row_as_if_alone():
    """register(spec="causal + alibi"): padding joins the mask before the score modifiers, and a
    left-padded row's logits equal the same tokens run alone."""
    implementation = integration.register("flexspec_alibi", spec="causal + alibi")
    _, model = pair(MODELS["llama"], implementation)
    ids, mask = left_padded(30)
    # rotary positions start at the first real token, as generate() sets them
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(ids[1:, 5:]).logits
        batched = model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(batched[1, 5:], alone[0], rtol=1e-4, atol=1e-4)


def test_packing_found_from_position_ids_keeps_documents_apart(name):
    """Without doc_ids, an attention_mask or a cache, position_ids that restart mark documents
    (as transformers finds them): the packed row equals its documents run alone, and equals the
    eager model's own packed-sequence handling."""
    eager, model = pair(MODELS["llama"], name)
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 100, (1, n), generator=generator) for n in (11, 19))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(11), torch.arange(19)])[None]
    with torch.no_grad():
        together = model(packed, position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(doc).logits for doc in (first, second)], dim=1)
        theirs = eager(packed, position_ids=positions, use_cache=False).logits
        # with a cache transformers does not look for packing: neither does flexspec
        cached, theirs_cached = (m(packed, position_ids=positions).logits for m in (model, eager))
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(together, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cached, theirs_cached, rtol=1e-4, atol=1e-4)
    assert (cached - together).abs().max() > 1e-2


def test_gradients_through_sinks_equal_eager(name):
    eager, ours = pair(MODELS["gpt-oss (attention sinks, sliding layers)"], name)
    ids, mask = left_padded(20)
    for model in (eager, ours):
        model.train()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
    for (label, theirs), (_, mine) in zip(eager.named_parameters(), ours.named_parameters()):
        if theirs.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-3, atol=1e-5,
                                       msg=lambda m: f"{label}: {m}")
    assert ours.model.layers[0].self_attn.sinks.grad.abs().sum() > 0


def test_sinks_run_at_long_sequences_on_the_cpu(name):
    """gpt-oss merges its sinks through the log-sum-exp: at 128+ positions the CPU's compiled
    kernel has none, and every gpt-oss model failed there (red-team 2026-12-02, item 4)."""
    eager, ours = pair(MODELS["gpt-oss (attention sinks, sliding layers)"], name)
    ids, mask = left_padded(140)
    with torch.no_grad():
        expected, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert (expected - got)[mask.bool()].abs().max() <= 1e-4


def test_packing_is_found_in_the_rows_that_restart_only():
    """Blind spot: a batch where only some rows restart their position_ids."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    documents = integration.packed_documents(positions, 2)
    assert documents.tolist() == [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert integration.packed_documents(torch.arange(6)[None].expand(2, 6), 2) is None


def test_a_cache_longer_than_the_tokens_seen_pads_its_tail_as_invalid():
    """Blind spot: a static cache holds more slots than tokens: the attention mask covers the
    tokens seen, the slots after them are keys no query may see."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # 4 tokens seen, a cache of 8 slots
    placed = integration.placement(2, 1, 8, q_offset=3, kv_offset=0, attention_mask=mask)
    assert placed.valid.tolist() == [[False, True, True, True, False, False, False, False],
                                     [True, True, True, True, False, False, False, False]]
    # with a sliding cache that dropped keys, the mask is read from the kv offset on
    placed = integration.placement(2, 1, 3, q_offset=4, kv_offset=1, attention_mask=mask)
    assert placed.valid.tolist() == [[True, True, True], [True, True, True]]


def test_a_prompt_past_one_block_runs_the_compiled_kernel(name, caplog):
    """The tiny-model tests above stay under 128 positions, where the CPU runs the dense
    reference: a left-padded prompt of 140 tokens reaches the compiled FlexAttention kernel
    (first-hour review), and gives eager's logits."""
    import logging
    eager, ours = pair(MODELS["llama"], name)
    ids, mask = left_padded(140)
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="flexspec"):
        expected, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert (expected - got)[mask.bool()].abs().max() <= 1e-4
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planned")]
    assert planned and all(": flex (" in message for message in planned), planned


@pytest.mark.parametrize("model", list(MODELS))
def test_generate_with_the_static_cache_gives_eager_tokens(model, name):
    """Issue 26: `cache_implementation = "static"` raised AttributeError ('Placement' object
    has no attribute 'ndim'): generate() prepares each step's mask before the forward, which
    prepares it again. Left-padded prompts; the cache is longer than the tokens seen (its tail
    is empty); sliding layers get transformers' sliding static layers."""
    eager, ours = pair(MODELS[model], name)
    ids, mask = left_padded(20)
    for m in (eager, ours):
        m.generation_config.cache_implementation = "static"
    with torch.no_grad():
        tokens = eager.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        ours_tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(tokens, ours_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("model, length", [("llama", 20), ("gemma2 (softcap, sliding layers)", 20),
                                           ("gpt-oss (attention sinks, sliding layers)", 140)])
def test_a_compiled_forward_with_the_static_cache_gives_eager_tokens_in_one_graph(
        model, length, name):
    """transformers' production decode path: the static cache with torch.compile(model.forward).
    The mask function is traced and each attention call is one operator, so the forward is one
    graph with no break (a break around every layer compiled each layer's frame apart, and
    past dynamo's recompile limit a deeper model's forward ran eagerly); one graph for the
    prefill, one for the decode steps. At 140 positions the compiled
    kernels run inside the operator. On the CPU here; CUDA graphs (mode='reduce-overhead')
    need the GPU suite."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    eager, ours = pair(MODELS[model], name)
    ids, mask = left_padded(length)
    for m in (eager, ours):
        m.generation_config.cache_implementation = "static"
    ours.forward = torch.compile(ours.forward)
    with torch.no_grad():
        tokens = eager.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        ours_tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, ours_tokens)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow
def test_a_compiled_forward_that_trains_breaks_around_attention_and_gives_eager_gradients(name):
    """The operator has no gradient: a compiled forward whose attention needs one runs the call
    outside the graph (a break per layer) and gives the eager model's loss and gradients (the
    padding's rows left out of the loss)."""
    eager, ours = pair(MODELS["llama"], name)
    ids, mask = left_padded(20)
    labels = labels_past_the_padding(ids, mask)
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ours.forward)
    losses = [forward(ids, attention_mask=mask, labels=labels).loss
              for forward in (eager.forward, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0])
    assert sum(counters["graph_break"].values()) > 0
    for (label, mine), theirs in zip(ours.named_parameters(), eager.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{label}: {m}")


@pytest.mark.slow
def test_a_compiled_forward_keeps_packed_documents_apart_found_or_given(name):
    """Inside torch.compile, calls that need what the forward finds (packed documents from
    position_ids) or is given by name (doc_ids) are not the operator: they break the graph and
    give the eager results, documents apart."""
    eager, model = pair(MODELS["llama"], name)
    given = integration.register("flexspec_packed_compiled", spec="causal & doc")
    _, by_name = pair(MODELS["llama"], given)
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 100, (1, n), generator=generator) for n in (11, 19))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(11), torch.arange(19)])[None]
    doc_ids = torch.tensor([[0] * 11 + [1] * 19])
    torch._dynamo.reset()
    with torch.no_grad():
        theirs = eager(packed, position_ids=positions, use_cache=False).logits
        found = torch.compile(model.forward)(packed, position_ids=positions,
                                             use_cache=False).logits
        named = torch.compile(by_name.forward)(packed, position_ids=positions,
                                               doc_ids=doc_ids).logits
    torch.testing.assert_close(found, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(named, theirs, rtol=1e-4, atol=1e-4)


def test_a_forward_finds_its_packed_documents_once_for_all_layers(monkeypatch):
    """The layers of one forward share its flexspec.Step: packed documents are found from
    position_ids once per forward, not once per layer (issue 26)."""
    implementation = integration.register("flexspec_packed_once")
    _, model = pair(MODELS["llama"], implementation)
    found = []
    real = integration.packed_documents
    monkeypatch.setattr(integration, "packed_documents",
                        lambda *args: found.append(1) or real(*args))
    ids = torch.randint(0, 100, (1, 30), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(12), torch.arange(18)])[None]
    with torch.no_grad():
        model(ids, position_ids=positions, use_cache=False)
    assert len(found) == 1 and model.config.num_hidden_layers == 2


# ---- mutation testing of integrations/transformers ----------------------------------------------


def fresh_name(stem):
    """A name never registered before in this process (registrations are global: a test run
    forked from a process that registered a name would find it there already)."""
    import uuid
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def test_packed_documents_of_one_row_of_positions_and_of_a_last_one_token_document():
    # position_ids of one row (as a model gets them) serve every batch row
    documents = integration.packed_documents(torch.tensor([0, 1, 2, 0, 1]), 2)
    assert documents.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    # a document that is only the last token still makes the row packed
    documents = integration.packed_documents(torch.tensor([[0, 1, 2, 3, 0]]), 1)
    assert documents.tolist() == [[0, 0, 0, 0, 1]]


def test_register_without_transformers_says_how_to_install_it(monkeypatch):
    import re
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(flexspec.SpecError, match="^" + re.escape(
            "flexspec.integrations.transformers needs transformers: pip install "
            "'flexspec[transformers]'") + "$"):
        integration.register(fresh_name("flexspec-missing"))


def test_the_default_registration_is_named_flexspec():
    assert integration.register() == "flexspec"  # docs/howto.md: name = register()


def test_a_name_registered_now_serves_attention_and_masks():
    implementation = integration.register(fresh_name("flexspec-fresh"))
    eager, ours = pair(MODELS["llama"], implementation)
    ids, mask = left_padded(24)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert (expected - got)[mask.bool()].abs().max() <= 1e-4


def test_a_spec_from_a_library_reaches_every_kind_of_layer():
    """register(spec=..., library=...): the padded, sliding and soft-capped layers of Gemma-2 all
    join their masks and scores to a spec whose names only the library knows."""
    library = flexspec.loads("mask own_causal = kv <= q")
    implementation = integration.register(fresh_name("flexspec-library"), spec="own_causal",
                                          library=library)
    eager, ours = pair(MODELS["gemma2 (softcap, sliding layers)"], implementation)
    ids, mask = left_padded(30)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert (expected - got)[mask.bool()].abs().max() <= 1e-4


def test_a_placement_keeps_one_step_per_kind_of_call():
    """HandedMask.step: packed documents from restarting position_ids, only without a cache and
    without doc_ids given by name; one step per position tensor, cache use, doc_ids and batch."""
    where = integration.HandedMask(0, 0, None)
    packed, plain = torch.tensor([[0, 1, 2, 0, 1]]), torch.tensor([[0, 1, 2, 3, 4]])
    first = where.step({"position_ids": packed}, 1)
    assert first.bindings["doc_ids"].tolist() == [[0, 0, 0, 1, 1]] and first.q_offset == 0
    assert where.step({"position_ids": packed}, 1) is first  # the next layer's
    assert "doc_ids" not in where.step({"position_ids": plain}, 1).bindings
    assert "doc_ids" not in where.step({"position_ids": packed, "use_cache": True}, 1).bindings
    given = torch.zeros(1, 5, dtype=torch.int64)
    assert "doc_ids" not in where.step({"position_ids": packed, "doc_ids": given}, 1).bindings
    assert where.step({"position_ids": packed}, 2).bindings["doc_ids"].shape == (2, 5)
    # a sliding cache that dropped keys shifts the queries by its key offset
    assert integration.HandedMask(10, 4, None).step({}, 1).q_offset == 6


def test_each_kind_of_layer_is_compiled_once_with_the_registered_options():
    layers = integration._Layers(flexspec.parse("causal"), None,
                                 {"backend": "reference", "block_size": 64})
    attn = layers.attention_for(8, None, True, False)
    assert (attn.backend, attn.block_size) == ("reference", (64, 64))
    assert str(attn.spec) == "causal & (sliding_window(7) & key_padding)"
    assert layers.attention_for(8, None, True, False) is attn
    assert layers.attention_for(8, None, False, False) is not attn


def test_a_window_of_one_key_is_the_query_alone_and_none_is_refused():
    import re
    layers = integration._Layers(flexspec.parse("causal"), None, {})
    assert str(layers.spec_for(1, None, False)) == "causal & sliding_window(0)"
    with pytest.raises(flexspec.SpecError, match="^" + re.escape(
            "sliding_window must be at least 1, got 0") + "$"):
        layers.spec_for(0, None, False)


def test_a_library_s_own_names_do_not_change_what_a_layer_joins():
    """Found by mutation testing (spec_for passing the library to with_score): the masks and the
    softcap a layer joins to the registered spec (transformers' sliding window, padding, packed
    documents, Gemma-2's logit softcapping) were resolved in the registered library first, so a
    library with patterns of its own named softcap, sliding_window, key_padding or doc changed
    them (Gemma-2's tanh cap became the library's score). They mean the registry's patterns."""
    library = flexspec.loads("""
mask own_causal = kv <= q
score softcap(c: float) = score * 2.0
mask sliding_window(n: int) = true
mask key_padding(valid: bool[B, KV_LEN]) = true
mask doc(doc_ids: int[B, KV_LEN]) = true
""")
    implementation = integration.register(fresh_name("flexspec-shadowed"), spec="own_causal",
                                          library=library)
    eager, ours = pair(MODELS["gemma2 (softcap, sliding layers)"], implementation)
    ids, mask = left_padded(30)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert (expected - got)[mask.bool()].abs().max() <= 1e-4
    # packed documents (restarting position_ids, no cache) stay apart
    _, model = pair(MODELS["llama"], implementation)
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 100, (1, n), generator=generator) for n in (11, 13))
    positions = torch.cat([torch.arange(11), torch.arange(13)])[None]
    with torch.no_grad():
        together = model(torch.cat([first, second], dim=1), position_ids=positions,
                         use_cache=False).logits
        alone = [model(doc, use_cache=False).logits for doc in (first, second)]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), rtol=1e-4, atol=1e-4)


# ---- the operator a compiled forward calls ---------------------------------------------------

def _dense_layer(q, k, v, scale, q_offset, kv_offset, valid, window, softcap, sinks):
    """One layer's attention as transformers means it, in float64, written out: causal at the
    cache's offsets, a window of ``window`` keys (the query included), the padding, Gemma-2's
    cap, gpt-oss's sink logits; GQA by repeating key heads. ``[B, S, Hq, Dv]``."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(q.shape[2])[:, None] + q_offset.reshape(-1, 1, 1, 1) - kv_offset
    keys = torch.arange(k.shape[2])[None, :]
    seen = (keys <= rows)
    if window is not None:
        seen = seen & (rows - keys < window)
    seen = seen & valid[:, None, None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("window, softcap, sinks", [(None, None, False), (5, None, False),
                                                    (None, 20.0, False), (5, None, True)])
@pytest.mark.parametrize("variant", ["transformers_attention",
                                     "transformers_attention_between_graphs"])
def test_the_operator_gives_the_layer_s_attention(window, softcap, sinks, variant, name):
    """torch.ops.flexspec.transformers_attention (and its variant run between CUDA graph
    replays), as a compiled forward calls it (a static cache: a tensor query offset, a padded
    batch, GQA, a value width of its own), against the layer written out in float64."""
    operator = getattr(torch.ops.flexspec, variant)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, 8, generator=generator)
    k = torch.randn(2, 2, 24, 8, generator=generator)
    v = torch.randn(2, 2, 24, 6, generator=generator)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, :4] = False  # the second row is padded on the left
    offset = torch.tensor(17)
    s_aux = torch.randn(4, generator=generator) if sinks else None
    out = operator(
        name, -1 if window is None else window, softcap or 0.0, q, k, v, 0.3, offset, 0, 0,
        valid, s_aux)
    expected = _dense_layer(q, k, v, 0.3, offset, 0, valid, window, softcap, s_aux)
    assert out.shape == (2, 3, 4, 6)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # an int offset (the prefill) and a key offset (a sliding cache that dropped old keys)
    out = operator(name, -1, 0.0, q, k, v, 0.3, None, 21, 4, valid, None)
    expected = _dense_layer(q, k, v, 0.3, torch.tensor(21), 4, valid, None, None, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_operator_refuses_a_window_of_no_key_as_the_eager_path_does(name):
    q = torch.zeros(1, 4, 2, 8)
    k = torch.zeros(1, 2, 5, 8)
    with pytest.raises(flexspec.SpecError, match="sliding_window must be at least 1, got 0"):
        torch.ops.flexspec.transformers_attention(name, 0, 0.0, q, k, k, None, None, 3, 0, None,
                                                  None)


def test_the_operator_leaves_the_warm_up_pool_of_its_inputs_device(name, monkeypatch):
    """The operator allocates outside a CUDA graph trees warm-up's pool on the device of its
    inputs (runtime.capture.outside_graph_pool; the pool itself needs a GPU)."""
    asked = []

    @contextlib.contextmanager
    def recorded(device):
        asked.append(device)
        yield False
    monkeypatch.setattr(integration, "outside_graph_pool", recorded)
    q = torch.zeros(1, 4, 2, 8)
    torch.ops.flexspec.transformers_attention(name, -1, 0.0, q, q, q, None, None, 0, 0, None,
                                              None)
    assert asked == [q.device]


def test_the_operator_s_fake_gives_the_output_s_shape(name):
    """What the compiled graph is traced with: ``[B, S, Hq, Dv]`` of q's dtype and device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(3, 4, 5, 8), torch.empty(3, 2, 9, 8)
        v = torch.empty(3, 2, 9, 6, dtype=torch.float32)
        out = torch.ops.flexspec.transformers_attention(name, -1, 0.0, q, k, v, None, None, 0, 0,
                                                        None, None)
    assert tuple(out.shape) == (3, 5, 4, 6) and out.dtype == q.dtype


def test_a_compiled_call_runs_as_the_operator_only_when_nothing_needs_the_graph_broken():
    """The operator has no gradient and sees no binding given by name nor packed documents:
    each of those keeps the call outside the graph."""
    layers = integration._Layers(flexspec.parse("causal & doc"), None, {}, "flexspec_test")
    q = k = v = torch.zeros(1, 2, 4, 8)
    where = integration.HandedMask(torch.tensor(0), 0, None)
    assert layers._operator_runs(where, {}, q, k, v, None)
    assert layers._operator_runs(where, {"use_cache": True}, q, k, v, None)
    assert not layers._operator_runs(None, {}, q, k, v, None)
    unnamed = integration._Layers(flexspec.parse("causal"), None, {})
    assert not unnamed._operator_runs(where, {}, q, k, v, None)
    learning = torch.zeros(1, 2, 4, 8, requires_grad=True)
    assert not layers._operator_runs(where, {}, learning, k, v, None)
    assert not layers._operator_runs(where, {}, q, k, v, torch.zeros(2, requires_grad=True))
    with torch.no_grad():  # inference of a model whose weights learn: no gradient needed
        assert layers._operator_runs(where, {}, learning, k, v, None)
    assert not layers._operator_runs(where, {"doc_ids": torch.zeros(1, 4)}, q, k, v, None)
    plain = integration._Layers(flexspec.parse("causal"), None, {}, "flexspec_test")
    assert not plain._operator_runs(where, {"doc_ids": torch.zeros(1, 4)}, q, k, v, None)
    # position_ids that may restart (no mask given, no cache, offset 0): packing is looked for
    positions = {"position_ids": torch.arange(4)[None]}
    at_start = integration.HandedMask(0, 0, None)
    assert not plain._operator_runs(at_start, positions, q, k, v, None)
    assert plain._operator_runs(at_start, {**positions, "use_cache": True}, q, k, v, None)
    assert plain._operator_runs(integration.HandedMask(0, 0, None, True), positions, q, k, v,
                                None)
    assert plain._operator_runs(integration.HandedMask(3, 0, None), positions, q, k, v, None)
    assert plain._operator_runs(where, positions, q, k, v, None)


def test_inside_torch_compile_the_attention_function_calls_the_operator(name, monkeypatch):
    """What a compiled forward's attention call does (torch.compile's flag set by hand, so the
    call runs here eagerly): the operator, given every part of the call, against the layer
    written out in float64; a call the operator cannot take goes to the eager path."""
    layers = integration._REGISTERED[name]
    generator = torch.Generator().manual_seed(5)
    q = 3 * torch.randn(2, 4, 3, 8, generator=generator)  # scores well past a cap of 2
    k = torch.randn(2, 2, 24, 8, generator=generator)
    v = torch.randn(2, 2, 24, 6, generator=generator)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, :4] = False
    sinks = torch.randn(4, generator=generator)
    operator_calls = []

    def counted(variant):
        real = getattr(torch.ops.flexspec, variant)

        def call(*args):
            operator_calls.append((variant, args[0]))
            tensor_offset, int_offset = args[7], args[8]
            # a graph must not read a tensor offset on the host: it travels as a tensor
            assert type(int_offset) is int
            assert tensor_offset is None or isinstance(tensor_offset, torch.Tensor)
            return real(*args)
        return call
    for variant in ("transformers_attention", "transformers_attention_between_graphs"):
        monkeypatch.setattr(integration.torch.ops.flexspec, variant, counted(variant),
                            raising=False)
    cases = [(integration.HandedMask(torch.tensor(17), 0, valid), None, None, None),
             (integration.HandedMask(torch.tensor(17), 0, valid), 5, 2.0, sinks),
             (integration.HandedMask(21, 4, valid), 6, None, None),
             (integration.HandedMask(torch.tensor(19), 0, None), None, None, sinks),
             (integration.HandedMask(torch.tensor(17), 3, valid), 6, None, None)]
    for compiling in (False, True):
        monkeypatch.setattr(integration, "_inside_graph", lambda: compiling)
        for where, window, softcap, s_aux in cases:
            out, weights = layers.attention(None, q, k, v, where, scaling=0.3,
                                            sliding_window=window, softcap=softcap,
                                            s_aux=s_aux)
            offset = where.q_offset if isinstance(where.q_offset, torch.Tensor) \
                else torch.tensor(where.q_offset)
            every = torch.ones(2, 24, dtype=torch.bool) if where.valid is None else where.valid
            expected = _dense_layer(q, k, v, 0.3, offset, where.kv_offset, every, window, softcap,
                                    s_aux)
            assert weights is None and out.shape == (2, 3, 4, 6)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # all the compiled calls, none of the others; a call at int offsets other than 0 (a
    # cache's counter) runs between CUDA graph replays, the others are captured
    captured, between = "transformers_attention", "transformers_attention_between_graphs"
    assert operator_calls == [(captured, name), (captured, name), (between, name),
                              (captured, name), (between, name)]
    # the operator has no gradient: a call whose q, k, v or sinks learn goes to the eager path
    where = cases[0][0]
    for learning in range(4):
        parts = [q, k, v, sinks]
        parts[learning] = parts[learning].clone().requires_grad_()
        layers.attention(None, *parts[:3], where, scaling=0.3, s_aux=parts[3])
    assert len(operator_calls) == len(cases)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "mistral (sliding window)"])
def test_a_compiled_static_cache_step_captures_the_operator_with_no_int_of_the_cache(
        model, name):
    """Which operator the compiled forward's graphs hold (CUDA graph trees capture the one and
    run the other between replays; they record a graph again for every value of an int the
    graph takes). transformers' static cache gives a full layer its query offset as a tensor,
    a sliding layer ints from the cache's counter, which move every decode step; generate()
    prepares each step's placement outside the graph, where flexspec makes the offset a
    tensor. So every call, prefill and decode, full and sliding, is the captured operator and
    none takes an int. Two layers, one graph for the prefill and one for the decode; the
    tokens are eager's."""
    from torch._dynamo.utils import counters
    held = collections.Counter()
    int_arguments = []

    def record(graph_module, inputs):
        for node in graph_module.graph.nodes:
            if str(node.target).startswith("flexspec."):
                held[str(node.target).removeprefix("flexspec.")] += 1
                int_arguments.extend(
                    arg for arg in node.args if isinstance(arg, torch.fx.Node)
                    and isinstance(arg.meta.get("example_value"), torch.SymInt))
        return graph_module.forward
    torch._dynamo.reset()
    counters.clear()
    eager, ours = pair(MODELS[model], name)
    ids, mask = left_padded(20)  # past the window of 16 within the decode
    for m in (eager, ours):
        m.generation_config.cache_implementation = "static"
    ours.forward = torch.compile(ours.forward, backend=record)
    with torch.no_grad():
        tokens = eager.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        ours_tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, ours_tokens)
    assert held == {"transformers_attention": 4} and int_arguments == []
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2


def _keys_shown(tensor: torch.Tensor):
    """The dispatch keys dynamo guards on: the tensor's, with this thread's included and
    excluded keys applied."""
    return ((torch._C._dispatch_keys(tensor) | torch._C._dispatch_tls_local_include_set())
            - torch._C._dispatch_tls_local_exclude_set())


def test_inside_the_operator_ordinary_and_inference_tensors_show_the_same_keys():
    """CUDA graph trees warm a graph up and record it in different dispatch states, with
    inference tensors in one and ordinary ones in the other: a kernel compiled in the warm-up
    must not compile again in the recording. In the operator's state the two kinds guard
    alike; in inference mode alone (one of the trees' states) they do not."""
    ordinary = torch.ones(2, 3)
    with torch.inference_mode():
        inference = torch.ones(2, 3)
        assert _keys_shown(ordinary) != _keys_shown(inference)
    with integration._one_dispatch_state():
        assert _keys_shown(ordinary) == _keys_shown(inference)
        assert torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()
    assert _keys_shown(ordinary) != _keys_shown(inference)


def test_ordinary_copies_inference_tensors_only():
    ordinary = torch.arange(4)
    assert integration._ordinary(ordinary) is ordinary
    assert integration._ordinary(None) is None
    with torch.inference_mode():
        inference = torch.arange(4)
        copied = integration._ordinary(inference)
    assert not copied.is_inference() and torch.equal(copied, inference)


@pytest.mark.parametrize("variant", ["transformers_attention",
                                     "transformers_attention_between_graphs"])
def test_the_operator_takes_inference_tensors_and_returns_an_ordinary_one(variant, name):
    """As a graph's warm-up calls it: in inference mode, on inference tensors. Its output is an
    ordinary tensor (the graph may use it outside inference mode), and right."""
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 3, 8, generator=generator),
               torch.randn(2, 2, 24, 8, generator=generator),
               torch.randn(2, 2, 24, 8, generator=generator))
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[0, :2] = False
    expected = _dense_layer(q, k, v, 0.3, torch.tensor(21), 0, valid, None, None, None)
    with torch.inference_mode():
        q, k, v, valid, offset = (t.clone() for t in (q, k, v, valid, torch.tensor(21)))
        out = getattr(torch.ops.flexspec, variant)(name, -1, 0.0, q, k, v, 0.3, offset, 0, 0,
                                                   valid, None)
    assert not out.is_inference()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_registration_serves_the_operator_under_its_name():
    implementation = integration.register("flexspec_operator_name", spec="causal")
    layers = integration._REGISTERED[implementation]
    assert layers.name == implementation
    q = torch.zeros(1, 2, 4, 8)
    assert layers._operator_runs(integration.HandedMask(torch.tensor(0), 0, None), {}, q, q, q,
                                 None)
    out = torch.ops.flexspec.transformers_attention(implementation, -1, 0.0, q, q, q, None, None,
                                                    0, 0, None, None)
    assert out.shape == (1, 4, 2, 8)


def test_the_mask_function_places_the_call(monkeypatch):
    """placement() as transformers calls it: offsets, padding, a static cache longer than the
    tokens seen, a placement generate() prepared, and inside torch.compile (flag set by hand)
    an unpadded batch keeps its all-true padding instead of reading it on the host."""
    assert integration.placement(2, 3, 10) == integration.HandedMask(0, 0, None)
    ones = torch.ones(2, 8, dtype=torch.long)
    assert integration.placement(2, 4, 6, q_offset=3, kv_offset=2, attention_mask=ones) == \
        integration.HandedMask(3, 2, None, True)
    padded = ones.clone()
    padded[1, :3] = 0
    placed = integration.placement(2, 1, 10, q_offset=7, kv_offset=2, attention_mask=padded)
    assert (placed.q_offset, placed.kv_offset, placed.given_mask) == (7, 2, True)
    # keys 2..11 of a cache of 12 slots, 8 seen: the last four are empty
    expected = torch.cat([padded.bool(), torch.zeros(2, 4, dtype=torch.bool)], dim=1)[:, 2:12]
    assert torch.equal(placed.valid, expected)
    prepared = integration.HandedMask(0, 0, placed.valid, True)
    again = integration.placement(2, 1, 10, q_offset=8, kv_offset=2, attention_mask=prepared)
    assert (again.q_offset, again.kv_offset, again.valid) == (8, 2, placed.valid)
    with pytest.raises(flexspec.SpecError, match=exactly(
            "the prepared placement covers 10 keys, this call 12: please report it")):
        integration.placement(2, 1, 12, attention_mask=prepared)
    with pytest.raises(flexspec.SpecError, match=exactly(
            "flexspec takes the 2-D attention_mask (1 for a token, 0 for padding), got one of "
            "shape [2, 1, 1, 8]")):
        integration.placement(2, 1, 8, attention_mask=ones[:, None, None])
    # more rows than keys seen: the empty tail still comes from the keys' count
    many = torch.ones(5, 3, dtype=torch.long)
    many[0, 0] = 0
    expected = torch.tensor([[True] * 3 + [False] * 3] * 5)
    expected[0, 0] = False
    assert torch.equal(integration.placement(5, 1, 6, attention_mask=many).valid, expected)
    monkeypatch.setattr(integration, "_inside_graph", lambda: True)
    inside = integration.placement(2, 4, 6, q_offset=3, kv_offset=2, attention_mask=ones)
    assert (inside.q_offset, inside.kv_offset, inside.given_mask) == (3, 2, True)
    assert inside.valid.shape == (2, 6) and bool(inside.valid.all())
