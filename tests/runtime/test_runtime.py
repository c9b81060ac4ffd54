"""Example tests of the runtime's documented behaviour: flexspec.compile, Attention, SpecAttention.

Compiling FlexAttention on a small CPU takes 10-30 s per spec, so every compiled call in the
default run uses ONE spec (:data:`SPEC`), one dtype and one set of shapes (:data:`SHAPE`): the
compiled kernel is built once per process and never recompiled. Other dtypes are ``slow``.
"""

import inspect
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
