"""ir.overflow: integer arithmetic that leaves the kernel's int dtype at a call's lengths is an
error before anything runs (red-team item 7: ``q * 2**62`` wrapped in the reference, and the
kernel differed from it by 0.86), while ``where`` branches that are not taken, every registry
pattern and the examples stay accepted at 1M positions, in int32 (FlexAttention's GPU kernels)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec import ir
from flexspec.ir.overflow import check_int_ranges, length_buckets, position_ranges
from flexspec.lang.library import load_text
from flexspec.resources import data_path
from flexspec.runtime.backends import REGISTRY
from flexspec.runtime.plan import check_ranges
from flexspec.testing import spec_texts

LIBRARY = flexspec.loads(
    "mask big = q * 4611686018427387904 >= kv\n"
    "mask guarded = where(q < 2, q * 4611686018427387904, q) >= kv\n"
    "mask loose = where(q < 3, q * 4611686018427387904, q) >= kv\n"
    "mask fixed = where(Q_LEN > 10, q, q * 4611686018427387904) >= kv\n"
    "mask gpu = q * 16777216 >= kv * 16777216\n"
    "mask both = where(q >= 4 & q < 6, (q - 4) * 4611686018427387904, 0) == kv\n"
    "spec s = causal & big\nspec g = causal & guarded\nspec l = causal & loose\n"
    "spec f = causal & fixed\nspec gpu_only = causal & gpu\nspec and_guard = full & both\n")
MILLION = {"B": 8, "H": 64, "Q_LEN": 1 << 20, "KV_LEN": 1 << 20}


def _check(name: str, sizes: dict, dtype: str = "int64"):
    check_int_ranges(LIBRARY[name].ir, position_ranges(sizes), dtype, "here")


def test_q_times_2_62_is_an_error_naming_the_expression_before_anything_runs():
    attn = flexspec.compile(LIBRARY["s"])
    with pytest.raises(flexspec.SpecError, match=r"'q \* 4611686018427387904' reaches "
                                                 r"0\.\.2\.91e\+20 for B=1, H=1, Q_LEN=64.*64-bit"):
        attn.dense_mask(64, 64)
    q = torch.randn(1, 1, 64, 8)
    for backend in ("auto", "reference"):
        with pytest.raises(flexspec.SpecError, match=r"'q \* 4611686018427387904' reaches"):
            flexspec.compile(LIBRARY["s"], backend=backend)(q, q, q)
    with pytest.raises(flexspec.SpecError, match="reaches"):
        attn.reference(q, q, q)
    # one row at position 0 fits: 0 * 2**62
    assert attn.dense_mask(1, 64).any()


def test_a_branch_is_bounded_under_its_condition_and_skipped_where_never_taken():
    sizes = {"B": 1, "H": 1, "Q_LEN": 64, "KV_LEN": 64}
    _check("g", sizes)      # q * 2**62 for q < 2 only: at most 2**62
    _check("f", sizes)      # Q_LEN > 10: the overflowing branch is never taken
    _check("and_guard", sizes)  # 4 <= q < 6: (q - 4) * 2**62 is at most 2**62
    with pytest.raises(flexspec.SpecError, match="reaches 0..9.22e"):
        _check("l", sizes)  # q = 2 gives 2**63
    with pytest.raises(flexspec.SpecError, match="reaches"):
        _check("f", {**sizes, "Q_LEN": 8})  # now the branch is taken
    assert flexspec.compile(LIBRARY["g"]).dense_mask(64, 64).any()


def test_query_offsets_move_the_positions_the_reference_checks():
    attn = flexspec.compile(LIBRARY["s"])
    attn.dense_mask(1, 64, q_offset=1)  # 1 * 2**62 fits
    with pytest.raises(flexspec.SpecError, match="query positions from 2"):
        attn.dense_mask(1, 64, q_offset=torch.tensor([2]))


def test_gpu_kernels_compute_in_int32():
    assert REGISTRY["flex"].index_dtype("cuda") == REGISTRY["flash"].index_dtype("cuda") == "int32"
    assert REGISTRY["flex"].index_dtype("cpu") == REGISTRY["reference"].index_dtype("cuda") \
        == "int64"
    sizes = {"B": 1, "H": 1, "Q_LEN": 256, "KV_LEN": 256}
    spec = LIBRARY["gpu_only"].ir
    check_ranges(spec, sizes, "int64")
    with pytest.raises(flexspec.SpecError, match=r"'q \* 16777216' reaches 0\.\.4278190080 for "
                                                 r"Q_LEN=256, KV_LEN=256 on a GPU, beyond the "
                                                 r"32-bit"):
        check_ranges(spec, sizes, "int32")


def test_unknown_bounds_are_not_errors():
    # a tensor's values are unknown: doc_ids[b, q] * 2 could be anything, and is not refused
    lib = flexspec.loads("mask m(ids: int[B, KV_LEN]) = ids[b, q] * 2 == ids[b, kv] * 2\n"
                         "spec s = m\n")
    check_int_ranges(lib["s"].ir, position_ranges(MILLION), "int32", "here")


REALISTIC = ["causal", "sliding_window(4096)", "window(131072)", "chunked(8192)",
             "block_causal(2048)", "dilated(4096, 8)", "strided(512)", "prefix_lm(65536)",
             "causal & sink(4)", "causal + alibi", "t5_bias", "t5_bias(32, 1048576)",
             "causal + rel_bias(max_distance=4096)", "natten(1024, 1024, 63, 63)",
             "causal & doc + softcap(30.0)", "global_tokens + head_bias", "causal + scale(0.5)",
             "key_padding", "causal_bottom_right"]


@pytest.mark.parametrize("text", REALISTIC)
def test_registry_patterns_at_a_million_positions_fit_int32(text):
    check_int_ranges(flexspec.parse(text).ir, position_ranges(MILLION, 0, (1 << 21) - 1),
                     "int32", "here")


def test_every_registry_example_and_the_examples_file_fit_int32():
    specs = [flexspec.parse(p.example) for p in flexspec.patterns()]
    specs += list(flexspec.load(data_path("examples", "model.attn")).specs.values())
    assert len(specs) > 25
    for spec in specs:
        check_int_ranges(spec.ir, position_ranges(MILLION), "int32", str(spec))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts(kinds=("static", "binding", "learnable")))
def test_drawn_registry_specs_fit_int32_at_a_million_positions(text):
    spec = flexspec.parse(text).ir
    assert isinstance(spec, ir.AttentionIR)
    check_int_ranges(spec, position_ranges(MILLION), "int32", text)


DIVISIONS = flexspec.loads(
    "mask at24 = q < Q_LEN // (Q_LEN - 24)\n"
    "mask pairs = q // (kv - q + 5) < 2\n"
    "mask guarded = where(kv > q, q // (kv - q), 0) < 2\n"
    "mask kept_away = q // max(kv - q, 1) < 2\n"
    "mask positive = q % (kv + 1) == 0\n"
    "mask tensor(t: int[KV_LEN]) = q // t[kv] < 2\n")


@pytest.mark.parametrize("name, length, divisor", [
    ("at24", 24, "Q_LEN - 24"), ("pairs", 8, "kv - q + 5"), ("guarded", 8, "kv - q")])
def test_a_divisor_that_can_be_zero_is_an_error_naming_it(name, length, divisor):
    attn = flexspec.compile(name, library=DIVISIONS)
    q = k = v = torch.randn(1, 1, length, 8)
    message = f"divides by .{re.escape(divisor)}., which can be 0 .*Q_LEN={length}.*max\\("
    for run in (lambda: attn(q, k, v), lambda: attn.reference(q, k, v),
                lambda: attn.dense_mask(length, length),
                lambda: attn.block_mask(length, length)):
        with pytest.raises(flexspec.SpecError, match=message):
            run()


def test_divisors_kept_away_from_zero_and_unknown_ones_run():
    q = k = v = torch.randn(1, 1, 30, 8, dtype=torch.float64)
    assert flexspec.compile("at24", library=DIVISIONS).reference(q, k, v).isfinite().all()
    for name in ("kept_away", "positive"):
        attn = flexspec.compile(name, library=DIVISIONS)
        torch.testing.assert_close(attn(q.float(), k.float(), v.float()).double(),
                                   attn.reference(q, k, v), rtol=1e-4, atol=1e-5)
    attn = flexspec.compile("tensor", library=DIVISIONS)
    # a tensor's values are not bounded: not refused (the values decide)
    assert attn.reference(q, k, v, t=torch.full((30,), 3)).isfinite().all()


# --- checks over ranges of lengths (a growing cache checks once per doubling) ----------------


def test_length_buckets_widen_the_lengths_to_the_doubling_they_lie_in():
    sizes = {"B": 3, "H": 5, "Q_LEN": 1, "KV_LEN": 1000}
    assert length_buckets(sizes) == {"B": 3, "H": 5, "Q_LEN": 1, "KV_LEN": (513, 1024)}
    assert length_buckets({**sizes, "Q_LEN": 2, "KV_LEN": 1024})["KV_LEN"] == (513, 1024)
    assert length_buckets({**sizes, "Q_LEN": 3, "KV_LEN": 1025}) == \
        {"B": 3, "H": 5, "Q_LEN": (3, 4), "KV_LEN": (1025, 2048)}
    ranges = position_ranges(length_buckets({**sizes, "Q_LEN": 130}))
    assert ranges["q"] == (0, 255) and ranges["kv"] == (0, 1023)
    assert ranges["Q_LEN"] == (129, 256) and ranges["KV_LEN"] == (513, 1024)
    assert ranges["B"] == (3, 3) and ranges["b"] == (0, 2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts(), st.integers(3, 5000), st.integers(1, 300))
def test_a_spec_that_fits_over_a_bucket_fits_at_every_length_in_it(text, kv_len, q_len):
    """Soundness of the widened check: where the bucket passes, the exact lengths pass too (at
    the bucket's ends, and at the lengths drawn)."""
    spec = flexspec.parse(text).ir
    sizes = {"B": 2, "H": 4, "Q_LEN": q_len, "KV_LEN": kv_len}
    bucket = length_buckets(sizes)
    try:
        check_int_ranges(spec, position_ranges(bucket), "int32", "")
    except flexspec.SpecError:
        return
    for kv in {kv_len, *(bucket["KV_LEN"] if isinstance(bucket["KV_LEN"], tuple) else ())}:
        check_int_ranges(spec, position_ranges({**sizes, "KV_LEN": kv}), "int32", "")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts(), st.integers(3, 5000), st.integers(1, 300),
       st.sampled_from(["int32", "int64"]))
def test_the_position_range_searched_from_its_bucket_s_is_the_exact_search_s(text, kv_len,
                                                                             q_len, dtype):
    """position_range(..., known=the bucket's range) gives what the search from the lengths'
    own first range gives (the bucket's range only skips checks it vouches for)."""
    from flexspec.ir.overflow import position_range
    spec = flexspec.parse(text).ir
    sizes = {"B": 2, "H": 4, "Q_LEN": q_len, "KV_LEN": kv_len}
    exact = tuple(sorted(sizes.items()))
    known = position_range(spec, tuple(sorted(length_buckets(sizes).items())), dtype)
    assert position_range(spec, exact, dtype, known) == position_range(spec, exact, dtype)


def test_a_growing_cache_s_tensor_offset_range_costs_at_most_two_checks_per_length(monkeypatch):
    """A decoding step's tensor offset is bounded by the exact position range at each new
    length (Placement.for_call): searched from the bucket's, it costs at most two checks per
    length (whether negatives fit, which a divisor by the query denies here, and the next power
    beyond the bucket's end), and none where the bucket's range is already the widest (causal's
    whole int64 range); the search from the lengths' own first range took six or more."""
    from flexspec.ir import overflow
    from flexspec.runtime import positions
    checked = []
    real = overflow.check_int_ranges
    monkeypatch.setattr(overflow, "check_int_ranges", lambda *a: checked.append(1) or real(*a))
    library = flexspec.loads("mask d = kv // (q + 1) >= 0\n")
    for text, most in (("causal", 0), ("causal & d", 2)):
        spec = flexspec.parse(text, library=library).ir
        overflow.position_range.cache_clear()
        for length in range(3001, 3041):
            positions._positions_that_fit(spec, {"B": 2, "H": 4, "Q_LEN": 1, "KV_LEN": length},
                                          "int64", None)
        checked_after_the_bucket = len(checked)
        checked.clear()
        overflow.position_range.cache_clear()
        positions._positions_that_fit(spec, {"B": 2, "H": 4, "Q_LEN": 1, "KV_LEN": 3001},
                                      "int64", None)  # the bucket's search and one exact
        assert checked_after_the_bucket <= len(checked) + 39 * most, text
        checked.clear()


def test_a_spec_the_bucket_is_too_loose_for_is_checked_at_its_exact_lengths():
    """KV_LEN's bucket 32769..65536 lets `65536 - KV_LEN` reach 32767, where q times it leaves
    int32; at KV_LEN = 65536 it is 0: the exact check passes, and a call there runs."""
    spec = flexspec.parse("m", library=load_text(
        "mask m = q * (65536 - KV_LEN) * 32768 >= kv - KV_LEN")).ir
    sizes = {"B": 1, "H": 1, "Q_LEN": 1, "KV_LEN": 65536}
    with pytest.raises(flexspec.SpecError):
        check_int_ranges(spec, position_ranges(length_buckets(sizes), 0, 65535), "int32", "")
    check_ranges(spec, sizes, "int32")  # passes: checked at the exact lengths
    with pytest.raises(flexspec.SpecError, match="for Q_LEN=1, KV_LEN=60000 on a GPU"):
        check_ranges(spec, {**sizes, "KV_LEN": 60000}, "int32")


def test_a_growing_cache_checks_its_ranges_once_per_doubling(monkeypatch):
    from flexspec.ir import overflow
    from flexspec.runtime import plan
    checked = []
    real = overflow.check_int_ranges
    counted = lambda *a: checked.append(1) or real(*a)  # noqa: E731
    # the bucket's check (overflow.fits_int_ranges) and the exact one (plan._check_ranges)
    monkeypatch.setattr(overflow, "check_int_ranges", counted)
    monkeypatch.setattr(plan, "check_int_ranges", counted)
    overflow.fits_int_ranges.cache_clear()
    plan._check_ranges.cache_clear()
    spec = flexspec.parse("causal & window(100) + alibi").ir
    for length in range(3001, 3200):
        check_ranges(spec, {"B": 2, "H": 4, "Q_LEN": 1, "KV_LEN": length}, "int32")
    assert len(checked) == 1  # the bucket 2049..4096
    assert overflow.length_buckets({"Q_LEN": 1, "KV_LEN": 3001})["KV_LEN"] == (2049, 4096)
