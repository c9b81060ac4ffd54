"""runtime.serving.reads: attention over a paged KV cache. For any spec, slot order and ragged
lengths, ``attn.paged`` equals the same call on the sequences laid out contiguously, read in
place or gathered; a read made once serves every layer of a step; the CPU's compiled reads,
kernel options and tuning; serving loops of arrivals and departures."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask

import flexspec
from flexspec.runtime.serving.cache import PagedKVCache
from flexspec.testing import Shape, bindings, spec_texts

# pytest puts this folder on sys.path
from test_cache import DIM, KV_HEADS, cache, dense_reference, filled


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts(), st.lists(st.integers(1, 24), min_size=1, max_size=3), st.integers(1, 3),
       st.randoms(use_true_random=False), st.integers(0, 2**31 - 1), st.data())
def test_attention_over_the_cache_equals_the_contiguous_call(text, lengths, q_len, rng, seed,
                                                             data):
    """Any registry spec, any slot order, ragged lengths: attn.paged(q, cache, slots) equals
    attn(q, keys, values, q_offset=lengths - Q_LEN, kv_lengths=lengths) on the same sequences
    laid out contiguously (and so the float64 reference, which that call is checked against
    elsewhere), with bindings that cover the capacity."""
    attn = flexspec.compile(text, backend="reference")
    lengths = [max(length, q_len) for length in lengths]
    order = rng.sample(range(len(lengths) + 2), len(lengths))
    paged, keys, values = filled(lengths, order, seed)
    batch, capacity = len(lengths), paged.capacity
    q = torch.randn(batch, 4, q_len, DIM, generator=torch.Generator().manual_seed(seed + 1))
    extra = data.draw(bindings(attn.spec, Shape(batch, 4, KV_HEADS, q_len, capacity, DIM)))
    valid = torch.tensor(lengths)
    slots = torch.tensor(order)
    try:
        want = attn(q, keys, values, q_offset=valid - q_len, kv_lengths=valid, **extra)
    except flexspec.SpecError as error:
        with pytest.raises(type(error)):
            attn.paged(q, paged, slots, **extra)
        return
    torch.testing.assert_close(attn.paged(q, paged, slots, **extra), want)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec_texts(), st.lists(st.integers(1, 40), min_size=1, max_size=3), st.integers(1, 3),
       st.randoms(use_true_random=False), st.integers(0, 2**31 - 1), st.data())
def test_reading_the_pool_in_place_equals_the_contiguous_call(eager_kernels, text, lengths,
                                                              q_len, rng, seed, data):
    """read="in_place" (FlexAttention run eagerly over the pool: its mask_mod and score_mod
    evaluated at every pool position) for any registry spec, any slot order, ragged lengths
    over pages of 16: equal to the same call on the sequences laid out contiguously, with
    bindings that cover the capacity. The compiled kernels, which read the mapped tables, are
    the slow tests' and the GPU's."""
    attn = flexspec.compile(text)
    lengths = [max(length, q_len) for length in lengths]
    order = rng.sample(range(len(lengths) + 2), len(lengths))
    paged, keys, values = filled(lengths, order, seed, page_size=16, max_pages=3)
    batch, capacity = len(lengths), paged.capacity
    q = torch.randn(batch, 4, q_len, DIM, generator=torch.Generator().manual_seed(seed + 1))
    extra = data.draw(bindings(attn.spec, Shape(batch, 4, KV_HEADS, q_len, capacity, DIM)))
    valid = torch.tensor(lengths)
    try:
        want = attn.reference(q, keys, values, q_offset=valid - q_len, kv_lengths=valid,
                              **extra)
    except flexspec.SpecError as error:
        with pytest.raises(type(error)):
            attn.paged(q, paged, torch.tensor(order), read="in_place", **extra)
        return
    with torch.no_grad():
        got = attn.paged(q, paged, torch.tensor(order), read="in_place", **extra)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_decode_loop_over_the_cache_equals_the_contiguous_loop(eager_kernels):
    """Three sequences decoding at once in slots 4, 0, 2, each token appended then attended,
    on the flex path (prefills of 130 rows) and the reference (decode rows): equal to the same
    loop over contiguous caches."""
    attn = flexspec.compile("causal & (window(50) | sink(2)) + alibi")
    paged = cache(pages=40, page_size=16, slots=5, max_pages=12)
    slots = torch.tensor([4, 0, 2])
    generator = torch.Generator().manual_seed(0)
    prompt = [torch.randn(3, KV_HEADS, 130, DIM, generator=generator) for _ in range(2)]
    q = torch.randn(3, 4, 130, DIM, generator=generator)
    paged.append(slots, *prompt)
    contiguous = [t for t in prompt]
    with torch.no_grad():
        torch.testing.assert_close(attn.paged(q, paged, slots),
                                   attn(q, *contiguous, q_offset=0), rtol=1e-4, atol=1e-4)
        for step in range(3):
            new = [torch.randn(3, KV_HEADS, 1, DIM, generator=generator) for _ in range(2)]
            paged.append(slots, *new)
            contiguous = [torch.cat([c, n], dim=2) for c, n in zip(contiguous, new)]
            token = torch.randn(3, 4, 1, DIM, generator=generator)
            length = contiguous[0].shape[2]
            torch.testing.assert_close(
                attn.paged(token, paged, slots),
                attn.reference(token, *contiguous, q_offset=length - 1), rtol=1e-4, atol=1e-4)


def test_a_mixed_batch_of_prefill_chunks_and_decoded_tokens_equals_each_request_alone():
    """Issue 27, item 2: one call runs a prefill chunk of one request, a decoded token of
    another and a longer chunk of a third (rows padded to the longest, each request's rows
    placed with its own q_offset): each request's rows equal its call alone."""
    attn = flexspec.compile("causal & window(20) + alibi", backend="reference")
    generator = torch.Generator().manual_seed(7)
    paged = cache(pages=30, page_size=4, slots=4, max_pages=10)
    slots, held, new = torch.tensor([3, 0, 1]), [6, 17, 0], [5, 1, 9]
    for slot, count in zip(slots.tolist(), held):
        if count:
            paged.append(torch.tensor([slot]), *(torch.randn(1, KV_HEADS, count, DIM,
                                                             generator=generator)
                                                 for _ in range(2)))
    rows = max(new)
    q = torch.randn(3, 4, rows, DIM, generator=generator)
    for row, (slot, count) in enumerate(zip(slots.tolist(), new)):  # the new tokens' keys
        paged.append(torch.tensor([slot]), *(torch.randn(1, KV_HEADS, count, DIM,
                                                         generator=generator)
                                             for _ in range(2)))
    lengths = paged.lengths[slots]
    mixed = attn.paged(q, paged, slots, q_offset=lengths - torch.tensor(new))
    for row, (slot, count) in enumerate(zip(slots.tolist(), new)):
        alone = attn.paged(q[row:row + 1, :, :count], paged, torch.tensor([slot]))
        torch.testing.assert_close(mixed[row:row + 1, :, :count], alone)
        keys, values = paged.gathered(torch.tensor([slot]))
        length = int(paged.lengths[slot])
        torch.testing.assert_close(alone, attn.reference(q[row:row + 1, :, :count],
                                                         keys[:, :, :length],
                                                         values[:, :, :length],
                                                         q_offset=length - count))


# --- attn.paged reading the pool in place (read="in_place", paged_read) ---------------------


@pytest.mark.slow
@pytest.mark.parametrize("text, allowed", [
    ("causal + alibi", None),
    ("causal & doc", lambda row, i, j: j <= i and j // 70 == i // 70),
    ("sliding_window(40) + softcap(20)", None)])
def test_paged_reads_the_pool_in_place_equal_to_each_sequence_alone(text, allowed):
    """attn.paged(..., read="in_place") on the CPU's compiled kernels (130 query rows): slots
    3, 0, 4 with interleaved pages and a page of a slot outside the call, GQA, a mask that
    reads a binding over the capacity, scores that read positions (alibi: the score sees each
    key's logical position, not its place in the pool); each row equals the float64 reference
    over its own sequence."""
    torch._dynamo.reset()
    page, rows = 32, 130
    attn = flexspec.compile(text)
    slots, lengths = [3, 0, 4], [200, 150, 177]
    paged, keys, values = filled(lengths, slots, seed=5, page_size=page, max_pages=8)
    paged.append(torch.tensor([1]), *(torch.randn(1, KV_HEADS, 20, DIM) for _ in range(2)))
    q = torch.randn(3, 4, rows, DIM, generator=torch.Generator().manual_seed(6))
    extra = {}
    if "doc" in text:
        extra["doc_ids"] = (torch.arange(paged.capacity) // 70).expand(3, -1).contiguous()
    with torch.no_grad():
        out = attn.paged(q, paged, torch.tensor(slots), read="in_place", **extra)
    for row, length in enumerate(lengths):
        alone = {name: value[row:row + 1, :length] for name, value in extra.items()}
        expected = attn.reference(q[row:row + 1].double(), keys[row:row + 1, :, :length].double(),
                                  values[row:row + 1, :, :length].double(),
                                  q_offset=length - rows, **alone)
        torch.testing.assert_close(out[row:row + 1].double(), expected, rtol=1e-4, atol=1e-4)
    if allowed is not None:  # and the reference itself against the mask written out
        written = dense_reference(q, keys, values, torch.tensor(lengths),
                                   torch.tensor(lengths) - rows, allowed)
        torch.testing.assert_close(out.double(), written, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def assert_rows_alone(attn, out, q, keys, values, lengths: list) -> None:
    """Each row of a read's ``out`` equals the float64 reference of its queries alone over its
    own sequence (the first ``lengths[row]`` of ``keys`` and ``values``), ending there."""
    q_len = q.shape[2]
    for row, length in enumerate(lengths):
        want = attn.reference(q[row:row + 1].double(), keys[row:row + 1, :, :length].double(),
                              values[row:row + 1, :, :length].double(),
                              q_offset=length - q_len)
        torch.testing.assert_close(out[row:row + 1].double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_in_place_reads_of_new_batches_and_query_lengths_compile_on_the_cpu():
    """A read in place of another batch or query length compiles again, statically, on the
    CPU: with shapes dynamic (dynamo's way from a second shape on) the CPU's C++ kernel of the
    mapped mask did not compile ('cur_kvSplitSize3' was not declared) and such a read failed
    (flexspec.workarounds: cpu-dynamic-row-binding). Each read's rows equal the float64
    reference over their own sequence."""
    torch._dynamo.reset()
    attn = flexspec.compile("causal & window(150)")
    slots, lengths = [3, 0, 4], [200, 150, 177]
    paged, keys, values = filled(lengths, slots, seed=9, page_size=32, max_pages=8)
    generator = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for rows, q_len in ((2, 130), (3, 130), (3, 129)):
            q = torch.randn(rows, 4, q_len, DIM, generator=generator)
            out = attn.paged_read(q, paged, torch.tensor(slots[:rows]))(q)
            assert_rows_alone(attn, out, q, keys, values, lengths[:rows])
    torch._dynamo.reset()


@pytest.mark.slow
def test_kernel_options_given_to_compile_reach_the_read_in_place():
    """flexspec.compile(..., kernel_options=...) reaches a read in place over flexspec's own
    options (a key tile of 16 within pages of 32), which still equals the float64 reference;
    a key tile that does not divide the page (it would span two pages), or is no tile of
    FlexAttention's, is refused, saying which tiles fit."""
    torch._dynamo.reset()
    slots, lengths = [3, 0, 4], [200, 150, 177]
    paged, keys, values = filled(lengths, slots, seed=9, page_size=32, max_pages=8)
    q = torch.randn(3, 4, 130, DIM, generator=torch.Generator().manual_seed(11))
    attn = flexspec.compile("causal + alibi", kernel_options={"BLOCK_N": 16, "num_stages": 1})
    with torch.no_grad():
        read = attn.paged_read(q, paged, torch.tensor(slots))
        out = read(q)
    assert {"BLOCK_N": 16, "num_stages": 1}.items() <= read._plan.state.kernel.options.items()
    assert_rows_alone(attn, out, q, keys, values, lengths)
    for tile in (64, 24, 8):
        wide = flexspec.compile("causal + alibi", kernel_options={"BLOCK_N": tile})
        with pytest.raises(flexspec.BindingError,
                           match=rf"BLOCK_N={tile} is not a key tile that divides .* pages "
                                 r"of 32 .* one of \[16, 32\]"):
            wide.paged_read(q, paged, torch.tensor(slots))
    from flexspec.runtime.flexpages import given_options
    assert given_options({"BLOCK_N": 32, "num_warps": 4}, 96) == {"BLOCK_N": 32, "num_warps": 4}
    with pytest.raises(flexspec.BindingError, match=r"powers of two .* one of \[16, 32\]"):
        given_options({"BLOCK_N": 48}, 96)  # divides the page, but is no tile of FlexAttention's
    torch._dynamo.reset()


@pytest.mark.slow
def test_tuning_a_read_in_place_keeps_the_fastest_options_and_its_answer():
    """PagedRead.tune times the read with each candidate (each compiled in an entry of its
    own) and its own options, leaves out a key tile that does not divide the page saying why,
    and keeps the fastest: the read still equals the float64 reference, runs with the options
    kept, and a spec compiled with ``kernel_options=result.best`` reads with them too."""
    torch._dynamo.reset()
    slots, lengths = [3, 0, 4], [200, 150, 177]
    paged, keys, values = filled(lengths, slots, seed=12, page_size=32, max_pages=8)
    q = torch.randn(3, 4, 130, DIM, generator=torch.Generator().manual_seed(13))
    attn = flexspec.compile("causal & window(150)")
    with torch.no_grad():
        read = attn.paged_read(q, paged, torch.tensor(slots))
        result = read.tune(q, candidates=[{"BLOCK_N": 16}, {"BLOCK_N": 64}], repeats=2)
        out = read(q)
    assert [options for options, _ in result.times] == [{}, {"BLOCK_N": 16}, {"BLOCK_N": 64}]
    assert all(ms > 0 for _, ms in result.times[:2]), result
    assert result.times[2][1] is None
    assert "divides the cache's pages of 32" in result.failed[str({"BLOCK_N": 64})]
    assert result.best in ({}, {"BLOCK_N": 16})
    assert result.best.items() <= (read._plan.state.kernel.options or {}).items()
    assert_rows_alone(attn, out, q, keys, values, lengths)
    pinned = flexspec.compile("causal & window(150)", kernel_options=result.best)
    with torch.no_grad():
        torch.testing.assert_close(pinned.paged_read(q, paged, torch.tensor(slots))(q), out)
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_paged_read_made_once_serves_every_layer_of_a_step():
    """attn.paged_read: made from one layer's cache, it runs the other layers' caches (same
    operations, other keys and values) and equals each cache read on its own; it refuses a
    query of another shape and a cache of another geometry, saying what to do."""
    torch._dynamo.reset()
    attn = flexspec.compile("causal + alibi")
    slots = torch.tensor([2, 0])
    layers = [cache(pages=20, page_size=16, slots=3, max_pages=10) for _ in range(2)]
    generator = torch.Generator().manual_seed(8)
    for lengths in ([90, 140], [40, 1]):
        for layer in layers:  # the same appends: the same pages
            layer.append(slots, *(torch.randn(2, KV_HEADS, lengths[0], DIM, generator=generator)
                                  for _ in range(2)))
    q = torch.randn(2, 4, 130, DIM, generator=generator)
    with torch.no_grad():
        read = attn.paged_read(q, layers[0], slots)
        for layer in layers:
            torch.testing.assert_close(read(q, layer),
                                       attn.paged(q, layer, slots, read="gather"),
                                       rtol=1e-4, atol=1e-4)
        with pytest.raises(flexspec.BindingError, match="queries of the shape it was made for"):
            read(q[:, :, :129])
        other = cache(pages=21, page_size=16, slots=3, max_pages=10)
        with pytest.raises(flexspec.BindingError, match="caches of the layout it was made"):
            read(q, other)
    with pytest.raises(flexspec.BindingError, match="inference only .* read='gather' to train"):
        read(q.clone().requires_grad_())
    torch._dynamo.reset()


def test_paged_refuses_what_it_cannot_read_in_place(monkeypatch):
    """read= is checked; pages that are not a multiple of 16 positions, and a query that needs
    gradients, are refused in place with the way out (read='gather'); on the CPU, read="auto"
    gathers (the in-place read is never made)."""
    from flexspec.runtime import flexpages
    attn = flexspec.compile("causal")
    paged = cache(pages=12, page_size=4, slots=3, max_pages=6)
    slots = torch.tensor([1])
    paged.append(slots, *(torch.randn(1, KV_HEADS, 7, DIM) for _ in range(2)))
    q = torch.randn(1, 4, 2, DIM)
    with pytest.raises(flexspec.BindingTypeError,
                       match="read must be 'auto', 'in_place' or 'gather', got 'pages'"):
        attn.paged(q, paged, slots, read="pages")
    with pytest.raises(flexspec.BindingError, match=r"pages hold 4: use pages of 16, 32, 64 or "
                                                    r"128 positions, or read='gather'"):
        attn.paged(q, paged, slots, read="in_place")
    sixteen = cache(pages=4, page_size=16, slots=2, max_pages=2)
    sixteen.append(slots, *(torch.randn(1, KV_HEADS, 7, DIM) for _ in range(2)))
    with pytest.raises(flexspec.BindingError, match="inference only .* read='gather' to train"):
        attn.paged(q.requires_grad_(), sixteen, slots, read="in_place")
    with pytest.raises(flexspec.BindingError, match=r"a row per slot \(B = 1\), got \[2, 4"):
        attn.paged(torch.randn(2, 4, 1, DIM), sixteen, slots, read="in_place")

    def never(*args, **kwargs):
        raise AssertionError("read in place")
    monkeypatch.setattr(flexpages, "prepare", never)
    out = attn.paged(q.detach(), sixteen, slots)  # auto, on the CPU: gathered
    keys, values = sixteen.gathered(slots)
    torch.testing.assert_close(out, attn.reference(q.detach(), keys[:, :, :7], values[:, :, :7],
                                                   q_offset=5))


SERVED = "causal & (window(48) | sink(2)) + alibi"


def serve_at_random(device, steps: int, seed: int = 0, slots: int = 4,
                    guard=contextlib.nullcontext, dim: int = DIM, text: str = SERVED):
    """Decode steps of up to ``slots`` requests over a paged cache, requests arriving into free
    slots and leaving at random (prompts of 1..40 tokens appended, then a token a step until
    each has its number). Every step makes one in-place read for all slots (idle slots hold no
    key) and checks each running request's row against the float64 reference over its own
    keys, under the spec ``text``. flexspec's part of each step (appends, the read, releases)
    runs inside ``guard()``. Returns the count of steps that checked rows."""
    attn = flexspec.compile(text)
    paged = PagedKVCache(pages=slots * 8, page_size=16, kv_heads=KV_HEADS, head_dim=dim,
                         slots=slots, max_pages=8, device=device)
    rng = torch.Generator().manual_seed(seed)
    running = {}  # slot -> [keys, values, tokens left]
    all_slots = torch.arange(slots, device=device)
    checked = 0

    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(device)
    for _ in range(steps):
        for slot in range(slots):
            if slot not in running and torch.rand(1, generator=rng).item() < 0.3:
                prompt = int(torch.randint(1, 41, (1,), generator=rng))
                kv = [randn(1, KV_HEADS, prompt, dim) for _ in range(2)]
                arriving = torch.tensor([slot], device=device)
                with guard():
                    paged.append(arriving, *kv, check=False)
                running[slot] = kv + [int(torch.randint(1, 80, (1,), generator=rng))]
        active = sorted(running)
        if active:  # the new token of every running request, then one read for all slots
            new = [randn(len(active), KV_HEADS, 1, dim) for _ in range(2)]
            decoding = torch.tensor(active, device=device)
            with guard():
                paged.append(decoding, *new, check=False)
            for row, slot in enumerate(active):
                for part in (0, 1):
                    running[slot][part] = torch.cat([running[slot][part],
                                                     new[part][row:row + 1]], dim=2)
        q = randn(slots, 4, 1, dim)
        with torch.no_grad(), guard():
            out = attn.paged_read(q, paged, all_slots)(q)
        for slot in active:
            keys, values, _ = running[slot]
            want = attn.reference(q[slot:slot + 1].double().cpu(), keys.double().cpu(),
                                  values.double().cpu(), q_offset=keys.shape[2] - 1)
            torch.testing.assert_close(out[slot:slot + 1].double().cpu(), want,
                                       rtol=1e-4, atol=1e-4)
        checked += bool(active)
        leaving = [slot for slot in active if running[slot][2] == 1
                   or running[slot][0].shape[2] == paged.capacity]
        for slot in active:
            running[slot][2] -= 1
        if leaving:
            leaving_slots = torch.tensor(leaving, device=device)
            with guard():
                paged.release(leaving_slots)
            for slot in leaving:
                del running[slot]
    paged.check()
    return checked


@pytest.mark.slow
def test_a_thousand_steps_of_arrivals_and_departures_compile_once():
    """Issue 27's serving target on the CPU: 1000 decode steps with requests arriving and
    leaving at random, slots reused, every running request's row equal to the float64
    reference each step, and the in-place read compiled once (dynamo's graph count)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    assert serve_at_random("cpu", 1000) > 900
    assert counters["stats"]["unique_graphs"] - before <= 2
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_mixed_batch_read_in_place_equals_each_request_alone():
    """Issue 27, item 2, read in place: a prefill chunk of one request (5 new tokens after 6
    held), a decoded token of another (after 17) and a whole prompt of a third (9 tokens), in
    one call with each row's own q_offset; each request's rows equal the float64 reference
    over its own keys."""
    torch._dynamo.reset()
    attn = flexspec.compile("causal & window(20) + alibi")
    generator = torch.Generator().manual_seed(7)
    paged = cache(pages=12, page_size=16, slots=4, max_pages=4)
    slots, held, new = torch.tensor([3, 0, 1]), [6, 17, 0], [5, 1, 9]
    sequences = {}
    for slot, count, added in zip(slots.tolist(), held, new):
        kv = [torch.randn(1, KV_HEADS, count + added, DIM, generator=generator)
              for _ in range(2)]
        sequences[slot] = kv
        if count:
            paged.append(torch.tensor([slot]), kv[0][:, :, :count], kv[1][:, :, :count])
    for slot, count, added in zip(slots.tolist(), held, new):  # the new tokens' keys
        kv = sequences[slot]
        paged.append(torch.tensor([slot]), kv[0][:, :, count:], kv[1][:, :, count:])
    q = torch.randn(3, 4, max(new), DIM, generator=generator)
    with torch.no_grad():
        mixed = attn.paged(q, paged, slots, q_offset=paged.lengths[slots] - torch.tensor(new),
                           read="in_place")
    for row, (slot, count, added) in enumerate(zip(slots.tolist(), held, new)):
        keys, values = sequences[slot]
        want = attn.reference(q[row:row + 1, :, :added].double(), keys.double(),
                              values.double(), q_offset=count)
        torch.testing.assert_close(mixed[row:row + 1, :, :added].double(), want,
                                   rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize("text", ["causal + alibi", "causal & doc",
                                  "sliding_window(9) + softcap(5)"])
def test_a_pool_too_wide_for_one_decoding_call_is_read_a_group_of_kv_heads_at_a_time(
        eager_kernels, monkeypatch, text):
    """A pool inductor would index in int64 (here: any pool wider than one KV head's) is read in
    one call per group of KV heads, each with its query heads, which the decoding kernel
    compiles for; a score that reads the head (alibi's slopes) sees each head's own number.
    Each row, and its log-sum-exp, equals the float64 reference over its own sequence."""
    from flexspec.runtime import flexpages
    slots, lengths, rows = [3, 0, 4], [40, 23, 31], 3
    paged, keys, values = filled(lengths, slots, seed=7, page_size=16, max_pages=3)
    one_head = paged.keys.shape[1] * DIM
    monkeypatch.setattr(flexpages, "wide_keys",
                        lambda positions, dim, v_dim: positions * max(dim, v_dim) > one_head)
    attn = flexspec.compile(text)
    q = torch.randn(3, 4, rows, DIM, generator=torch.Generator().manual_seed(8))
    extra = {}
    if "doc" in text:
        extra["doc_ids"] = (torch.arange(paged.capacity) // 10).expand(3, -1).contiguous()
    with torch.no_grad():
        read = attn.paged_read(q, paged, torch.tensor(slots), return_lse=True, **extra)
        out, lse = read(q)
        alone = attn.paged_read(q, paged, torch.tensor(slots), **extra)(q)  # no log-sum-exp
    assert read._plan.state.parts == KV_HEADS
    torch.testing.assert_close(alone, out)
    for row, length in enumerate(lengths):
        alone = {name: value[row:row + 1, :length] for name, value in extra.items()}
        expected, expected_lse = attn.reference(
            q[row:row + 1].double(), keys[row:row + 1, :, :length].double(),
            values[row:row + 1, :, :length].double(), q_offset=length - rows,
            return_lse=True, **alone)
        torch.testing.assert_close(out[row:row + 1].double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[row:row + 1].double(), expected_lse, rtol=1e-4,
                                   atol=1e-4)


# --- a read that lists every page its slots hold (flexpages.lists_every_page) ------------------


def computed_cells(block_mask, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Bool ``[B, H, Q_LEN, KV_LEN]`` (H the mask's head extent): the cells a kernel computes
    from ``block_mask``'s tables, those of listed partial tiles where its ``mask_mod`` allows
    them and every cell of listed full tiles."""
    from torch.nn.attention.flex_attention import create_mask
    heads = block_mask.kv_num_blocks.shape[1]
    q_block, kv_block = block_mask.BLOCK_SIZE
    allowed = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    cells = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    for counts, indices, full in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                                  (block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                   True)):
        if counts is None:
            continue
        counts = counts.expand(batch, heads, -1)
        indices = indices.expand(batch, heads, -1, -1)
        for b in range(batch):
            for h in range(heads):
                for row in range(counts.shape[2]):
                    for column in indices[b, h, row, :int(counts[b, h, row])].tolist():
                        rows = slice(row * q_block, (row + 1) * q_block)
                        keys = slice(column * kv_block, (column + 1) * kv_block)
                        cells[b, h, rows, keys] |= True if full else allowed[b, h, rows, keys]
    return cells


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts(), st.lists(st.integers(1, 40), min_size=1, max_size=3), st.integers(1, 3),
       st.randoms(use_true_random=False), st.integers(0, 2**31 - 1), st.data())
def test_a_read_listing_every_page_computes_the_cells_of_the_exact_read(text, lengths, q_len,
                                                                        rng, seed, data):
    """A decoding read whose slots' keys are small lists every page each slot holds and lets
    the mask decide each key, instead of building the exact logical block mask every step
    (flexpages.lists_every_page; CUDA only, forced here on the CPU). For any registry spec,
    slot order and ragged lengths over pages of 16, the pool's block mask it makes lists the
    pages each row's slot holds, every one of them, and the cells a kernel computes from its
    tables equal those of the exact read's mask."""
    from unittest import mock

    from flexspec.runtime import flexpages, masks
    lengths = [max(length, q_len) for length in lengths]
    order = rng.sample(range(len(lengths) + 2), len(lengths))
    paged, _, _ = filled(lengths, order, seed, page_size=16, max_pages=3)
    batch, slots = len(lengths), torch.tensor(order)
    q = torch.randn(batch, 4, q_len, DIM, generator=torch.Generator().manual_seed(seed + 1))
    extra = data.draw(bindings(flexspec.parse(text),
                               Shape(batch, 4, KV_HEADS, q_len, paged.capacity, DIM)))
    made, mapped = {}, []
    every_tile, pool_block_mask = masks.MaskCache.every_tile, flexpages.pool_block_mask

    def mapping(*args):  # the pool's block mask the read makes
        mapped.append(pool_block_mask(*args))
        return mapped[-1]
    for listed in (False, True):
        attn = flexspec.compile(text)  # the rule is the plan's: a plan of its own each way
        with mock.patch.object(flexpages, "lists_every_page", lambda *_: listed), \
                mock.patch.object(masks.MaskCache, "every_tile", autospec=True,
                                  side_effect=every_tile) as spy, \
                mock.patch.object(flexpages, "pool_block_mask", mapping), torch.no_grad():
            try:
                attn.paged_read(q, paged, slots, **extra)
            except flexspec.SpecError as error:  # bindings the spec refuses: both refuse them
                made[listed] = type(error)
                continue
        assert spy.called == listed
        made[listed] = mapped[-1]
    if not isinstance(made[False], BlockMask):
        assert made[True] is made[False]
        return
    every, exact = made[True], made[False]
    held = (paged.lengths[slots] + 15) // 16
    assert every.full_kv_num_blocks is None
    assert (every.kv_num_blocks == held.view(-1, 1, 1)).all()
    for row, slot in enumerate(order):
        pages = every.kv_indices[row, 0, 0, :int(held[row])].sort().values
        assert pages.tolist() == sorted(paged.page_table[slot, :int(held[row])].tolist())
    pool = paged.pages * 16
    assert torch.equal(computed_cells(every, batch, q_len, pool).expand(-1, 4, -1, -1),
                       computed_cells(exact, batch, q_len, pool).expand(-1, 4, -1, -1))


@pytest.mark.parametrize("read", ["in_place", "gather"])
@pytest.mark.parametrize("counts", [None, [1, 3, 1]])
def test_a_step_makes_the_read_once_for_every_layer(eager_kernels, monkeypatch, read, counts):
    """attn.paged(q, cache, step=flexspec.Step(slots=..., new_tokens=...)): the step's first
    layer makes the read of the pages (the plan looked up once, the pages copied into tables
    once), every later layer runs it over its own cache (the same appends, other keys); each
    layer's rows equal the float64 reference over that layer's own sequences, decoded tokens or
    a mixed batch, read in place or gathered; a new step makes a new read."""
    from flexspec.runtime.serving.cache import PagedKVCache as Cache
    attn = flexspec.compile("causal & window(20) + alibi")
    layers, slots, held = 3, torch.tensor([4, 0, 2]), [30, 9, 17]
    new = counts or [1, 1, 1]
    generator = torch.Generator().manual_seed(5)
    caches = [cache(pages=30, page_size=16, slots=5, max_pages=4) for _ in range(layers)]
    sequences = []
    for layer_cache in caches:  # the same appends in every layer: the same pages
        kv = [torch.randn(3, KV_HEADS, 33, DIM, generator=generator) for _ in range(2)]
        for row, (slot, count) in enumerate(zip(slots.tolist(), held)):
            layer_cache.append(torch.tensor([slot]), kv[0][row:row + 1, :, :count],
                               kv[1][row:row + 1, :, :count])
        layer_cache.append(slots, kv[0][:, :, 30:33], kv[1][:, :, 30:33], new_tokens=new)
        sequences.append(kv)
    tables = []
    original = Cache.tables
    monkeypatch.setattr(Cache, "tables", lambda self, s: tables.append(1) or original(self, s))
    q = [torch.randn(3, 4, max(new), DIM, generator=generator) for _ in range(layers)]
    for repeat in range(2):
        step = flexspec.Step(slots=slots, new_tokens=counts)
        with torch.no_grad():
            outs = [attn.paged(q[layer], caches[layer], step=step, read=read)
                    for layer in range(layers)]
        assert len(tables) == (repeat + 1) * (2 if counts else 1)  # a read per count of tokens
        for layer, out in enumerate(outs):
            keys, values = sequences[layer]
            for row, (count, before) in enumerate(zip(new, held)):
                # row b's own keys: its held ones, then its new ones
                own = [torch.cat([t[row:row + 1, :, :before], t[row:row + 1, :, 30:30 + count]],
                                 dim=2) for t in (keys, values)]
                want = attn.reference(q[layer][row:row + 1, :, :count].double(),
                                      *(t.double() for t in own), q_offset=before)
                torch.testing.assert_close(out[row:row + 1, :, :count].double(), want,
                                           rtol=1e-4, atol=1e-4)


def test_a_paged_step_s_refusals_say_what_to_do():
    attn = flexspec.compile("causal")
    paged = cache(pages=4, page_size=16, slots=2, max_pages=2)
    slots = torch.tensor([1])
    paged.append(slots, *(torch.randn(1, KV_HEADS, 7, DIM) for _ in range(2)))
    q = torch.randn(1, 4, 1, DIM)
    step = flexspec.Step(slots=slots)
    with pytest.raises(flexspec.BindingError, match="takes slots, new_tokens and q_offset from "
                                                    r"the step: give them to flexspec.Step"):
        attn.paged(q, paged, slots, step=step)
    with pytest.raises(flexspec.BindingError, match="names the slots its rows read"):
        attn.paged(q, paged, step=flexspec.Step())
    with pytest.raises(flexspec.BindingError, match="a step with slots is a paged step"):
        attn(q, *paged.gathered(slots), step=step)
    with pytest.raises(flexspec.BindingTypeError, match="slots must be a 1-D int tensor"):
        flexspec.Step(slots=[1])
    with pytest.raises(flexspec.BindingError, match="new_tokens goes with slots"):
        flexspec.Step(new_tokens=[1])
    with pytest.raises(flexspec.BindingError, match="takes no kv_lengths or cu_seqlens"):
        flexspec.Step(slots=slots, kv_lengths=torch.tensor([3]))
    with pytest.raises(flexspec.BindingTypeError, match="cache must be a flexspec.PagedKVCache"):
        attn.paged(q, {}, step=step)
    with pytest.raises(flexspec.BindingTypeError, match="step must be a flexspec.Step, got dict"):
        attn.paged(q, paged, step={"slots": slots})
    documents = flexspec.compile("causal & doc")
    ids = torch.zeros(1, 32, dtype=torch.long)
    with pytest.raises(flexspec.BindingError, match="doc_ids given to the call and to its "
                                                    "step: give them once"):
        documents.paged(q, paged, step=flexspec.Step(slots=slots, doc_ids=ids), doc_ids=ids)


def test_explain_says_how_a_paged_call_reads_its_pages():
    """attn.explain(q, cache, slots) plans the paged call as attn.paged would make it: on the
    CPU, auto copies the sequences out (and says why), read="in_place" reads the pool on flex
    with a block mask of page-wide key blocks over the capacity."""
    attn = flexspec.compile("causal & window(40)")
    paged = cache(pages=8, page_size=16, slots=3, max_pages=4)
    slots = torch.tensor([2, 0])
    paged.append(slots, *(torch.randn(2, KV_HEADS, 50, DIM) for _ in range(2)))
    q = torch.randn(2, 4, 1, DIM)
    gathered = attn.explain(q, paged, slots)
    assert gathered.pages.startswith("copied out of their pages into contiguous keys and "
                                     "values (no backend reads this paged pool in place (flex: "
                                     "on cpu, copying")
    assert gathered.sizes["KV_LEN"] == 64 and gathered.choice.backend == "reference"
    in_place = attn.explain(q, paged, slots, read="in_place")
    assert in_place.choice.backend == "flex" and in_place.block_size == (128, 16)
    assert in_place.pages == ("read in place from a pool of 8 pages of 16 positions (a row "
                              "reads the pages its slot holds, up to 4)")
    assert "over the pool in place, key tiles within pages of 16" in in_place.kernel
    assert "pages:    read in place" in str(in_place)
    # 41 of 50 keys a row sees, out of the capacity's 64
    assert in_place.density == pytest.approx(41 / 64)
    with pytest.raises(flexspec.BindingError, match="explained on the device of its cache"):
        attn.explain(q, paged, slots, target="cuda")


@pytest.mark.slow
def test_a_later_layer_of_a_paged_decode_step_only_launches_its_kernel():
    """One layer of a paged decode step after the step's read is made (the first layer made
    it), warm, in place on the CPU's compiled kernel, traced with sys.setprofile: at most 30
    calls of flexspec's functions, in at most 5 files (the facade, the reads, the step, the
    pool's launch, the replay of the compiled code), none of them planning or building a block
    mask; and its rows equal the float64 reference over that layer's own sequences."""
    import os
    import sys
    torch._dynamo.reset()
    attn = flexspec.compile("causal & window(100)")
    caches = [cache(pages=24, page_size=16, slots=4, max_pages=8) for _ in range(2)]
    slots, generator = torch.tensor([3, 1]), torch.Generator().manual_seed(2)
    kv = [[torch.randn(2, KV_HEADS, 70, DIM, generator=generator) for _ in range(2)]
          for _ in caches]
    for layer, layer_cache in enumerate(caches):
        layer_cache.append(slots, *kv[layer])
    q = torch.randn(2, 4, 1, DIM, generator=generator)
    package = os.path.dirname(flexspec.__file__)
    called = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            called.append((frame.f_code.co_filename, frame.f_code.co_name))
    with torch.no_grad():
        for _ in range(2):  # compiled, and its code cached
            step = flexspec.Step(slots=slots)
            for layer_cache in caches:
                attn.paged(q, layer_cache, step=step, read="in_place")
        step = flexspec.Step(slots=slots)
        attn.paged(q, caches[0], step=step, read="in_place")  # makes the step's read
        sys.setprofile(profile)
        try:
            out = attn.paged(q, caches[1], step=step, read="in_place")
        finally:
            sys.setprofile(None)
    files = {name for name, _ in called}
    assert len(called) <= 30 and len(files) <= 5, called
    assert not {"plan.py", "masks.py", "calls.py"} & {os.path.basename(name) for name in files}
    want = attn.reference(q.double(), *(t.double() for t in kv[1]), q_offset=69)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
