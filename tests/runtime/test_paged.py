"""runtime.paged: a paged KV cache (issue 27). Pages are taken and given back by tensor
operations; the cache's sequences read back as written, in any slot order; attention over
them equals the same call on the sequences laid out contiguously, for any spec."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask

import flexspec
from flexspec.runtime.paged import PagedKVCache
from flexspec.testing import Shape, bindings, spec_texts

KV_HEADS, DIM = 2, 4


def cache(pages=12, page_size=4, slots=5, max_pages=6, **options) -> PagedKVCache:
    return PagedKVCache(pages=pages, page_size=page_size, kv_heads=KV_HEADS, head_dim=DIM,
                        slots=slots, max_pages=max_pages, **options)


def check_books(paged: PagedKVCache) -> None:
    """Every page is free or held by exactly one slot, at the place its table says."""
    page = paged.page_size
    held = {}
    for slot in range(paged.slots):
        count = (int(paged.lengths[slot]) + page - 1) // page
        for index in range(count):
            physical = int(paged.page_table[slot, index])
            assert physical not in held, "a page held twice"
            held[physical] = (slot, index)
            assert int(paged.page_slot[physical]) == slot
            assert int(paged.page_index[physical]) == index
    free = paged.free[:int(paged.free_count)].tolist()
    assert sorted(free + list(held)) == list(range(paged.pages))
    for physical in free:
        assert int(paged.page_slot[physical]) == -1 and int(paged.page_index[physical]) == -1


# an operation: ("append", slots, new tokens) or ("release", slots)
operations = st.lists(st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
              st.integers(1, 6)),
    st.tuples(st.just("release"), st.lists(st.integers(0, 4), min_size=1, max_size=2,
                                           unique=True))), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations, st.integers(0, 2**31 - 1))
def test_sequences_read_back_as_written_through_any_appends_and_releases(ops, seed):
    paged = cache()
    written = {slot: [] for slot in range(paged.slots)}  # slot -> [(keys, values)]
    generator = torch.Generator().manual_seed(seed)
    for op in ops:
        slots = torch.tensor(op[1])
        if op[0] == "release":
            paged.release(slots)
            for slot in op[1]:
                written[slot] = []
        else:
            count = op[2]
            if any(sum(k.shape[1] for k, _ in written[s]) + count > paged.capacity
                   for s in op[1]):
                continue  # past a slot's capacity: refused below, not here
            keys, values = (torch.randn(len(op[1]), KV_HEADS, count, DIM, generator=generator)
                            for _ in range(2))
            pages_needed = sum(
                -(-(sum(k.shape[1] for k, _ in written[s]) + count) // paged.page_size)
                - -(-sum(k.shape[1] for k, _ in written[s]) // paged.page_size) for s in op[1])
            if pages_needed > int(paged.free_count):
                with pytest.raises(flexspec.BindingError, match="more pages than were free"):
                    paged.append(slots, keys, values)
                return  # the cache says its sequences are broken now
            paged.append(slots, keys, values)
            for row, slot in enumerate(op[1]):
                written[slot].append((keys[row], values[row]))
        check_books(paged)
        order = torch.randperm(paged.slots, generator=generator)
        got_keys, got_values = paged.gathered(order)
        for row, slot in enumerate(order.tolist()):
            length = int(paged.lengths[slot])
            assert length == sum(k.shape[1] for k, _ in written[slot])
            if length:
                assert torch.equal(got_keys[row, :, :length],
                                   torch.cat([k for k, _ in written[slot]], dim=1))
                assert torch.equal(got_values[row, :, :length],
                                   torch.cat([v for _, v in written[slot]], dim=1))


def test_pages_are_taken_from_the_top_and_given_back_in_order():
    paged = cache(pages=6, page_size=4, slots=3, max_pages=3)
    paged.append(torch.tensor([2, 0]), torch.randn(2, KV_HEADS, 5, DIM),
                 torch.randn(2, KV_HEADS, 5, DIM))
    assert paged.page_table[2, :2].tolist() == [0, 1] and paged.page_table[0, :2].tolist() == [2, 3]
    assert paged.lengths.tolist() == [5, 0, 5] and int(paged.free_count) == 2
    paged.release(torch.tensor([2]))
    assert int(paged.free_count) == 4 and paged.free[:4].tolist() == [5, 4, 0, 1]
    assert paged.lengths.tolist() == [5, 0, 0]
    check_books(paged)


def test_layouts_of_other_engines_are_views_of_the_pool():
    """The module docstring's claims: FlashInfer's HND and vLLM's layout are views."""
    paged = cache(pages=3, page_size=4, slots=1, max_pages=3)
    keys = torch.randn(1, KV_HEADS, 10, DIM)
    paged.append(torch.tensor([0]), keys, keys.clone())
    hnd = paged.keys.view(KV_HEADS, 3, 4, DIM).transpose(0, 1)   # [pages, heads, page, dim]
    vllm = paged.keys.view(KV_HEADS, 3, 4, DIM).permute(1, 2, 0, 3)  # [pages, page, heads, dim]
    assert hnd.data_ptr() == vllm.data_ptr() == paged.keys.data_ptr()
    page, offset = int(paged.page_table[0, 1]), 2  # position 6
    assert torch.equal(hnd[page, :, offset], keys[0, :, 6])
    assert torch.equal(vllm[page, offset], keys[0, :, 6])


def test_bad_inputs_are_refused_with_what_to_do():
    paged = cache(pages=2, page_size=4, slots=2, max_pages=3)
    keys = torch.randn(1, KV_HEADS, 3, DIM)
    with pytest.raises(flexspec.BindingError, match="slots must lie in 0..1, got 2..2"):
        paged.append(torch.tensor([2]), keys, keys)
    with pytest.raises(TypeError, match="slots must be a 1-D int tensor"):
        paged.append(torch.tensor([0.0]), keys, keys)
    with pytest.raises(flexspec.BindingError, match=r"shape \[n slots, kv_heads, new tokens, "
                                                    r"head_dim\] = \[1, 2, T, 4\], got \[1, 3"):
        paged.append(torch.tensor([0]), torch.randn(1, 3, 3, DIM), keys)
    with pytest.raises(flexspec.BindingError, match="must be torch.float32 on cpu"):
        paged.append(torch.tensor([0]), keys.double(), keys)
    with pytest.raises(flexspec.BindingError, match=r"lengths must lie in 0..12"):
        paged.reserve(torch.tensor([0]), torch.tensor([13]))
    with pytest.raises(flexspec.BindingError, match="more pages than were free"):
        paged.append(torch.tensor([0, 1]), torch.randn(2, KV_HEADS, 5, DIM),
                     torch.randn(2, KV_HEADS, 5, DIM))
    with pytest.raises(flexspec.BindingError, match="page_size must be a positive int"):
        PagedKVCache(pages=2, page_size=0, kv_heads=1, head_dim=1, slots=1, max_pages=1)
    with pytest.raises(TypeError, match="cache must be a flexspec.PagedKVCache, got dict"):
        flexspec.compile("causal").paged(torch.randn(1, 2, 1, DIM), {}, torch.tensor([0]))


# --- attention over the cache ------------------------------------------------------------------


def filled(lengths: list, order: list, seed: int, page_size: int = 4, max_pages: int = 6):
    """A cache whose slots ``order`` hold sequences of ``lengths`` (appended in two parts, so
    their pages interleave), and the same keys and values laid out contiguously, padded to the
    capacity: ``(cache, keys, values)`` with the contiguous ones in ``order``'s rows."""
    generator = torch.Generator().manual_seed(seed)
    paged = cache(pages=len(lengths) * max_pages, page_size=page_size, slots=len(lengths) + 2,
                  max_pages=max_pages)
    capacity = paged.capacity
    keys = torch.randn(len(lengths), KV_HEADS, capacity, DIM, generator=generator)
    values = torch.randn(len(lengths), KV_HEADS, capacity, DIM, generator=generator)
    for part in (0, 1):
        for row, (slot, length) in enumerate(zip(order, lengths)):
            cut = length // 2
            lo, hi = (0, cut) if part == 0 else (cut, length)
            if hi > lo:
                paged.append(torch.tensor([slot]), keys[row:row + 1, :, lo:hi],
                             values[row:row + 1, :, lo:hi])
    return paged, keys, values


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


# --- the pool read in place: a block mask mapped through the page table --------------------


def _dense_reference(q, keys, values, lengths, q_offset, allowed):
    """Attention of q over each row's own keys in float64, written out: ``allowed(row, i, j)``
    says whether query row ``i`` (at position ``q_offset[row] + i``) sees key ``j``, keys past
    the row's length never. GQA by repeating key heads."""
    q, keys, values = q.double(), keys.double(), values.double()
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], values.shape[-1], dtype=torch.float64)
    for row in range(q.shape[0]):
        for i in range(q.shape[2]):
            seen = [j for j in range(int(lengths[row]))
                    if allowed(row, int(q_offset[row]) + i, j)]
            scores = torch.einsum("hd,hnd->hn", q[row, :, i], keys[row][:, seen]) \
                / q.shape[-1] ** 0.5
            out[row, :, i] = torch.einsum("hn,hnd->hd", scores.softmax(-1),
                                          values[row][:, seen])
    return out


@pytest.mark.parametrize("text, allowed", [
    ("causal", lambda row, i, j: j <= i),
    ("sliding_window(40)", lambda row, i, j: i - 40 <= j <= i),
    ("causal & doc", lambda row, i, j: j <= i and j // 70 == i // 70)])
def test_flex_attention_reads_the_pool_in_place_through_the_mapped_block_mask(text, allowed):
    """PagedKVCache.block_mask: FlexAttention (compiled, on the CPU's kernels: 130 query rows;
    eager for documents, see below) over the whole pool, every batch row reading it through
    its own pages, equals attention over each sequence's own keys written out in float64.
    Slots 3, 0, 4 in that order, pages interleaved between them, lengths not multiples of
    the page, a page in the pool that no call row holds, GQA, a binding (documents of 70
    positions) over the capacity."""
    from torch.nn.attention.flex_attention import flex_attention
    torch._dynamo.reset()  # see the end
    page, heads = 32, 4
    attn = flexspec.compile(text, block_size=(128, page))
    slots, lengths = [3, 0, 4], [200, 150, 177]
    paged, keys, values = filled(lengths, slots, seed=5, page_size=page, max_pages=8)
    paged.append(torch.tensor([1]), *(torch.randn(1, KV_HEADS, 20, DIM) for _ in range(2)))
    rows = 130
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(3, heads, rows, DIM, generator=generator)
    valid = torch.tensor(lengths)
    offset = valid - rows
    extra = {}
    if "doc" in text:
        extra["doc_ids"] = (torch.arange(paged.capacity) // 70).expand(3, -1).contiguous()
    logical = attn.block_mask(rows, paged.capacity, batch=3, q_offset=offset, kv_lengths=valid,
                              **extra)
    pool_mask = paged.block_mask(logical, torch.tensor(slots))
    assert pool_mask.kv_indices.shape[-1] == paged.pages
    # the tables' memory: the logical mask's columns, plus a spare row's worth
    assert pool_mask.kv_indices.untyped_storage().nbytes() <= 4 * (
        logical.kv_indices.expand(3, -1, -1, -1).numel() + paged.pages)
    # the CPU's compiled kernel fails to build (a C++ compile error in inductor's CPU
    # template) where the mask reads a binding at a position read from the page tables: that
    # case runs FlexAttention's eager path here
    run = flex_attention if extra else torch.compile(flex_attention)
    out = run(q, paged.keys.unsqueeze(0), paged.values.unsqueeze(0), block_mask=pool_mask,
              enable_gqa=True)
    expected = _dense_reference(q, keys, values, valid, offset, allowed)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    # flex_attention's compiled frames are shared by every torch.compile of it: a later
    # compile at other shapes would recompile these dynamic, which the CPU's kernel fails to
    # build for these mods
    torch._dynamo.reset()


def test_the_mapped_block_mask_drops_blocks_past_a_slot_s_pages():
    """A logical mask that lists blocks past a slot's pages (built without the lengths) keeps
    only the pages the slot holds, so no row reads another sequence's page; its mask_mod
    leaves out positions past the slot's length and pages the slot does not hold."""
    from torch.nn.attention.flex_attention import create_block_mask
    paged = cache(pages=12, page_size=4, slots=3, max_pages=6)
    paged.append(torch.tensor([2, 0]), *(torch.randn(2, KV_HEADS, 6, DIM) for _ in range(2)))
    paged.append(torch.tensor([2]), *(torch.randn(1, KV_HEADS, 3, DIM) for _ in range(2)))
    everything = create_block_mask(lambda b, h, q, kv: kv >= 0, 2, 1, 4, paged.capacity,
                                   BLOCK_SIZE=(4, 4), device="cpu")
    mapped = paged.block_mask(everything, torch.tensor([2, 0]))
    counts = mapped.kv_num_blocks + (0 if mapped.full_kv_num_blocks is None
                                     else mapped.full_kv_num_blocks)
    assert counts[:, 0, 0].tolist() == [3, 2]  # 9 and 6 positions in pages of 4
    for row, slot in enumerate([2, 0]):
        listed = [mapped.kv_indices[row, 0, 0, :int(mapped.kv_num_blocks[row, 0, 0])].tolist()]
        if mapped.full_kv_num_blocks is not None:
            listed.append(mapped.full_kv_indices[
                row, 0, 0, :int(mapped.full_kv_num_blocks[row, 0, 0])].tolist())
        pages = sorted(sum(listed, []))
        assert pages == sorted(paged.page_table[slot, :len(pages)].tolist())
    # the mask: slot 2 holds 9 positions; slot 0's pages are not slot 2's
    row = torch.tensor(0)
    own = paged.page_table[2, 2].item() * 4  # slot 2's third page: positions 8..11
    seen = [bool(mapped.mask_mod(row, torch.tensor(0), torch.tensor(0), torch.tensor(own + i)))
            for i in range(4)]
    assert seen == [True, False, False, False]
    other = paged.page_table[0, 0].item() * 4
    assert not bool(mapped.mask_mod(row, torch.tensor(0), torch.tensor(0), torch.tensor(other)))


def test_the_mapped_block_mask_refuses_a_logical_mask_of_other_blocks():
    from torch.nn.attention.flex_attention import create_block_mask
    paged = cache(pages=12, page_size=4, slots=3, max_pages=6)
    wrong = create_block_mask(lambda b, h, q, kv: kv >= 0, 1, 1, 4, paged.capacity,
                              BLOCK_SIZE=(4, 8), device="cpu")
    with pytest.raises(flexspec.BindingError,
                       match=r"key blocks of the page size \(4\) over the capacity \(24 "
                             r"positions, 6 blocks\), got blocks of 8 and 3 key blocks: build it "
                             r"with block_size=\(query block, 4\) for KV_LEN = 24"):
        paged.block_mask(wrong, torch.tensor([0]))
    with pytest.raises(flexspec.BindingTypeError, match="must be a BlockMask, got str"):
        paged.block_mask("causal", torch.tensor([0]))
    right = create_block_mask(lambda b, h, q, kv: kv >= 0, 2, 1, 4, paged.capacity,
                              BLOCK_SIZE=(4, 4), device="cpu")
    with pytest.raises(flexspec.BindingError, match="the logical mask has batch 2, the call 3"):
        paged.block_mask(right, torch.tensor([0, 1, 2]))


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
        written = _dense_reference(q, keys, values, torch.tensor(lengths),
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
    assert {"BLOCK_N": 16, "num_stages": 1}.items() <= read._tail[3].items()
    assert_rows_alone(attn, out, q, keys, values, lengths)
    for tile in (64, 24, 8):
        wide = flexspec.compile("causal + alibi", kernel_options={"BLOCK_N": tile})
        with pytest.raises(flexspec.BindingError,
                           match=rf"BLOCK_N={tile} is not a key tile that divides .* pages "
                                 r"of 32 .* one of \[16, 32\]"):
            wide.paged_read(q, paged, torch.tensor(slots))
    from flexspec.runtime.paged_call import given_options
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
    assert result.best.items() <= (read._tail[3] or {}).items()
    assert_rows_alone(attn, out, q, keys, values, lengths)
    pinned = flexspec.compile("causal & window(150)", kernel_options=result.best)
    with torch.no_grad():
        torch.testing.assert_close(pinned.paged_read(q, paged, torch.tensor(slots))(q), out)
    torch._dynamo.reset()


def test_a_read_s_default_candidates_are_tiles_dividing_the_page_and_stages():
    """paged_call.read_candidates: key tiles of a multiple of 16 that divide the page, up to
    128, and pipeline stages, leaving out what the read already runs with."""
    from flexspec.runtime.paged_call import read_candidates
    assert read_candidates(64, {"BLOCK_N": 64, "num_stages": 3}) == [
        {"BLOCK_N": 16}, {"BLOCK_N": 32}, {"num_stages": 2}, {"num_stages": 4}]
    assert read_candidates(256, {"num_stages": 2}) == [
        {"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 64}, {"BLOCK_N": 128}, {"num_stages": 4}]
    assert read_candidates(48, {"BLOCK_N": 16}) == [{"num_stages": 2}, {"num_stages": 4}]


def test_a_read_asks_for_the_widest_key_tile_that_divides_its_pages():
    """FlexAttention's key tiles are powers of two; its default (up to 128) would span two
    pages of 48 or 96 positions, so such a read asks for the widest that divides the page, and
    none where 128 does."""
    from flexspec.runtime.paged_call import page_tiles
    assert page_tiles(16) == [16]
    assert page_tiles(48) == [16]
    assert page_tiles(64) == [16, 32, 64]
    assert page_tiles(96) == [16, 32]
    assert page_tiles(128) == page_tiles(256) == [16, 32, 64, 128]


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
        with pytest.raises(flexspec.BindingError, match="caches of the geometry it was made"):
            read(q, other)
    with pytest.raises(flexspec.BindingError, match="inference only .* read='gather' to train"):
        read(q.clone().requires_grad_())
    torch._dynamo.reset()


def test_paged_refuses_what_it_cannot_read_in_place(monkeypatch):
    """read= is checked; pages that are not a multiple of 16 positions, and a query that needs
    gradients, are refused in place with the way out (read='gather'); on the CPU, read="auto"
    gathers (the in-place read is never made)."""
    from flexspec.runtime import paged_call
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
    monkeypatch.setattr(paged_call, "pool_read", never)
    monkeypatch.setattr("flexspec.runtime.attention.pool_read", never)
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


def test_a_mixed_append_writes_each_row_s_real_tokens_only():
    """append(..., new_tokens=counts): row b's first counts[b] keys and values are written
    after its slot's last position, its padding is not."""
    paged = cache(pages=12, page_size=4, slots=4, max_pages=4)
    generator = torch.Generator().manual_seed(2)
    first = [torch.randn(2, KV_HEADS, 3, DIM, generator=generator) for _ in range(2)]
    paged.append(torch.tensor([2, 0]), *first)
    new = [torch.randn(3, KV_HEADS, 5, DIM, generator=generator) for _ in range(2)]
    paged.append(torch.tensor([0, 3, 2]), *new, new_tokens=[5, 2, 1])
    assert paged.lengths.tolist() == [8, 0, 4, 2]
    keys, values = paged.gathered(torch.tensor([0, 3, 2]))
    for row, (before, count) in enumerate(((first[0][1], 5), (None, 2), (first[0][0], 1))):
        held = 0 if before is None else 3
        if before is not None:
            torch.testing.assert_close(keys[row, :, :held], before)
        torch.testing.assert_close(keys[row, :, held:held + count], new[0][row, :, :count])
        torch.testing.assert_close(values[row, :, held:held + count], new[1][row, :, :count])
    check_books(paged)
    with pytest.raises(flexspec.BindingError, match="new_tokens must lie in 1..5"):
        paged.append(torch.tensor([1]), new[0][:1], new[1][:1], new_tokens=[6])
    with pytest.raises(flexspec.BindingError, match="keys and values must be tensors"):
        paged.append(torch.tensor([1]), new[0][:1], "values", new_tokens=[1])


@pytest.mark.parametrize("text", ["causal + alibi", "causal & doc",
                                  "sliding_window(9) + softcap(5)"])
def test_a_pool_too_wide_for_one_decoding_call_is_read_a_group_of_kv_heads_at_a_time(
        eager_kernels, monkeypatch, text):
    """A pool inductor would index in int64 (here: any pool wider than one KV head's) is read in
    one call per group of KV heads, each with its query heads, which the decoding kernel
    compiles for; a score that reads the head (alibi's slopes) sees each head's own number.
    Each row, and its log-sum-exp, equals the float64 reference over its own sequence."""
    from flexspec.runtime import paged_call
    slots, lengths, rows = [3, 0, 4], [40, 23, 31], 3
    paged, keys, values = filled(lengths, slots, seed=7, page_size=16, max_pages=3)
    one_head = paged.keys.shape[1] * DIM
    monkeypatch.setattr(paged_call, "wide_keys",
                        lambda positions, dim, v_dim: positions * max(dim, v_dim) > one_head)
    attn = flexspec.compile(text)
    q = torch.randn(3, 4, rows, DIM, generator=torch.Generator().manual_seed(8))
    extra = {}
    if "doc" in text:
        extra["doc_ids"] = (torch.arange(paged.capacity) // 10).expand(3, -1).contiguous()
    with torch.no_grad():
        read = attn.paged_read(q, paged, torch.tensor(slots), return_lse=True, **extra)
        out, lse = read(q)
    assert len(read._groups) == KV_HEADS
    for row, length in enumerate(lengths):
        alone = {name: value[row:row + 1, :length] for name, value in extra.items()}
        expected, expected_lse = attn.reference(
            q[row:row + 1].double(), keys[row:row + 1, :, :length].double(),
            values[row:row + 1, :, :length].double(), q_offset=length - rows,
            return_lse=True, **alone)
        torch.testing.assert_close(out[row:row + 1].double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[row:row + 1].double(), expected_lse, rtol=1e-4,
                                   atol=1e-4)


def test_the_fewest_groups_of_kv_heads_whose_pool_slices_are_narrow():
    from flexspec.runtime.flexattention import WIDE_INDEX_ELEMENTS
    from flexspec.runtime.paged_call import head_parts
    positions = WIDE_INDEX_ELEMENTS // 128 // 8  # 8 heads of 128 dims: exactly wide
    assert head_parts(8, positions, 128, 128) == 2
    assert head_parts(8, positions, 64, 128) == 2  # the wider of the two head sizes counts
    assert head_parts(8, 3 * positions, 128, 128) == 4  # 3 is no divisor of 8
    assert head_parts(6, 9 * positions, 128, 128) is None  # one head's slice is wide


# --- a read that lists every page its slots hold (paged_call.lists_every_page) -----------------


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
    (paged_call.lists_every_page; CUDA only, forced here on the CPU). For any registry spec,
    slot order and ragged lengths over pages of 16, the pool's block mask it makes lists the
    pages each row's slot holds, every one of them, and the cells a kernel computes from its
    tables equal those of the exact read's mask."""
    from unittest import mock

    from flexspec.runtime import masks, paged_call
    attn = flexspec.compile(text)
    lengths = [max(length, q_len) for length in lengths]
    order = rng.sample(range(len(lengths) + 2), len(lengths))
    paged, _, _ = filled(lengths, order, seed, page_size=16, max_pages=3)
    batch, slots = len(lengths), torch.tensor(order)
    q = torch.randn(batch, 4, q_len, DIM, generator=torch.Generator().manual_seed(seed + 1))
    extra = data.draw(bindings(attn.spec, Shape(batch, 4, KV_HEADS, q_len, paged.capacity, DIM)))
    made = {}
    every_tile = masks.BlockMasks.every_tile
    for listed in (False, True):
        with mock.patch.object(paged_call, "lists_every_page", lambda *_: listed), \
                mock.patch.object(masks.BlockMasks, "every_tile", autospec=True,
                                  side_effect=every_tile) as spy, torch.no_grad():
            try:
                read = attn.paged_read(q, paged, slots, **extra)
            except flexspec.SpecError as error:  # bindings the spec refuses: both refuse them
                made[listed] = type(error)
                continue
        assert spy.called == listed
        made[listed] = read._tail[0]
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


def test_a_read_lists_every_page_for_small_decoding_reads_on_cuda_only():
    """The rule of a contiguous decoding call (flexattention.every_tile_fits): keys and values
    at the capacity of at most EVERY_TILE_BYTES, fewer than 128 query rows, on CUDA; and a
    mask under which a decoded row sees every key its slot holds (a window narrower than the
    capacity, or documents, would have every layer read pages the exact mask skips)."""
    from types import SimpleNamespace

    from flexspec.runtime.flexattention import EVERY_TILE_BYTES
    from flexspec.runtime.paged_call import lists_every_page

    def q(device: str, rows: int):
        return SimpleNamespace(device=torch.device(device), shape=(8, 32, rows, 128))

    def mask(text: str):
        return flexspec.compile(text).ir.mask
    causal = mask("causal")
    positions = EVERY_TILE_BYTES // (256 * 2)  # bf16 keys and values of 128 dimensions each
    assert lists_every_page(q("cuda", 1), causal, 4096, positions, 256, 2)
    assert lists_every_page(q("cuda", 127), causal, 4096, positions, 256, 2)
    assert not lists_every_page(q("cuda", 1), causal, 4096, positions + 1, 256, 2)
    assert not lists_every_page(q("cuda", 128), causal, 4096, 1024, 256, 2)
    assert not lists_every_page(q("cpu", 1), causal, 4096, 1024, 256, 2)
    for text in ("full", "causal + alibi", "causal + softcap(30)", "sliding_window(4096)"):
        assert lists_every_page(q("cuda", 1), mask(text), 4096, 1024, 256, 2), text
    assert lists_every_page(q("cuda", 1), mask("sliding_window(1024)"), 1024, 1024, 256, 2)
    for text in ("sliding_window(1024)", "causal & doc", "causal & window(100) + alibi"):
        assert not lists_every_page(q("cuda", 1), mask(text), 4096, 1024, 256, 2), text
