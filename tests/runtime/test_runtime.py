"""Example tests of the runtime's documented behaviour: flexspec.compile, Attention, SpecAttention.

Compiling FlexAttention on a small CPU takes 10-30 s per spec, so every compiled call in the
default run uses ONE spec (:data:`SPEC`), one dtype and one set of shapes (:data:`SHAPE`): the
compiled kernel is built once per process and never recompiled. Other dtypes are ``slow``.
"""

import inspect
import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_mask

import flexspec
from flexspec import BindingError, SpecError
from flexspec.runtime import compiled, notices
from flexspec.lang.library import load_text
from flexspec.kernels.lower import lower
from flexspec.testing import Shape, document_ids

# A document mask with ~causal: every query sees the later keys of its own document, so the last
# query of each document sees nothing (a fully masked row). Plus a per-head bias and a cap.
SPEC = "document & ~causal + alibi + softcap(20.0)"
SHAPE = Shape(B=2, Hq=4, Hkv=2, Q_LEN=140, KV_LEN=150, D=16)
# Row 0: documents [0, 40), [40, 90), [90, 150). Row 1: [0, 20), [20, 150).
BOUNDS = ((40, 90), (20,))


def doc_ids(bounds=BOUNDS, length=SHAPE.KV_LEN):
    return document_ids(bounds, length)


def random_doc_ids(seed, shape=(SHAPE.B, SHAPE.KV_LEN), docs=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, docs, shape, generator=gen).sort(dim=-1).values


@pytest.fixture(scope="module")
def attn():
    return flexspec.compile(SPEC)


@pytest.fixture(scope="module")
def qkv():
    # The same q, k, v in both batch rows, so rows can only differ through doc_ids.
    q, k, v = SHAPE._replace(B=1).qkv(seed=0)
    return tuple(t.expand(SHAPE.B, -1, -1, -1).contiguous() for t in (q, k, v))


@pytest.fixture(scope="module")
def compiled_out(attn, qkv):
    """The first compiled call of the module (pays for the compile once)."""
    with torch.no_grad():
        return attn(*qkv, doc_ids=doc_ids())


def test_unknown_backend_and_bad_block_size():
    with pytest.raises(SpecError, match="unknown backend 'flexx'. Did you mean 'flex'?"):
        flexspec.compile("causal", backend="flexx")
    with pytest.raises(SpecError, match="block_size must be a positive multiple of 16"):
        flexspec.compile("causal", block_size=100)


# --- block masks -------------------------------------------------------------------------


def test_a_dense_mask_that_reads_the_batch_and_head_counts():
    # B and H are sizes, not indices: the dense mask used to evaluate them at its extent of 1
    # (found by the generators of flexspec.testing.definitions)
    library = load_text("mask by_b = B / 2 < Q_LEN | kv == 0\nmask by_h = H > 2 | kv == 0\n")
    for name, visible in (("by_b", 1), ("by_h", 3)):  # B / 2 < 1 is false, 4 > 2 is true
        attn = flexspec.compile(name, library=library)
        mask_mod, _ = attn.mods(q_len=1, kv_len=3, batch=2, heads=4)
        dense = attn.dense_mask(1, 3, batch=2, heads=4)
        assert torch.equal(dense.expand(2, 4, 1, 3), create_mask(mask_mod, 2, 4, 1, 3))
        assert dense.sum() == visible * dense.numel() // 3


# --- compiled calls (one spec, one shape, one dtype) ---------------------------------------


def test_compiled_call_matches_the_reference(attn, qkv, compiled_out):
    expected = attn.reference(*qkv, doc_ids=doc_ids())
    assert compiled_out.dtype == torch.float32 and compiled_out.shape == qkv[0].shape
    torch.testing.assert_close(compiled_out, expected, rtol=1e-4, atol=1e-4)


def test_compiled_call_reads_each_batch_row(compiled_out):
    # Same q, k, v in both rows, different documents: a mask broadcast from b=0 would make them
    # equal.
    assert not torch.allclose(compiled_out[0], compiled_out[1])


def test_fully_masked_rows_are_zeros(compiled_out):
    assert not compiled_out.isnan().any()
    # The last query of each document in row 0 (39 and 89), of the first one in row 1 (19).
    for b, q in ((0, 39), (0, 89), (1, 19)):
        assert torch.equal(compiled_out[b, :, q], torch.zeros_like(compiled_out[b, :, q]))
    assert compiled_out[0, :, 38].abs().sum() > 0


def test_fully_masked_everywhere_on_the_reference_backend():
    q = torch.randn(1, 2, 30, 8)
    out = flexspec.compile("~full", backend="reference")(q, q, q)
    assert torch.equal(out, torch.zeros_like(out))


def test_fresh_doc_ids_do_not_recompile(attn, qkv, compiled_out):
    spec_ir = attn.ir  # doc_ids of shape [B, KV_LEN]: the IR stays as it is
    if "MUTANT_UNDER_TEST" in os.environ:
        # under mutation testing tests/conftest.py empties flexspec's caches before every test,
        # so the plan compiled_out made gets new mods (new code objects, one new graph) at its
        # next call: make that call first, and count from there
        with torch.no_grad():
            attn(*qkv, doc_ids=random_doc_ids(99))
    entry = compiled.compiled_entry(lower(spec_ir))
    graphs = counters["stats"]["unique_graphs"]
    misses = compiled.compiled_entry.cache_info().misses
    with torch.no_grad():
        for seed in range(3):
            ids = random_doc_ids(seed)
            out = attn(*qkv, doc_ids=ids)
            torch.testing.assert_close(out, attn.reference(*qkv, doc_ids=ids),
                                       rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.compiled_entry.cache_info().misses == misses
    assert compiled.compiled_entry(lower(spec_ir)) is entry


def test_equal_specs_share_the_lowering_and_the_mod_code():
    first = flexspec.compile("causal & window(3) + softcap(5.0)")
    second = flexspec.compile("causal & window(3) + softcap(c=5.0)")
    inlined = flexspec.compile("sliding_window(3) + softcap(5.0)")
    assert lower(first.ir) is lower(second.ir) is lower(inlined.ir)
    mods = [a.mods(q_len=10, kv_len=10) for a in (first, second, inlined)]
    assert mods[0][0] is not mods[1][0]  # fresh closures ...
    assert mods[0][0].__code__ is mods[1][0].__code__ is mods[2][0].__code__  # ... same code
    assert mods[0][1].__code__ is mods[1][1].__code__ is mods[2][1].__code__


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_low_precision_inputs_on_cpu(attn, qkv, dtype, tol):
    # Another compile per dtype (~10 s each on a 2-core CPU).
    q, k, v = (t.to(dtype) for t in qkv)
    with torch.no_grad():
        out = attn(q, k, v, doc_ids=doc_ids())
    assert out.dtype == dtype and not out.isnan().any()
    expected = attn.reference(*(t.double() for t in (q, k, v)), doc_ids=doc_ids())
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


# --- descriptions --------------------------------------------------------------------------


def test_source_is_python_with_both_mods():
    attn = flexspec.compile("causal & document + alibi + softcap(5.0)")
    source = attn.source()
    namespace = {}
    exec(compile(source, "<flexspec source>", "exec"), namespace)
    assert list(inspect.signature(namespace["mask_mod"]).parameters) == ["b", "h", "q_idx",
                                                                         "kv_idx"]
    assert list(inspect.signature(namespace["score_mod"]).parameters) == ["score", "b", "h",
                                                                          "q_idx", "kv_idx"]
    # Pasteable: given its free names, the mask_mod gives the reference mask.
    ids = doc_ids()
    namespace.update(doc_ids=ids, alibi_slopes_H=2.0 ** (-8.0 * torch.arange(1, 5) / 4))
    assert "doc_ids" in source and "alibi_slopes_H" in source
    assert torch.equal(create_mask(namespace["mask_mod"], 2, 1, 100, 150),
                       attn.dense_mask(100, 150, batch=2, doc_ids=ids))


def test_source_of_a_mask_only_spec_has_no_score_mod():
    source = flexspec.compile("causal").source()
    assert "def mask_mod(b, h, q_idx, kv_idx):" in source and "score_mod(" not in source


def test_repr():
    """The repr is the call that compiles it again (first-hour review: a spec from a library
    could not be pasted back)."""
    assert repr(flexspec.compile("causal&window(3)+alibi")) == \
        "flexspec.compile(flexspec.parse('causal & window(3) + alibi'), backend='auto')"
    attn = flexspec.compile("causal", backend="reference", block_size=(64, 128),
                            block_masks="dense")
    assert repr(attn) == ("flexspec.compile(flexspec.parse('causal'), backend='reference', "
                          "block_size=(64, 128), block_masks='dense')")
    again = eval(repr(attn), {"flexspec": flexspec})
    assert (again.spec, again.backend, again.block_size, again.block_masks) == \
        (attn.spec, attn.backend, attn.block_size, attn.block_masks)
    module = flexspec.SpecAttention("causal + rel_bias(max_distance=4)", num_heads=2)
    assert "'causal + rel_bias(max_distance=4)', num_heads=2" in repr(module)


def test_bindings_property():
    assert flexspec.compile("causal & document + head_bias").bindings == ["doc_ids", "bias"]
    assert flexspec.compile("causal + rel_bias").bindings == []


# --- gradients on the CPU ------------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(notices, "_warned", set())


def test_requires_grad_on_cpu_falls_back_to_the_reference_with_one_warning(fresh_warnings):
    attn = flexspec.compile("causal & window(4) + softcap(5.0)")
    q, k, v = Shape(1, 2, 2, 33, 33, 8).qkv(seed=1, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attn(q, k, v)
        attn(q, k, v)
    messages = [str(w.message) for w in caught if "no backward" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert "reference" in messages[0]
    torch.testing.assert_close(out, attn.reference(q, k, v))
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_gradients_reach_a_bound_float_tensor(fresh_warnings):
    # (a per-head constant such as head_bias would not do: softmax ignores it, its gradient is 0)
    attn = flexspec.compile("causal + alibi(slopes=my_slopes)")
    q, k, v = Shape(1, 2, 1, 17, 17, 8).qkv(seed=3)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    with pytest.warns(UserWarning, match="no backward"):
        out = attn(q, k, v, my_slopes=slopes)
    (out * torch.randn_like(out)).sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0


def test_spec_attention_parameters_and_gradients(fresh_warnings):
    module = flexspec.SpecAttention("causal + rel_bias(max_distance=4)", num_heads=4)
    params = dict(module.named_parameters())
    assert list(params) == ["tables.rel_bias_table"]
    table = params["tables.rel_bias_table"]
    assert table.shape == (4, 9) and table.requires_grad and torch.equal(table, torch.zeros(4, 9))
    with torch.no_grad():
        table.copy_(torch.randn(4, 9))
    q, k, v = Shape(1, 4, 2, 20, 20, 8).qkv(seed=2, requires_grad=True)
    with pytest.warns(UserWarning, match="no backward"):
        out = module(q, k, v)
    expected = module.attention.reference(q, k, v, rel_bias_table=table.detach())
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    assert q.grad is not None and q.grad.abs().sum() > 0
    # Only the distances a causal query can see (kv - q in -4..0) get gradients.
    assert torch.equal(table.grad[:, 5:], torch.zeros(4, 4))


def test_spec_attention_checks_its_heads():
    module = flexspec.SpecAttention("causal + rel_bias(max_distance=4)", num_heads=4)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(BindingError, match="built for 4 heads, but q has 2"):
        module(q, q, q)


def test_learnable_tables_start_at_zero_and_can_be_passed_by_name():
    attn = flexspec.compile("causal + rel_bias(max_distance=2)")
    q = torch.randn(1, 2, 7, 8)
    # A fresh table initialised to zeros: the same as no bias.
    torch.testing.assert_close(attn.reference(q, q, q),
                               flexspec.compile("causal").reference(q, q, q))
    table = torch.randn(2, 5)
    biased = attn.reference(q, q, q, rel_bias_table=table)
    assert not torch.allclose(biased, attn.reference(q, q, q))
    with pytest.raises(BindingError, match=r"'rel_bias_table' has shape \[2, 4\]"):
        attn.reference(q, q, q, rel_bias_table=torch.randn(2, 4))


def test_two_learnable_tables_of_one_pattern():
    # each use of a learnable pattern has its own table, named by order of use
    module = flexspec.SpecAttention("rel_bias(max_distance=3) + rel_bias(max_distance=2)",
                                    num_heads=2)
    assert len(list(module.parameters())) == 2
    assert sorted(module.tables) == ["rel_bias_table", "rel_bias_table_2"]
    assert module.tables["rel_bias_table"].shape == (2, 7)
    assert module.tables["rel_bias_table_2"].shape == (2, 5)
    q = torch.randn(1, 2, 9, 8)
    module.attention.reference(q, q, q)


def test_t5_bias_beyond_its_exact_buckets():
    # Regression: the lookup check bounded where(...)'s branches without its condition and
    # refused every length beyond the exact buckets.
    attn = flexspec.compile("causal + t5_bias")
    q = torch.randn(1, 2, 40, 8)
    table = torch.randn(2, 32)
    out = attn.reference(q, q, q, t5_bias_table=table)
    assert out.shape == q.shape


def test_short_cpu_sequences_run_on_the_reference():
    # torch 2.13's compiled CPU kernel gave wrong values for sequences shorter than one
    # 128-position block, so these run densely; longer ones take the kernel.
    attn = flexspec.compile("causal & window(3)")
    short = Shape(1, 2, 2, 120, 120, 8).qkv(seed=0)
    long = Shape(1, 2, 2, 130, 200, 8).qkv(seed=0)
    assert attn.explain(*short).choice.backend == "reference"
    assert attn.explain(*long).choice.backend == "flex"
    torch.testing.assert_close(attn(*short), attn.reference(*short))


def test_mods_read_sizes_off_the_bindings_and_ask_for_the_rest():
    mask_mod, score_mod = flexspec.compile("causal").mods()
    assert score_mod is None and mask_mod is not None
    ids = torch.tensor([0, 0, 1, 1, 1])
    mask_mod, _ = flexspec.compile("causal & doc").mods(doc_ids=ids)
    b, h = torch.tensor(0), torch.tensor(0)
    assert bool(mask_mod(b, h, torch.tensor(1), torch.tensor(0)))
    assert not bool(mask_mod(b, h, torch.tensor(2), torch.tensor(1)))  # different documents
    with pytest.raises(flexspec.BindingError, match="needs KV_LEN, Q_LEN; pass kv_len"):
        flexspec.compile("causal_bottom_right").mods()
    with pytest.raises(flexspec.BindingError, match="needs H; pass heads"):
        flexspec.compile("alibi").mods()


def test_masks_comparing_constants_with_the_lengths_run_at_new_lengths():
    # found by test_the_runtime_matches_the_reference_call_after_call: the second length makes
    # the lengths dynamic, and torch 2.13's dynamo failed on `False == (0.5 < Q_LEN)` and on
    # `0.0 * inf < Q_LEN` with a symbolic Q_LEN (raw dynamo errors); the lowering compares
    # such bools as ints, and the simplifier folds comparisons with NaN
    library = load_text("mask m = where(false == (0.5 < Q_LEN) & 0.5 < Q_LEN, 0.5 < Q_LEN, 0.5 < q)"
                        "\nmask n = (q >= kv) != (KV_LEN > 140)"
                        "\nmask o = (0.0 * inf < Q_LEN) | (q >= kv & 0.0 * inf != KV_LEN)")
    for text in ("m", "n", "o"):
        attn = flexspec.compile(text, library=library)
        for length in (129, 145):
            q, k, v = Shape(1, 1, 1, length, length, 8).qkv(seed=0)
            torch.testing.assert_close(attn(q, k, v), attn.reference(q, k, v), rtol=1e-4,
                                       atol=1e-4)


@pytest.mark.slow
def test_reaching_the_recompile_limit_is_a_flexspec_error():
    # A spec that keeps changing shapes would make dynamo give up and silently fall back to the
    # unfused kernel (which materialises S^2 scores); flexspec raises instead.
    attn = flexspec.compile("causal & window(3)")
    first = Shape(1, 2, 2, 136, 136, 8).qkv(seed=0)
    second = Shape(1, 2, 2, 152, 152, 8).qkv(seed=0)
    with torch._dynamo.config.patch(recompile_limit=1):
        attn(*first)
        with pytest.raises(flexspec.runtime.CompileLimitError, match="recompile limit"):
            attn(*second)


@pytest.mark.slow
def test_flexspec_s_compiled_calls_leave_cuda_graph_generations_alone():
    """flexspec.workarounds: compiled-call-new-generation. A call of flexspec's compiled kernel
    from eager code (its attention between a compiled model's graphs) must not count as a new
    invocation of the model for CUDA graph trees: warm calls, plain and in a step, keep dynamo's
    generation."""
    from torch._dynamo.mutation_guard import GenerationTracker
    attn = flexspec.compile("causal & window(50) + alibi", backend="flex")
    q, k, v = Shape(1, 2, 2, 130, 130, 8).qkv(seed=0)
    with torch.no_grad():
        attn(q, k, v)  # compiles
        before = GenerationTracker.generation
        out = attn(q, k, v)
        step = flexspec.Step()
        for _ in range(3):
            attn(q, k, v, step=step)  # the first layers plan, the later ones launch
    assert GenerationTracker.generation == before
    torch.testing.assert_close(out, attn.reference(q, k, v), rtol=1e-4, atol=1e-4)


def test_compiled_calls_refuse_graph_breaks():
    # fullgraph=True's meaning without its per-call cost: a graph break while compiling is an
    # error (a broken graph would run flex_attention unfused), not a silent split
    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    entry = torch.compile(breaks)
    with pytest.raises(Exception, match="graph_break|graph break"):
        compiled.run_compiled(entry, torch.ones(3))
    torch._dynamo.reset()


def test_strided_bindings_run():
    """Red-team finding: doc_ids=ids[::2] and bias=b[::2] crashed inductor."""
    q, k, v = Shape(1, 4, 4, 200, 200, 16).qkv(0)
    ids = torch.arange(400) // 130
    doc = flexspec.compile("causal & doc")
    bias = torch.randn(8)
    head = flexspec.compile("causal + head_bias")
    with torch.no_grad():
        torch.testing.assert_close(doc(q, k, v, doc_ids=ids[::2]),
                                   doc.reference(q, k, v, doc_ids=ids[::2].contiguous()),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(head(q, k, v, bias=bias[::2]),
                                   head.reference(q, k, v, bias=bias[::2].contiguous()),
                                   rtol=1e-4, atol=1e-4)


def test_a_strided_binding_given_again_finds_its_block_mask(monkeypatch):
    """A decode loop's doc_ids[:, :length], passed anew at every call, is one binding to the
    block-mask cache while it is unchanged: its mask is built once (it was rebuilt on every
    call, 3.8 ms per call at B=64 on an H200), and again after an in-place change."""
    from flexspec.runtime import masks
    builds = []
    build = masks.MaskCache._build
    monkeypatch.setattr(masks.MaskCache, "_build",
                        lambda self, *args, **kwargs: builds.append(1) or build(self, *args,
                                                                                **kwargs))
    q, k, v = Shape(1, 4, 4, 200, 200, 16).qkv(0)  # test_strided_bindings_run's compile
    ids = torch.arange(400) // 130
    doc = flexspec.compile("causal & doc")
    with torch.no_grad():
        for _ in range(3):
            doc(q, k, v, doc_ids=ids[::2])
        assert len(builds) == 1
        ids[300:] = 7
        out = doc(q, k, v, doc_ids=ids[::2])
    assert len(builds) == 2
    torch.testing.assert_close(out, doc.reference(q, k, v, doc_ids=ids[::2].contiguous()),
                               rtol=1e-4, atol=1e-4)


# ---- inference mode -----------------------------------------------------------------------------


def test_bindings_made_under_inference_mode_run_the_compiled_kernel(attn, qkv):
    """Red-team 2026-12-02, item 2: a binding made under torch.inference_mode() crashed the
    flex path ('Inference tensors do not track version counter'). Inference tensors have no
    version counter, so nothing is cached under them: a binding changed in place between two
    calls gives each call its own answer."""
    q, k, v = qkv
    with torch.inference_mode():
        ids = doc_ids()
        assert ids.is_inference()
        assert attn.explain(q, k, v, doc_ids=ids).choice.backend == "flex"
        first = attn(q, k, v, doc_ids=ids)
        torch.testing.assert_close(first, attn.reference(q, k, v, doc_ids=ids), atol=2e-5,
                                   rtol=1e-5)
        ids.copy_(doc_ids(((70,), (100,))))  # in place, unseen by any version counter
        second = attn(q, k, v, doc_ids=ids)
        torch.testing.assert_close(second, attn.reference(q, k, v, doc_ids=ids), atol=2e-5,
                                   rtol=1e-5)
    assert not torch.equal(first, second)


def test_an_offset_first_used_in_inference_mode_serves_every_mode_later():
    """An int q_offset becomes a tensor kept for later calls with that offset: made in inference
    mode it crashed every later call at that offset outside it. No cache may hold a tensor
    one mode made for another."""
    attn = flexspec.compile("causal & window(40) + alibi")
    q, k, v = Shape(1, 2, 2, 130, 200, 16).qkv(seed=3)
    with torch.inference_mode():
        inside = attn(q, k, v, q_offset=70)
        block_mask = attn.block_mask(130, 200, q_offset=70)
    assert not block_mask.kv_num_blocks.is_inference()  # the cache serves every mode
    from flexspec.runtime import positions
    assert not positions._int_tensor(70, 1, "cpu").is_inference()  # the offset's kept tensor
    outside = attn(q, k, v, q_offset=70)
    torch.testing.assert_close(inside, outside)
    torch.testing.assert_close(outside, attn.reference(q, k, v, q_offset=70), atol=2e-5,
                               rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v, q_offset=70), outside)
    # and with gradients (the dense reference on this CPU), from the same offset tensor
    q.requires_grad_()
    attn(q, k, v, q_offset=70).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_kv_lengths_made_under_inference_mode():
    attn = flexspec.compile("causal_bottom_right & window(40)")
    q, k, v = Shape(2, 2, 2, 130, 200, 16).qkv(seed=4)
    with torch.inference_mode():
        lengths = torch.tensor([200, 170])
        out = attn(q, k, v, kv_lengths=lengths)
        torch.testing.assert_close(out, attn.reference(q, k, v, kv_lengths=lengths), atol=2e-5,
                                   rtol=1e-5)


# ---- mutation testing of runtime/attention ------------------------------------------------------
# Short calls (fewer than 128 positions run on the reference or SDPA on the CPU) and masks against
# hand-computed ones, so nothing here compiles a kernel.


def whole(message):
    import re
    return "^" + re.escape(message) + "$"


def hand_attention(q, k, v, visible, scale):
    """Attention by hand in float64: ``visible`` [Q_LEN, KV_LEN] (or broadcastable)."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v.double(), torch.logsumexp(scores, -1)


def test_an_attention_s_defaults_and_refusals_in_full():
    from flexspec.runtime.attention import Attention
    from flexspec.runtime.backends import REGISTRY
    attn = Attention(flexspec.parse("causal"))
    assert (attn.backend, attn.block_size, attn.block_masks) == ("auto", (128, 128), "exact")
    window = flexspec.parse("causal & window(3)")
    refusal = REGISTRY["sdpa"].cannot_run(window.ir)
    assert refusal
    with pytest.raises(flexspec.BackendError, match=whole(
            f"backend 'sdpa' cannot run 'causal & window(3)': {refusal}. backend='auto' "
            "chooses one that can")):
        flexspec.compile(window, backend="sdpa")
    with pytest.raises(SpecError, match=whole(
            "unknown block_masks mode 'exakt'. Did you mean 'exact'? Modes: exact, intervals, "
            "dense")):
        flexspec.compile("causal", block_masks="exakt")
    with pytest.raises(SpecError, match=whole(
            "unknown block_masks mode 'sparse'. Modes: exact, intervals, dense")):
        flexspec.compile("causal", block_masks="sparse")
    for bad in (0, (0, 16), (16, -16)):
        with pytest.raises(SpecError, match=whole(
                f"block_size must be a positive multiple of 16 or a pair of them, got {bad!r}")):
            flexspec.compile("causal", block_size=bad)


def test_the_exact_mode_refines_every_tile_it_can():
    from flexspec.kernels.block_tables import FULL, tile_classes
    # (q + kv) % 2 is 0 or 1 everywhere: interval analysis alone cannot prove a tile full
    library = load_text("mask parity = (q + kv) % 2 == 0 | (q + kv) % 2 == 1")
    block_mask = flexspec.compile("parity", library=library, block_size=16).block_mask(48, 64)
    assert (tile_classes(block_mask) == FULL).all()


def test_a_copy_keeps_the_spec_and_every_option():
    import copy
    import pickle
    attn = flexspec.compile("causal & window(3) + alibi", backend="reference",
                            block_size=(32, 64), block_masks="intervals")
    assert attn.__getstate__() == {"spec": attn.spec, "backend": "reference",
                                   "block_size": (32, 64), "block_masks": "intervals",
                                   "kernel_options": {}, "tuned": {}}
    q, k, v = Shape(1, 2, 2, 10, 10, 8).qkv(seed=3)
    for copied in (copy.deepcopy(attn), pickle.loads(pickle.dumps(attn))):
        assert copied is not attn and copied._calls is not attn._calls
        assert (str(copied.spec), copied.backend, copied.block_size, copied.block_masks) == \
            ("causal & window(3) + alibi", "reference", (32, 64), "intervals")
        assert repr(copied) == repr(attn)
        torch.testing.assert_close(copied(q, k, v), attn.reference(q, k, v))


def test_every_argument_of_a_call_reaches_it():
    attn = flexspec.compile("causal & doc + alibi")
    q = Shape(1, 2, 2, 5, 12, 8).qkv(seed=4)[0]
    _, k, v = Shape(1, 2, 2, 12, 12, 8).qkv(seed=5)
    ids = torch.arange(12) // 7
    # rows 7..11 in the second document; keys 10 and 11 are past the valid length
    given = {"scale": 0.3, "q_offset": 7, "kv_lengths": torch.tensor([10]), "doc_ids": ids}
    want, want_lse = attn.reference(q, k, v, return_lse=True, **given)
    # every argument changes the answer here
    for name in ("scale", "q_offset", "kv_lengths"):
        less = {key: value for key, value in given.items() if key != name}
        assert not torch.allclose(attn.reference(q, k, v, **less), want), name
    out, lse = attn(q, k, v, return_lse=True, **given)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    bindings = {"doc_ids": ids}
    rest = {key: value for key, value in given.items() if key != "doc_ids"}
    out, lse = attn._call(q, k, v, bindings=bindings, return_lse=True, **rest)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    plain = attn._call(q, k, v, bindings=bindings, **rest)  # return_lse defaults to False
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, want)
    # a step's positions and documents
    step = flexspec.Step(q_offset=7, kv_lengths=torch.tensor([10]), doc_ids=ids)
    torch.testing.assert_close(attn(q, k, v, scale=0.3, step=step), want)
    torch.testing.assert_close(attn._call(q, k, v, bindings={}, scale=0.3, step=step), want)


def test_the_reference_entry_point_against_attention_by_hand():
    attn = flexspec.compile("causal")
    q, k, v = (t.double() for t in Shape(1, 1, 1, 4, 6, 8).qkv(seed=6))
    position = torch.arange(6)
    visible = position[None, :] <= torch.arange(4)[:, None] + 2  # q_offset = 2
    want, want_lse = hand_attention(q, k, v, visible, 0.3)
    out, lse = attn.reference(q, k, v, scale=0.3, q_offset=2, return_lse=True)
    assert out.dtype == torch.float64  # float64 inputs are taken as they are
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert isinstance(attn.reference(q, k, v, scale=0.3, q_offset=2), torch.Tensor)
    rows = attn.reference(q, k, v, scale=0.3, q_offset=2, rows=torch.tensor([1, 3]))
    torch.testing.assert_close(rows, want[:, :, [1, 3]])


def test_dense_masks_with_positions_and_their_extents():
    attn = flexspec.compile("causal")
    position = torch.arange(5)
    mask = attn.dense_mask(3, 5, q_offset=2)
    assert torch.equal(mask, (position[None, :] <= torch.arange(3)[:, None] + 2)[None, None])
    # per-row lengths give a row each; one length for every row, one mask
    lengths = attn.dense_mask(3, 5, batch=2, q_offset=2, kv_lengths=torch.tensor([5, 3]))
    causal = position[None, :] <= torch.arange(3)[:, None] + 2
    assert torch.equal(lengths, torch.stack([causal, causal & (position < 3)])[:, None])
    shared = attn.dense_mask(3, 5, batch=3, kv_lengths=torch.tensor([4]))
    plain = position[None, :] <= torch.arange(3)[:, None]
    assert torch.equal(shared, (plain & (position < 4))[None, None])
    # extents the mask does not read stay 1
    assert attn.dense_mask(4, 4, batch=2, heads=3).shape == (1, 1, 4, 4)
    # the score's bindings are not needed for the mask
    tilt = flexspec.compile("causal + tilt", library=load_text(
        "score tilt(w: float[H]) = score + w[h] * (kv - q)"))
    assert torch.equal(tilt.dense_mask(4, 4, heads=2),
                       (position[None, :4] <= position[:4, None])[None, None])


def test_mods_place_the_queries_and_ask_for_the_lengths_they_need():
    attn = flexspec.compile("causal")
    with pytest.raises(BindingError, match=whole(
            "this spec needs KV_LEN, Q_LEN; pass kv_len=..., q_len=...")):
        attn.mods(q_offset=2)
    with pytest.raises(BindingError, match=whole(
            "this spec needs KV_LEN, Q_LEN; pass kv_len=..., q_len=...")):
        attn.mods(kv_lengths=torch.tensor([3]))
    # placed queries need the lengths on top of what the spec reads, not instead of it
    wide = flexspec.compile("wide", library=load_text("mask wide = kv <= q + H"))
    with pytest.raises(BindingError, match=whole("this spec needs H; pass heads=...")):
        wide.mods(q_len=4, kv_len=6, q_offset=2)
    position = torch.arange(6)
    mask_mod, score_mod = attn.mods(q_len=4, kv_len=6, q_offset=2)
    assert score_mod is None
    assert torch.equal(create_mask(mask_mod, 1, 1, 4, 6)[0, 0],
                       position[None, :] <= torch.arange(4)[:, None] + 2)
    mask_mod, _ = attn.mods(q_len=4, kv_len=6, kv_lengths=torch.tensor([3]), batch=1)
    assert torch.equal(create_mask(mask_mod, 1, 1, 4, 6)[0, 0],
                       (position[None, :] <= torch.arange(4)[:, None]) & (position < 3))


def test_block_masks_with_positions_batch_and_heads():
    position = torch.arange(60)
    causal = flexspec.compile("causal", block_size=16)
    block_mask = causal.block_mask(40, 60, q_offset=20, kv_lengths=torch.tensor([50]))
    want = (position[None, :] <= torch.arange(40)[:, None] + 20) & (position < 50)
    assert torch.equal(create_mask(block_mask.mask_mod, 1, 1, 40, 60)[0, 0], want)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), torch.nn.functional.pad(
        want, (0, 4, 0, 8)).view(3, 16, 4, 16).any(3).any(1))
    documents = flexspec.compile("doc", block_size=16)
    ids = torch.stack([position // 20, position // 30])
    block_mask = documents.block_mask(60, 60, batch=2, doc_ids=ids)
    assert block_mask.shape[:2] == (2, 1)
    assert torch.equal(create_mask(block_mask.mask_mod, 2, 1, 60, 60)[:, 0],
                       ids[:, :, None] == ids[:, None, :])
    per_head = flexspec.compile("per_head", library=load_text(
        "mask per_head = kv <= q + 7 * h"), block_size=16)
    block_mask = per_head.block_mask(40, 40, heads=3)
    assert block_mask.shape[:2] == (1, 3)
    assert torch.equal(create_mask(block_mask.mask_mod, 1, 3, 40, 40)[0],
                       position[None, None, :40] <= position[None, :40, None]
                       + 7 * torch.arange(3)[:, None, None])


def test_block_mask_keeps_one_plan_per_signature_and_checks_lookups(monkeypatch):
    from flexspec.runtime import calls
    plans = []
    original = calls.make_mask_plan
    monkeypatch.setattr(calls, "make_mask_plan",
                        lambda **kwargs: plans.append(kwargs) or original(**kwargs))
    attn = flexspec.compile("doc", block_size=16)
    ids = torch.arange(40) // 15
    first = attn.block_mask(40, 40, doc_ids=ids)
    assert attn.block_mask(40, 40, doc_ids=ids) is first and len(plans) == 1
    for q_len, given in ((40, ids.to(torch.int32)), (30, ids)):
        block_mask = attn.block_mask(q_len, 40, doc_ids=given)
        assert torch.equal(create_mask(block_mask.mask_mod, 1, 1, q_len, 40)[0, 0],
                           ids[:q_len, None] == ids[None, :])
    assert len(plans) == 3
    # lookups it cannot prove in range are checked on every call's values
    group = flexspec.compile("same_group", library=load_text(
        "mask same_group(group: int[KV_LEN]) = group[group[q]] == group[kv]"))
    table = torch.zeros(24, dtype=torch.int64)
    group.block_mask(24, 24, group=table)
    table[3] = 24
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\]"):
        group.block_mask(24, 24, group=table)


def test_explain_places_the_queries_and_reads_only_the_keys_they_see():
    window = flexspec.compile("causal & window(3)")
    q = torch.randn(1, 2, 2, 8)
    k = torch.randn(1, 2, 10, 8)
    # rows 8 and 9 see keys 5..8 and 6..9: 8 of 20 pairs, and only keys 5:10 are read
    explanation = window.explain(q, k, k, q_offset=8)
    assert explanation.keys == (5, 10, 10) and explanation.density == 8 / 20
    assert explanation.spec == "causal & window(3)"
    # with 9 valid keys: 4 + 3 pairs
    assert window.explain(q, k, k, q_offset=8, kv_lengths=torch.tensor([9])).density == 7 / 20
    # a row that sees every key it reads runs without the mask
    causal = flexspec.compile("causal")
    one = torch.randn(1, 2, 1, 8)
    unmasked = causal.explain(one, k, k, q_offset=9)
    assert (unmasked.mask, unmasked.keys, unmasked.density) == ("true", None, 1.0)
    assert unmasked.spec == "causal"
    part = causal.explain(one, k, k, q_offset=5)
    assert (part.mask, part.keys, part.density) == ("true", (0, 6, 10), 0.6)
    masked = causal.explain(torch.randn(1, 2, 4, 8), k, k, q_offset=5)
    assert masked.density == (6 + 7 + 8 + 9) / 40 and masked.mask != "true"
    # ... but not when some of those keys are past a row's valid length: 7 + 10 of 20 pairs
    lengths = causal.explain(torch.randn(2, 2, 1, 8), k.expand(2, -1, -1, -1),
                             k.expand(2, -1, -1, -1), q_offset=9,
                             kv_lengths=torch.tensor([7, 10]))
    assert lengths.density == 17 / 20 and lengths.mask != "true"


def test_explain_takes_the_call_s_scale_and_log_sum_exp():
    attn = flexspec.compile("causal & window(30)")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=7)
    assert attn.explain(q, k, v).choice.backend == "flex"
    assert attn.explain(q, k, v, return_lse=True).choice.backend == "reference"
    causal = flexspec.compile("causal")
    assert causal.explain(q, k, v).choice.backend == "sdpa"
    assert causal.explain(q, k, v, scale=0.0).choice.backend != "sdpa"


def test_explain_for_another_device_plans_with_its_facts():
    attn = flexspec.compile("causal & window(256)")
    q, k, v = (torch.randn(4, 16, 4096, 64, dtype=torch.bfloat16) for _ in range(3))
    here = attn.explain(q[:1, :1, :200], k[:1, :1, :200], v[:1, :1, :200])
    assert here.device == "cpu"
    there = attn.explain(q, k, v, target="cuda", capability=(9, 0),
                         facts={"fa4.installed": True})
    assert there.choice.backend == "fa4" and there.device == "cuda (planned on cpu)"
    assert there.spec == "causal & window(256)"
    without = attn.explain(q, k, v, target="cuda", capability=(9, 0))
    assert without.choice.backend == "flex"
    assert "not installed" in dict(without.choice.rejected)["fa4"]
    ampere = attn.explain(q, k, v, target="cuda", capability=(8, 0),
                          facts={"fa4.installed": True})
    assert "this one is 8.0" in dict(ampere.choice.rejected)["fa4"]


def test_a_first_call_names_its_spec_in_the_log(qkv, compiled_out, caplog):
    import logging
    fresh = flexspec.compile(SPEC)
    with caplog.at_level(logging.INFO, logger="flexspec"), torch.no_grad():
        fresh(*qkv, doc_ids=doc_ids())
    assert any(record.getMessage().startswith(f"first call of '{fresh.spec}' on backend 'flex'")
               for record in caplog.records)
