"""runtime.serving.mixed: a mixed batch over a paged cache (issue 27, item 2): prefill chunks
and decoded tokens of many requests in one ``attn.paged(..., new_tokens=...)`` call, each
request's rows equal to the float64 reference over its own keys, each count of new tokens run apart and
unpadded, the padding rows zero."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec.testing import Shape, bindings, spec_texts

from test_cache import DIM, KV_HEADS, filled  # pytest puts this folder on sys.path

HEADS = 6  # not DIM: an output's last dimension is not its heads'


def row_bindings(attn, extra: dict, row: int, batch: int) -> dict:
    """The bindings of one request: those declared per batch row, cut to its row."""
    declared = {t.name: t for t in attn.ir.bindings()}
    cut = {}
    for name, value in extra.items():
        shape = declared[name].shape
        per_row = (value.dim() == len(shape) and str(shape[0]) == "B"
                   and value.shape[0] == batch)
        cut[name] = value[row:row + 1] if per_row else value
    return cut


def reference_rows(attn, q, keys, values, lengths, counts, extra):
    """Each request alone, in float64: its new tokens over its own keys (KV_LEN the capacity,
    as a paged call's, the keys past its length masked)."""
    wanted = []
    for row, (length, count) in enumerate(zip(lengths, counts)):
        wanted.append(attn.reference(
            q[row:row + 1, :, :count].double(), keys[row:row + 1].double(),
            values[row:row + 1].double(), q_offset=length - count,
            kv_lengths=torch.tensor([length]), **row_bindings(attn, extra, row, len(lengths))))
    return wanted


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec_texts(), st.lists(st.tuples(st.integers(0, 30), st.integers(1, 5)), min_size=1,
                              max_size=4),
       st.sampled_from(["gather", "in_place"]), st.randoms(use_true_random=False),
       st.integers(0, 2**31 - 1), st.data())
def test_a_mixed_batch_equals_each_request_alone(eager_kernels, text, requests, read, rng,
                                                 seed, data):
    """Any registry spec, requests holding 0-30 tokens before 1-5 new ones, slots in any order,
    read gathered or in place (eager FlexAttention over the pool): each request's rows equal
    its own reference; the padding rows are zero."""
    attn = flexspec.compile(text)
    counts = [new for _, new in requests]
    lengths = [held + new for held, new in requests]
    order = rng.sample(range(len(lengths) + 2), len(lengths))
    paged, keys, values = filled(lengths, order, seed, page_size=16, max_pages=3)
    batch, q_len = len(lengths), max(counts)
    q = torch.randn(batch, HEADS, q_len, DIM, generator=torch.Generator().manual_seed(seed + 1))
    extra = data.draw(bindings(attn.spec, Shape(batch, HEADS, KV_HEADS, q_len,
                                                paged.capacity, DIM)))
    try:
        wanted = reference_rows(attn, q, keys, values, lengths, counts, extra)
    except flexspec.SpecError as error:
        with pytest.raises(type(error)), torch.no_grad():
            attn.paged(q, paged, torch.tensor(order), new_tokens=counts, read=read, **extra)
        return
    with torch.no_grad():
        got = attn.paged(q, paged, torch.tensor(order), new_tokens=counts, read=read, **extra)
    assert got.shape == (batch, HEADS, q_len, DIM)
    for row, (count, want) in enumerate(zip(counts, wanted)):
        torch.testing.assert_close(got[row:row + 1, :, :count].double(), want, rtol=1e-4,
                                   atol=1e-4)
        assert not got[row, :, count:].any()


def test_rows_of_each_count_of_new_tokens_run_together_unpadded(monkeypatch):
    """The decoded tokens (one new token each) run as one call of Q_LEN 1, each count of new
    tokens as a call of its own of that Q_LEN (not q's), whatever the order of the rows."""
    attn = flexspec.compile("causal & window(20)")
    paged, _, _ = filled([9, 12, 30, 5, 16], [4, 0, 2, 1, 5], seed=3, page_size=16,
                         max_pages=3)
    q = torch.randn(5, HEADS, 6, DIM)
    from flexspec.runtime.calls import Calls
    seen, call = [], Calls.__call__

    def recording(self, q, k, v, **options):  # the gathered parts' ordinary calls
        seen.append((q.shape[0], q.shape[2]))
        return call(self, q, k, v, **options)
    monkeypatch.setattr(Calls, "__call__", recording)
    attn.paged(q, paged, torch.tensor([4, 0, 2, 1, 5]), new_tokens=[1, 3, 1, 2, 3],
               read="gather")
    assert seen == [(2, 1), (1, 2), (2, 3)]


def test_consecutive_rows_of_a_count_are_read_and_written_through_views():
    """mixed.split: the rows of a count that stand together in the batch get a span, and
    their queries are a view of q (no copy), written back through a view of the output; rows
    apart are gathered and scattered by index. Either way each row lands where it came from."""
    from flexspec.runtime.serving import mixed
    q = torch.randn(5, HEADS, 3, DIM)
    slots = torch.arange(5)
    cases = {(1, 1, 2, 3, 3): [(0, 2), (2, 3), (3, 5)], (1, 3, 1, 2, 3): [None, (3, 4), None]}
    for counts, spans in cases.items():
        split = mixed.split(q, slots, list(counts), None, {}, {})
        assert [part.span for part in split.parts] == spans
        out = torch.zeros_like(q)
        for part in split.parts:
            queries = part.queries(q)
            if part.span is not None:
                assert queries.data_ptr() == q[part.span[0]].data_ptr()
            part.write(out, queries)
        real = split.real[:, None, :, None]
        assert torch.equal(out, q * real)


def test_a_short_chunk_of_a_full_sequence_beside_a_long_one_runs():
    """A chunk of 2 tokens at the end of a sequence holding the whole capacity, beside a chunk
    of 5: padded to 5, the short one's rows would stand past the capacity (a doc_ids lookup out
    of range); run apart, each equals its reference."""
    attn = flexspec.compile("causal & doc")
    paged, keys, values = filled([48, 20], [0, 1], seed=4, page_size=16, max_pages=3)
    ids = (torch.arange(paged.capacity) // 7).expand(2, -1).contiguous()
    q = torch.randn(2, HEADS, 5, DIM)
    got = attn.paged(q, paged, torch.tensor([0, 1]), new_tokens=[2, 5], doc_ids=ids)
    for row, (length, count) in enumerate(((48, 2), (20, 5))):
        want = attn.reference(q[row:row + 1, :, :count], keys[row:row + 1],
                              values[row:row + 1], q_offset=length - count,
                              kv_lengths=torch.tensor([length]), doc_ids=ids[row:row + 1])
        torch.testing.assert_close(got[row:row + 1, :, :count], want, rtol=1e-4, atol=1e-4)


def test_a_read_made_once_runs_the_mixed_batch_of_every_layer(eager_kernels):
    """attn.paged_read(..., new_tokens=...) makes its parts' reads once; run over a second
    cache of the same geometry (another layer), it equals a call on that cache."""
    attn = flexspec.compile("causal & doc")
    lengths, order = [20, 7, 33], [1, 3, 0]
    first, _, _ = filled(lengths, order, seed=1, page_size=16, max_pages=3)
    second, _, _ = filled(lengths, order, seed=2, page_size=16, max_pages=3)
    ids = (torch.arange(first.capacity) // 10).expand(3, -1).contiguous()
    q = torch.randn(3, HEADS, 4, DIM)
    slots = torch.tensor(order)
    with torch.no_grad():
        read = attn.paged_read(q, first, slots, new_tokens=[4, 1, 2], doc_ids=ids)
        for paged in (first, second):
            torch.testing.assert_close(read(q, paged), attn.paged(
                q, paged, slots, new_tokens=[4, 1, 2], read="in_place", doc_ids=ids))


def test_a_mixed_batch_returns_the_log_sum_exp_of_each_request(eager_kernels):
    attn = flexspec.compile("causal + alibi")
    lengths, order, counts = [12, 6], [2, 0], [1, 3]
    paged, keys, values = filled(lengths, order, seed=5, page_size=16, max_pages=3)
    q = torch.randn(2, HEADS, 3, DIM)
    with torch.no_grad():
        out, lse = attn.paged(q, paged, torch.tensor(order), new_tokens=counts,
                              return_lse=True, read="in_place")
    for row, (length, count) in enumerate(zip(lengths, counts)):
        _, want = attn.reference(q[row:row + 1, :, :count], keys[row:row + 1],
                                 values[row:row + 1], q_offset=length - count,
                                 kv_lengths=torch.tensor([length]), return_lse=True)
        torch.testing.assert_close(lse[row:row + 1, :, :count], want, rtol=1e-4, atol=1e-4)
        assert torch.isinf(lse[row, :, count:]).all()
    with torch.no_grad():  # one part: every row decodes a token
        _, alone = attn.paged(q[:, :, :1], paged, torch.tensor(order), new_tokens=[1, 1],
                              return_lse=True, read="in_place")
    torch.testing.assert_close(alone[:1], lse[:1, :, :1])


def test_bad_counts_are_refused_with_what_to_do():
    attn = flexspec.compile("causal")
    paged, _, _ = filled([5, 6], [0, 1], seed=0, page_size=16, max_pages=3)
    q, slots = torch.randn(2, HEADS, 3, DIM), torch.tensor([0, 1])
    cases = [([1], "new_tokens has 1 entries, q has 2 rows"),
             ([1, 4], r"new_tokens must lie in 1..3 \(q's Q_LEN"),
             ([0, 1], "must lie in 1..3"),
             ([1.0, 2], "new_tokens must be a list of ints"),
             ("12", "new_tokens must be a list of ints")]
    for counts, message in cases:
        with pytest.raises(flexspec.BindingError, match=message):
            attn.paged(q, paged, slots, new_tokens=counts)
    # a CPU tensor of counts is read as a list
    attn.paged(q, paged, slots, new_tokens=torch.tensor([1, 2]))


@pytest.mark.parametrize("offsets", ["tensor", "int"])
def test_a_mixed_batch_places_its_rows_at_the_offsets_given(eager_kernels, offsets):
    """q_offset given with new_tokens places each row there (not at the end of its
    sequence): a tensor of one offset per row, or one int for every row."""
    attn = flexspec.compile("causal & window(9) + alibi")
    lengths, order, counts = [30, 21, 40], [3, 0, 1], [2, 1, 4]
    paged, keys, values = filled(lengths, order, seed=6, page_size=16, max_pages=3)
    q = torch.randn(3, HEADS, 4, DIM)
    placed = [12, 20, 7] if offsets == "tensor" else [15, 15, 15]
    given = torch.tensor(placed) if offsets == "tensor" else 15
    with torch.no_grad():
        got = attn.paged(q, paged, torch.tensor(order), new_tokens=counts, q_offset=given,
                         read="in_place")
        read = attn.paged_read(q, paged, torch.tensor(order), new_tokens=counts,
                               q_offset=given, return_lse=True)
        out, lse = read(q)
    torch.testing.assert_close(out, got)
    for row, (length, count, at) in enumerate(zip(lengths, counts, placed)):
        want = attn.reference(q[row:row + 1, :, :count], keys[row:row + 1], values[row:row + 1],
                              q_offset=at, kv_lengths=torch.tensor([length]))
        torch.testing.assert_close(got[row:row + 1, :, :count], want, rtol=1e-4, atol=1e-4)
    assert lse.shape == (3, HEADS, 4) and torch.isinf(lse[1, :, 1:]).all()
    with pytest.raises(flexspec.BindingError, match=r"a MixedRead runs queries \[B, Hq, Q_LEN, "
                                                    r"D\] of the shape it was made for, got "
                                                    r"\[3, 6, 3, 4\]"):
        read(q[:, :, :3])
    with pytest.raises(flexspec.BindingError, match="got 'q'"):
        read("q")


def test_counts_on_a_device_are_refused_as_a_host_read():
    attn = flexspec.compile("causal")
    paged, _, _ = filled([5, 6], [0, 1], seed=0, page_size=16, max_pages=3)
    q, slots = torch.randn(2, HEADS, 3, DIM), torch.tensor([0, 1])
    with pytest.raises(flexspec.BindingError, match="new_tokens is read on the host: give it as "
                                                    r"a list of ints \(or a CPU tensor\), not a "
                                                    "tensor on meta, whose read would wait for "
                                                    "the device"):
        attn.paged(q, paged, slots, new_tokens=torch.ones(2, dtype=torch.long, device="meta"))
    with pytest.raises(flexspec.BindingError, match="new_tokens has 1 entries, q has 2 rows: "
                                                    "give one count per row"):
        attn.paged(q, paged, slots, new_tokens=[1])


def test_only_bindings_of_the_batch_are_cut_to_a_part_s_rows():
    """A binding declared [H] is not a row per request, even where H equals B: every part
    gets it whole; doc_ids [B, KV_LEN] is cut to each part's rows."""
    attn = flexspec.compile("causal & doc + head_bias")
    lengths, order, counts = [20, 9, 33, 14, 25, 40], [5, 0, 2, 7, 1, 3], [1, 2, 1, 3, 2, 1]
    paged, keys, values = filled(lengths, order, seed=8, page_size=16, max_pages=3)
    q = torch.randn(6, HEADS, 3, DIM)  # B = H = 6
    bias = torch.linspace(-1, 1, HEADS)
    ids = torch.stack([torch.arange(paged.capacity) // (5 + row) for row in range(6)])
    got = attn.paged(q, paged, torch.tensor(order), new_tokens=counts, bias=bias, doc_ids=ids)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        want = attn.reference(q[row:row + 1, :, :count], keys[row:row + 1],
                              values[row:row + 1], q_offset=length - count,
                              kv_lengths=torch.tensor([length]), bias=bias,
                              doc_ids=ids[row:row + 1])
        torch.testing.assert_close(got[row:row + 1, :, :count], want, rtol=1e-4, atol=1e-4)
