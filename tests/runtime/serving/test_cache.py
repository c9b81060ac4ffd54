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
    """Every page is free or held by exactly one slot, at the place its table says; a slot holds
    the pages its length needs, at least; the free pages hold zeros."""
    page = paged.page_size
    held = {}
    for slot in range(paged.slots):
        count = int(paged.held[slot])
        assert count >= (int(paged.lengths[slot]) + page - 1) // page
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
        for pool in (paged.keys, paged.values):
            assert not pool[:, physical * page:(physical + 1) * page].any(), "a free page kept data"


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
    with pytest.raises(flexspec.BindingTypeError, match="values must be a torch.Tensor, got str"):
        paged.append(torch.tensor([1]), new[0][:1], "values", new_tokens=[1])



def _full_pool():
    """Two pages of 16, three slots; slots 0 and 1 hold a page each, full (tokens 1 and 2)."""
    paged = PagedKVCache(pages=2, page_size=16, kv_heads=1, head_dim=2, slots=3, max_pages=2)
    for slot in (0, 1):
        tokens = torch.full((1, 1, 16, 2), float(slot + 1))
        paged.append(torch.tensor([slot]), tokens, tokens)
    return paged


def test_an_unchecked_append_to_an_exhausted_pool_writes_nothing_until_checked():
    """With check=False an append the pool cannot serve changes nothing (it wrote into another
    slot's page and left it on the free list after the advised release), and check() says so
    once: the flag is cleared, so later appends and checks run."""
    paged = _full_pool()
    before = [t.clone() for t in (paged.keys, paged.values, paged.page_table, paged.lengths,
                                  paged.held, paged.free, paged.free_count)]
    three = torch.full((1, 1, 6, 2), 3.0)
    paged.append(torch.tensor([2]), three, three, check=False)
    after = (paged.keys, paged.values, paged.page_table, paged.lengths, paged.held, paged.free,
             paged.free_count)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(flexspec.BindingError, match="refused and changed nothing"):
        paged.check()
    paged.check()  # said once
    paged.release(torch.tensor([2]))  # as the message advises: releases nothing of slot 0's
    check_books(paged)
    assert paged.gathered(torch.tensor([0]))[0][0, 0, :16, 0].tolist() == [1.0] * 16
    paged.release(torch.tensor([1]))
    paged.append(torch.tensor([2]), three, three)  # the cache goes on
    assert paged.gathered(torch.tensor([2]))[0][0, 0, :6, 0].tolist() == [3.0] * 6
    check_books(paged)


def test_a_refused_reservation_takes_nothing_and_the_cache_goes_on():
    """A checked append the pool cannot serve raises and takes no page (the pages it took
    leaked, its slot's length never advanced, and every later append failed)."""
    paged = _full_pool()
    three = torch.full((1, 1, 6, 2), 3.0)
    with pytest.raises(flexspec.BindingError, match="refused and changed nothing"):
        paged.append(torch.tensor([2]), three, three)
    assert int(paged.free_count) == 0 and int(paged.held[2]) == 0
    paged.release(torch.tensor([0]))
    paged.append(torch.tensor([2]), three, three)
    check_books(paged)


def test_slots_named_twice_or_none():
    """Slots named twice are refused before anything changes (an append dropped a row and
    leaked a page; a release freed a page twice); no slots at all is nothing to do."""
    paged = cache(pages=4, page_size=4, slots=3, max_pages=2)
    keys = torch.randn(2, KV_HEADS, 3, DIM)
    for call in (lambda: paged.append(torch.tensor([1, 1]), keys, keys),
                 lambda: paged.reserve(torch.tensor([0, 0]), torch.tensor([3, 3])),
                 lambda: paged.release(torch.tensor([2, 2]))):
        with pytest.raises(flexspec.BindingError, match="slots must be distinct: slot . is "
                                                        "named twice"):
            call()
        assert int(paged.free_count) == 4 and not paged.held.any()
    none = torch.zeros(0, dtype=torch.long)
    paged.append(none, keys[:0], keys[:0])
    paged.reserve(none, none)
    paged.release(none)
    assert int(paged.free_count) == 4
    check_books(paged)


def test_a_reservation_then_an_append_takes_the_pages_once():
    """reserve() then append() into the reserved pages: the pages are taken once and given
    back at release (they were taken twice, the reserved ones never returned); a reservation
    for less than a slot holds beside a growing one leaves both tables right."""
    paged = cache(pages=4, page_size=4, slots=2, max_pages=2)
    paged.reserve(torch.tensor([0]), torch.tensor([8]))
    assert int(paged.free_count) == 2
    tokens = torch.randn(1, KV_HEADS, 8, DIM)
    paged.append(torch.tensor([0]), tokens, tokens)
    assert int(paged.free_count) == 2
    paged.append(torch.tensor([1]), tokens[:, :, :3], tokens[:, :, :3])
    paged.reserve(torch.tensor([0, 1]), torch.tensor([2, 7]))  # less than 0 holds; 1 grows
    more = torch.randn(1, KV_HEADS, 4, DIM)
    paged.append(torch.tensor([1]), more, more)
    keys, _ = paged.gathered(torch.tensor([0, 1]))
    torch.testing.assert_close(keys[0], tokens[0])
    torch.testing.assert_close(keys[1, :, :7], torch.cat([tokens[0, :, :3], more[0]], dim=1))
    check_books(paged)
    paged.release(torch.tensor([0, 1]))
    assert int(paged.free_count) == 4
    check_books(paged)


def test_a_cache_s_arguments_are_checked_when_it_is_made():
    """dtype, device and v_head_dim are refused when the cache is made, naming the argument
    (they were accepted until the first read); a cache made under inference_mode is written
    outside it."""
    for options, error, message in (
            ({"dtype": "float32"}, TypeError, "dtype must be a floating torch.dtype"),
            ({"dtype": torch.int32}, TypeError, "dtype must be a floating torch.dtype"),
            ({"device": "gpu:7"}, TypeError, "device must name a torch device"),
            ({"v_head_dim": 0}, flexspec.BindingError, "v_head_dim must be a positive int")):
        with pytest.raises(error, match=message):
            cache(**options)
    with torch.inference_mode():
        made = cache()
    tokens = torch.randn(1, KV_HEADS, 3, DIM)
    made.append(torch.tensor([0]), tokens, tokens)
    torch.testing.assert_close(made.gathered(torch.tensor([0]))[0][0, :, :3], tokens[0])


def test_what_a_released_page_held_reaches_no_later_sequence():
    """A NaN written by one request, whose page another takes after it is released, reaches
    none of the new owner's positions: the page is zeroed when given back, and a gathered
    read is zero past each row's length."""
    paged = cache(pages=2, page_size=4, slots=2, max_pages=2)
    poison = torch.full((1, KV_HEADS, 4, DIM), float("nan"))
    paged.append(torch.tensor([0]), poison, poison)
    paged.release(torch.tensor([0]))
    assert not paged.keys.isnan().any() and not paged.values.isnan().any()
    tokens = torch.randn(1, KV_HEADS, 2, DIM)
    paged.append(torch.tensor([1]), tokens, tokens)
    keys, values = paged.gathered(torch.tensor([1]))
    assert torch.equal(keys[0, :, 2:], torch.zeros_like(keys[0, :, 2:]))
    attn = flexspec.compile("causal")
    q = torch.randn(1, 4, 1, DIM)
    out = attn.paged(q, paged, torch.tensor([1]))
    torch.testing.assert_close(out, attn.reference(q, tokens, tokens, q_offset=1))

# --- the pool against a model of it -----------------------------------------------------------

from hypothesis.stateful import (RuleBasedStateMachine, invariant, rule,  # noqa: E402
                                 run_state_machine_as_test)

# 48 positions a slot, 6 pages: pages of 16 positions, which FlexAttention reads in place
POOL = {"pages": 6, "page_size": 16, "slots": 4, "max_pages": 3}
SPEC = "causal + alibi"


class PoolModel(RuleBasedStateMachine):
    """``PagedKVCache`` against a pure-Python model of the pool: each slot's tokens (a token is
    its number: its keys hold it, its values its negative; NaN for a poisoned token), the pages
    each slot holds, the free pages, and whether an operation made with ``check=False`` was
    refused. Appends (plain and mixed, checked or not), reservations, releases, checks, slots
    named twice or none, lengths past the capacity, more pages than are free; after every step
    the books balance, every token reads back where it was written and nowhere else, free pages
    hold zeros, and reads, gathered and in place, equal the float64 reference of each request
    alone (a NaN reaching only the rows of its own sequence)."""

    def __init__(self):
        super().__init__()
        self.paged = cache(**POOL)
        self.attn = flexspec.compile(SPEC)
        self.tokens = {slot: [] for slot in range(POOL["slots"])}
        self.pages = {slot: 0 for slot in range(POOL["slots"])}
        self.pending = False  # an unchecked operation was refused
        self.counter = 0

    # -- the model's arithmetic
    def _needs(self, slot: int, length: int) -> int:
        page = POOL["page_size"]
        return max(-(-length // page), self.pages[slot]) - self.pages[slot]

    def _fits(self, wanted: dict) -> bool:
        """Whether the pool serves slot -> length in all (pages and capacity)."""
        capacity = POOL["page_size"] * POOL["max_pages"]
        free = POOL["pages"] - sum(self.pages.values())
        return all(length <= capacity for length in wanted.values()) and \
            sum(self._needs(slot, length) for slot, length in wanted.items()) <= free

    def _tokens(self, count: int, poison: bool) -> list:
        made = []
        for _ in range(count):
            self.counter += 1
            made.append(float("nan") if poison and not made else float(self.counter))
        return made

    def _expect(self, refused: bool, check: bool, call) -> bool:
        """Run ``call``: with ``refused``, it must raise (``check``) or flag (not ``check``);
        returns whether the model changes."""
        if refused and check:
            with pytest.raises(flexspec.BindingError, match="refused and changed nothing"):
                call()
            return False
        call()
        if refused:
            self.pending = True
        return not refused

    # -- rules
    @rule(slots=st.lists(st.integers(0, 3), max_size=3), counts=st.lists(st.integers(1, 20),
                                                                        min_size=3, max_size=3),
          mixed=st.booleans(), check=st.booleans(), poison=st.booleans())
    def append(self, slots, counts, mixed, check, poison):
        counts = counts[:len(slots)] if mixed else [counts[0]] * len(slots)
        width = max(counts, default=1)
        made = [self._tokens(count, poison) for count in counts]
        keys = torch.zeros(len(slots), KV_HEADS, width, DIM)
        for row, tokens in enumerate(made):
            keys[row, :, :len(tokens)] = torch.tensor(tokens).view(1, -1, 1)
        call = lambda: self.paged.append(torch.tensor(slots, dtype=torch.long), keys, -keys,  # noqa: E731
                                         check=check, new_tokens=counts if mixed else None)
        if len(set(slots)) < len(slots):  # the host sees it: refused whatever check says
            with pytest.raises(flexspec.BindingError, match="slots must be distinct"):
                call()
            return
        wanted = {slot: len(self.tokens[slot]) + count for slot, count in zip(slots, counts)}
        if self._expect(not self._fits(wanted), check, call):
            for slot, tokens in zip(slots, made):
                self.pages[slot] += self._needs(slot, len(self.tokens[slot]) + len(tokens))
                self.tokens[slot].extend(tokens)

    @rule(slots=st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True),
          lengths=st.lists(st.integers(0, 48), min_size=2, max_size=2), check=st.booleans())
    def reserve(self, slots, lengths, check):
        lengths = lengths[:len(slots)]
        wanted = dict(zip(slots, lengths))
        call = lambda: self.paged.reserve(torch.tensor(slots), torch.tensor(lengths),  # noqa: E731
                                          check=check)
        if self._expect(not self._fits(wanted), check, call):
            for slot, length in wanted.items():
                self.pages[slot] += self._needs(slot, length)

    @rule(slots=st.lists(st.integers(0, 3), max_size=3))
    def release(self, slots):
        if len(set(slots)) < len(slots):
            with pytest.raises(flexspec.BindingError, match="slots must be distinct"):
                self.paged.release(torch.tensor(slots, dtype=torch.long))
            return
        self.paged.release(torch.tensor(slots, dtype=torch.long))
        for slot in slots:
            self.tokens[slot], self.pages[slot] = [], 0

    @rule()
    def check(self):
        if self.pending:
            with pytest.raises(flexspec.BindingError, match="refused and changed nothing"):
                self.paged.check()
            self.pending = False
        self.paged.check()  # cleared

    @rule(read=st.sampled_from(["gather", "in_place"]), q_len=st.integers(1, 2),
          seed=st.integers(0, 2**16))
    def read(self, read, q_len, seed):
        slots = [slot for slot, tokens in self.tokens.items() if len(tokens) >= q_len]
        poisoned = [slot for slot in slots if any(t != t for t in self.tokens[slot])]
        if not slots or (read == "in_place" and poisoned):
            return  # eager FlexAttention reads the whole pool: a NaN anywhere reaches every row
        q = torch.randn(len(slots), 4, q_len, DIM, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = self.attn.paged(q, self.paged, torch.tensor(slots), read=read)
        for row, slot in enumerate(slots):
            keys = torch.tensor(self.tokens[slot], dtype=torch.float64).view(1, 1, -1, 1)
            keys = keys.expand(1, KV_HEADS, -1, DIM)
            want = self.attn.reference(q[row:row + 1].double(), keys, -keys,
                                       q_offset=len(self.tokens[slot]) - q_len)
            if slot in poisoned:
                assert out[row].isnan().any()
            else:
                torch.testing.assert_close(out[row:row + 1].double(), want, rtol=1e-4,
                                           atol=1e-4)

    # -- what holds after every step
    @invariant()
    def books_balance(self):
        check_books(self.paged)
        for slot in range(POOL["slots"]):
            assert int(self.paged.held[slot]) == self.pages[slot]
            assert int(self.paged.lengths[slot]) == len(self.tokens[slot])
        assert int(self.paged.free_count) == POOL["pages"] - sum(self.pages.values())
        assert bool(self.paged.refused) == self.pending

    @invariant()
    def tokens_read_back_where_they_were_written(self):
        keys, values = self.paged.gathered(torch.arange(POOL["slots"]))
        for slot, tokens in self.tokens.items():
            want = torch.tensor(tokens + [0.0] * (keys.shape[2] - len(tokens)))
            want = want.view(1, -1, 1).expand(KV_HEADS, -1, DIM)
            torch.testing.assert_close(keys[slot], want, equal_nan=True)
            torch.testing.assert_close(values[slot], -want, equal_nan=True)


@pytest.mark.slow
def test_the_pool_against_a_model_of_it(eager_kernels):
    """The state machine of PoolModel: 200 sequences of 30 operations (a tenth in CI's bounded
    profile). The in-place reads run FlexAttention eagerly over the pool (the compiled CPU
    kernel is the slow tests' of the reads)."""
    from flexspec.testing import slow_examples
    run_state_machine_as_test(PoolModel, settings=settings(
        max_examples=slow_examples(200), stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
