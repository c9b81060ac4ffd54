"""How often a spec compiles in real use: any number of lengths (variable-length batches, a
growing KV cache, a preallocated cache) and of scales costs at most two compilations, counted
with dynamo's own counters; results stay equal to the reference throughout."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import flexspec
from flexspec.kernels import fused_blocks
from flexspec.runtime import compiled, masks
from flexspec.runtime.contract import BackendError
from flexspec.testing import Shape

# Lengths that are not multiples of 128, crossing block boundaries both ways.
LENGTHS = (200, 230, 129, 300, 333, 257, 400, 450, 513, 385, 600, 700, 777)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # other tests' compiles of the same spec would count as warm-up: dynamo's caches and
    # flexspec's entries (which remember the lengths they first compiled for) start afresh
    torch._dynamo.reset()
    compiled.compiled_entry.cache_clear()
    yield


def test_any_number_of_lengths_compiles_at_most_twice():
    attn = flexspec.compile("causal & window(64) + alibi")
    before = graphs()
    with torch.no_grad():
        for n in LENGTHS:
            q, k, v = Shape(1, 4, 2, n, n, 16).qkv(n)
            torch.testing.assert_close(attn(q, k, v), attn.reference(q, k, v),
                                       rtol=1e-4, atol=1e-4)
    assert graphs() - before <= 2


def test_new_scales_never_recompile():
    attn = flexspec.compile("causal & doc + softcap(20.0)")
    q, k, v = Shape(2, 4, 4, 200, 200, 16).qkv(0)
    ids = torch.arange(200) // 70
    before = graphs()
    with torch.no_grad():
        for scale in (None, 0.1, 0.2, 0.25, 0.3, 0.5, 1.0, 2.0, 0.05, 0.7, 0.9, 1.5, 3.0, 0.0):
            torch.testing.assert_close(attn(q, k, v, scale=scale, doc_ids=ids),
                                       attn.reference(q, k, v, scale=scale, doc_ids=ids),
                                       rtol=1e-4, atol=1e-4)
    assert graphs() - before <= 2  # one kernel for the default scale, one for any other


def test_a_growing_cache_decodes_for_a_hundred_steps_without_recompiling():
    """Decoding a window of the newest 128 queries (the CPU kernel's smallest block; on a GPU a
    single token works the same) while the cache grows by one key a step."""
    attn = flexspec.compile("causal & doc + alibi")
    window, heads = 128, 4
    q, k, v = Shape(2, heads, 2, 430, 430, 16).qkv(7)
    ids = torch.arange(430) // 150
    before, warm = graphs(), None
    with torch.no_grad():
        for step, length in enumerate(range(300, 405)):
            start = length - window
            out = attn(q[:, :, start:length], k[:, :, :length], v[:, :, :length],
                       q_offset=start, doc_ids=ids[:length])
            if step == 2:
                warm = graphs()
            if step % 25 == 0:
                full = attn.reference(q[:, :, :length], k[:, :, :length], v[:, :, :length],
                                      doc_ids=ids[:length])
                torch.testing.assert_close(out, full[:, :, start:], rtol=1e-4, atol=1e-4)
    assert graphs() - before <= 2 and graphs() == warm


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad mode"])
def test_a_repeated_call_whose_two_mods_read_its_offset_compiles_once(grad):
    """The mask and the score both read the call's offset (a tensor made from the int
    ``q_offset``). The first call's mods read the very same tensor, later calls' score_mod a
    new view of it next to the kept block mask's: dynamo guards on that sharing, so the second
    identical call compiled again (on a GPU, a warm decode plan then left the decoding kernel).
    Calls with the same inputs compile once, and stay equal to the reference."""
    attn = flexspec.compile("causal & (window(300) | sink(4)) + alibi", backend="flex")
    q, k, v = Shape(2, 8, 2, 128, 1000, 64).qkv(0)
    before = graphs()
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            out = attn(q, k, v, q_offset=872)
    assert graphs() - before == 1
    torch.testing.assert_close(out.detach(), attn.reference(q, k, v, q_offset=872),
                               rtol=1e-4, atol=1e-4)


def _bindings(text: str) -> dict:
    """Binding tensors for the specs of the test below (B=2, KV_LEN=300): new objects at
    every call, the same values."""
    made = {}
    if "doc" in text:
        made["doc_ids"] = (torch.arange(300) // 70).expand(2, 300).clone()
    if "key_padding" in text:
        made["valid"] = torch.arange(300).expand(2, 300) >= torch.tensor([[0], [37]])
    if "rel_bias" in text:
        made["rel_bias_table"] = torch.randn(4, 129, generator=torch.Generator().manual_seed(0))
    return made


@pytest.mark.parametrize("text", ["causal & doc + alibi", "causal & key_padding + softcap(30)",
                                  "causal & doc + rel_bias(max_distance=64)"])
def test_calls_with_the_same_or_fresh_bindings_compile_once(text):
    """Mask and score read bindings and the call's offset: calls repeating the very same
    tensors, then calls with fresh ones of the same shapes (a training step's new doc_ids, a
    decode step's new padding), all run on the graph of the first call."""
    attn = flexspec.compile(text, backend="flex")
    q, k, v = Shape(2, 4, 2, 128, 300, 16).qkv(0)
    before = graphs()
    given = _bindings(text)
    with torch.no_grad():
        outs = [attn(q, k, v, q_offset=172, **given) for _ in range(3)]
        outs += [attn(q, k, v, q_offset=172, **_bindings(text)) for _ in range(2)]
    assert graphs() - before == 1
    expected = attn.reference(q, k, v, q_offset=172, **given)
    for out in outs:
        torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-4)


def test_a_preallocated_cache_runs_with_fixed_shapes():
    """A static cache: the buffers keep their shape, the valid length of each row grows in
    place, and the end-aligned spec places the newest queries at the end of each row."""
    attn = flexspec.compile("causal_bottom_right & window(100)")
    window, capacity = 128, 512
    q, k, v = Shape(2, 4, 2, window, capacity, 16).qkv(3)
    before = graphs()
    decode_a_static_cache(attn, q, k, v, torch.tensor([200, 260]))
    assert graphs() - before <= 1


def decode_a_static_cache(attn, q, k, v, lengths: torch.Tensor, steps: int = 100) -> None:
    """``steps`` calls over fixed buffers whose valid lengths grow in place; every 33rd call,
    each row equals the reference of that row's valid keys alone."""
    with torch.no_grad():
        for step in range(steps):
            out = attn(q, k, v, kv_lengths=lengths)
            if step % 33 == 0:
                for row, n in enumerate(lengths.tolist()):
                    alone = attn.reference(q[row:row + 1], k[row:row + 1, :, :n],
                                           v[row:row + 1, :, :n])
                    torch.testing.assert_close(out[row:row + 1], alone, rtol=1e-4, atol=1e-4)
            lengths += 1  # in place, as a decode loop over a static cache does


def test_a_static_cache_with_fused_block_masks_never_recompiles(monkeypatch):
    """As on a GPU, where the block mask of every decoding step is built by the mask's compiled
    program (flexspec.kernels.fused_blocks): the static cache of the test above, a hundred steps,
    one graph for the kernel and one for the mask's program, results still exact."""
    monkeypatch.setattr(masks, "FUSED_DEVICES", frozenset({"cpu"}))
    built = []
    original = fused_blocks.fused_block_mask
    monkeypatch.setattr(fused_blocks, "fused_block_mask",
                        lambda *a, **kw: built.append(1) or original(*a, **kw))
    attn = flexspec.compile("causal_bottom_right & window(100) + alibi")
    q, k, v = Shape(2, 4, 2, 128, 512, 16).qkv(5)
    before = graphs()
    decode_a_static_cache(attn, q, k, v, torch.tensor([200, 333]))
    assert len(built) == 100  # a mask per step, each from the program
    assert graphs() - before <= 2


def test_single_token_decoding_on_the_cpu_needs_no_compilation():
    """On the CPU a sequence shorter than one block runs on the reference (torch's compiled CPU
    kernel was wrong there): a hundred single-token steps, no graph."""
    attn = flexspec.compile("causal_bottom_right + alibi")
    q, k, v = Shape(1, 4, 4, 150, 150, 8).qkv(1)
    before = graphs()
    with torch.no_grad():
        for length in range(51, 151):
            out = attn(q[:, :, length - 1:length], k[:, :, :length], v[:, :, :length])
        full = attn.reference(q, k, v)
    torch.testing.assert_close(out, full[:, :, -1:], rtol=1e-5, atol=1e-5)
    assert graphs() == before


def test_a_mask_its_program_cannot_trace_falls_back_to_the_eager_builder(monkeypatch):
    monkeypatch.setattr(masks, "FUSED_DEVICES", frozenset({"cpu"}))
    tried = []

    def untraceable(*args, **kwargs):
        tried.append(1)
        raise fused_blocks.Untraceable("planted")

    monkeypatch.setattr(fused_blocks, "fused_block_mask", untraceable)
    attn = flexspec.compile("causal & doc")
    q, k, v = Shape(1, 2, 2, 200, 200, 16).qkv(0)
    with torch.no_grad():
        for n in (2, 3, 4):
            ids = torch.arange(200) * n // 200
            torch.testing.assert_close(attn(q, k, v, doc_ids=ids),
                                       attn.reference(q, k, v, doc_ids=ids),
                                       rtol=1e-4, atol=1e-4)
    assert len(tried) == 1  # remembered: not traced again


def recorded_entry(purpose: str, describe) -> tuple:
    """``(run, seen)``: the function of a compiled FlexAttention entry compiled with a backend
    that appends ``describe(keys)`` to ``seen`` for the keys and values of each graph (the fake
    tensors dynamo hands it: placeholders with 3 heads)."""
    from flexspec.kernels.lower import lower
    from flexspec.runtime import compiled

    seen = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) \
                    and value.dim() == 4 and value.shape[1] == 3:
                seen.append(describe(value))
        return gm.forward

    entry = compiled.compiled_entry(lower(flexspec.compile("causal").ir), purpose)
    return torch.compile(entry._torchdynamo_orig_callable, backend=backend), seen


def test_a_cache_view_s_strides_stay_constants_when_lengths_turn_dynamic():
    """Keys viewed in a longer cache have a head stride that does not follow from their length:
    once lengths are dynamic, dynamo would give it a symbol of its own, which inductor cannot
    prove a multiple of 16 (unaligned loads, flexspec.workarounds: dynamic-stride-alignment).
    The entry states it as 16 times a number, a constant here: read off the graph dynamo hands
    its backend, while the lengths do turn dynamic. Contiguous keys pin nothing (their strides
    follow the length)."""
    from flexspec.runtime import compiled

    def length_and_stride(keys):
        stride = keys.stride(1)
        if isinstance(stride, torch.SymInt):  # what the shape environment knows of it
            stride = stride.node.shape_env.replace(stride.node.expr)
            stride = int(stride) if stride.is_number else None
        return type(keys.shape[2]), stride

    run, seen = recorded_entry("stride test", length_and_stride)
    cache = torch.randn(2, 3, 1201, 16)
    q = torch.randn(2, 6, 4, 16)
    for n in (100, 120, 130):
        k, v = cache[:, :, :n], cache[:, :, :n]
        if n == 120:  # as compiled.mark_lengths_dynamic does before a second compile
            torch._dynamo.maybe_mark_dynamic(k, 2)
            torch._dynamo.maybe_mark_dynamic(v, 2)
        pinned = compiled.free_strides(q, k, v)
        assert pinned == ((1, 1, 16, 1201), (2, 1, 16, 1201))
        run(q, k, v, None, None, None, True, None, None, pinned)
    # a static graph, then one dynamic in the length with the stride a constant; no third
    assert seen == [(int, 1201 * 16)] * 2 + [(torch.SymInt, 1201 * 16)] * 2
    contiguous = torch.randn(2, 3, 50, 16)
    assert compiled.free_strides(q, contiguous, contiguous.transpose(1, 2).contiguous()
                                 .transpose(1, 2)) == ()
    assert compiled.free_strides(q.transpose(2, 3), contiguous, contiguous) == ()  # follows
    padded = torch.randn(2, 6, 4, 20)[..., :16]  # rows of 20 elements, 16 of them read
    assert compiled.free_strides(padded, contiguous, contiguous) == ((0, 2, 1, 20),)


def test_keys_viewed_in_caches_of_two_capacities_compile_with_inductor():
    """Keys viewed in a cache of one capacity, then of another (two models, or two static
    caches of one spec in a process): the pinned head stride's number changes, dynamo makes it
    a graph input of its own, and inductor refused the graph ("For 32*s0, expected [s0] to
    have been codegen-ed") when that input came after the keys whose strides it names. The
    entry reads the numbers first; every call equals the float64 reference, on FlexAttention
    (``backend="flex"`` raises rather than moving the call elsewhere), in three graphs."""
    attn = flexspec.compile("causal + softcap(30)", backend="flex")
    before = graphs()
    with torch.no_grad():
        for capacity, lengths in ((1201, (900, 901, 902)), (700, (600, 601))):
            cache = torch.randn(2, 2, capacity, 16)
            for n in lengths:
                q = torch.randn(2, 4, 128, 16)
                k, v = cache[:, :, :n], cache[:, :, :n]
                out = attn(q, k, v, q_offset=n - 128)
                ref = attn.reference(q.double(), k.double(), v.double(), q_offset=n - 128)
                torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    # static, dynamic in the lengths, dynamic in the stride's number
    assert graphs() - before == 3


@pytest.mark.parametrize("batch_static", [False, True], ids=["any call", "a decoding call"])
def test_a_window_of_a_cache_that_grows_by_concatenation_keeps_its_stride_a_multiple_of_16(
        batch_static):
    """A cache that grows by concatenation (transformers' dynamic cache) read through a window:
    the keys' length stays the window's while their head stride, the cache's length times D,
    changes every step. The entry states it as 16 times a number, which dynamo makes dynamic
    once it changes: one more graph, then none, and inductor still knows the stride a multiple
    of 16 (flexspec.workarounds: dynamic-stride-alignment). A decoding call keeps its batch and
    heads static (compiled.mark_batch_static), which must not keep that stride static too:
    dynamo then guarded it exactly, and an H100 compiled every step of such a decode."""
    from torch._inductor.sizevars import SizeVarAllocator
    from flexspec.runtime import compiled

    def symbolic_and_aligned(keys):
        stride = keys.stride(1)
        if not isinstance(stride, torch.SymInt):
            return False, stride % 16 == 0
        shapes = SizeVarAllocator(stride.node.shape_env)
        return True, shapes.statically_known_multiple_of(stride.node.expr, 16)

    run, seen = recorded_entry(f"window test {batch_static}", symbolic_and_aligned)
    q = torch.randn(2, 6, 4, 16)
    for n in range(300, 306):
        # a new, longer cache every step
        k, v = (torch.randn(2, 3, n, 16)[:, :, n - 100:] for _ in range(2))
        if batch_static:
            compiled.mark_batch_static(q, k, v)
        run(q, k, v, None, None, None, True, None, None, compiled.free_strides(q, k, v))
    assert seen == [(False, True)] * 2 + [(True, True)] * 2


def test_a_mask_reading_rows_of_keys_compiles_for_new_lengths_on_the_cpu_or_runs_elsewhere(
        monkeypatch):
    """torch's C++ kernel does not compile a mask that reads a binding with a row per batch row
    (``valid[B, KV_LEN]``) once lengths are dynamic (flexspec.workarounds:
    cpu-dynamic-row-binding). Asked for by name, flex says so; under auto the calls go on on
    another backend, equal to the reference. When torch fixes it, the first half fails: the
    workaround can then go."""
    from flexspec.runtime import plan as planning
    monkeypatch.setattr(planning, "FAILURES", planning.Failures())
    q = torch.randn(2, 1, 128, 8)
    cache_k, cache_v = torch.randn(2, 1, 340, 8), torch.randn(2, 1, 340, 8)
    valid = torch.ones(2, 340, dtype=torch.bool)
    valid[0, :5] = False

    def call(attn, n):
        return attn(q, cache_k[:, :, :n], cache_v[:, :, :n], q_offset=n - 128,
                    valid=valid[:, :n])

    named = flexspec.compile("causal & key_padding", backend="flex")
    with torch.no_grad():
        call(named, 300)
        with pytest.raises(BackendError, match="backend 'flex' could not "
                           "compile this spec: torch.compile failed \\(CppCompileError: "):
            call(named, 301)
        auto = flexspec.compile("causal & key_padding")
        with pytest.warns(UserWarning, match="backend 'flex' could not compile"):
            outs = [(n, call(auto, n)) for n in (300, 301, 333)]
    for n, out in outs:
        expected = auto.reference(q, cache_k[:, :, :n], cache_v[:, :, :n], q_offset=n - 128,
                                  valid=valid[:, :n])
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_second_plan_of_a_compiled_shape_with_more_keys_than_rows_compiles_nothing():
    """A compiled entry remembers the (Q_LEN, KV_LEN) it first compiled for, and a new plan of
    that very shape (a second model of the spec, a chunk of 130 rows over 200 keys) must not
    mark its lengths dynamic: remembered the other way round, it compiled again."""
    q, k, v = Shape(1, 2, 2, 130, 200, 16).qkv(0)
    before = graphs()
    with torch.no_grad():
        for _ in range(2):
            attn = flexspec.compile("causal & window(64)")
            torch.testing.assert_close(attn(q, k, v, q_offset=70),
                                       attn.reference(q, k, v, q_offset=70),
                                       rtol=1e-4, atol=1e-4)
    assert graphs() - before == 1
