"""runtime.flexpages: FlexAttention's read of a paged pool. The block mask mapped through the
page tables, FlexAttention over the whole pool through it against each sequence's own keys
written out in float64; the key tiles a page allows; groups of KV heads for a wide pool; when a
read lists every page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flexspec

sys.path.insert(0, str(Path(__file__).parent / "serving"))
from test_cache import DIM, KV_HEADS, cache, dense_reference, filled  # noqa: E402


# --- the pool read in place: a block mask mapped through the page table --------------------


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
    expected = dense_reference(q, keys, values, valid, offset, allowed)
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


def test_a_read_s_default_candidates_are_tiles_dividing_the_page_and_stages():
    """flexpages.read_candidates: key tiles of a multiple of 16 that divide the page, up to
    128, and pipeline stages, leaving out what the read already runs with."""
    from flexspec.runtime.flexpages import read_candidates
    assert read_candidates(64, {"BLOCK_N": 64, "num_stages": 3}) == [
        {"BLOCK_N": 16}, {"BLOCK_N": 32}, {"num_stages": 2}, {"num_stages": 4}]
    assert read_candidates(256, {"num_stages": 2}) == [
        {"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 64}, {"BLOCK_N": 128}, {"num_stages": 4}]
    assert read_candidates(48, {"BLOCK_N": 16}) == [{"num_stages": 2}, {"num_stages": 4}]


def test_a_read_asks_for_the_widest_key_tile_that_divides_its_pages():
    """FlexAttention's key tiles are powers of two; its default (up to 128) would span two
    pages of 48 or 96 positions, so such a read asks for the widest that divides the page, and
    none where 128 does."""
    from flexspec.runtime.flexpages import page_tiles
    assert page_tiles(16) == [16]
    assert page_tiles(48) == [16]
    assert page_tiles(64) == [16, 32, 64]
    assert page_tiles(96) == [16, 32]
    assert page_tiles(128) == page_tiles(256) == [16, 32, 64, 128]


def test_the_fewest_groups_of_kv_heads_whose_pool_slices_are_narrow():
    from flexspec.runtime.flexattention import WIDE_INDEX_ELEMENTS
    from flexspec.runtime.flexpages import head_parts
    positions = WIDE_INDEX_ELEMENTS // 128 // 8  # 8 heads of 128 dims: exactly wide
    assert head_parts(8, positions, 128, 128) == 2
    assert head_parts(8, positions, 64, 128) == 2  # the wider of the two head sizes counts
    assert head_parts(8, 3 * positions, 128, 128) == 4  # 3 is no divisor of 8
    assert head_parts(6, 9 * positions, 128, 128) is None  # one head's slice is wide


def test_a_read_lists_every_page_for_small_decoding_reads_on_cuda_only():
    """The rule of a contiguous decoding call (flexattention.every_tile_fits): keys and values
    at the capacity of at most EVERY_TILE_BYTES, fewer than 128 query rows, on CUDA; and a
    mask under which a decoded row sees every key its slot holds (a window narrower than the
    capacity, or documents, would have every layer read pages the exact mask skips)."""
    from flexspec.runtime.contract import PageGeometry, Request
    from flexspec.runtime.flexattention import EVERY_TILE_BYTES
    from flexspec.runtime.flexpages import lists_every_page

    def request(device: str, rows: int, capacity: int = 4096, kv_heads: int = 2):
        return Request(device_type=device, capability=None, dtype=torch.bfloat16, batch=8,
                       heads=32, kv_heads=kv_heads, q_len=rows, kv_len=capacity, head_dim=128,
                       v_head_dim=128, grads=False, table_grads=False,
                       pages=PageGeometry(64, 1024, capacity // 64))

    def mask(text: str):
        return flexspec.compile(text).ir.mask
    causal = mask("causal")
    # bf16 keys and values of 128 dimensions each, over 8 rows of 16 KV heads at 4096
    assert 8 * 16 * 4096 * 256 * 2 == EVERY_TILE_BYTES
    assert lists_every_page(request("cuda", 1, kv_heads=16), causal)
    assert lists_every_page(request("cuda", 127, kv_heads=16), causal)
    assert not lists_every_page(request("cuda", 1, 4160, kv_heads=16), causal)
    assert not lists_every_page(request("cuda", 128), causal)
    assert not lists_every_page(request("cpu", 1), causal)
    for text in ("full", "causal + alibi", "causal + softcap(30)", "sliding_window(4096)"):
        assert lists_every_page(request("cuda", 1), mask(text)), text
    assert lists_every_page(request("cuda", 1, 1024), mask("sliding_window(1024)"))
    for text in ("sliding_window(1024)", "causal & doc", "causal & window(100) + alibi"):
        assert not lists_every_page(request("cuda", 1), mask(text)), text


@pytest.mark.parametrize("text, listed", [("causal", True), ("causal + alibi", True),
                                          ("causal & window(10)", False),
                                          ("causal & doc", False)])
def test_a_paged_decoding_plan_on_cuda_lists_every_page_where_its_spec_sees_every_key(text,
                                                                                      listed):
    """The every-page rule reads the spec as written: the plan's own IR has its rows placed
    (q_offset, kv_lengths as tensors), of which interval analysis proves nothing. A decoding
    plan of a small pool planned on the CPU and prepared as if on CUDA lists every page under
    ``causal`` (and a score over it), not under a window narrower than the capacity nor over
    documents; and it runs on the decoding kernel."""
    import dataclasses

    from flexspec.runtime import flexpages
    attn = flexspec.compile(text)
    paged = cache(pages=12, page_size=16, slots=3, max_pages=4)
    slots = torch.tensor([2, 0])
    paged.append(slots, *(torch.randn(2, KV_HEADS, 40, DIM) for _ in range(2)))
    q = torch.randn(2, 4, 1, DIM)
    extra = {"doc_ids": torch.zeros(2, 64, dtype=torch.long)} if "doc" in text else {}
    plan, placed = attn._calls.paged_plan(q, paged.keys, paged.values, paged.tables(slots),
                                          scale=None, bindings=extra, q_offset=None,
                                          return_lse=False, vetoes=False)
    on_cuda = dataclasses.replace(plan, request=dataclasses.replace(plan.request,
                                                                    device_type="cuda"))
    state = flexpages.prepare(on_cuda, plan.values(placed)).state
    assert state.every_page is listed and state.kernel.decoding
    assert state.kernel.options["num_stages"] == 3 and state.parts == 1
    assert flexpages.prepare(plan, plan.values(placed)).state.every_page is False  # the CPU


def _paged_plan(text, q_len=1, page_size=16, heads=4, kv_heads=KV_HEADS, head_dim=DIM,
                max_pages=4, extra=None, cuda=True, **compile_options):
    """A paged plan planned on the CPU for read='in_place' (no veto), the request made a CUDA
    one where ``cuda``, and the values of its bindings: ``(plan, values)``."""
    import dataclasses
    attn = flexspec.compile(text, **compile_options)
    paged = flexspec.PagedKVCache(pages=3 * max_pages, page_size=page_size, kv_heads=kv_heads,
                                  head_dim=head_dim, slots=3, max_pages=max_pages)
    slots = torch.tensor([2, 0])
    paged.append(slots, *(torch.randn(2, kv_heads, 20, head_dim) for _ in range(2)))
    q = torch.randn(2, heads, q_len, head_dim)
    plan, placed = attn._calls.paged_plan(q, paged.keys, paged.values, paged.tables(slots),
                                          scale=None, bindings=extra or {}, q_offset=None,
                                          return_lse=False, vetoes=False)
    if cuda:
        plan = dataclasses.replace(plan, request=dataclasses.replace(plan.request,
                                                                     device_type="cuda"))
    return plan, plan.values(placed)


def test_a_paged_plan_s_state_says_how_its_reads_run():
    """flexpages.prepare on synthetic CUDA requests (planned on the CPU): a decoded token on the
    decoding kernel with its three stages; a chunk of fewer than 128 rows whose query heads per
    key head are not a power of two on the main kernel, asked for by name; pages narrower than
    128 read in tiles of the widest power of two dividing them, pages of 128 in the kernel's
    own; options given to compile over flexspec's, in an entry of their own; a score reading no
    binding made once; the CPU's reads compiled with static shapes."""
    from flexspec.runtime import flexpages
    plan, values = _paged_plan("causal + alibi")
    state = flexpages.prepare(plan, values).state
    assert state.kernel.decoding and state.kernel.options == {"num_stages": 3, "BLOCK_N": 16}
    assert not state.static and state.parts == 1 and state.score_reads_kv and \
        state.score_reads_h  # alibi's slopes are per head
    plan, values = _paged_plan("causal + alibi", heads=6)  # three query heads a key head
    state = flexpages.prepare(plan, values).state
    assert not state.kernel.decoding
    assert state.kernel.options == {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_N": 16}
    plan, values = _paged_plan("causal", page_size=48, q_len=130, max_pages=3)
    assert flexpages.prepare(plan, values).state.kernel.options == {"BLOCK_N": 16}
    plan, values = _paged_plan("causal", page_size=128, q_len=130, max_pages=2)
    assert flexpages.prepare(plan, values).state.kernel.options is None
    plan, values = _paged_plan("causal", kernel_options={"BLOCK_N": 16, "num_warps": 2})
    state = flexpages.prepare(plan, values).state
    assert state.kernel.options == {"num_stages": 3, "BLOCK_N": 16, "num_warps": 2}
    own, _ = _paged_plan("causal")
    assert state.kernel.entry is not flexpages.prepare(own, values).state.kernel.entry
    assert state.kernel.entry is flexpages.prepare(plan, values).state.kernel.entry
    fixed, values = _paged_plan("causal + softcap(10)")
    state = flexpages.prepare(fixed, values).state
    assert state.score_varies is False and state.score_mod is not None
    assert not state.score_reads_kv
    heads, values = _paged_plan("causal + head_bias", extra={"bias": torch.ones(4)})
    state = flexpages.prepare(heads, values).state
    assert state.score_varies is True and state.score_reads_h
    cpu, values = _paged_plan("causal", cuda=False)
    state = flexpages.prepare(cpu, values).state
    assert state.static and not state.kernel.decoding and not state.every_page



def test_a_wide_pool_is_read_a_group_of_kv_heads_at_a_time_and_explain_says_so(monkeypatch):
    """A pool inductor would index in int64 (the width rule lowered here to one KV head's
    slice) decodes in groups of KV heads where the mask has one head, on the main kernel where
    no group is narrow enough, and explain's kernel line says how the pool is read."""
    from flexspec.runtime import flexattention, flexpages
    plan, values = _paged_plan("causal")
    one_head = plan.request.pages.positions * DIM

    def wide(positions, dim, v_dim):
        return positions * max(dim, v_dim) > one_head
    for module in (flexpages, flexattention):
        monkeypatch.setattr(module, "wide_keys", wide)
    state = flexpages.prepare(plan, values).state
    assert state.parts == KV_HEADS and state.kernel.decoding
    explained = flexpages.kernel(dataclasses_replace_state(plan, state))
    assert explained == (
        "FlexAttention's decoding kernel over the pool in place, key tiles within pages of 16 "
        "positions, one call per group of 1 KV heads (the pool holds 2**31 elements or more; "
        "flexspec.workarounds: flex-decoding-wide-indices), every page a row's slot holds "
        "listed (no exact mask built at each step; a decoded row sees every key it holds)")
    for module in (flexpages, flexattention):  # no group narrow enough
        monkeypatch.setattr(module, "wide_keys", lambda *args: True)
    state = flexpages.prepare(plan, values).state
    assert state.parts == 1 and not state.kernel.decoding
    assert flexpages.kernel(dataclasses_replace_state(plan, state)) == (
        "FlexAttention's main kernel over the pool in place, key tiles within pages of 16 "
        "positions, every page a row's slot holds listed (no exact mask built at each step; "
        "a decoded row sees every key it holds)")


def dataclasses_replace_state(plan, state):
    import dataclasses
    return dataclasses.replace(plan, state=state)


def test_what_flexattention_refuses_of_a_paged_call_in_full():
    """flexpages.why_not and auto_veto on synthetic requests, their messages whole."""
    import dataclasses

    from flexspec.runtime import flexpages
    plan, _ = _paged_plan("causal", head_dim=16)
    request = plan.request
    assert flexpages.why_not(request) is None and flexpages.auto_veto(request) is None
    assert flexpages.why_not(dataclasses.replace(request, grads=True)) == (
        "the pool is read in place for inference only (no backward pass); use read='gather' "
        "to train through a paged cache")
    small = dataclasses.replace(request, head_dim=8, v_head_dim=16)
    assert flexpages.why_not(small) == ("FlexAttention's GPU kernels take heads of at least 16 "
                                        "dimensions")
    assert flexpages.why_not(dataclasses.replace(small, device_type="cpu")) is None
    pages = dataclasses.replace(request, pages=dataclasses.replace(request.pages, page_size=24))
    assert flexpages.why_not(pages) == (
        "the pool is read in place in key tiles of a multiple of 16 positions, and its pages "
        "hold 24: use pages of 16, 32, 64 or 128 positions, or read='gather'")
    assert flexpages.auto_veto(dataclasses.replace(request, device_type="mps")) == (
        "on mps, copying the sequences out of their pages costs less than compiling the "
        "pool's read (read='in_place' reads in place)")
    with pytest.raises(flexspec.BindingError) as caught:
        flexpages.given_options({"BLOCK_N": 64}, 32)
    assert str(caught.value) == (
        "kernel_options BLOCK_N=64 is not a key tile that divides the cache's pages of 32 "
        "positions (a key tile may not span two pages, and FlexAttention's are powers of two "
        "from 16 to 128): give one of [16, 32], or leave BLOCK_N out (for other calls that "
        "need it, compile the spec once more without it for the paged reads)")
    with pytest.raises(flexspec.BindingError):
        flexpages.given_options({"BLOCK_N": True}, 32)
    assert flexpages.given_options(None, 32) == {}
