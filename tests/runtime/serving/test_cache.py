"""runtime.serving.cache: a paged KV cache, an allocator of pages. Pages are taken and given
back by tensor operations; the cache's sequences read back as written, in any slot order; its
tables are what reads are made from. (The helpers here, ``cache`` and ``filled``, serve the
tests of the reads, mixed batches and FlexAttention's read of the pool too.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec.runtime.serving.cache import PagedKVCache

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


def dense_reference(q, keys, values, lengths, q_offset, allowed):
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
