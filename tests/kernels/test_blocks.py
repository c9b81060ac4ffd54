"""Block masks from interval analysis (flexspec.kernels.blocks) against the reference and torch.

* the interval classes alone (``classify``) are sound against the reference dense mask;
* the refined classes (``refine``) are exact, and the BlockMask built from them has the same
  tables as torch's ``create_block_mask`` (same mask_mod, same B/H extents), q-side tables and
  ``to_dense()`` included;
* the interval-only BlockMask (``exact=False``) is a superset of torch's, with truly full FULL
  blocks;
* attention with any of these block masks gives the reference result. Eager ``flex_attention``
  (the unfused path) evaluates ``mask_mod`` on every position and never reads the block tables,
  so it is run as asked but cannot tell a wrong table from a right one; a float64 emulation of
  the block-sparse kernel here (FULL tiles without ``mask_mod``, PARTIAL tiles with it, every
  other tile skipped) is what checks that the tables give the right attention;
* ``ordered`` is a stable descending argsort; lookups with index expressions other than ``q``
  or ``kv`` (the sparse-table path) are exact too; the runtime builds block masks this way;
* ``index_tables``' eight tables list what the classes hold, row by row and (against the
  transposed classes) column by column, on every path: the rank path, the run path with columns
  that are runs and with columns that need the transposed copy, the sort of small matrices.

Random specs come from :mod:`flexspec.testing` (the registry) and from ``LIBRARY`` below
(head-dependent masks and lookups through index expressions), with lengths that are not multiples
of the block size, ``Q_LEN != KV_LEN``, per-batch and per-head bindings.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

import flexspec
from flexspec import ir
from flexspec.kernels import block_tables, blocks
from flexspec.kernels.block_tables import (EMPTY, FULL, PARTIAL, from_tables, ordered, sorted_rows,
                                          tile_classes, to_block_mask)
from flexspec.kernels.blocks import build_block_mask, classify, refine
from flexspec.lang.library import load_text
from flexspec.kernels.reference import dense_scores
from flexspec.testing import KINDS, Shape, bindings, lookups_fit, slow_examples, spec_texts

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

CPU = torch.device("cpu")
BLOCKS = ((128, 128), (64, 64), (256, 128), (64, 128), (16, 32), (32, 16))

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=slow_examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Masks the registry lacks: head-dependent, and lookups through index expressions other than a
# bare q or kv (the sparse-table path of flexspec.kernels.blocks), per batch and per head. `parity` is
# always true, which intervals cannot prove: tiles are decided by evaluating their cells.
LIBRARY = load_text("""
mask by_head = kv <= q + h
mask shifted(ids: int[KV_LEN]) = ids[q // 2] == ids[kv // 2]
mask clamped(t: int[20]) = t[clamp(kv - q + 10, 0, 19)] > 0
mask mirrored(r: int[B, KV_LEN]) = r[b, KV_LEN - 1 - kv] <= r[b, min(q, KV_LEN - 1)]
mask head_flags(f: bool[H, KV_LEN]) = f[h, kv // 3] | q >= kv
mask thirds(pid: int[B, KV_LEN]) = pid[b, q // 3] == pid[b, (kv + 1) // 3]
mask head_window(w: int[H]) = abs(q - kv) <= w[h] & kv // 7 != (q + h) % 5
mask parity = (q + kv) % 2 == 0 | (q + kv) % 2 == 1
""", "test_blocks.attn")
LIBRARY_MASKS = tuple(LIBRARY.definitions)
MASK_NAMES = tuple(p.name for p in flexspec.patterns() if p.kind == "mask")
SCORE_NAMES = tuple(p.name for p in flexspec.patterns() if p.kind == "score")


# ---------------------------------------------------------------------------------------------
# Cases


class Case:
    """A compiled spec with a shape and bindings, and what every check needs from them."""

    def __init__(self, spec, shape: Shape, values: dict, block=(128, 128)):
        self.spec, self.shape, self.bindings, self.block = spec, shape, values, tuple(block)
        self.attn = flexspec.compile(spec, library=LIBRARY)
        self.sizes = shape.sizes
        # where the queries stand (an end-aligned spec reads a q_offset tensor)
        placed = self.attn._placement.bindings(values, None, None, shape.sizes, CPU)
        self.values, self.ir = self.attn._tensors(self.sizes, placed, CPU)
        free = ir.free_vars(self.ir.mask)
        self.batch = shape.B if "b" in free else 1
        self.heads = shape.Hq if "h" in free else 1
        self._dense = self._truth = None

    def __repr__(self):
        return (f"Case({str(self.spec)!r}, {self.shape}, block={self.block}, "
                f"bindings={ {k: list(v.shape) for k, v in self.bindings.items()} })")

    def mods(self):
        return self.attn.mods(q_len=self.shape.Q_LEN, kv_len=self.shape.KV_LEN,
                              batch=self.shape.B, heads=self.shape.Hq, **self.bindings)

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self._dense_mask()
        return self._dense

    def truth(self) -> tuple:
        """:func:`tile_truth` of the reference mask."""
        if self._truth is None:
            self._truth = tile_truth(self.dense(), self.block)
        return self._truth

    def _dense_mask(self) -> torch.Tensor:
        mask = self.attn.dense_mask(self.shape.Q_LEN, self.shape.KV_LEN, batch=self.shape.B,
                                    heads=self.shape.Hq, **self.bindings)
        # the runtime may read b where the reference needs not: an int q_offset is one entry
        # per batch row (for FLASH), equal in every row
        assert mask.shape[0] in (1, self.batch) and mask.shape[1] in (1, self.heads)
        assert mask.shape[2:] == (self.shape.Q_LEN, self.shape.KV_LEN)
        return mask.expand(self.batch, self.heads, -1, -1)

    def classes(self) -> torch.Tensor:
        return classify(self.ir.mask, self.sizes, self.block, self.values, CPU,
                        batch=self.batch, heads=self.heads)

    def ours(self, exact=True):
        mask_mod, _ = self.mods()
        return build_block_mask(self.ir.mask, self.sizes, self.block, self.values, CPU,
                                batch=self.batch, heads=self.heads, mask_mod=mask_mod,
                                exact=exact)

    def torch_block_mask(self):
        mask_mod, _ = self.mods()
        return create_block_mask(mask_mod or noop_mask, self.batch, self.heads, self.shape.Q_LEN,
                                 self.shape.KV_LEN, device="cpu", BLOCK_SIZE=self.block)


def tile_truth(dense: torch.Tensor, block) -> tuple:
    """Per tile of a ``[b, h, Q_LEN, KV_LEN]`` mask: (some pair visible, every pair inside the
    sequence visible, every pair visible with padding counting as hidden)."""
    bq, bkv = block
    batch, heads, q_len, kv_len = dense.shape
    nq, nk = -(-q_len // bq), -(-kv_len // bkv)
    padded = torch.zeros(batch, heads, nq * bq, nk * bkv, dtype=torch.bool)
    padded[..., :q_len, :kv_len] = dense
    visible = padded.reshape(batch, heads, nq, bq, nk, bkv).sum(dim=(3, 5))
    rows = (torch.arange(nq * bq) < q_len).reshape(nq, bq).sum(1)
    columns = (torch.arange(nk * bkv) < kv_len).reshape(nk, bkv).sum(1)
    return visible > 0, visible == rows[:, None] * columns[None, :], visible == bq * bkv


def exact_classes(case: Case) -> torch.Tensor:
    """Tile classes as create_block_mask defines them (a tile with padding is never FULL)."""
    any_visible, _, all_visible = case.truth()
    classes = torch.full(any_visible.shape, PARTIAL, dtype=torch.int8)
    classes[~any_visible] = EMPTY
    classes[all_visible] = FULL
    return classes


def table_dense(num: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """The bool matrix ``[..., rows, columns]`` listed by a (num_blocks, indices) table."""
    listed = torch.arange(indices.shape[-1]) < num.unsqueeze(-1)
    dense = torch.zeros(indices.shape[:-1] + (columns + 1,), dtype=torch.bool)
    # entries past num go to a spare column, dropped below
    dense.scatter_(-1, torch.where(listed, indices.long(), columns), True)
    return dense[..., :columns]


TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def assert_same_block_mask(ours, theirs, context=""):
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE), context
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths), context
    for name in TABLES:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{context} {name}: {a.shape} {b.shape}"
    for counts, indices in (("kv_num_blocks", "kv_indices"),
                            ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        num = getattr(ours, counts)
        assert torch.equal(num, getattr(theirs, counts)), f"{context} {counts}"
        # the listed entries agree in order; past them each table holds unread filler
        listed = torch.arange(getattr(ours, indices).shape[-1]) < num.unsqueeze(-1)
        mine, torch_s = getattr(ours, indices), getattr(theirs, indices)
        assert torch.equal(torch.where(listed, mine, -1), torch.where(listed, torch_s, -1)), \
            f"{context} {indices}:\n{mine}\n{torch_s}"
    assert torch.equal(ours.to_dense(), theirs.to_dense()), context


def block_sets(block_mask, nq, nk) -> tuple:
    """(partial, full) tile sets of a BlockMask as bool ``[b, h, NQ, NK]``."""
    partial = table_dense(block_mask.kv_num_blocks, block_mask.kv_indices, nk)
    full = table_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
    return partial[..., :nq, :], full[..., :nq, :]


# ---------------------------------------------------------------------------------------------
# Strategies


@st.composite
def mixed_texts(draw, max_masks=2, max_scores=0, kinds=("static", "binding")):
    """A registry mask expression, sometimes combined with one of LIBRARY's masks by ``& | ~``,
    then up to ``max_scores`` registry score modifiers."""
    # spec_texts(max_scores=0) may still draw a lone score modifier: pick by names instead
    text = draw(spec_texts(max_masks=max_masks, max_scores=0, kinds=kinds, names=MASK_NAMES))
    if draw(st.integers(0, 2)):
        extra = draw(st.sampled_from(LIBRARY_MASKS))
        if draw(st.integers(0, 3)) == 0:
            extra = f"~{extra}"
        text = f"({text}) {draw(st.sampled_from('&|'))} {extra}"
    if max_scores and draw(st.booleans()):
        text += " + " + draw(spec_texts(max_masks=0, max_scores=max_scores, kinds=kinds,
                                        names=SCORE_NAMES))
    return text


def _length(max_len):
    """Lengths over the whole range (and near block edges) more than tiny ones."""
    edges = [n for n in (1, 15, 17, 63, 65, 127, 129, 255, 257, 383, 385, 511, 513)
             if n <= max_len]
    return st.one_of(st.integers(1, max_len), st.integers(max_len // 3, max_len),
                     st.sampled_from(edges))


@st.composite
def fitting_shapes(draw, spec, max_len):
    """Like flexspec.testing.shapes, with longer sequences (many tiles per row); when a lookup
    does not fit (doc_ids[b, q] needs Q_LEN <= KV_LEN), the lengths are swapped."""
    kv_heads = draw(st.integers(1, 2))
    kv_len = draw(_length(max_len))
    q_len = kv_len if draw(st.integers(0, 3)) == 0 else draw(_length(max_len))
    shape = Shape(draw(st.integers(1, 3)), kv_heads * draw(st.integers(1, 2)), kv_heads,
                  q_len, kv_len, 16)
    if not lookups_fit(spec, shape, exact=False):
        shape = shape._replace(Q_LEN=min(q_len, kv_len), KV_LEN=max(q_len, kv_len))
    # exact=False: what the runtime checks before a call
    assume(lookups_fit(spec, shape, exact=False))
    return shape


@st.composite
def cases(draw, max_len=300, blocks=BLOCKS, **text_options):
    text = draw(mixed_texts(**text_options))
    spec = flexspec.parse(text, library=LIBRARY)
    shape = draw(fitting_shapes(spec, max_len))
    values = draw(bindings(spec, shape))
    return Case(spec, shape, values, draw(st.sampled_from(blocks)))


def doc_case(block=(128, 128), *, q_len=250, kv_len=300, spec="causal & doc") -> Case:
    """Per-batch document ids with different boundaries in each row."""
    ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50,
                        [0] * 30 + [1] * 200 + [2] * 40 + [3] * 30,
                        [0] * 300])[:, :kv_len]
    shape = Shape(3, 4, 2, q_len, kv_len, 16)
    return Case(flexspec.parse(spec), shape, {"doc_ids": ids}, block)


def head_case(block=(128, 128), *, q_len=300, kv_len=200) -> Case:
    spec = flexspec.parse("causal & window(2) | by_head", library=LIBRARY)
    return Case(spec, Shape(2, 4, 2, q_len, kv_len, 16), {}, block)


FIXED = [
    pytest.param(lambda block: doc_case(block), id="doc-per-batch"),
    pytest.param(lambda block: doc_case(block, spec="causal & ~doc | sink(5)"), id="not-doc"),
    pytest.param(lambda block: head_case(block), id="by-head"),
    pytest.param(lambda block: Case(flexspec.parse("sliding_window(40) | prefix(3)"),
                                    Shape(1, 1, 1, 383, 257, 16), {}, block), id="sliding"),
    pytest.param(lambda block: Case(flexspec.parse("chunked(50) & ~strided(3)"),
                                    Shape(1, 1, 1, 129, 385, 16), {}, block), id="chunked"),
    pytest.param(lambda block: Case(flexspec.parse("causal_bottom_right & dilated(90, 2)"),
                                    Shape(1, 1, 1, 100, 300, 16), {}, block), id="bottom-right"),
    # FULL tiles that only the cell-by-cell evaluation finds, next to ragged ones
    pytest.param(lambda block: Case(flexspec.parse("parity", library=LIBRARY),
                                    Shape(1, 1, 1, 256, 300, 16), {}, block), id="parity"),
    # sub-tiles proven FULL by causal beside undecided ones, in tiles that are all visible
    pytest.param(lambda block: Case(flexspec.parse("causal | parity", library=LIBRARY),
                                    Shape(1, 1, 1, 256, 256, 16), {}, block), id="causal-parity"),
]


# ---------------------------------------------------------------------------------------------
# Soundness of the interval classes


def check_classes_sound(case: Case) -> None:
    classes = case.classes()
    nq = -(-case.shape.Q_LEN // case.block[0])
    nk = -(-case.shape.KV_LEN // case.block[1])
    assert classes.shape == (case.batch, case.heads, nq, nk)
    assert classes.dtype == torch.int8  # as the block tables' builder takes them
    any_visible, all_inside, _ = case.truth()
    assert not ((classes == EMPTY) & any_visible).any(), f"{case}: an EMPTY tile has a visible pair"
    assert not ((classes == FULL) & ~all_inside).any(), f"{case}: a FULL tile has a hidden pair"


def check_refine_exact(case: Case) -> None:
    refined = refine(case.classes(), case.ir.mask, case.sizes, case.block, case.values, CPU)
    expected = exact_classes(case)
    assert torch.equal(refined, expected), f"{case}:\n{refined}\n{expected}"


@FAST
@given(cases())
def test_interval_classes_are_sound(case):
    check_classes_sound(case)


@FAST
@given(cases())
def test_refined_classes_are_exact(case):
    check_refine_exact(case)


# each fixed case with two block sizes; together they cover every size of BLOCKS
FIXED_BLOCKS = [(0, (128, 128)), (0, (64, 128)), (1, (64, 64)), (2, (256, 128)),
                (2, (16, 32)), (3, (32, 16)), (4, (64, 128)), (5, (64, 64)),
                (6, (128, 128)), (7, (64, 64)), (7, (256, 128))]


@pytest.mark.parametrize("make, block", [
    pytest.param(FIXED[i].values[0], block, id=f"{FIXED[i].id}-{block[0]}x{block[1]}")
    for i, block in FIXED_BLOCKS])
def test_fixed_cases(make, block):
    case = make(block)
    check_classes_sound(case)
    check_refine_exact(case)
    check_against_torch(case)


@pytest.mark.parametrize("make, block", [
    pytest.param(FIXED[i].values[0], block, id=f"{FIXED[i].id}-{block[0]}x{block[1]}")
    for i, block in [(0, (24, 24)), (3, (24, 24)), (3, (8, 8)), (6, (100, 100)),
                     (6, (48, 80)), (7, (8, 8)), (3, (24, 32)), (3, (17, 32)),
                     (3, (32, 24))]])
def test_block_sizes_that_are_not_multiples_of_16(make, block):
    """build_block_mask takes any block size (the runtime asks for multiples of 16); the 16 x 16
    sub-tile pass of refine only applies where sub-tiles tile the block."""
    case = make(block)
    check_classes_sound(case)
    check_refine_exact(case)
    check_against_torch(case)


def test_per_batch_and_per_head_masks_get_their_own_rows():
    case = doc_case()
    assert (case.batch, case.heads) == (3, 1)
    classes = case.classes()
    assert not torch.equal(classes[0], classes[2])  # batch 2 holds one document: causal
    case = head_case()
    assert (case.batch, case.heads) == (1, 4)
    classes = refine(case.classes(), case.ir.mask, case.sizes, case.block, case.values, CPU)
    assert not torch.equal(classes[:, 0], classes[:, 3])
    # a [KV_LEN] doc_ids is shared by every batch: no b in the mask, one row of tiles
    ids = torch.tensor([0] * 100 + [1] * 200)
    case = Case(flexspec.parse("causal & doc"), Shape(3, 2, 2, 300, 300, 16), {"doc_ids": ids})
    assert (case.batch, case.heads) == (1, 1)
    check_refine_exact(case)


def test_classify_finds_full_empty_and_partial_tiles():
    case = Case(flexspec.parse("causal"), Shape(1, 1, 1, 512, 512, 16), {})
    classes = case.classes()[0, 0]
    assert torch.equal(classes.diagonal(), torch.full((4,), PARTIAL, dtype=torch.int8))
    assert (classes.tril(-1)[classes.tril(-1) != 0] == FULL).all()
    assert (classes.triu(1) == EMPTY).all()
    assert int((classes == FULL).sum()) == 6


# ---------------------------------------------------------------------------------------------
# Equality with create_block_mask


def check_against_torch(case: Case) -> None:
    """Exact block mask == create_block_mask's; the interval-only one is a superset of it."""
    theirs = case.torch_block_mask()
    assert_same_block_mask(case.ours(), theirs, repr(case))
    check_interval_superset(case, theirs)


@FEW
@given(cases(max_len=260))
def test_exact_block_mask_equals_create_block_mask(case):
    check_against_torch(case)


@pytest.mark.parametrize("mask, bindings", [
    ("shifted", {"ids": torch.tensor([0] * 40 + [1] * 70 + [2] * 90)}),
    ("clamped", {"t": torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0])}),
    ("clamped | causal", {"t": torch.tensor([0] * 9 + [1] + [0] * 10)}),
    ("mirrored", {"r": torch.randint(0, 4, (2, 200), generator=torch.Generator().manual_seed(1))}),
    ("head_flags", {"f": torch.rand(3, 200, generator=torch.Generator().manual_seed(2)) < 0.02}),
    ("thirds & causal", {"pid": torch.tensor([[0] * 60 + [1] * 140, [0] * 150 + [1] * 50])}),
    ("head_window", {"w": torch.tensor([0, 3, 17])}),
], ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("block", [(128, 128), (16, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_index_expression_lookups(mask, bindings, block):
    spec = flexspec.parse(mask, library=LIBRARY)
    case = Case(spec, Shape(2, 3, 3, 190, 200, 16), bindings, block)
    check_classes_sound(case)
    check_refine_exact(case)
    check_against_torch(case)


# ---------------------------------------------------------------------------------------------
# Interval-only block masks


def check_interval_superset(case: Case, reference=None) -> None:
    """Every block of ``reference`` (create_block_mask's; by default the exact classes of the
    dense reference mask, which the tests above show to be the same) is listed, and the FULL
    blocks are truly full."""
    nq = -(-case.shape.Q_LEN // case.block[0])
    nk = -(-case.shape.KV_LEN // case.block[1])
    loose_partial, loose_full = block_sets(case.ours(exact=False), nq, nk)
    if reference is None:
        reference = to_block_mask(exact_classes(case), case.sizes, case.block)
    partial, full = block_sets(reference, nq, nk)
    assert not (loose_partial & loose_full).any()
    listed = loose_partial | loose_full
    assert not ((partial | full) & ~listed).any(), f"{case}: a needed block is missing"
    _, _, all_visible = case.truth()
    assert not (loose_full & ~all_visible).any(), f"{case}: a FULL block has masked pairs"
    # a FULL block of create_block_mask may stay PARTIAL here, never the other way round
    assert not (loose_full & ~full).any()


@FAST
@given(cases())
def test_interval_block_mask_is_a_superset(case):
    check_interval_superset(case)


# ---------------------------------------------------------------------------------------------
# Attention outputs


def block_sparse_attention(case: Case, block_mask, q, k, v) -> torch.Tensor:
    """What the fused kernel computes from the tables, in float64: FULL tiles without the mask,
    PARTIAL tiles with it, every other tile skipped; a row with nothing visible gives zeros."""
    shape = case.shape
    group = shape.Hq // shape.Hkv
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    logits = q.double() @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = dense_scores(case.ir, logits, case.values)
    bq, bkv = block_mask.BLOCK_SIZE
    nq, nk = -(-shape.Q_LEN // bq), -(-shape.KV_LEN // bkv)
    partial, full = block_sets(block_mask, nq, nk)
    grow = lambda t: t.repeat_interleave(bq, -2).repeat_interleave(bkv, -1)[  # noqa: E731
        ..., :shape.Q_LEN, :shape.KV_LEN]
    visible = grow(full) | (grow(partial) & case.dense())
    scores = torch.where(visible, scores, -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(row_max), row_max, 0.0))
    total = weights.sum(-1, keepdim=True)
    return ((weights / torch.where(total > 0, total, 1.0)) @ v64).to(q.dtype)


def check_attention(case: Case, seed: int, *, eager: bool) -> None:
    q, k, v = case.shape.qkv(seed)
    expected = case.attn.reference(q, k, v, **case.bindings)
    masks = {"exact": case.ours(), "intervals": case.ours(exact=False),
             "create_block_mask": case.torch_block_mask()}
    for name, block_mask in masks.items():
        got = block_sparse_attention(case, block_mask, q, k, v)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{case} {name} (block-sparse): {m}")
    if not eager:
        return
    _, score_mod = case.mods()
    outputs = {name: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=case.shape.Hq != case.shape.Hkv)
               for name, block_mask in masks.items()}
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["create_block_mask"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{case} {name} vs create_block_mask: {m}")
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{case} {name} vs reference: {m}")


@FEW
@given(cases(max_len=200, max_scores=1, kinds=KINDS), st.integers(0, 2**31 - 1))
def test_block_sparse_attention_matches_the_reference(case, seed):
    check_attention(case, seed, eager=False)


# Eager flex_attention traces each new score_mod (1-2 s per spec here): a few fixed cases.
@pytest.mark.parametrize("make", [
    pytest.param(lambda: doc_case((64, 64), q_len=200, kv_len=230), id="doc"),
    pytest.param(lambda: Case(flexspec.parse("shifted | by_head + softcap(5.0)",
                                             library=LIBRARY),
                              Shape(1, 2, 1, 130, 100, 16),
                              {"ids": torch.tensor([0] * 30 + [1] * 70)}, (64, 64)), id="lookups"),
])
def test_eager_flex_attention_is_the_same_with_every_block_mask(make):
    check_attention(make(), 0, eager=True)


@pytest.mark.slow
@FEW
@given(cases(max_len=200, max_scores=1, kinds=KINDS), st.integers(0, 2**31 - 1))
def test_eager_flex_attention_sweep(case, seed):
    check_attention(case, seed, eager=True)


def test_block_sparse_emulation_sees_a_wrong_table():
    """The emulation reads the tables: a FULL tile that is not full changes the result."""
    case = Case(flexspec.parse("causal"), Shape(1, 1, 1, 256, 256, 16), {})
    classes = exact_classes(case)
    classes[..., 0, 0] = FULL  # the diagonal tile, which is only half visible
    wrong = to_block_mask(classes, case.sizes, case.block)
    q, k, v = case.shape.qkv(0)
    got = block_sparse_attention(case, wrong, q, k, v)
    assert not torch.allclose(got, case.attn.reference(q, k, v), atol=1e-3)


def test_nan_rows_are_not_full():
    library = load_text("mask nan_rows = sqrt(q - 2) < 100.0\n", "nan.attn")
    case = Case(flexspec.parse("nan_rows", library=library), Shape(1, 1, 1, 256, 256, 16), {})
    assert case.dense()[0, 0, :2].sum() == 0  # rows 0 and 1 see nothing: NaN < 100.0 is false
    check_classes_sound(case)



# Found by mutation testing (docs/testing.md): each of these tiles was misclassified by a one-line
# bug that the random cases did not reach.
EDGES = load_text("""
mask flagged(flags: int[KV_LEN]) = flags[kv // 3] > 0
mask zero_log = log(kv) * 0.0 <= 1.0
mask narrowed = where(q / 4 < 5.5, q / 4, 0.0) > 5.0
""", "edges.attn")


@pytest.mark.parametrize("block", [(16, 16), (16, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_a_single_flag_anywhere_keeps_its_tile(block):
    # flags[kv // 3] reads each tile's range of flags through the sparse table; one set flag
    # at the right end of a range (not a run of equal values) must keep its tile visible
    spec = flexspec.parse("flagged(flags)", library=EDGES)
    for at in range(0, 80 // 3 + 1):
        flags = torch.zeros(80, dtype=torch.int64)
        flags[at] = 1
        case = Case(spec, Shape(1, 1, 1, 16, 80, 16), {"flags": flags}, block)
        check_classes_sound(case)
        check_refine_exact(case)


@pytest.mark.parametrize("text, q_len", [("zero_log", 40), ("narrowed", 40)])
def test_nan_products_and_float_where_narrowing_keep_their_tiles(text, q_len):
    # log(0) * 0.0 is NaN (hidden) at kv = 0; q / 4 < 5.5 keeps q / 4 up to 5.25 at q = 21
    case = Case(flexspec.parse(text, library=EDGES), Shape(1, 1, 1, q_len, 40, 16), {}, (16, 16))
    assert 0 < case.dense().sum() < q_len * 40
    check_classes_sound(case)
    check_refine_exact(case)
    check_against_torch(case)


@pytest.mark.parametrize("block, kv_len", [((16, 32), 48), ((16, 32), 80), ((32, 16), 72),
                                           ((64, 128), 192)])
def test_a_ragged_last_column_of_unequal_blocks_is_never_full(block, kv_len):
    # KV_LEN = 16 mod 32 in blocks of (16, 32): the last kv column runs past the end, although
    # KV_LEN is a multiple of the q block; create_block_mask counts its padding as masked
    case = Case(flexspec.parse("causal"), Shape(1, 1, 1, 3 * kv_len, kv_len, 16), {}, block)
    check_refine_exact(case)
    check_against_torch(case)
    check_interval_superset(case)

# ---------------------------------------------------------------------------------------------
# ordered()


def test_the_compiled_cpu_kernel_reads_a_row_of_a_table_only_up_to_its_count(monkeypatch):
    # on the CPU the filler after a row's count is left unwritten (any int32): flexspec relies on
    # FlexAttention's compiled CPU kernel never reading it. Every filler entry is made block 0,
    # which a row that does not list it must not see: read as a FULL block, it would add keys
    # the window hides.
    def poisoned(index, sizes, block, mask_mod=None):
        index = list(index)
        for at in range(0, 8, 2):
            count, indices = index[at], index[at + 1]
            filler = torch.arange(indices.shape[-1]) >= count.unsqueeze(-1)
            index[at + 1] = indices.masked_fill(filler, 0)
        return from_tables(tuple(index), sizes, block, mask_mod)
    monkeypatch.setattr(block_tables, "from_tables", poisoned)
    attn = flexspec.compile("sliding_window(300)")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1000, 32, generator=gen) for _ in range(3))
    tables = attn.block_mask(1000, 1000)
    assert (tables.full_kv_indices == 0).sum() > tables.full_kv_num_blocks.numel()  # poisoned
    out = attn(q, k, v)
    want = attn.reference(q.double(), k.double(), v.double())
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-5


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40), st.integers(1, 40), st.floats(0.0, 1.0),
       st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_ordered_lists_true_columns_first(batch, rows, columns, density, sort, written, seed):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, rows, columns, generator=gen) < density
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_tables, "SORT_PATH_ENTRIES", 1 << 30 if sort else 0)
        if written:  # as on a GPU: the filler is written too
            patch.setattr(block_tables, "UNWRITTEN_FILLER_DEVICES", frozenset())
        count, indices = ordered(dense)
    if written or sort:
        assert ((indices >= 0) & (indices < columns)).all()  # filler: valid column numbers
    assert count.dtype == indices.dtype == torch.int32
    assert torch.equal(count, dense.sum(-1).to(torch.int32))
    # the first `count` entries: what a stable descending argsort (create_block_mask) lists
    expected = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    listed = torch.arange(columns) < count.unsqueeze(-1)
    assert torch.equal(torch.where(listed, indices, -1), torch.where(listed, expected, -1))
    assert count.is_contiguous() and indices.is_contiguous()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 40), st.booleans(),
       st.sampled_from(["run", "rank", "sort"]), st.integers(0, 2**31 - 1))
def test_ordered_run_rows_on_every_path(rows, columns, scatter, path, seed):
    # rows that are one run of columns (causal, window, document masks), some with extra True
    # entries (several runs), laid out by the run path (fraction 0), the rank path and the sort
    # path of small matrices
    gen = torch.Generator().manual_seed(seed)
    ends = torch.randint(0, columns + 1, (2, rows, 1), generator=gen)
    column = torch.arange(columns)
    dense = (column >= ends.min(0).values) & (column < ends.max(0).values)
    if scatter:
        dense |= torch.rand(rows, columns, generator=gen) < 0.1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_tables, "RUN_PATH_FRACTION", 0.0 if path == "run" else 1e9)
        patch.setattr(block_tables, "SORT_PATH_ENTRIES", 1 << 30 if path == "sort" else 0)
        count, indices = ordered(dense)
    expected = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    listed = column < count.unsqueeze(-1)
    assert torch.equal(count, dense.sum(-1).to(torch.int32))
    assert torch.equal(torch.where(listed, indices, -1), torch.where(listed, expected, -1))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.sampled_from([1, 7, 8, 64, 1016, 1024, 2048 + 8, 3 * 1016, 4100]),
       st.sampled_from([0.0, 0.05, 0.5, 1.0]), st.sampled_from(["plain", "sliced", "transposed"]),
       st.integers(0, 2**31 - 1))
def test_row_counts_equal_torchs_sum(rows, columns, density, layout, seed):
    """The word-at-a-time count against torch's own, at row lengths around the 127-word sums
    (1016 columns), all-True rows (every byte of a partial sum at its largest), views at an
    offset and transposed views (which take torch's sum)."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(rows + 1, columns, generator=gen) < density
    if layout == "sliced":
        dense = dense[1:]
    elif layout == "transposed":
        dense = dense.t()
    got = block_tables.row_counts(dense)
    assert got.dtype == torch.int32 and got.shape == dense.shape[:-1]
    assert torch.equal(got, dense.sum(-1).to(torch.int32))


@pytest.mark.parametrize("shape", [(2, 8, 5), (3, 16, 24), (2, 1, 3, 16)])
def test_row_counts_of_tensors_of_more_dimensions(shape):
    # rows are the last dimension, whatever the others (here a second one that is a multiple
    # of 8 while the last is not, and the reverse)
    dense = torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.5
    assert torch.equal(block_tables.row_counts(dense), dense.sum(-1).to(torch.int32))


def test_row_counts_of_a_view_at_an_unaligned_offset():
    # contiguous rows that start 9 bytes into their storage cannot be read as int64 words
    flat = torch.arange(9 + 3 * 16) % 3 == 0
    dense = flat[9:].view(3, 16)
    assert dense.is_contiguous() and dense.storage_offset() == 9
    assert torch.equal(block_tables.row_counts(dense), dense.sum(-1).to(torch.int32))


@pytest.mark.parametrize("columns", [1016, 1024, 2056, 8192])
def test_row_counts_of_rows_all_true(columns):
    # every byte of every partial sum at its largest (127 words of ones): a longer sum carries
    dense = torch.ones(3, columns, dtype=torch.bool)
    assert block_tables.row_counts(dense).tolist() == [columns] * 3


def test_ordered_edge_rows():
    count, indices = ordered(torch.tensor([[False, False, False], [True, True, True],
                                           [False, True, False]]))
    assert count.tolist() == [0, 3, 1]
    assert indices[1].tolist() == [0, 1, 2] and indices[2, 0] == 1


def lists(count: torch.Tensor, indices: torch.Tensor) -> list:
    """The listed entries of every row of a (count, indices) table, as Python lists."""
    flat_count = count.reshape(-1).tolist()
    return [row[:n] for row, n in zip(indices.reshape(-1, indices.shape[-1]).tolist(),
                                      flat_count)]


def true_columns(dense: torch.Tensor) -> list:
    """The True columns of every row of a bool tensor, in increasing order, by a Python loop."""
    return [[c for c, value in enumerate(row) if value]
            for row in dense.reshape(-1, dense.shape[-1]).tolist()]


def check_tables(classes: torch.Tensor, index: tuple) -> None:
    """index_tables' eight tables against the classes: the listed blocks of each kv-side row and
    of each q-side column (from the transposed classes), and the classes rebuilt from both sides
    (the filler after a row's count is any int32 on the CPU: see block_tables.ordered)."""
    *outer, nq, nk = classes.shape
    by_kv = classes.transpose(-2, -1)
    for k, (value, dense) in enumerate([(PARTIAL, classes), (FULL, classes),
                                        (PARTIAL, by_kv), (FULL, by_kv)]):
        count, indices = index[2 * k], index[2 * k + 1]
        rows, columns = dense.shape[-2:]
        assert count.dtype == indices.dtype == torch.int32
        assert count.shape == (*outer, rows) and indices.shape == (*outer, rows, columns)
        assert count.is_contiguous() and indices.is_contiguous()
        assert lists(count, indices) == true_columns(dense == value), k
    rebuilt = torch.zeros_like(classes)
    rebuilt[table_dense(index[0], index[1], nk)] = PARTIAL
    rebuilt[table_dense(index[2], index[3], nk)] = FULL
    assert torch.equal(rebuilt, classes)
    rebuilt = torch.zeros_like(by_kv)
    rebuilt[table_dense(index[4], index[5], nq)] = PARTIAL
    rebuilt[table_dense(index[6], index[7], nq)] = FULL
    assert torch.equal(rebuilt, by_kv)


@st.composite
def class_grids(draw):
    """int8 tile classes [B, H, NQ, NK]: random tiles, or FULL runs per row (monotone down the
    rows or not, some rows emptied) with PARTIAL tiles around or scattered."""
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    nq, nk = draw(st.integers(1, 24)), draw(st.sampled_from([1, 3, 8, 13, 16, 24, 40]))
    kind = draw(st.sampled_from(["random", "runs", "monotone", "monotone gaps"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (batch, heads, nq, 1)
    if kind == "random":
        return torch.randint(0, 3, (batch, heads, nq, nk), generator=gen).to(torch.int8)
    start = torch.randint(0, nk + 1, shape, generator=gen)
    stop = torch.randint(0, nk + 1, shape, generator=gen)
    start, stop = torch.minimum(start, stop), torch.maximum(start, stop)
    if kind != "runs":
        start, stop = start.sort(-2).values, stop.sort(-2).values
    column = torch.arange(nk)
    full = (column >= start) & (column < stop)
    if kind == "monotone gaps":
        full &= torch.rand(shape, generator=gen) < 0.7
    partial = ((column == start - 1) | (column == stop)) & (torch.rand(shape, generator=gen) < 0.8)
    partial |= torch.rand(batch, heads, nq, nk, generator=gen) < draw(st.sampled_from([0, 0.1]))
    return torch.where(full, FULL, torch.where(partial, PARTIAL, EMPTY)).to(torch.int8)


@settings(max_examples=150, deadline=None)
@given(class_grids(), st.sampled_from(["run", "rank", "sort", "default"]))
def test_index_tables_list_the_classes_on_every_path(classes, path):
    """Every path of index_tables (the run and rank paths of both sides, the transposed copy for
    columns that are not runs, the sort of small matrices) against the classes themselves."""
    with pytest.MonkeyPatch.context() as patch:
        if path != "default":
            patch.setattr(block_tables, "RUN_PATH_FRACTION", 0.0 if path == "run" else 1e9)
            patch.setattr(block_tables, "SORT_PATH_ENTRIES", 1 << 30 if path == "sort" else 0)
        index = block_tables.index_tables(classes)
        check_tables(classes, index)
        assert all(torch.equal(mine, theirs) for mine, theirs in
                   zip(index[0::2], block_tables.index_tables(classes, order=sorted_rows)[0::2]))


def causal_classes(rows: int, columns: int) -> torch.Tensor:
    """[1, 1, rows, columns] int8: the diagonal PARTIAL, FULL below it."""
    q, kv = torch.arange(rows).reshape(-1, 1), torch.arange(columns)
    return torch.where(q > kv, FULL, torch.where(q == kv, PARTIAL, EMPTY)).to(torch.int8)[None, None]


def test_index_tables_takes_the_paths_it_documents(monkeypatch):
    """Above SORT_PATH_ENTRIES, ordered's tables come from the two kv-side class matrices alone
    when their columns are runs, and the transposed copy is compared only for the others; up to
    it, and for sorted_rows (the compiled program, which must not synchronise), the
    transposed classes and one sort per row."""
    compared = []
    listed = block_tables._ordered
    monkeypatch.setattr(block_tables, "_ordered",
                        lambda dense, by_column: compared.append(tuple(dense.shape))
                        or listed(dense, by_column))
    classes = causal_classes(300, 400)
    check_tables(classes, block_tables.index_tables(classes))
    assert compared == [(1, 1, 300, 400)] * 2
    compared.clear()
    scattered = torch.randint(0, 3, (1, 1, 300, 400), generator=torch.Generator().manual_seed(1))
    check_tables(scattered.to(torch.int8), block_tables.index_tables(scattered.to(torch.int8)))
    assert (1, 1, 400, 300) in compared
    compared.clear()

    def refuse(*args, **kwargs):
        raise AssertionError("the run and rank paths were taken")

    monkeypatch.setattr(block_tables, "_ordered", refuse)
    check_tables(classes, block_tables.index_tables(classes, order=sorted_rows))
    small = causal_classes(256, 256)  # exactly SORT_PATH_ENTRIES tiles
    assert small.numel() == block_tables.SORT_PATH_ENTRIES
    check_tables(small, block_tables.index_tables(small))
    assert compared == []


def test_ordered_lists_rows_only(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("columns were listed")

    monkeypatch.setattr(block_tables, "_column_runs", refuse)
    dense = causal_classes(300, 300)[0, 0] == FULL
    count, indices = ordered(dense)
    assert lists(count, indices) == true_columns(dense)


def column_tables(dense: torch.Tensor):
    """_ordered's column side of ``dense`` on the run path (None where it needs the copy)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_tables, "RUN_PATH_FRACTION", 0.0)
        return block_tables._ordered(dense, by_column=True)[1]


def runs(spans: list, columns: int) -> torch.Tensor:
    """A bool matrix whose row i is True on columns spans[i][0] .. spans[i][1] - 1."""
    column = torch.arange(columns)
    return torch.stack([(column >= a) & (column < b) for a, b in spans])


@pytest.mark.parametrize("spans, columns", [
    ([(0, 1), (0, 2), (0, 3), (1, 4)], 8),            # causal-like, the last row moved on
    ([(0, 0), (0, 2), (0, 0), (3, 6), (4, 8), (0, 0)], 8),  # empty rows no column spans
    ([(2, 5)] * 3 + [(5, 8)], 16),                      # runs that touch
    ([(0, 0)] * 3, 8),                                  # no True entry at all
])
def test_columns_of_monotone_runs_are_runs(spans, columns):
    dense = runs(spans, columns)
    count, indices = column_tables(dense)
    assert lists(count, indices) == true_columns(dense.t())


@pytest.mark.parametrize("spans, columns", [
    ([(0, 4), (2, 3)], 8),                    # the last column decreases
    ([(2, 4), (0, 5)], 8),                    # the first column decreases
    ([(0, 3), (0, 0), (2, 6)], 8),            # column 2 on both sides of an empty row
    ([(0, 3), (0, 0), (0, 0), (2, 6)], 8),    # two empty rows
    ([(0, 8), (0, 0), (7, 8)], 8),            # only the last column spans the gap
])
def test_columns_of_other_runs_need_the_copy(spans, columns):
    dense = runs(spans, columns)
    assert column_tables(dense) is None
    # and index_tables still lists them, from the transposed copy
    classes = torch.where(dense, FULL, EMPTY).to(torch.int8)[None, None]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_tables, "RUN_PATH_FRACTION", 0.0)
        patch.setattr(block_tables, "SORT_PATH_ENTRIES", 0)
        check_tables(classes, block_tables.index_tables(classes))


def test_rows_of_several_runs_need_the_copy():
    dense = runs([(0, 2), (0, 3), (0, 4)], 8)
    dense[1, 6] = True
    assert column_tables(dense) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.sampled_from([1, 5, 8, 16, 24, 64]), st.sampled_from([0, 8, 3]),
       st.sampled_from([0.0, 0.02, 0.3, 1.0]), st.integers(0, 2**31 - 1))
def test_ends_and_nonzero_equal_torchs(rows, columns, offset, density, seed):
    """_ends and _nonzero (word by word where the rows read as words: contiguous, row length and
    storage offset multiples of 8) against an argmax per row and torch's nonzero."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.rand(offset + rows * columns, generator=gen) < density
    flat = storage[offset:].view(rows, columns)
    assert torch.equal(torch.stack(block_tables._nonzero(flat)),
                       torch.stack(flat.nonzero(as_tuple=True)))
    first, last = block_tables._ends(flat)
    column = torch.arange(columns)
    filled = flat.any(-1)
    assert torch.equal(first[filled], torch.where(flat, column, columns).min(-1).values[filled])
    assert torch.equal(last[filled], torch.where(flat, column, -1).max(-1).values[filled])
    for ends in (first, last):
        assert ((ends >= 0) & (ends < columns)).all()


@FEW
@given(cases(max_len=400), st.integers(2, 5))
def test_coarse_to_fine_classification(case, side):
    """Forced at small sizes: super-tiles of a few tiles, then the tiles inside the PARTIAL
    ones. Still sound, and exact after refinement."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blocks, "HIERARCHY_TILES", 1)
        patch.setattr(blocks, "COARSE_SIDE", side)
        check_classes_sound(case)
        check_refine_exact(case)


# ---------------------------------------------------------------------------------------------
# The runtime


def test_runtime_causal_block_mask_equals_create_block_mask():
    attn = flexspec.compile("causal")
    ours = attn.block_mask(1000, 1000)
    theirs = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 1000, 1000, device="cpu")
    assert_same_block_mask(ours, theirs, "causal 1000")
    dense = flexspec.compile("causal", block_masks="dense").block_mask(1000, 1000)
    assert_same_block_mask(dense, theirs, "causal 1000, dense")
    # for causal the intervals alone are exact already (ragged tiles are never FULL)
    loose = flexspec.compile("causal", block_masks="intervals").block_mask(1000, 1000)
    assert_same_block_mask(loose, theirs, "causal 1000, intervals")


@pytest.mark.parametrize("block_size", [128, (256, 128), (64, 128)], ids=str)
def test_runtime_modes_agree(block_size):
    ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 30 + [1] * 270])
    masks = {mode: flexspec.compile("causal & doc", block_size=block_size, block_masks=mode)
             .block_mask(250, 300, batch=2, doc_ids=ids)
             for mode in ("exact", "intervals", "dense")}
    assert_same_block_mask(masks["exact"], masks["dense"], f"{block_size}")
    assert masks["exact"].kv_num_blocks.shape[0] == 2  # one row per batch
    bq, bkv = masks["exact"].BLOCK_SIZE
    nq, nk = -(-250 // bq), -(-300 // bkv)
    loose, exact = block_sets(masks["intervals"], nq, nk), block_sets(masks["dense"], nq, nk)
    assert not ((exact[0] | exact[1]) & ~(loose[0] | loose[1])).any()


def test_runtime_uses_the_analysis_by_default(monkeypatch):
    from flexspec.runtime import masks

    def refuse(*args, **kwargs):
        raise AssertionError("create_block_mask was called")

    monkeypatch.setattr(masks, "create_block_mask", refuse)
    attn = flexspec.compile("causal & window(100)")
    assert attn.block_masks == "exact"
    attn.block_mask(700, 900)
    with pytest.raises(AssertionError):
        flexspec.compile("causal", block_masks="dense").block_mask(300, 300)


# ---------------------------------------------------------------------------------------------
# Sweeps


@pytest.mark.slow
@MANY
@given(cases(max_len=520))
def test_block_masks_sweep(case):
    check_classes_sound(case)
    check_refine_exact(case)
    check_against_torch(case)


@pytest.mark.slow
@MANY
@given(cases(max_len=300, max_scores=1, kinds=KINDS), st.integers(0, 2**31 - 1))
def test_block_sparse_attention_sweep(case, seed):
    check_attention(case, seed, eager=False)


@pytest.mark.parametrize("text, q_len, kv_len", [
    ("causal", 300, 300), ("causal & window(40)", 260, 200), ("full", 129, 257),
    ("~causal", 1, 130), ("causal & document", 333, 333),
])
def test_tile_classes_invert_the_tables(text, q_len, kv_len):
    attn = flexspec.compile(text, block_size=(32, 64))
    sizes = {"B": 2, "H": 1, "Q_LEN": q_len, "KV_LEN": kv_len}
    bindings = {"doc_ids": torch.arange(kv_len) // 50} if "document" in text else {}
    values, spec = attn._tensors(sizes, bindings, torch.device("cpu"), mask_only=True)
    classes = refine(classify(spec.mask, sizes, (32, 64), values, "cpu", batch=1, heads=1),
                     spec.mask, sizes, (32, 64), values, "cpu")
    block_mask = to_block_mask(classes, sizes, (32, 64))
    read_back = tile_classes(block_mask)
    # the same int8 tensor classify builds (torch.equal alone does not compare dtypes)
    assert read_back.dtype == torch.int8 and torch.equal(read_back, classes)


@pytest.mark.parametrize("text, q_len, kv_len", [
    ("causal", 300, 300), ("causal & window(200)", 64, 700), ("full", 129, 257),
    ("causal & (window(300) | sink(4))", 64, 1000), ("causal & document", 333, 333),
])
def test_as_partial_lists_every_tile_as_partial_in_order(text, q_len, kv_len):
    """FlexAttention's decoding kernel splits a row's listed tiles evenly among its splits only
    when no tile is full: as_partial lists the full tiles as partial, in increasing order, the
    filler after them the last column, and no full or q-side tables (forward only)."""
    attn = flexspec.compile(text, block_size=(32, 64))
    bindings = {"doc_ids": torch.arange(kv_len) // 150} if "document" in text else {}
    block_mask = attn.block_mask(q_len, kv_len, batch=2, q_offset=kv_len - q_len, **bindings)
    classes = tile_classes(block_mask)
    assert (classes == FULL).any()  # something to list
    partial = block_tables.as_partial(block_mask)
    assert partial.full_kv_num_blocks is None and partial.full_kv_indices is None
    assert partial.q_num_blocks is None and partial.full_q_num_blocks is None
    assert partial.seq_lengths == block_mask.seq_lengths and partial.BLOCK_SIZE == (32, 64)
    assert partial.mask_mod is block_mask.mask_mod
    expected = torch.where(classes == FULL, PARTIAL, classes).to(torch.int8)
    assert torch.equal(tile_classes(partial), expected)
    count, columns = partial.kv_num_blocks, partial.kv_indices
    assert count.dtype == columns.dtype == torch.int32
    n = columns.shape[-1]
    listed = torch.arange(n) < count.unsqueeze(-1)
    want = torch.where(expected != EMPTY, torch.arange(n), n).sort(-1).values.clamp(max=n - 1)
    assert torch.equal(torch.where(listed, columns, n - 1), want.to(torch.int32))
    assert torch.equal(columns[~listed], torch.full_like(columns[~listed], n - 1))
    assert block_tables.as_partial(partial) is partial  # nothing full to list


# ---------------------------------------------------------------------------------------------
# Counting visible pairs, sub-tiles, super-tiles and lookups, each against its own definition


def evaluated_cells(monkeypatch) -> list:
    """Records the number of tiles whose cells ``refine`` evaluates (calls of _count_cells)."""
    calls = []
    count_cells = blocks._count_cells

    def counting(coords, *args):
        calls.append(coords.shape[0])
        return count_cells(coords, *args)

    monkeypatch.setattr(blocks, "_count_cells", counting)
    return calls


@pytest.mark.parametrize("make, block", [
    pytest.param(FIXED[i].values[0], block, id=f"{FIXED[i].id}-{block[0]}x{block[1]}")
    for i in (0, 2, 3) for block in ((128, 128), (16, 32))] + [
    # padding of exactly one row and one column (Q_LEN and KV_LEN one short of a block)
    pytest.param(lambda block: Case(flexspec.parse("parity", library=LIBRARY),
                                    Shape(1, 1, 1, 255, 383, 16), {}, block), block,
                 id=f"parity-one-short-{block[0]}x{block[1]}")
    for block in ((128, 128), (16, 32))])
def test_count_visible_counts_the_reference_mask(make, block, monkeypatch):
    """count_visible (FULL tiles by area, PARTIAL ones cell by cell) against the dense mask: with
    the interval classes it computes itself, with exact classes given, and with the cells
    evaluated a few tiles at a time."""
    case = make(block)
    expected = int(case.dense().sum())
    args = (case.ir.mask, case.sizes, case.block, case.values, CPU)
    extent = {"batch": case.batch, "heads": case.heads}
    assert blocks.count_visible(*args, **extent) == expected
    exact = refine(case.classes(), *args)
    assert torch.equal(exact, exact_classes(case))
    assert blocks.count_visible(*args, **extent, classes=exact) == expected
    # build_block_mask refines by default
    built = build_block_mask(*args, **extent)
    assert torch.equal(tile_classes(built), exact)
    monkeypatch.setattr(blocks, "CELLS_PER_CHUNK", 3 * case.block[0] * case.block[1])
    assert blocks.count_visible(*args, **extent) == expected
    assert torch.equal(refine(case.classes(), *args), exact)


def test_count_visible_evaluates_the_cells_of_partial_tiles_only(monkeypatch):
    """causal at 512 x 512 in 128 x 128 tiles: the four diagonal tiles are PARTIAL, the six
    below them FULL (counted by area), the rest EMPTY."""
    case = Case(flexspec.parse("causal"), Shape(1, 1, 1, 512, 512, 16), {}, (128, 128))
    calls = evaluated_cells(monkeypatch)
    assert blocks.count_visible(case.ir.mask, case.sizes, case.block, case.values, CPU,
                                batch=1, heads=1) == 512 * 513 // 2
    assert calls == [4]


def test_visible_counts_are_int64():
    # a float32 count is inexact past 2**24 pairs
    case = FIXED[3].values[0]((128, 128))
    coords = (case.classes() == PARTIAL).nonzero()
    visible, valid = blocks._count_cells(coords, torch.arange(128), case.ir.mask, case.sizes,
                                         case.block, case.values, CPU)
    assert visible.dtype == valid.dtype == torch.int64


# Masks that the intervals of a whole tile cannot decide but those of each 16 x 16 sub-tile can:
# q // 16 is one number in a sub-tile. Lengths one short of a multiple of 16 leave the last
# sub-tile one row (column) short of its end.
STRIPES = load_text("""
mask rows_always = (q // 16) % 2 == 0 | (q // 16) % 2 == 1
mask rows_never = (q // 16) % 2 == 0 & (q // 16) % 2 == 1
mask columns_always = (kv // 16) % 2 == 0 | (kv // 16) % 2 == 1
mask columns_never = (kv // 16) % 2 == 0 & (kv // 16) % 2 == 1
mask stripes = (q // 16) % 2 == 0 | (kv // 16) % 3 == 1
mask row_17 = (q * q) % 7 == 3 | q % 16 == 1 & q >= 16 & kv % 2 == 0
mask corner_or_never = q >= 112 & kv < 112 | (q // 16) % 2 == 0 & (q // 16) % 2 == 1 & kv >= 128
""", "test_blocks_stripes.attn")


@pytest.mark.parametrize("name", [name for name in STRIPES.definitions if name != "row_17"])
@pytest.mark.parametrize("q_len, kv_len", [(256, 256), (255, 223), (240, 176)])
def test_sub_tiles_decide_tiles_without_evaluating_cells(name, q_len, kv_len, monkeypatch):
    case = Case(flexspec.parse(name, library=STRIPES), Shape(1, 1, 1, q_len, kv_len, 16), {},
                (128, 128))
    classes = case.classes()
    assert (classes == PARTIAL).any()  # the intervals of whole tiles do not decide
    calls = evaluated_cells(monkeypatch)
    refined = refine(classes, case.ir.mask, case.sizes, case.block, case.values, CPU)
    assert torch.equal(refined, exact_classes(case))
    assert sum(calls) == 0, f"cells of {sum(calls)} tiles evaluated"


@pytest.mark.parametrize("make", [FIXED[i].values[0] for i in (0, 2, 3, 4)],
                         ids=[FIXED[i].id for i in (0, 2, 3, 4)])
@pytest.mark.parametrize("side", [2, 3])
def test_coarse_to_fine_classes_equal_the_flat_ones(make, side, monkeypatch):
    """A tile inside a PARTIAL super-tile gets the intervals of its own ranges, so the classes
    are those of the flat classification (for masks whose bounds shrink with their ranges)."""
    case = make((16, 32))
    flat = case.classes()
    monkeypatch.setattr(blocks, "HIERARCHY_TILES", 1)
    monkeypatch.setattr(blocks, "COARSE_SIDE", side)
    assert torch.equal(case.classes(), flat)
    # one PARTIAL super-tile per chunk (and one q-block row per chunk of the coarse grid)
    monkeypatch.setattr(blocks, "TILES_PER_CHUNK", 1)
    assert torch.equal(case.classes(), flat)


def test_grids_of_more_than_hierarchy_tiles_are_classified_coarse_to_fine(monkeypatch):
    """HIERARCHY_TILES is the largest grid classified flat (here 3 x 9 = 27 tiles)."""
    case = FIXED[3].values[0]((128, 32))  # 383 x 257
    super_tiles = []
    tiles_inside = blocks._tiles_inside
    monkeypatch.setattr(blocks, "_tiles_inside",
                        lambda coords, *args: super_tiles.append(len(coords))
                        or tiles_inside(coords, *args))
    flat = case.classes()
    assert flat.shape[-2:] == (3, 9)
    for limit, coarse in ((27, False), (26, True)):
        super_tiles.clear()
        monkeypatch.setattr(blocks, "HIERARCHY_TILES", limit)
        assert torch.equal(case.classes(), flat)
        assert bool(super_tiles) == coarse, limit
    # 9 tiles a side make super-tiles of one tile (factor 1): only the PARTIAL ones are
    # classified again, tile by tile
    assert sum(super_tiles) == int((flat == PARTIAL).sum()) < flat.numel()


def one_dim_lookup_mask(relation, value):
    table = ir.Tensor("t", (ir.Var("KV_LEN"),), dtype="int")
    return ir.Binary(relation, ir.Lookup(table, (ir.Var("kv"),)), ir.Const(value))


@pytest.mark.parametrize("kv_len", [300, 256, 40])
def test_lookups_of_a_vector_by_kv_are_bounded_per_block(kv_len):
    """t[kv] on a [KV_LEN] tensor: the per-block minimum and maximum, the padding of a short
    last block counted as neither."""
    sizes = {"B": 1, "H": 1, "Q_LEN": 100, "KV_LEN": kv_len}
    ones = torch.ones(kv_len, dtype=torch.int64)
    for mask, values in ((one_dim_lookup_mask(">", 0), ones),
                         (one_dim_lookup_mask("<", 0), -ones)):
        classes = classify(mask, sizes, (64, 128), {"t": values}, CPU, batch=1, heads=1)
        assert (classes == FULL).all(), classes
    # one hidden key per block: PARTIAL everywhere, never EMPTY
    mixed = ones.clone()
    mixed[::128] = 0
    classes = classify(one_dim_lookup_mask(">", 0), sizes, (64, 128), {"t": mixed}, CPU,
                       batch=1, heads=1)
    assert (classes == PARTIAL).all(), classes


def test_sparse_table_queries_are_exact():
    gen = torch.Generator().manual_seed(5)
    for length in (1, 2, 5, 16, 37):
        values = torch.randint(-50, 50, (3, length), generator=gen).double()
        table = blocks._SparseTable(values)
        pairs = [(lo, hi) for lo in range(length) for hi in range(lo, length)]
        lo = torch.tensor([p[0] for p in pairs]).reshape(1, -1)
        hi = torch.tensor([p[1] for p in pairs]).reshape(1, -1)
        rows = torch.arange(3).reshape(-1, 1)
        low, high = table.query((rows,), lo, hi)
        for r in range(3):
            for j, (a, b_) in enumerate(pairs):
                window = values[r, a:b_ + 1]
                assert (low[r, j].item(), high[r, j].item()) == (window.min().item(),
                                                                  window.max().item())


def test_sampled_rows_stay_inside_their_tile():
    """row_17: q * q % 7 is never 3 (not a square mod 7), which no interval shows; the rows at
    16 k + 1 (k >= 1) see every other key. The first q-block row of tiles is EMPTY: the rows
    refine samples first must be its own, not row 17 of the next tile."""
    case = Case(flexspec.parse("row_17", library=STRIPES), Shape(1, 1, 1, 64, 64, 16), {},
                (16, 16))
    assert (case.classes()[..., 0, :] == PARTIAL).all()
    check_refine_exact(case)
    assert (exact_classes(case)[..., 0, :] == EMPTY).all()


@pytest.mark.parametrize("q_len, kv_len, block", [(256, 256, (128, 128)), (300, 250, (128, 128)),
                                                  (48, 80, (16, 32)), (64, 96, (32, 16)),
                                                  (300, 128, (128, 128))])
def test_interval_block_masks_turn_only_ragged_full_tiles_partial(q_len, kv_len, block):
    """exact=False: the interval classes, except that a FULL tile running past the end of the
    sequence is PARTIAL."""
    case = Case(flexspec.parse("causal"), Shape(1, 1, 1, q_len, kv_len, 16), {}, block)
    classes = case.classes()
    nq, nk = classes.shape[-2:]
    ragged = (((torch.arange(nq) + 1) * block[0] > q_len).reshape(-1, 1)
              | ((torch.arange(nk) + 1) * block[1] > kv_len).reshape(1, -1))
    expected = torch.where(ragged & (classes == FULL), PARTIAL, classes)
    built = build_block_mask(case.ir.mask, case.sizes, case.block, case.values, CPU,
                             batch=1, heads=1, exact=False)
    assert torch.equal(tile_classes(built), expected)
    assert (expected == FULL).any()


# Lookups through each path of blocks._Lookups: two dimensions read by q and kv, a two-entry
# dimension read by q, two tensors through the sparse table, index bounds that leave the tensor
# (loose intervals of an index that stays inside), per-block and per-range bounds that must be
# exact.
LOOKUPS = load_text("""
mask both(t: int[Q_LEN, KV_LEN]) = t[q, kv] > 0
mask pair(t: int[2]) = t[q % 2] > 0
mask two(a: int[Q_LEN], c: int[KV_LEN]) = a[q // 2] > 0 & c[kv // 2] > 0
mask falling(t: int[Q_LEN]) = t[16 - q] > 0
mask folded(t: int[Q_LEN]) = t[abs(q - 8)] > 0
mask by_row(t: int[Q_LEN]) = t[q] > 0
mask steps(t: int[4]) = t[q // 64] > 0
mask heads(t: int[H, KV_LEN]) = t[h, kv] > 0
mask loose(t: int[Q_LEN]) = t[q + (q - q) * 3] > 0
mask three(t: int[H, Q_LEN, 2]) = t[h, q, 1] > 0
mask seven_tenths = kv <= q * 0.7
""", "test_blocks_lookups.attn")


def _columns_of_ones(q_len, kv_len, every):
    t = torch.zeros(q_len, kv_len, dtype=torch.int64)
    t[:, ::every] = 1
    return t


def _ones_but(row):
    t = torch.ones(1, 96, 2, dtype=torch.int64)
    t[0, row, 1] = 0
    return t


@pytest.mark.parametrize("name, shape, values, block", [
    # the first kv column of every tile true, the rest false: bounds from one column are unsound
    ("both", (96, 128), {"t": _columns_of_ones(96, 128, 32)}, (32, 32)),
    ("pair", (64, 64), {"t": torch.tensor([1, 0])}, (32, 32)),
    # the sparse tables of two tensors are not shared
    ("two", (64, 64), {"a": torch.ones(64, dtype=torch.int64), "c": torch.zeros(64, dtype=torch.int64)}, (32, 32)),
    ("two", (64, 64), {"a": torch.zeros(64, dtype=torch.int64), "c": torch.ones(64, dtype=torch.int64)}, (32, 32)),
    ("falling", (17, 40), {"t": torch.tensor([1, 0] * 8 + [1])}, (128, 128)),
    ("folded", (17, 40), {"t": torch.tensor([1, 0] * 8 + [1])}, (128, 128)),
    # q + (q - q) * 3 is q, bounded by [-48, 64] over the 17 rows: the sparse-table query of
    # the 17 entries must clamp both ends to the tensor, no further (the last row is hidden)
    ("loose", (17, 40), {"t": torch.tensor([1] * 16 + [0])}, (128, 128)),
    # the per-block reduction of a 3-D tensor along its middle dimension: one hidden row
    ("three", (96, 64), {"t": _ones_but(70)}, (32, 32)),
    # 0.7 in float32 is below 0.7: q = 10 sees kv = 7 (10 * 0.7 > 7 in float64), in the tile
    # q 0..10, kv 7..13
    ("seven_tenths", (22, 14), {}, (11, 7)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_lookups_through_every_path_are_sound(name, shape, values, block):
    case = Case(flexspec.parse(name, library=LOOKUPS), Shape(1, 1, 1, *shape, 16), values, block)
    check_classes_sound(case)
    check_refine_exact(case)


@pytest.mark.parametrize("name, values", [
    # the last q-block differs from the one before it
    ("by_row", {"t": torch.tensor([0] * 192 + [1] * 64)}),
    ("steps", {"t": torch.tensor([1, 0, 1, 0])}),
    ("steps", {"t": torch.tensor([0, 1, 0, 1])}),
], ids=lambda x: x if isinstance(x, str) else "")
def test_lookups_aligned_with_the_tiles_are_exact(name, values):
    """A lookup whose index covers exactly the entries of one block per tile is bounded by
    those entries' minimum and maximum: the interval classes are already exact."""
    case = Case(flexspec.parse(name, library=LOOKUPS), Shape(1, 1, 1, 256, 128, 16), values,
                (64, 64))
    assert torch.equal(case.classes(), exact_classes(case)), case.classes()


def test_a_tensor_with_fewer_dimensions_broadcasts_like_the_reference():
    """t[h, kv] of a [KV_LEN] tensor reads it as [1, KV_LEN] (the reference does the same)."""
    spec = flexspec.parse("heads", library=LOOKUPS)
    ir_mask = Case(spec, Shape(1, 2, 2, 64, 64, 16), {"t": torch.ones(2, 64, dtype=torch.int64)},
                   (32, 32)).ir.mask
    flags = torch.zeros(64, dtype=torch.int64)
    flags[32:] = 1
    sizes = {"B": 1, "H": 2, "Q_LEN": 64, "KV_LEN": 64}
    classes = classify(ir_mask, sizes, (32, 32), {"t": flags}, CPU, batch=1, heads=2)
    expected = torch.tensor([[EMPTY, FULL], [EMPTY, FULL]], dtype=torch.int8)
    assert torch.equal(classes, expected.expand(1, 2, 2, 2)), classes


# sqrt(5) rounded to float32 is above sqrt(5) in float64, and equal to the next float64 up once
# that is rounded to float32 too: with an index range in float32 (or int64, whose sqrt torch
# takes in float32) the fifth batch, head, row or column would be proven to pass
# `sqrt(x) >= nextafter(sqrt(5))`, which the float64 reference says it does not.
ROOTS = load_text("".join(
    f"mask root_{name} = sqrt({name}) >= {math.nextafter(math.sqrt(5), 3)!r}\n"
    for name in ("b", "h", "q", "kv")), "test_blocks_roots.attn")


@pytest.mark.parametrize("name, shape", [
    ("b", Shape(7, 1, 1, 10, 10, 16)), ("h", Shape(1, 7, 7, 10, 10, 16)),
    ("q", Shape(1, 1, 1, 10, 10, 16)), ("kv", Shape(1, 1, 1, 10, 10, 16))])
def test_index_ranges_are_float64(name, shape):
    case = Case(flexspec.parse(f"root_{name}", library=ROOTS), shape, {}, (5, 5))
    check_classes_sound(case)
    check_refine_exact(case)


# Thresholds at tile edges on one axis, and `>= 16` on the other, which leaves the first
# column (row) of 32 x 32 super-tiles PARTIAL: the coarse-to-fine pass bounds the tiles inside it.
TILE_EDGES = load_text("".join(
    f"mask {x}_{name} = {x} {relation} & {y} >= 16\n"
    for x, y in (("q", "kv"), ("kv", "q"))
    for name, relation in (("from_16", ">= 16"), ("from_15", ">= 15"), ("from_39", ">= 39"),
                           ("to_39", "<= 39"))), "test_blocks_tile_edges.attn")


@pytest.mark.parametrize("name", list(TILE_EDGES.definitions))
@pytest.mark.parametrize("coarse", [False, True], ids=["flat", "coarse"])
def test_interval_classes_of_thresholds_at_tile_edges(name, coarse, monkeypatch):
    """Each tile is bounded by its own rows and columns, the last ones ending at the end of the
    sequence (40 = 2 * 16 + 8): a threshold at a tile's edge gives each tile its exact class, a
    ragged tile all of whose pairs inside the sequence are visible included (FULL here;
    refine and build_block_mask turn it PARTIAL). The same for the tiles inside PARTIAL
    super-tiles."""
    if coarse:
        monkeypatch.setattr(blocks, "HIERARCHY_TILES", 1)
        monkeypatch.setattr(blocks, "COARSE_SIDE", 2)
    case = Case(flexspec.parse(name, library=TILE_EDGES), Shape(1, 1, 1, 40, 40, 16), {},
                (16, 16))
    any_visible, all_inside, _ = case.truth()
    expected = torch.where(all_inside, FULL, torch.where(any_visible, PARTIAL, EMPTY))
    assert torch.equal(case.classes(), expected.to(torch.int8)), case.classes()


@pytest.mark.parametrize("make", [FIXED[i].values[0] for i in (0, 2, 4)],
                         ids=[FIXED[i].id for i in (0, 2, 4)])
def test_tile_rows_classified_in_chunks_equal_the_whole_grid(make, monkeypatch):
    """A grid of more than TILES_PER_CHUNK tiles (over every batch and head row) is classified a
    few q-block rows at a time: one row, then three (16 and 19 rows leave a short last chunk),
    with per-batch lookups and head-dependent masks."""
    case = make((16, 32))
    whole = case.classes()
    nk = whole.shape[-1]
    for rows in (1, 3):
        monkeypatch.setattr(blocks, "TILES_PER_CHUNK", rows * case.batch * case.heads * nk)
        assert torch.equal(case.classes(), whole), rows
