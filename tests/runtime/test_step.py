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


# --- the launch a step's first layer resolves for the later ones ------------------------------


def count_plans(monkeypatch) -> list:
    """Each call that takes the whole path (planning, positions, block mask) appends to it."""
    from flexspec.runtime.calls import Calls
    counted = []
    real = Calls._plan_for
    monkeypatch.setattr(Calls, "_plan_for",
                        lambda self, *args: counted.append(1) or real(self, *args))
    return counted


@pytest.mark.parametrize("text, offset", [
    ("causal & window(100) + alibi", 250),  # the keys cut to the rows' windows: 150:380
    ("causal & (window(100) | sink(4)) + softcap(20)", 250),
    ("causal & doc + head_bias", None),
])
def test_later_layers_of_a_step_only_launch_and_equal_the_reference(text, offset,
                                                                    eager_kernels, monkeypatch):
    """Issue 26, item 1: the first layers resolve the spec's launch (plan, keys read, position
    tensors, block mask, score); the step's later layers with the same signature only launch
    it, and each layer equals the float64 reference (the flex path: 128+ rows on the CPU)."""
    attn = flexspec.compile(text, backend="flex")
    shape = Shape(2, 4, 2, 130, 400, 16)
    bindings = {}
    if "doc" in text:
        bindings["doc_ids"] = (torch.arange(400) // 90).expand(2, 400)
    if "head_bias" in text:
        bindings["bias"] = torch.randn(4)
    kwargs = {"q_offset": offset} if offset is not None else {}
    inputs = layers(5, shape, seed=3)
    counted = count_plans(monkeypatch)
    with torch.no_grad():
        step = flexspec.Step(**kwargs, **bindings)
        for q, k, v in inputs:
            torch.testing.assert_close(attn(q, k, v, step=step),
                                       attn.reference(q, k, v, **kwargs, **bindings),
                                       rtol=1e-4, atol=1e-4)
        # the first layer compiles its kernel (taking the whole path) and resolves the launch,
        # the other four only launch it
        assert len(counted) == 1
        counted.clear()
        step = flexspec.Step(**kwargs, **bindings)  # a new step resolves its own launch
        for q, k, v in inputs[:3]:
            torch.testing.assert_close(attn(q, k, v, step=step),
                                       attn.reference(q, k, v, **kwargs, **bindings),
                                       rtol=1e-4, atol=1e-4)
        assert len(counted) == 1


def test_a_growing_cache_s_later_layers_only_launch_at_every_new_length(eager_kernels,
                                                                       monkeypatch):
    """A cache that grows by one key per step makes every step a new plan: its first layer's
    call compiles (or finds) the kernel and then resolves the launch, so the step's other layers
    only launch it, at every length, each equal to the float64 reference (130 rows, which the
    CPU runs on the flex path)."""
    attn = flexspec.compile("causal & window(200) + alibi", backend="flex")
    counted = count_plans(monkeypatch)
    with torch.no_grad():
        for length in range(400, 404):
            shape = Shape(2, 4, 2, 130, length, 16)
            step = flexspec.Step(q_offset=length - 130)
            for q, k, v in layers(3, shape, seed=length):
                torch.testing.assert_close(attn(q, k, v, step=step),
                                           attn.reference(q, k, v, q_offset=length - 130),
                                           rtol=1e-4, atol=1e-4)
            assert len(counted) == 1, length
            counted.clear()


def test_a_layer_of_another_signature_in_the_step_gets_its_own_launch(monkeypatch):
    """Layers whose q, k, v differ (a shape, a dtype, gradients) do not share a launch."""
    attn = flexspec.compile("causal", backend="sdpa")
    step = flexspec.Step()
    counted = count_plans(monkeypatch)
    one, other = Shape(1, 2, 2, 16, 16, 8), Shape(1, 2, 2, 24, 24, 8)
    calls = [one.qkv(0), other.qkv(1), one.qkv(2), one.qkv(3, dtype=torch.bfloat16),
             other.qkv(4), one.qkv(5, requires_grad=True)]
    for q, k, v in calls:
        want = attn.reference(q.double(), k.double(), v.double()).to(q.dtype)
        loose = {"rtol": 2e-2, "atol": 2e-2} if q.dtype == torch.bfloat16 else {}
        torch.testing.assert_close(attn(q, k, v, step=step), want, **loose)
    # new: the first (16), the second (24), bfloat16, the one that needs gradients
    assert len(counted) == 4


def test_a_layer_with_bindings_or_learnables_of_its_own_takes_the_whole_path(monkeypatch):
    """A call that gives bindings of its own (a table per layer), or a module's learnable
    tables, is not a later layer of one launch: each such call takes the whole path, with its
    own values."""
    attn = flexspec.compile("causal + head_bias", backend="reference")
    step = flexspec.Step()
    counted = count_plans(monkeypatch)
    q, k, v = Shape(1, 2, 2, 8, 8, 4).qkv(0)
    for seed in range(3):
        bias = torch.randn(2, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(attn(q, k, v, step=step, bias=bias),
                                   attn.reference(q, k, v, bias=bias))
    assert len(counted) == 3
    counted.clear()
    modules = [flexspec.SpecAttention("causal + rel_bias", num_heads=2) for _ in range(2)]
    with torch.no_grad():
        for module in modules:
            for table in module.parameters():
                table.normal_()
        step = flexspec.Step(q_offset=3)
        for module in modules:
            torch.testing.assert_close(module(q, k, v, step=step), module(q, k, v, q_offset=3))
    assert len(counted) == 4


def test_a_launch_made_outside_a_cuda_graph_capture_is_not_used_inside_one(monkeypatch):
    """A captured step must build its block masks inside the graph (replays rebuild them from
    the step's tensors then): whether a capture is under way is part of the signature."""
    from flexspec.runtime import step as step_module
    q, k, v = Shape(1, 2, 2, 4, 4, 8).qkv(0)
    outside = step_module.launch_signature(q, k, v, None, False)
    monkeypatch.setattr(step_module, "capturing", lambda device: True)
    assert step_module.launch_signature(q, k, v, None, False) != outside
    assert step_module.launch_signature(q, k, v, 0.5, False) != \
        step_module.launch_signature(q, k, v, None, False)
    assert step_module.launch_signature(q, k, v, None, True) != \
        step_module.launch_signature(q, k, v, None, False)
    assert step_module.launch_signature(q, k, [v], None, False) is None  # the whole path


def test_a_step_keeps_launches_per_spec():
    """Two specs called in one step each keep their own launch (same signature, other calls)."""
    causal = flexspec.compile("causal", backend="sdpa")
    full = flexspec.compile("full", backend="sdpa")
    step = flexspec.Step()
    for seed in range(3):
        q, k, v = Shape(1, 2, 2, 16, 16, 8).qkv(seed)
        torch.testing.assert_close(causal(q, k, v, step=step), causal.reference(q, k, v))
        torch.testing.assert_close(full(q, k, v, step=step), full.reference(q, k, v))


def test_document_bounds_that_split_nothing_are_refused():
    """cu_seqlens must start at 0, never decrease and end at the rows the calls lay end to end;
    it is an int tensor (not bool) with values (not on the meta device); max_seqlen is a
    positive int at least the longest document. Each refusal names the argument (they all made
    up documents, or raised torch's own errors)."""
    cases = [
        ({"cu_seqlens": torch.tensor([1, 4, 8])}, "must start at 0"),
        ({"cu_seqlens": torch.tensor([0, 6, 4, 8])}, "must not decrease: 6 then 4"),
        ({"cu_seqlens": torch.tensor([True, False])}, "cu_seqlens must be a 1-D int tensor"),
        ({"cu_seqlens": torch.zeros(3, dtype=torch.long, device="meta")}, "meta device"),
        ({"cu_seqlens": torch.tensor([0, 4, 8]), "max_seqlen": 2.5}, "max_seqlen must be a "
                                                                     "positive int"),
        ({"cu_seqlens": torch.tensor([0, 4, 8]), "max_seqlen": -1}, "positive int"),
        ({"cu_seqlens": torch.tensor([0, 4, 8]), "max_seqlen": "30"}, "positive int"),
        ({"cu_seqlens": torch.tensor([0, 4, 8]), "max_seqlen": 3}, "max_seqlen is 3, but a "
                                                                   "document"),
    ]
    for given, message in cases:
        with pytest.raises(flexspec.BindingError, match=message):
            flexspec.Step(**given)
    attn = flexspec.compile("causal & doc")
    q = torch.randn(1, 2, 8, 4)
    for bounds in ([0, 4, 6], [0, 4, 10]):  # a total short of or past the 8 rows
        with pytest.raises(flexspec.BindingError, match=r"cu_seqlens ends at \d+, but the "
                                                        "step's calls lay 1 rows of 8"):
            attn(q, q, q, step=flexspec.Step(cu_seqlens=torch.tensor(bounds)))
    step = flexspec.Step(cu_seqlens=torch.tensor([0, 3, 8]), max_seqlen=5)
    torch.testing.assert_close(attn(q, q, q, step=step), attn.reference(
        q, q, q, doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])))


@pytest.mark.slow
def test_a_warm_step_launch_checks_its_lookups_once_for_the_step():
    """A later step's launch of a warm plan still checks the lookups of the step's tensors
    (once, for every layer): document ids read at q + q_offset past their end are a flexspec
    error that says so, not torch's IndexError (which a launch that skipped the check raised
    on the CPU, and an out-of-bounds read on a GPU)."""
    attn = flexspec.compile("causal & doc", backend="flex")
    q, k, v = Shape(1, 2, 2, 130, 200, 8).qkv(0)
    ids = torch.arange(200).unsqueeze(0) // 50
    for offset in (0, 70):  # two steps: the plan is warm
        step = flexspec.Step(q_offset=torch.tensor([offset]), doc_ids=ids)
        torch.testing.assert_close(attn(q, k, v, step=step), attn.reference(
            q, k, v, q_offset=offset, doc_ids=ids), rtol=1e-4, atol=1e-4)
    step = flexspec.Step(q_offset=torch.tensor([71]), doc_ids=ids)  # row 129 reads ids[200]
    with pytest.raises(flexspec.BindingError, match="doc_ids"):
        attn(q, k, v, step=step)


def test_a_launch_signature_tells_the_grad_modes_and_gradients_apart():
    """A step's layers share a launch only where dynamo would run the same code: a no-grad
    layer's launch is not reused under grad (as activation checkpointing recomputes a layer),
    nor for inputs that require gradients, nor under inference mode."""
    from flexspec.runtime.step import launch_signature
    q = torch.randn(1, 2, 4, 8)
    with torch.no_grad():
        quiet = launch_signature(q, q, q, None, False)
    loud = launch_signature(q, q, q, None, False)
    with torch.inference_mode():
        inferred = launch_signature(q, q, q, None, False)
    needing = launch_signature(q.requires_grad_(), q, q, None, False)
    assert len({quiet, loud, inferred, needing}) == 4
    assert launch_signature(q, q, q, 0.5, False) != launch_signature(q, q, q, None, False)
    assert launch_signature(q, q, q, None, True) != needing
    assert launch_signature("q", q, q, None, False) is None
