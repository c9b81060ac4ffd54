"""runtime.lookups: the range checks of tensor lookups. Lookups that interval analysis cannot
prove in range are evaluated exactly at any length (in chunks of bounded memory), and refused
with the fix where that would take too long. Red-team item 13: above 2^24 index points the check
became a warning, then inductor's "index out of bounds" error. No kernel runs here: every call
below fails its checks or runs on the reference."""

from __future__ import annotations

import math
import re

import pytest
import torch

import flexspec
from flexspec import ir, limits
from flexspec.ir import tensor_key
from flexspec.lang.library import load_text
from flexspec import BindingError
from flexspec.runtime import lookups
from flexspec.runtime.lookups import _index_range


LIBRARY = ("score pick(bias: float[4], ids: int[KV_LEN]) = score + bias[ids[q]]\n"
           "score safe(bias: float[4], ids: int[KV_LEN]) = score + bias[clamp(ids[q], 0, 3)]\n"
           "spec s = causal + pick\nspec clamped = causal + safe\n")


def _call(name: str, ids: torch.Tensor):
    attn = flexspec.compile(flexspec.loads(LIBRARY)[name], backend="reference")
    q = torch.randn(1, 1, len(ids), 8, generator=torch.Generator().manual_seed(0))
    return attn(q, q, q, bias=torch.arange(4.0), ids=ids)


def test_an_index_beyond_one_chunk_is_still_checked_exactly(monkeypatch):
    monkeypatch.setattr(limits, "EXACT_INDEX_CHECK_LIMIT", 5)  # 64 points: 13 chunks
    ids = torch.zeros(64, dtype=torch.long)
    ids[50] = 9  # in a late chunk
    with pytest.raises(flexspec.BindingError, match=r"reaches 0\.\.9 for Q_LEN=64.* 4 entries"):
        _call("s", ids)
    ids[50] = 3
    out = _call("s", ids)
    monkeypatch.undo()
    assert torch.equal(out, _call("s", ids))


@pytest.mark.parametrize("limit, dims, parts", [(3, [1, 1, 13, 1], 5), (1, [1, 1, 13, 1], 13),
                                               (6, [1, 1, 13, 2], 5), (4, [2, 1, 1, 7], 4),
                                               (100, [1, 1, 13, 1], 1)])
def test_the_range_of_an_index_is_evaluated_in_slices_of_bounded_size(monkeypatch, limit, dims,
                                                                      parts):
    sizes = []
    real = lookups.evaluate

    def evaluate(index, grid, values, **options):
        sizes.append(math.prod(torch.broadcast_shapes(*(t.shape for t in grid.values()
                                                        if isinstance(t, torch.Tensor)))))
        return real(index, grid, values, **options)

    monkeypatch.setattr(limits, "EXACT_INDEX_CHECK_LIMIT", limit)
    monkeypatch.setattr(lookups, "evaluate", evaluate)
    index = ir.Binary("+", ir.Binary("+", ir.Var("q"), ir.Var("kv")), ir.Var("b"))
    low, high = _index_range(index, dims, {}, "cpu")
    assert (int(low), int(high)) == (0, (dims[0] - 1) + (dims[2] - 1) + (dims[3] - 1))
    assert len(sizes) == parts and sum(sizes) == math.prod(dims)
    assert max(sizes) <= max(limit, math.prod(dims) // max(dims))


def test_too_many_points_to_check_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(limits, "MAX_INDEX_CHECK_POINTS", 32)
    with pytest.raises(flexspec.BindingError, match="^" + re.escape(
            "cannot check that 'bias' stays in range in dimension 0: its index ids[q] is not "
            "bounded by the sizes, and checking it means evaluating it at 64 points for "
            "Q_LEN=64, KV_LEN=64 (flexspec evaluates at most 32); clamp the index into the "
            "tensor, as in clamp(ids[q], 0, 3), so it is proven in range, or use shorter "
            "sequences") + "$"):
        _call("s", torch.zeros(64, dtype=torch.long))
    # the fix works: a clamped index is proven in range and needs no evaluation
    assert _call("clamped", torch.full((64,), 9)).isfinite().all()


@pytest.mark.parametrize("limit", [1, 3, 7, 64, 10**6])
def test_chunked_range_equals_the_whole_range(monkeypatch, limit):
    monkeypatch.setattr(limits, "EXACT_INDEX_CHECK_LIMIT", limit)
    spec = flexspec.loads(LIBRARY)["s"].ir
    lookup = next(n for n in flexspec.ir.walk(spec.score) if isinstance(n, flexspec.ir.Lookup))
    index = lookup.index[0]
    ids = torch.randint(-50, 50, (13,), generator=torch.Generator().manual_seed(1))
    values = {flexspec.ir.tensor_key(t): ids for t in spec.tensors() if t.name == "ids"}
    low, high = _index_range(index, [1, 1, 13, 1], values, "cpu")
    assert (int(low), int(high)) == (int(ids.min()), int(ids.max()))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_lookup_one_past_the_end_is_refused_and_the_last_entry_is_not(backend):
    library = load_text("mask ahead(t: float[KV_LEN]) = t[q + 1] > 0.0\n")
    attn = flexspec.compile("ahead(t)", library=library, backend=backend)
    t = torch.randn(16)
    q = torch.randn(1, 1, 16, 8)
    # Q_LEN = KV_LEN = 16: row 15 reads t[16], one past the end (found by mutation testing)
    with pytest.raises(BindingError, match=r"'t' is indexed by q \+ 1"):
        attn(q, q, q, t=t)
    # Q_LEN = 15: row 14 reads t[15], the last entry
    short = q[:, :, :15]
    torch.testing.assert_close(attn(short, q, q, t=t), attn.reference(short, q, q, t=t))


def test_a_lookup_before_the_first_entry_is_refused():
    library = load_text("mask behind(t: float[KV_LEN]) = t[q - 1] > 0.0\n")
    attn = flexspec.compile("behind", library=library, backend="reference")
    q = torch.zeros(1, 1, 16, 8)
    with pytest.raises(BindingError, match="^" + re.escape(
            "'t' is indexed by q - 1 in dimension 0, which reaches -1..14 for Q_LEN=16, "
            "KV_LEN=16, but that dimension has 16 entries") + "$"):
        attn(q, q, q, t=torch.ones(16))


@pytest.mark.parametrize("index, sizes, reach", [("q + b", dict(batch=9), "0..15"),
                                                 ("q + h", dict(heads=9), "0..15"),
                                                 ("kv + 1", {}, "1..8")])
def test_a_lookup_is_checked_over_every_batch_row_head_and_key(index, sizes, reach):
    # each index leaves the tensor only beyond b = 0, h = 0 or kv = 0; the longest axis (9
    # batch rows, 9 heads, 8 keys) is the one the check slices
    library = load_text(f"mask m(t: int[KV_LEN]) = t[{index}] >= 0\n")
    attn = flexspec.compile("m", library=library)
    with pytest.raises(BindingError, match="^" + re.escape(
            f"'t' is indexed by {index} in dimension 0, which reaches {reach} for Q_LEN=8, "
            "KV_LEN=8, but that dimension has 8 entries") + "$"):
        attn.block_mask(8, 8, t=torch.zeros(8, dtype=torch.int64), **sizes)


def test_an_index_variable_over_a_dimension_of_its_own_extent_needs_no_analysis(monkeypatch):
    """``t[q]`` with ``t`` of KV_LEN entries: where Q_LEN == KV_LEN the lookup is in range by its
    shape alone (no interval analysis: a growing cache proves its lookups every step); where
    they differ it is analysed, proven when Q_LEN < KV_LEN and refused when Q_LEN > KV_LEN."""
    analysed = []
    real = lookups.bounds
    monkeypatch.setattr(lookups, "bounds",
                        lambda index, *args: analysed.append(index) or real(index, *args))
    library = load_text("mask m(t: int[KV_LEN]) = t[q] >= 0\n")
    attn = flexspec.compile("m", library=library, backend="reference")
    t = torch.zeros(40, dtype=torch.int64)
    for q_len in (40, 39, 41):
        q = torch.randn(1, 1, q_len, 8)
        k = torch.randn(1, 1, 40, 8)
        analysed.clear()
        if q_len > 40:
            with pytest.raises(BindingError, match=r"'t' is indexed by q .* reaches 0\.\.40"):
                attn(q, k, k, t=t)
        else:
            torch.testing.assert_close(attn(q, k, k, t=t), attn.reference(q, k, k, t=t))
        # the index's range analysed, at the new sizes only
        assert len(analysed) == (q_len != 40)


def test_an_offset_given_as_an_int_is_checked_by_its_known_value_without_a_read(monkeypatch):
    """``causal & doc`` reads ``doc_ids`` at the query's position, ``q + q_offset[b]``, which
    interval analysis cannot bound from the spec alone. An int offset becomes a tensor whose
    value the runtime knows: the lookup is then proven with it, and no value is read (on a GPU a
    host synchronisation at every decoding step). An int offset that reads past the ids is
    still refused; a tensor offset is still checked by its values."""
    read = []
    real = lookups.check_lookups
    monkeypatch.setattr(lookups, "check_lookups",
                        lambda *args, **kwargs: read.append(1) or real(*args, **kwargs))
    attn = flexspec.compile("causal & doc", backend="reference")
    ids = (torch.arange(60) // 25).expand(2, 60)
    k = torch.randn(2, 2, 60, 8)
    for offset in (57, 50, 58):
        q = torch.randn(2, 4, 2, 8)
        torch.testing.assert_close(attn(q, k, k, q_offset=offset, doc_ids=ids),
                                   attn.reference(q, k, k, q_offset=offset, doc_ids=ids))
    assert read == []
    with pytest.raises(BindingError, match=r"'doc_ids' is indexed by q \+ q_offset\[b\].* "
                                           r"reaches 59\.\.60"):
        attn(q, k, k, q_offset=59, doc_ids=ids)
    assert read  # the known range did not prove it: the values were checked, and refused
    read.clear()
    attn(q, k, k, q_offset=torch.tensor([50, 57]), doc_ids=ids)
    assert read


def test_a_lookup_is_checked_again_when_a_tensor_its_index_reads_changes():
    """The check of ``doc_ids[b, q + q_offset[b]]`` is kept by the identity of every tensor it
    read: a new ``q_offset`` tensor, or one changed in place, is checked anew though
    ``doc_ids`` is the same (a check kept by ``doc_ids`` alone let a later offset read past
    the ids)."""
    attn = flexspec.compile("causal & doc", backend="reference")
    ids = (torch.arange(60) // 25).expand(2, 60)
    k = torch.randn(2, 2, 60, 8)
    q = torch.randn(2, 4, 2, 8)
    offset = torch.tensor([50, 57])
    torch.testing.assert_close(attn(q, k, k, q_offset=offset, doc_ids=ids),
                               attn.reference(q, k, k, q_offset=offset, doc_ids=ids))
    with pytest.raises(BindingError, match=r"'doc_ids' is indexed by q \+ q_offset\[b\].* "
                                           r"reaches 50\.\.60"):
        attn(q, k, k, q_offset=torch.tensor([50, 59]), doc_ids=ids)
    offset[1] = 59  # in place: the same tensor, a new version
    with pytest.raises(BindingError, match=r"reaches 50\.\.60"):
        attn(q, k, k, q_offset=offset, doc_ids=ids)
    offset[1] = 58
    torch.testing.assert_close(attn(q, k, k, q_offset=offset, doc_ids=ids),
                               attn.reference(q, k, k, q_offset=offset, doc_ids=ids))


def test_asserting_lookups_on_the_device_passes_in_range_and_names_the_lookup_outside():
    """assert_lookups (what a CUDA call uses: no value read back) computes each unproven
    index's range on the values' device and asserts it there; on the CPU the assertion
    raises at once, which shows what a GPU's device-side assertion says."""
    attn = flexspec.compile("causal & doc", backend="reference")
    spec = attn._calls.placement.tensors_for({"q_offset": 0}).ir
    sizes = {"B": 2, "H": 1, "Q_LEN": 2, "KV_LEN": 60}
    keys = {t.name: tensor_key(t) for t in spec.tensors()}
    ids = (torch.arange(60) // 25).expand(2, 60)
    unproven = lookups.unproven_lookups(spec, tuple(sorted(sizes.items())),
                                        (("doc_ids", (2, 60)), ("q_offset", (2,))))
    assert unproven
    fine = {keys["doc_ids"]: ids, keys["q_offset"]: torch.tensor([50, 58])}
    lookups.assert_lookups(spec, sizes, fine, unproven)
    outside = {keys["doc_ids"]: ids, keys["q_offset"]: torch.tensor([50, 59])}
    with pytest.raises(RuntimeError, match=r"flexspec: 'doc_ids' is indexed by q \+ "
                                           r"q_offset\[b\] in dimension 1 outside its 60 "
                                           r"entries for Q_LEN=2, KV_LEN=60"):
        lookups.assert_lookups(spec, sizes, outside, unproven)


def test_asserting_lookups_reads_no_value_back(monkeypatch):
    """A read back is a host synchronisation on a GPU, and not allowed at all inside a CUDA
    graph capture (the H200 refused the capture of a ``causal & doc`` decode step while the
    evaluation of ``q + q_offset[b]`` checked its read of ``q_offset`` on the host): nothing in
    assert_lookups may turn a tensor into a Python value."""
    attn = flexspec.compile("causal & doc", backend="reference")
    spec = attn._calls.placement.tensors_for({"q_offset": 0}).ir
    sizes = {"B": 2, "H": 1, "Q_LEN": 2, "KV_LEN": 60}
    keys = {t.name: tensor_key(t) for t in spec.tensors()}
    values = {keys["doc_ids"]: (torch.arange(60) // 25).expand(2, 60),
              keys["q_offset"]: torch.tensor([50, 58])}
    unproven = lookups.unproven_lookups(spec, tuple(sorted(sizes.items())),
                                        (("doc_ids", (2, 60)), ("q_offset", (2,))))

    def read_back(*args):
        raise AssertionError("a value was read back")
    for name in ("__bool__", "__int__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    lookups.assert_lookups(spec, sizes, values, unproven)


def test_asserting_lookups_copies_no_constant_from_the_host(monkeypatch):
    """An unproven index with constants (``2 * q + o[b] + 1``): each constant is filled on the
    values' device, never made by ``torch.tensor``, a copy from host memory that a CUDA graph
    capture refuses; out-of-range reads are still asserted."""
    library = load_text("mask m(t: int[B, KV_LEN], o: int[B]) = t[b, 2 * q + o[b] + 1] >= 0\n")
    spec = flexspec.compile("m(t, o)", library=library,
                            backend="reference")._calls.placement.tensors_for({}).ir
    sizes = {"B": 2, "H": 1, "Q_LEN": 2, "KV_LEN": 60}
    unproven = lookups.unproven_lookups(spec, tuple(sorted(sizes.items())),
                                        (("t", (2, 60)), ("o", (2,))))
    ids = torch.zeros(2, 60, dtype=torch.int64)
    inside, outside = torch.tensor([50, 56]), torch.tensor([50, 57])

    def copied(*args, **kwargs):
        raise AssertionError("a tensor was made from host data")
    monkeypatch.setattr(torch, "tensor", copied)
    monkeypatch.setattr(torch, "as_tensor", copied)
    lookups.assert_lookups(spec, sizes, {"t": ids, "o": inside}, unproven)
    with pytest.raises(RuntimeError, match=r"'t' is indexed by 2 \* q \+ o\[b\] \+ 1"):
        lookups.assert_lookups(spec, sizes, {"t": ids, "o": outside}, unproven)


def test_inside_a_graph_capture_every_call_checks_its_lookups(monkeypatch):
    """Inside a CUDA graph capture (or its warm-up) a lookup's check is made at every call,
    never skipped as checked before: the capture records it, for the values each replay
    holds."""
    attn = flexspec.compile("causal & doc", backend="reference")
    ids = (torch.arange(60) // 25).expand(2, 60)
    k = torch.randn(2, 2, 60, 8)
    q = torch.randn(2, 4, 2, 8)
    offset = torch.tensor([50, 57])
    attn(q, k, k, q_offset=offset, doc_ids=ids)
    checked = []
    real = lookups.check_lookups
    monkeypatch.setattr(lookups, "check_lookups",
                        lambda *args, **kwargs: checked.append(1) or real(*args, **kwargs))
    attn(q, k, k, q_offset=offset, doc_ids=ids)
    assert checked == []  # the same unchanged tensors: checked before
    monkeypatch.setattr(lookups, "in_graph_memory", lambda device: True)
    for _ in range(2):
        attn(q, k, k, q_offset=offset, doc_ids=ids)
    assert checked == [1, 1]
