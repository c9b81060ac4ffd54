"""runtime.masks: the extents a mask needs, the key standing for a mask at given sizes, the
builder each mode and device takes, and the bounded cache of block masks (probation, least
recently used out first, a byte budget, keyed by the identity of the tensors the mask reads).

Every block mask is checked against the dense float64 reference (``Attention.dense_mask``): its
``mask_mod`` cell by cell, and its tables tile by tile (a tile is EMPTY when no cell is visible,
FULL when every cell is, PARTIAL otherwise; ``intervals`` mode may call a decidable tile
PARTIAL). Rebuilds are counted by wrapping the builders the module calls.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import create_mask

import flexspec
from flexspec import BindingError, ir, limits
from flexspec.kernels import fused_blocks
from flexspec.kernels.block_tables import (EMPTY, FULL, PARTIAL, as_partial, tables,
                                          tile_classes)
from flexspec.lang.library import load_text
from flexspec.runtime import masks
from flexspec.runtime.masks import MaskCache, mask_extent
from flexspec.testing import Shape, document_ids

LIBRARY = load_text("""
mask per_head = kv <= q + 7 * h
mask per_row(r: int[B, KV_LEN]) = r[b, kv] <= r[b, q]
mask both(r: int[B, KV_LEN], f: bool[H]) = r[b, kv] <= r[b, q] & f[h]
mask two(a: int[KV_LEN], z: int[KV_LEN]) = a[kv] == a[q] & z[kv] <= z[q]
mask parity = (q + kv) % 2 == 0 | (q + kv) % 2 == 1
mask tail = kv >= KV_LEN - 8 | q >= kv
mask same_group(group: int[KV_LEN]) = group[group[q]] == group[kv]
""")


def compile_mask(text, **options):
    return flexspec.compile(text, library=LIBRARY, **options)


def doc_ids(bounds=((40, 90), (20,)), length=150):
    """Document ids per batch row: a new document starts at each bound."""
    return document_ids(bounds, length)


def reference_classes(dense: torch.Tensor, block: tuple) -> torch.Tensor:
    """Tile classes worked out from the reference's dense mask, one tile at a time; the padding
    of a tile that runs past the end counts as masked (as in torch's create_block_mask)."""
    b, h, q_len, kv_len = dense.shape
    nq, nk = -(-q_len // block[0]), -(-kv_len // block[1])
    padded = torch.zeros(b, h, nq * block[0], nk * block[1], dtype=torch.bool)
    padded[:, :, :q_len, :kv_len] = dense
    classes = torch.empty(b, h, nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            tile = padded[:, :, i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            for bb in range(b):
                for hh in range(h):
                    cells = tile[bb, hh]
                    classes[bb, hh, i, j] = (FULL if cells.all() else
                                             PARTIAL if cells.any() else EMPTY)
    return classes


def assert_is_the_reference(block_mask, attn, q_len, kv_len, *, batch=None, heads=None,
                            exact=True, **bindings):
    """``block_mask`` means what the reference computes: its mask_mod cell by cell, its tables
    tile by tile (exactly, or soundly in intervals mode: decided tiles right, the rest
    PARTIAL)."""
    dense = attn.dense_mask(q_len, kv_len, batch=batch, heads=heads, **bindings)
    b, h = block_mask.kv_num_blocks.shape[:2]
    assert dense.shape[:2] == (b, h)
    assert block_mask.shape == (b, h, q_len, kv_len)
    assert torch.equal(create_mask(block_mask.mask_mod, b, h, q_len, kv_len), dense)
    classes, expected = tile_classes(block_mask), reference_classes(dense, block_mask.BLOCK_SIZE)
    if exact:
        assert torch.equal(classes, expected)
    else:
        assert torch.equal(classes == EMPTY, expected == EMPTY)  # no visible tile skipped
        assert not ((classes == FULL) & (expected != FULL)).any()


class Builds:
    """Counts the calls of a builder of the masks module while passing them on."""

    def __init__(self, monkeypatch, name):
        self.calls = []
        original = getattr(masks, name)

        def build(*args, **kwargs):
            self.calls.append(kwargs)
            return original(*args, **kwargs)

        monkeypatch.setattr(masks, name, build)

    def __len__(self):
        return len(self.calls)


def spec_of(text):
    return flexspec.parse(text, library=LIBRARY).ir


SIZES = {"B": 2, "H": 3, "Q_LEN": 40, "KV_LEN": 50}


# --- extents and keys ------------------------------------------------------------------------


def test_a_mask_needs_the_batch_and_head_extents_it_reads_and_no_others():
    key_r = next(ir.tensor_key(t) for t in spec_of("per_row").tensors())
    assert mask_extent(spec_of("causal").mask, SIZES) == (1, 1, frozenset())
    assert mask_extent(spec_of("per_head").mask, SIZES) == (1, 3, frozenset())
    assert mask_extent(spec_of("per_row").mask, SIZES) == (2, 1, frozenset({key_r}))
    both = spec_of("both")
    assert mask_extent(both.mask, SIZES) == (2, 3, frozenset(ir.tensor_key(t)
                                                             for t in both.tensors()))


def test_a_key_stands_for_the_mask_its_extents_lengths_and_device():
    block_masks = MaskCache("exact", (16, 16))
    cpu = torch.device("cpu")
    per_row = spec_of("per_row")
    first = block_masks.key(per_row, SIZES, cpu)
    assert block_masks.key(per_row, dict(SIZES), cpu) == first
    assert (first.batch, first.heads) == (2, 1)
    assert first.reads == tuple(ir.tensor_key(t) for t in per_row.tensors())
    others = [block_masks.key(per_row, {**SIZES, "Q_LEN": 41}, cpu),
              block_masks.key(per_row, {**SIZES, "KV_LEN": 51}, cpu),
              block_masks.key(per_row, {**SIZES, "B": 3}, cpu),
              block_masks.key(per_row, SIZES, torch.device("meta")),
              block_masks.key(spec_of("causal"), SIZES, cpu),
              block_masks.key(spec_of("per_head"), SIZES, cpu),
              block_masks.key(spec_of("per_head"), {**SIZES, "H": 4}, cpu)]
    tokens = [first.token] + [key.token for key in others]
    assert len(set(tokens)) == len(tokens)
    # extents a mask does not read do not make another mask
    assert block_masks.key(per_row, {**SIZES, "H": 7}, cpu) == first
    assert block_masks.key(spec_of("causal"), {**SIZES, "B": 5, "H": 1}, cpu) == others[4]
    # FLASH's form of the mask_mod is another entry with the same extents and tensors
    flash = block_masks.key(per_row, SIZES, cpu, "cute")
    assert flash.token not in tokens and flash.dialect == "cute" and first.dialect == "torch"
    assert (flash.batch, flash.heads, flash.reads) == (first.batch, first.heads, first.reads)


def test_a_mask_keeps_its_id_at_every_size_and_tokens_are_bounded(monkeypatch):
    """A growing cache asks for a key at every length: the tokens kept are bounded (the oldest
    out first, never given again), while the mask's id stays that of the mask."""
    monkeypatch.setattr(masks, "TOKENS_KEPT", 3)
    block_masks = MaskCache("exact", (16, 16))
    cpu = torch.device("cpu")
    per_row = spec_of("per_row")
    keys = [block_masks.key(per_row, {**SIZES, "KV_LEN": n}, cpu) for n in range(50, 60)]
    assert len({key.token for key in keys}) == 10 and len({key.mask_id for key in keys}) == 1
    assert len(block_masks._tokens) == 3
    again = block_masks.key(per_row, {**SIZES, "KV_LEN": 50}, cpu)  # its token went
    assert again.token not in {key.token for key in keys} and again.mask_id == keys[0].mask_id
    assert block_masks.key(spec_of("causal"), SIZES, cpu).mask_id != keys[0].mask_id


def test_a_key_lists_the_tensors_read_in_sorted_order():
    spec = spec_of("two")
    key = MaskCache("exact", (16, 16)).key(spec, SIZES, torch.device("cpu"))
    assert key.reads == tuple(sorted(ir.tensor_key(t) for t in spec.tensors()))
    assert len(key.reads) == 2 and (key.batch, key.heads) == (1, 1)


# --- the builders ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "intervals", "dense"])
def test_every_mode_builds_the_reference_mask(mode):
    attn = compile_mask("both", block_masks=mode, block_size=(16, 32))
    r = doc_ids(((10, 30), (25,)), 70)
    f = torch.tensor([True, False, True])
    block_mask = attn.block_mask(60, 70, batch=2, heads=3, r=r, f=f)
    assert block_mask.BLOCK_SIZE == (16, 32)
    assert_is_the_reference(block_mask, attn, 60, 70, batch=2, heads=3, r=r, f=f,
                            exact=mode != "intervals")


@pytest.mark.parametrize("mode", ["exact", "intervals", "dense"])
def test_a_mask_that_reads_the_lengths_gets_them(mode):
    # the last 8 keys are seen by every query: the mask_mod must be made for these lengths
    attn = compile_mask("tail", block_masks=mode, block_size=16)
    for kv_len in (50, 64):
        assert_is_the_reference(attn.block_mask(40, kv_len), attn, 40, kv_len,
                                exact=mode != "intervals")


def test_a_given_key_finds_the_mask_built_without_one():
    # a call passes its plan's key; Attention.block_mask passes none: both find one entry
    block_masks = MaskCache("exact", (16, 16))
    spec, cpu = spec_of("per_row"), torch.device("cpu")
    sizes = {"B": 2, "H": 1, "Q_LEN": 40, "KV_LEN": 50}
    values = {ir.tensor_key(t): doc_ids(((10,), (30,)), 50) for t in spec.tensors()}
    first = block_masks.get(spec, sizes, values, cpu)
    assert block_masks.get(spec, sizes, values, cpu, block_masks.key(spec, sizes, cpu)) is first
    assert block_masks.get(spec, sizes, values, cpu) is first


def _aten_ops(mask_mod) -> set:
    """The names of the aten ops ``mask_mod`` runs, traced over vectors of indices."""
    index = torch.arange(4)
    graph = make_fx(mask_mod)(index, index, index, index).graph
    return {str(node.target).split(".")[1] for node in graph.nodes
            if node.op == "call_function" and str(node.target).startswith("aten.")}


@pytest.mark.parametrize("mode", ["exact", "intervals", "dense"])
def test_a_block_mask_for_flash_carries_flashs_form_of_the_mask(mode):
    # FLASH compiles the block mask's mask_mod inside partial tiles, and its CuTeDSL rejected
    # the maximum a clamp becomes (natten, torch 2.11): a FLASH key's masks carry the where form
    attn = flexspec.compile("natten(6, 5, 3, 3)", block_masks=mode, block_size=16)
    spec, sizes, cpu = attn.ir, {"B": 1, "H": 1, "Q_LEN": 30, "KV_LEN": 30}, torch.device("cpu")
    block_masks = MaskCache(mode, (16, 16))
    plain = block_masks.get(spec, sizes, {}, cpu)
    flash = block_masks.get(spec, sizes, {}, cpu, block_masks.key(spec, sizes, cpu, "cute"))
    assert flash is not plain
    assert {"clamp", "abs"} <= _aten_ops(plain.mask_mod)
    assert not {"clamp", "abs", "maximum", "minimum"} & _aten_ops(flash.mask_mod)
    for block_mask in (plain, flash):
        assert_is_the_reference(block_mask, attn, 30, 30, exact=mode != "intervals")


def test_a_mask_built_again_after_the_fused_builder_fails_keeps_flashs_form(monkeypatch):
    FusedProgram(monkeypatch, fail=True)  # intervals mode takes the fused builder first
    attn = flexspec.compile("natten(6, 5, 3, 3)", block_masks="intervals", block_size=16)
    spec, sizes, cpu = attn.ir, {"B": 1, "H": 1, "Q_LEN": 30, "KV_LEN": 30}, torch.device("cpu")
    block_masks = MaskCache("intervals", (16, 16))
    flash = block_masks.get(spec, sizes, {}, cpu, block_masks.key(spec, sizes, cpu, "cute"))
    assert not {"clamp", "abs", "maximum", "minimum"} & _aten_ops(flash.mask_mod)
    assert_is_the_reference(flash, attn, 30, 30, exact=False)


def test_intervals_mode_leaves_undecided_tiles_partial_and_exact_mode_refines_them():
    # (q + kv) % 2 is 0 or 1 at every cell, which intervals cannot prove: every tile is FULL
    exact = compile_mask("parity", block_size=16).block_mask(48, 64)
    loose = compile_mask("parity", block_size=16, block_masks="intervals").block_mask(48, 64)
    dense = compile_mask("parity", block_size=16, block_masks="dense").block_mask(48, 64)
    assert (tile_classes(exact) == FULL).all() and (tile_classes(dense) == FULL).all()
    assert (tile_classes(loose) == PARTIAL).all()


def test_the_dense_mode_builds_with_torch_and_the_others_with_the_analysis(monkeypatch):
    torch_builds = Builds(monkeypatch, "create_block_mask")
    analysis = Builds(monkeypatch, "build_block_mask")
    compile_mask("per_head", block_masks="dense").block_mask(40, 40, heads=2)
    assert (len(torch_builds), len(analysis)) == (1, 0)
    compile_mask("per_head", block_masks="exact").block_mask(40, 40, heads=2)
    compile_mask("per_head", block_masks="intervals").block_mask(40, 40, heads=2)
    assert len(torch_builds) == 1
    assert [call["exact"] for call in analysis.calls] == [True, False]


def test_a_spec_without_a_mask_gets_an_all_full_block_mask_in_every_mode():
    for mode in ("exact", "intervals", "dense"):
        attn = flexspec.compile("full + alibi", block_masks=mode, block_size=16)
        block_mask = attn.block_mask(48, 32, heads=4)
        assert block_mask.shape == (1, 1, 48, 32)
        assert (tile_classes(block_mask) == FULL).all()
        assert create_mask(block_mask.mask_mod, 1, 1, 48, 32).all()


def _same_grid_length(length: int, block: int) -> int:
    """Another length of the same number of tiles whose last tile runs past the end as
    ``length``'s does (``length`` itself where there is none)."""
    tiles = -(-length // block)
    if length % block == 0:
        return length
    others = [n for n in range((tiles - 1) * block + 1, tiles * block) if n != length]
    return others[0] if others else length


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.integers(1, 600), st.sampled_from([(16, 16), (64, 32), (128, 128)]),
       st.booleans(), st.sampled_from(["exact", "intervals"]), st.integers(1, 3), st.integers(1, 3))
def test_a_mask_that_hides_nothing_is_built_once_per_grid_and_equals_a_build(
        q_len, kv_len, block, partial, mode, batch, heads):
    """A spec without a mask (what a decoded token that sees every key runs): its block mask
    at a length is made from the tables kept for its grid of tiles, built at another length of
    that grid first, and equals the eager builder's at that length (in the decoding kernel's
    partial form too), with the length's own seq_lengths."""
    spec = ir.AttentionIR(ir.TRUE, ir.SCORE, "start")
    cache = MaskCache(mode, block)
    sizes = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
    other = {**sizes, "Q_LEN": _same_grid_length(q_len, block[0]),
             "KV_LEN": _same_grid_length(kv_len, block[1])}
    cpu = torch.device("cpu")
    cache.bind(spec, other, cpu, partial=partial).get({}, cpu)
    made = cache.bind(spec, sizes, cpu, partial=partial).get({}, cpu)
    built = masks.build_block_mask(ir.TRUE, sizes, block, {}, cpu, batch=1, heads=1,
                                   exact=mode == "exact")
    built = as_partial(built) if partial else built
    assert made.seq_lengths == (q_len, kv_len)
    assert torch.equal(tile_classes(made), tile_classes(built))
    if not partial and mode == "exact":
        dense = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool)
        assert torch.equal(tile_classes(made), reference_classes(dense, block))


def test_a_growing_cache_s_mask_that_hides_nothing_builds_once_per_grid(monkeypatch):
    """Decoding with every key seen, at key lengths 1001 to 1020: one build for the lengths of
    8 tiles (1001-1023), one for 1024 (no tile past the end); every mask equals the build at its
    own length. Inside a CUDA graph capture the tables are built every time, never kept."""
    analysis = Builds(monkeypatch, "build_block_mask")
    spec = ir.AttentionIR(ir.TRUE, ir.SCORE, "start")
    cache, cpu = MaskCache("exact", (128, 128)), torch.device("cpu")
    for kv_len in list(range(1001, 1021)) + [1024]:
        made = cache.bind(spec, {"B": 8, "H": 32, "Q_LEN": 1, "KV_LEN": kv_len}, cpu,
                          partial=True).get({}, cpu)
        assert made.seq_lengths == (1, kv_len)
        assert made.kv_num_blocks.tolist() == [[[8]]] and made.full_kv_num_blocks is None
    assert len(analysis) == 2
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    for kv_len in (1100, 1101):
        cache.bind(spec, {"B": 8, "H": 32, "Q_LEN": 1, "KV_LEN": kv_len}, cpu,
                   partial=True).get({}, cpu)
    assert len(analysis) == 4


def test_a_block_mask_too_large_to_build_is_a_binding_error(monkeypatch):
    attn = compile_mask("both", block_size=(16, 32))
    # 2 x 3 (batch x heads) rows of 13 x 10 tiles
    monkeypatch.setattr(limits, "MAX_BLOCK_MASK_BYTES",
                        2 * 3 * 13 * 10 * limits.BLOCK_MASK_BYTES_PER_TILE - 1)
    builds = Builds(monkeypatch, "build_block_mask")
    r, f = torch.zeros(2, 300, dtype=torch.int64), torch.ones(3, dtype=torch.bool)
    with pytest.raises(BindingError, match=r"^a block mask for Q_LEN = 200 and KV_LEN = 300 in "
                                           r"blocks of 16x32 has 13 x 10 tiles per row of 2 x 3 "
                                           r"\(batch x heads\)"):
        attn.block_mask(200, 300, batch=2, heads=3, r=r, f=f)
    assert len(builds) == 0
    monkeypatch.setattr(limits, "MAX_BLOCK_MASK_BYTES",
                        2 * 3 * 13 * 10 * limits.BLOCK_MASK_BYTES_PER_TILE)
    attn.block_mask(200, 300, batch=2, heads=3, r=r, f=f)  # exactly at the limit
    assert len(builds) == 1


class FusedProgram:
    """A stand-in for the compiled fused builder (about 20 s to compile on the CPU): the
    interval-only eager builder, with the arguments of each call recorded; ``fail`` raises
    Untraceable instead."""

    def __init__(self, monkeypatch, fail=False):
        self.calls, self.fail = [], fail
        monkeypatch.setattr(masks, "FUSED_DEVICES", frozenset({"cpu"}))
        monkeypatch.setattr(fused_blocks, "fused_block_mask", self)

    def __call__(self, mask, sizes, block, tensors, device, *, batch, heads, mask_mod,
                 partial=False):
        self.calls.append(mask)
        if self.fail:
            raise fused_blocks.Untraceable("cannot trace")
        built = masks.build_block_mask(mask, sizes, block, tensors, device, batch=batch,
                                       heads=heads, mask_mod=mask_mod, exact=False)
        return as_partial(built) if partial else built


def test_masks_that_read_tensors_take_the_fused_builder_on_its_devices(monkeypatch):
    fused = FusedProgram(monkeypatch)
    r = doc_ids(((10, 30), (25,)), 70)
    f = torch.tensor([True, False, True])
    attn = compile_mask("both", block_size=16)
    block_mask = attn.block_mask(60, 70, batch=2, heads=3, r=r, f=f)
    assert fused.calls == [attn.ir.mask]
    assert_is_the_reference(block_mask, attn, 60, 70, batch=2, heads=3, r=r, f=f, exact=False)
    # a mask that reads no tensor is built once, exactly, by the eager builder
    attn = compile_mask("per_head", block_size=16)
    assert_is_the_reference(attn.block_mask(60, 70, heads=3), attn, 60, 70, heads=3)
    assert len(fused.calls) == 1
    # ... but by the fused one in intervals mode
    attn = compile_mask("per_head", block_size=16, block_masks="intervals")
    block_mask = attn.block_mask(60, 70, heads=3)
    assert len(fused.calls) == 2
    assert_is_the_reference(block_mask, attn, 60, 70, heads=3, exact=False)
    # never in dense mode
    compile_mask("both", block_masks="dense").block_mask(60, 70, batch=2, heads=3, r=r, f=f)
    assert len(fused.calls) == 2


def test_grids_too_large_for_the_fused_builder_take_the_eager_one(monkeypatch):
    fused = FusedProgram(monkeypatch)
    monkeypatch.setattr(fused_blocks, "MAX_FUSED_TILES", 2 * 3 * 4 * 5)  # B x H x NQ x NK
    attn = compile_mask("both", block_size=16)
    f = torch.tensor([True, False, True])
    attn.block_mask(64, 80, batch=2, heads=3, r=doc_ids(((10,), (30,)), 80), f=f)
    assert len(fused.calls) == 1
    r = doc_ids(((10,), (30,)), 81)
    assert_is_the_reference(attn.block_mask(64, 81, batch=2, heads=3, r=r, f=f), attn, 64, 81,
                            batch=2, heads=3, r=r, f=f)
    assert len(fused.calls) == 1


def test_a_mask_the_fused_builder_cannot_trace_is_built_eagerly_from_then_on(monkeypatch):
    fused = FusedProgram(monkeypatch, fail=True)
    attn = compile_mask("per_row", block_size=16)
    for bounds in (((10,), (30,)), ((20,), (5,))):
        r = doc_ids(bounds, 50)
        assert_is_the_reference(attn.block_mask(40, 50, batch=2, r=r), attn, 40, 50, batch=2,
                                r=r)
    assert len(fused.calls) == 1  # the second binding went straight to the eager builder
    r = doc_ids(((10,), (30,)), 61)  # and so does the mask at other lengths
    assert_is_the_reference(attn.block_mask(41, 61, batch=2, r=r), attn, 41, 61, batch=2, r=r)
    assert len(fused.calls) == 1
    # another mask on the same cache is still tried
    attn._calls.masks.get(spec_of("two"), {"B": 1, "H": 1, "Q_LEN": 40, "KV_LEN": 50},
                    {ir.tensor_key(t): torch.zeros(50, dtype=torch.int64)
                     for t in spec_of("two").tensors()}, torch.device("cpu"))
    assert len(fused.calls) == 2


# --- the cache ---------------------------------------------------------------------------------


def test_a_mask_is_cached_when_asked_for_a_second_time(monkeypatch):
    builds = Builds(monkeypatch, "build_block_mask")
    attn = flexspec.compile("causal & document")
    ids = doc_ids()
    first = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    assert attn._calls.masks.cached_bytes() == 0  # on probation
    assert attn.block_mask(100, 150, batch=2, doc_ids=ids) is first
    expected = sum(t.numel() * t.element_size() for t in (
        first.kv_num_blocks, first.kv_indices, first.full_kv_num_blocks, first.full_kv_indices,
        first.q_num_blocks, first.q_indices, first.full_q_num_blocks, first.full_q_indices, ids))
    assert attn._calls.masks.cached_bytes() == expected
    assert attn.block_mask(100, 150, batch=2, doc_ids=ids) is first  # from the cache
    assert attn._calls.masks.cached_bytes() == expected
    assert len(builds) == 1
    # another tensor is another binding, even with equal values: built anew, equal content
    other = attn.block_mask(100, 150, batch=2, doc_ids=ids.clone())
    assert other is not first and len(builds) == 2
    assert torch.equal(other.to_dense(), first.to_dense())


def test_block_mask_cache_hits_for_a_broadcast_binding():
    attn = flexspec.compile("causal & document")
    ids = doc_ids()[0]
    first = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    assert attn.block_mask(100, 150, batch=2, doc_ids=ids) is first


def test_views_of_one_tensor_at_different_offsets_are_different_bindings(eager_kernels):
    # ids[0] and ids[1] share storage, shape, strides and version: only the storage offset
    # tells them apart, and a cache that missed it reused the first mask (mutation testing)
    attn = flexspec.compile("causal & document")
    ids = torch.stack([doc_ids(), doc_ids(((10, 60), (100,)))])
    q, k, v = Shape(2, 4, 2, 150, 150, 16).qkv(seed=3)
    for _ in range(2):  # the second round is served from the cache
        for row in ids:
            block_mask = attn.block_mask(150, 150, batch=2, doc_ids=row)
            assert torch.equal(create_mask(block_mask.mask_mod, 2, 1, 150, 150),
                               attn.dense_mask(150, 150, batch=2, doc_ids=row))
            with torch.no_grad():
                torch.testing.assert_close(attn(q, k, v, doc_ids=row),
                                           attn.reference(q, k, v, doc_ids=row),
                                           rtol=1e-4, atol=1e-4)


def test_block_mask_cache_without_bindings():
    attn = flexspec.compile("causal & window(20)")
    first = attn.block_mask(300, 300)
    assert attn.block_mask(300, 300) is first
    assert attn.block_mask(300, 301) is not first
    assert first.shape == (1, 1, 300, 300)


def test_block_mask_cache_is_bounded():
    attn = flexspec.compile("causal")
    first = attn.block_mask(17, 17)
    for length in range(18, 18 + masks.BLOCK_MASK_CACHE_SIZE):
        attn.block_mask(length, length)
    assert attn.block_mask(17, 17) is not first


def test_the_least_recently_used_mask_leaves_the_cache_first(monkeypatch):
    monkeypatch.setattr(masks, "BLOCK_MASK_CACHE_SIZE", 2)
    builds = Builds(monkeypatch, "build_block_mask")
    attn = flexspec.compile("causal", block_size=16)
    for length in (20, 21, 20, 21):  # both asked twice: cached
        attn.block_mask(length, length)
    assert len(builds) == 2
    attn.block_mask(20, 20)  # 20 is now the most recently used
    for _ in range(2):
        attn.block_mask(22, 22)  # 22 enters the cache, 21 leaves it
    assert len(builds) == 3
    attn.block_mask(20, 20)
    assert len(builds) == 3
    attn.block_mask(21, 21)
    assert len(builds) == 4


def test_new_masks_wait_on_probation_where_the_oldest_leaves_first(monkeypatch):
    builds = Builds(monkeypatch, "build_block_mask")
    attn = flexspec.compile("causal", block_size=16)
    a = attn.block_mask(20, 20)
    attn.block_mask(21, 21)
    assert attn.block_mask(20, 20) is a and len(builds) == 2  # two fit on probation
    attn = flexspec.compile("causal", block_size=16)  # an empty cache
    for length in (20, 21, 22):
        attn.block_mask(length, length)
    assert len(attn._calls.masks._probation) == masks.PROBATION_SIZE == 2
    attn.block_mask(22, 22)
    attn.block_mask(21, 21)
    assert len(builds) == 5  # 21 and 22 were waiting
    attn.block_mask(20, 20)
    assert len(builds) == 6  # 20, the oldest, had left
    assert attn._calls.masks.cached_bytes() > 0


def test_block_mask_plans_once_per_signature_and_builds_each_call_s_values(monkeypatch):
    from flexspec.runtime import calls
    plans = []
    original = calls.make_mask_plan
    monkeypatch.setattr(calls, "make_mask_plan",
                        lambda **kwargs: plans.append(kwargs) or original(**kwargs))
    attn = flexspec.compile("causal & document")
    rows = (((40, 90), (20,)), ((10,), (70, 71)), ((), (140,)))
    for bounds in rows:  # new values of one signature: one plan, each call's own mask
        ids = doc_ids(bounds)
        assert_is_the_reference(attn.block_mask(100, 150, batch=2, doc_ids=ids), attn, 100,
                                150, batch=2, doc_ids=ids)
    assert len(plans) == 1
    ids = doc_ids(rows[1])
    for signature in ({"doc_ids": ids.to(torch.int32)}, {"doc_ids": ids[:1]},
                      {"doc_ids": ids, "q_len": 99}):
        q_len = signature.pop("q_len", 100)
        block_mask = attn.block_mask(q_len, 150, batch=2, **signature)
        assert_is_the_reference(block_mask, attn, q_len, 150, batch=2, **signature)
    assert len(plans) == 4


def test_block_mask_checks_lookups_it_cannot_prove_on_every_new_binding():
    attn = compile_mask("same_group")
    group = torch.zeros(24, dtype=torch.int64)
    attn.block_mask(24, 24, group=group)
    wild = torch.zeros(24, dtype=torch.int64)
    wild[3] = 24  # the same signature, but group[group[3]] reads past the end
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\]"):
        attn.block_mask(24, 24, group=wild)
    group[5] = -1  # in place: checked again
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\]"):
        attn.block_mask(24, 24, group=group)


def test_block_mask_is_rebuilt_after_an_in_place_change():
    attn = flexspec.compile("causal & document")
    ids = doc_ids()
    before = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    attn.block_mask(100, 150, batch=2, doc_ids=ids)  # cached
    ids[0] = 0  # one document in row 0: now row 0 matches row 1's first block structure
    after = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    assert after is not before
    assert_is_the_reference(after, attn, 100, 150, batch=2, doc_ids=ids)


def test_per_batch_block_masks_for_per_batch_doc_ids():
    attn = flexspec.compile("causal & document")
    # Row 0: documents of 128 tokens; row 1: one document. Block (1, 0) is skipped in row 0
    # and full in row 1.
    ids = torch.stack([torch.arange(200) // 128, torch.zeros(200, dtype=torch.int64)])
    block_mask = attn.block_mask(200, 200, batch=2, doc_ids=ids)
    assert block_mask.kv_num_blocks.shape[0] == 2
    assert block_mask.shape[0] == 2
    dense = block_mask.to_dense()
    assert not torch.equal(dense[0], dense[1])
    assert dense[0, 0, 1, 0] == 0 and dense[1, 0, 1, 0] == 1
    # Its mask_mod reads row b, never row 0 for every batch.
    assert_is_the_reference(block_mask, attn, 200, 200, batch=2, doc_ids=ids)


def test_shared_block_mask_for_broadcast_doc_ids():
    attn = flexspec.compile("causal & document")
    ids = torch.arange(200) // 64
    block_mask = attn.block_mask(200, 200, batch=3, doc_ids=ids)
    assert block_mask.kv_num_blocks.shape[0] == 1 and block_mask.shape[0] == 1
    for same in (ids[None], ids[None].expand(3, -1)):
        # [1, KV_LEN] broadcasts like [KV_LEN]; [B, KV_LEN] with equal rows is per batch.
        mask = attn.block_mask(200, 200, batch=3, doc_ids=same)
        assert torch.equal(mask.to_dense()[0], block_mask.to_dense()[0])


def test_head_dependent_masks_get_a_head_dimension():
    attn = flexspec.compile("causal & window(3) + alibi")
    assert attn.block_mask(40, 40, batch=2, heads=4).shape[:2] == (1, 1)
    assert attn.dense_mask(40, 40, batch=2, heads=4).shape == (1, 1, 40, 40)
    per_head = compile_mask("per_head")
    block_mask = per_head.block_mask(300, 300, batch=2, heads=4)
    assert block_mask.shape[:2] == (1, 4)
    assert_is_the_reference(block_mask, per_head, 300, 300, batch=2, heads=4)


def test_fresh_bindings_every_call_do_not_fill_the_block_mask_cache(monkeypatch):
    """Red-team finding: fresh doc_ids every step filled all 32 entries (about 400 MB at B=8,
    S=32K) although none was ever reused. New masks now wait in a small probation area; a mask
    asked for twice enters the cache, which is bounded in bytes too."""
    attn = flexspec.compile("causal & doc")
    for step in range(40):
        attn.block_mask(300, 300, doc_ids=torch.arange(300) * (step % 7 + 2) // 300)
    cache = attn._calls.masks
    assert cache.cached_bytes() == 0 and len(cache._probation) <= masks.PROBATION_SIZE
    ids = torch.arange(300) // 100
    first = attn.block_mask(300, 300, doc_ids=ids)
    assert attn.block_mask(300, 300, doc_ids=ids) is first  # the second request keeps it
    kept = attn._calls.masks.cached_bytes()
    assert kept > 0
    # a byte budget smaller than two entries keeps one
    monkeypatch.setattr(masks, "BLOCK_MASK_CACHE_BYTES", kept + kept // 2)
    other = torch.arange(300) // 50
    attn.block_mask(300, 300, doc_ids=other)
    attn.block_mask(300, 300, doc_ids=other)
    assert len(cache._cache) == 1 and cache.cached_bytes() <= kept + kept // 2


def test_the_byte_budget_counts_every_entry_and_refuses_one_larger_than_itself(monkeypatch):
    attn = flexspec.compile("causal", block_size=16)
    attn.block_mask(64, 64)
    attn.block_mask(64, 64)
    size = attn._calls.masks.cached_bytes()
    attn = flexspec.compile("causal", block_size=16)  # an empty cache
    monkeypatch.setattr(masks, "BLOCK_MASK_CACHE_BYTES", size - 1)  # too small for one
    for _ in range(3):
        attn.block_mask(64, 64)
    assert attn._calls.masks.cached_bytes() == 0 and not attn._calls.masks._cache
    monkeypatch.setattr(masks, "BLOCK_MASK_CACHE_BYTES", size)  # room for exactly one
    attn.block_mask(64, 64)
    assert attn._calls.masks.cached_bytes() == size and len(attn._calls.masks._cache) == 1
    attn = flexspec.compile("causal", block_size=16)  # an empty cache
    monkeypatch.setattr(masks, "BLOCK_MASK_CACHE_BYTES", 2 * size)  # room for exactly two
    for length in (64, 64, 63, 63):  # 63 has as many tiles and tables as 64
        attn.block_mask(length, length)
    assert attn._calls.masks.cached_bytes() == 2 * size and len(attn._calls.masks._cache) == 2
    attn.block_mask(62, 62)
    attn.block_mask(62, 62)
    assert attn._calls.masks.cached_bytes() == 2 * size and len(attn._calls.masks._cache) == 2


def test_inside_a_cuda_graph_capture_a_mask_that_reads_tensors_is_built_every_time(monkeypatch):
    """A captured graph replays the block mask's build with whatever its tensors hold at each
    replay; a mask served from the cache would be replayed as it was at capture (a stale mask
    for the next step's doc_ids). Masks that read no tensor are still served from the cache."""
    built = FusedProgram(monkeypatch).calls
    attn = flexspec.compile("causal & doc")
    ids = torch.arange(300) // 100
    first = attn.block_mask(300, 300, doc_ids=ids)
    assert attn.block_mask(300, 300, doc_ids=ids) is first and len(built) == 1
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    inside = attn.block_mask(300, 300, doc_ids=ids)
    assert inside is not first and len(built) == 2
    assert torch.equal(inside.to_dense(), first.to_dense())
    plain = flexspec.compile("causal & window(50)")
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: False)
    kept = plain.block_mask(300, 300)
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    assert plain.block_mask(300, 300) is kept
    # a build inside a capture is not kept: after it the cache serves what it held before
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: False)
    assert attn.block_mask(300, 300, doc_ids=ids) is first and len(built) == 2
    # nor is a mask waiting in probation (asked for once) served to a capture
    other = torch.arange(300) // 60
    waiting = attn.block_mask(300, 300, doc_ids=other)
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    assert attn.block_mask(300, 300, doc_ids=other) is not waiting and len(built) == 4


def test_a_mask_too_large_for_its_program_cannot_be_built_inside_a_capture(monkeypatch):
    FusedProgram(monkeypatch)
    monkeypatch.setattr(fused_blocks, "MAX_FUSED_TILES", 4)
    monkeypatch.setattr(masks, "MAX_FUSED_TILES", 4)
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    attn = flexspec.compile("causal & doc")
    with pytest.raises(BindingError, match=r"^flexspec cannot build this block mask inside a "
                       r"CUDA graph capture: its grid of 9 tiles \(B x H x query blocks x key "
                       r"blocks\) is larger than the 4 the compiled block-mask program takes, "
                       r"and the eager builder reads counts on the host. Run this step outside "
                       r"the graph, or capture a smaller one$"):
        attn.block_mask(300, 300, doc_ids=torch.arange(300) // 100)


def test_a_mask_on_a_device_without_its_program_cannot_be_built_inside_a_capture(monkeypatch):
    """The error names the device the program does not run on, not a grid that fits."""
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    attn = flexspec.compile("causal & doc")
    with pytest.raises(BindingError, match=r"^flexspec cannot build this block mask inside a "
                       r"CUDA graph capture: the compiled block-mask program does not run on "
                       r"cpu, and the eager builder reads counts on the host. Run this step "
                       r"outside the graph, or capture a smaller one$"):
        attn.block_mask(300, 300, doc_ids=torch.arange(300) // 100)


def test_a_mask_its_program_cannot_trace_cannot_be_built_inside_a_capture(monkeypatch):
    FusedProgram(monkeypatch, fail=True)
    attn = flexspec.compile("causal & doc")
    ids = torch.arange(300) // 100
    attn.block_mask(300, 300, doc_ids=ids)  # outside a capture: the eager builder takes it
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    with pytest.raises(BindingError, match=r"^flexspec cannot build this block mask inside a "
                       r"CUDA graph capture: torch.compile could not trace its block-mask "
                       r"program, and the eager builder reads counts on the host. Run this "
                       r"step outside the graph, or capture a smaller one$"):
        attn.block_mask(300, 300, doc_ids=ids.clone())


def test_a_program_that_fails_to_compile_inside_a_capture_is_tried_again_outside(monkeypatch):
    """Compiling inside a CUDA graph capture can fail where it works outside: the capture gets
    an error that says to build once before capturing, and the program is not given up."""
    fused = FusedProgram(monkeypatch, fail=True)
    attn = flexspec.compile("causal & doc")
    ids = torch.arange(300) // 100
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    with pytest.raises(BindingError, match=r"^flexspec could not compile this block mask's "
                       r"program inside a CUDA graph capture \(cannot trace\): its first build "
                       r"for these batch and head extents came during the capture. Run the step "
                       r"once outside the graph before capturing it \(a warm-up on a side "
                       r"stream, as torch.cuda.graphs asks\), or build the mask once with "
                       r"Attention.block_mask\(Q_LEN, KV_LEN, batch=..., device=..., "
                       r"<bindings>\)$"):
        attn.block_mask(300, 300, doc_ids=ids)
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: False)
    fused.fail = False
    assert_is_the_reference(attn.block_mask(300, 300, doc_ids=ids), attn, 300, 300,
                            doc_ids=ids, exact=False)
    assert len(fused.calls) == 2


# --- mutation testing of runtime/masks (after the runtime-contract refactor) -------------------


def test_a_mask_that_reads_an_inference_tensor_is_built_every_time(monkeypatch):
    # an inference tensor has no version counter: the cache could not see it change in place
    builds = Builds(monkeypatch, "build_block_mask")
    attn = flexspec.compile("causal & document")
    with torch.inference_mode():
        ids = doc_ids()
    assert ids.is_inference()
    first = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    second = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    assert second is not first and len(builds) == 2
    assert attn._calls.masks.cached_bytes() == 0 and not attn._calls.masks._probation
    for block_mask in (first, second):
        assert_is_the_reference(block_mask, attn, 100, 150, batch=2, doc_ids=ids)
    # ... and inside a capture it is refused like any eager build there
    monkeypatch.setattr(masks, "in_graph_memory", lambda device: True)
    with pytest.raises(BindingError, match="cannot build this block mask inside a CUDA graph"):
        attn.block_mask(100, 150, batch=2, doc_ids=ids)


def test_a_mask_built_inside_inference_mode_holds_no_inference_tensors():
    # the cache serves calls of every mode: a mask first asked for under inference_mode must
    # serve a later grad-mode call, whose backward may save its tables
    attn = flexspec.compile("causal & document")
    ids = doc_ids()
    with torch.inference_mode():
        block_mask = attn.block_mask(100, 150, batch=2, doc_ids=ids)
    tensors = [t for t in (block_mask.kv_num_blocks, block_mask.kv_indices,
                           block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                           block_mask.q_num_blocks, block_mask.q_indices) if t is not None]
    assert tensors and not any(t.is_inference() for t in tensors)


def test_a_bound_handle_finds_its_plan_s_entry_in_its_dialect():
    block_masks = MaskCache("exact", (16, 16))
    spec, cpu = spec_of("per_row"), torch.device("cpu")
    sizes = {"B": 2, "H": 1, "Q_LEN": 40, "KV_LEN": 50}
    bound = block_masks.bind(spec, sizes, cpu)
    assert bound.key == block_masks.key(spec, sizes, cpu)
    assert (bound.batch, bound.heads, bound.reads) == (2, 1, bound.key.reads)
    assert block_masks.bind(spec, sizes, torch.device("meta")).key != bound.key
    assert block_masks.bind(spec, sizes, cpu, "cute").key == \
        block_masks.key(spec, sizes, cpu, "cute") != bound.key
    values = {ir.tensor_key(t): doc_ids(((10,), (30,)), 50) for t in spec.tensors()}
    first = bound.get(values, cpu)
    assert block_masks.get(spec, sizes, values, cpu) is first  # one entry for both
    # a handle bound for FLASH builds FLASH's form of the mask_mod
    attn = flexspec.compile("natten(6, 5, 3, 3)", block_size=16)
    sizes = {"B": 1, "H": 1, "Q_LEN": 30, "KV_LEN": 30}
    flash = block_masks.bind(attn.ir, sizes, cpu, "cute").get({}, cpu)
    assert not {"clamp", "abs", "maximum", "minimum"} & _aten_ops(flash.mask_mod)
    assert_is_the_reference(flash, attn, 30, 30)


@pytest.mark.parametrize("text, q_len, kv_len", [("per_row", 1, 50), ("per_row", 3, 47),
                                                  ("both", 2, 64), ("causal", 20, 50)])
def test_a_mask_listing_every_tile_evaluates_its_mask_in_each_with_the_exact_form_s_tables(
        text, q_len, kv_len):
    """MaskCache.every_tile (what a decoding call with new bindings runs with where its keys
    are few): every tile of the grid listed as partial, so the mask_mod decides every cell,
    and that mask_mod is the reference's cell by cell; the tables have the exact partial
    form's extents, dtypes and layout (a kernel compiled for one runs the other) and are kept
    per grid while the mask_mod is each call's."""
    block_masks = MaskCache("exact", (16, 16))
    attn = compile_mask(text, block_size=16)
    spec, cpu = spec_of(text), torch.device("cpu")
    batch, heads = 2, 3
    sizes = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
    bound = block_masks.bind(spec, sizes, cpu, partial=True)
    generator = torch.Generator().manual_seed(q_len)

    def bindings():
        found = {}
        if "r" in attn.bindings:
            found["r"] = torch.randint(0, 4, (batch, kv_len), generator=generator)
        if "f" in attn.bindings:
            found["f"] = torch.rand(heads, generator=generator) < 0.5
        return found
    keys = {t.name: ir.tensor_key(t) for t in spec.tensors()}
    first, second = bindings(), bindings()
    every = bound.every_tile({keys[n]: t for n, t in first.items()}, cpu)
    exact = bound.get({keys[n]: t for n, t in first.items()}, cpu)
    nq, nk = -(-q_len // 16), -(-kv_len // 16)
    assert tile_classes(every).tolist() == torch.full(
        (bound.batch, bound.heads, nq, nk), PARTIAL).tolist()
    for mine, theirs in zip(tables(every), tables(exact)):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert (mine.shape, mine.dtype, mine.stride()) == \
                (theirs.shape, theirs.dtype, theirs.stride())
    for given, block_mask in ((first, every), (second, bound.every_tile(
            {keys[n]: t for n, t in second.items()}, cpu))):
        dense = attn.dense_mask(q_len, kv_len, batch=bound.batch, heads=bound.heads, **given)
        assert torch.equal(create_mask(block_mask.mask_mod, bound.batch, bound.heads, q_len,
                                       kv_len), dense)
    kept = bound.every_tile({keys[n]: t for n, t in second.items()}, cpu)
    assert kept.kv_indices is every.kv_indices and kept.kv_num_blocks is every.kv_num_blocks


def test_a_mask_is_compiled_for_captures_once_its_program_built_its_form(monkeypatch):
    """What a call listing every tile asks before it skips the exact mask: a capture after it
    must find the program compiled for the mask's form (partial or not), unless no program
    builds the mask (then a capture cannot build it at all)."""
    cpu = torch.device("cpu")
    block_masks = MaskCache("exact", (16, 16))
    spec = spec_of("per_row")
    sizes = {"B": 2, "H": 1, "Q_LEN": 1, "KV_LEN": 50}
    values = {ir.tensor_key(t): doc_ids(((10,), (30,)), 50) for t in spec.tensors()}
    partial, whole = (block_masks.bind(spec, sizes, cpu, partial=form) for form in (True, False))
    assert partial.compiled_for_captures(cpu)  # the CPU has no program
    FusedProgram(monkeypatch)
    assert not partial.compiled_for_captures(cpu) and not whole.compiled_for_captures(cpu)
    whole.get(values, cpu)
    assert whole.compiled_for_captures(cpu) and not partial.compiled_for_captures(cpu)
    partial.get(values, cpu)
    assert partial.compiled_for_captures(cpu)
    longer = block_masks.bind(spec, {**sizes, "KV_LEN": 70}, cpu, partial=True)
    assert longer.compiled_for_captures(cpu)  # compiled for any length


def test_the_fused_program_s_first_build_of_a_mask_is_logged_and_no_other(monkeypatch, caplog):
    import logging
    FusedProgram(monkeypatch)
    attn = flexspec.compile("causal & doc")
    with caplog.at_level(logging.INFO, logger="flexspec"):
        for step in range(3):  # fresh doc_ids every step: three builds of one program
            attn.block_mask(300, 300, doc_ids=torch.arange(300) * (step + 2) // 300)
        other = compile_mask("per_row", block_size=16)
        other.block_mask(40, 50, batch=2, r=doc_ids(((10,), (30,)), 50))
    starts = [r.getMessage() for r in caplog.records if r.getMessage().endswith("...")]
    assert starts == [
        "building the block-mask program of '" + ir.to_text(attn.ir.mask) + "' (its first "
        "build compiles) (may take seconds)...",
        "building the block-mask program of '" + ir.to_text(other.ir.mask) + "' (its first "
        "build compiles) (may take seconds)..."]


# --- mutation testing of runtime/masks (2026-12-03: the decoding kernel's partial-only masks) --


@pytest.mark.parametrize("dialect", ["torch", "cute"])
def test_a_partial_only_handle_lists_every_visible_tile_as_partial_cached_apart(dialect):
    # FlexAttention's decoding kernel gets block masks without full tiles (MaskKey.partial): the
    # same mask, every tile with a visible cell listed as partial, kv side only
    block_masks = MaskCache("exact", (16, 16))
    spec, cpu = spec_of("per_row"), torch.device("cpu")
    attn = compile_mask("per_row", block_size=16)
    sizes = {"B": 2, "H": 1, "Q_LEN": 40, "KV_LEN": 50}
    r = doc_ids(((20,), (30,)), 50)
    values = {ir.tensor_key(t): r for t in spec.tensors()}
    bound = block_masks.bind(spec, sizes, cpu, dialect)
    assert bound.device == cpu
    partial = bound.partial_only()
    assert partial.device == cpu and partial.spec is spec and partial.sizes is sizes
    assert partial.key == block_masks.key(spec, sizes, cpu, dialect, partial=True)
    assert partial.key.partial is True and partial.key.dialect == dialect
    assert (partial.key.batch, partial.key.heads, partial.key.reads) == \
        (bound.key.batch, bound.key.heads, bound.key.reads)
    assert partial.key.token != bound.key.token
    # the partial form of a handle bound on another device is another mask
    assert block_masks.bind(spec, sizes, torch.device("meta"), dialect).partial_only().key \
        != partial.key
    full = bound.get(values, cpu)
    listed = partial.get(values, cpu)
    assert listed is not full
    dense = attn.dense_mask(40, 50, batch=2, r=r)
    expected = reference_classes(dense, (16, 16))
    assert (expected == FULL).any()  # something to list as partial
    assert torch.equal(tile_classes(full), expected)
    assert listed.full_kv_num_blocks is None and listed.q_num_blocks is None
    assert torch.equal(tile_classes(listed), torch.where(expected == FULL, PARTIAL, expected))
    assert torch.equal(create_mask(listed.mask_mod, 2, 1, 40, 50), dense)
    # cached apart from the full form: asked for again, each handle finds its own
    assert partial.get(values, cpu) is listed and bound.get(values, cpu) is full
    assert block_masks.get(spec, sizes, values, cpu, partial.key) is listed


def test_the_tables_listing_every_tile_are_kept_per_count_of_key_tiles():
    """MaskCache.every_tile keeps its tables per grid: one cache asked at two key lengths with
    the same query rows (16 and 70 keys in tiles of 16: one and five key tiles) lists each
    length's own tiles. Kept without the count of key tiles, the second length would read the
    first one's tables and leave keys out."""
    cpu = torch.device("cpu")
    block_masks = MaskCache("exact", (16, 16))
    spec = spec_of("causal")
    for kv_len, tiles in ((16, 1), (70, 5), (16, 1)):
        sizes = {"B": 1, "H": 1, "Q_LEN": 3, "KV_LEN": kv_len}
        every = block_masks.bind(spec, sizes, cpu, partial=True).every_tile({}, cpu)
        assert every.kv_num_blocks.flatten().tolist() == [tiles]
        assert every.kv_indices.shape[-1] == tiles
        assert every.kv_indices[0, 0, 0, :tiles].tolist() == list(range(tiles))
