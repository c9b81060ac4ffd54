"""What flexspec promises about NaN inputs (docs/howto.md, "NaN in the inputs"): every row that
does not read a NaN is what the reference gives, on every backend; the rows that read one are NaN
on the reference and SDPA, and unspecified on FlexAttention's kernels (zeros, or finite numbers:
the CPU kernel gave both)."""

from __future__ import annotations

import pytest
import torch

import flexspec


@pytest.mark.parametrize("text, backend", [("causal", "sdpa"), ("causal", "flex"),
                                           ("causal & window(40) + alibi", "flex"),
                                           ("causal & window(40) + alibi", "reference")])
def test_a_nan_spoils_only_the_rows_that_read_it(text, backend):
    attn = flexspec.compile(text, backend=backend)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 16, generator=generator) for _ in range(3))
    q[0, 0, 50] = float("nan")    # query row 50 of head 0
    k[0, 1, 120] = float("nan")   # key 120 of head 1: every row of head 1 that sees it
    with torch.no_grad():
        out = attn(q, k, v)
    clean_q, clean_k = q.clone(), k.clone()
    clean_q[0, 0, 50], clean_k[0, 1, 120] = 0.0, 0.0
    expected = attn.reference(clean_q.double(), clean_k.double(), v.double())
    sees = attn.dense_mask(200, 200, heads=2)[0].expand(2, 200, 200)
    spoiled = torch.zeros(2, 200, dtype=torch.bool)
    spoiled[0, 50] = True
    spoiled[1] = sees[1, :, 120]
    if backend in ("sdpa", "reference"):
        assert out[0][spoiled].isnan().all()
    torch.testing.assert_close(out[0][~spoiled].double(), expected[0][~spoiled],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "flex", "sdpa"])
def test_a_nan_value_reaches_the_rows_the_docs_say(backend):
    """A NaN in the values at key 150 of 300 (causal): on the reference only the rows that see
    it (150..299) are NaN and every other row is exact (the weighted sum skips keys of weight
    0: a matrix product spread it to every row); on FlexAttention's CPU kernel the rows of the
    query tiles whose block mask lists its key tile (128..299), the rows before them exact; on
    SDPA every row of the head, as docs/howto.md says."""
    attn = flexspec.compile("causal", backend=backend)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 300, 16, generator=generator) for _ in range(3))
    v[0, 0, 150, 3] = float("nan")
    with torch.no_grad():
        out = attn(q, k, v)
    nan_rows = out[0, 0].isnan().any(-1)
    first = {"reference": 150, "flex": 128, "sdpa": 0}[backend]
    assert nan_rows[first:].all() and not nan_rows[:first].any()
    clean = v.clone()
    clean[0, 0, 150, 3] = 0.0
    expected = attn.reference(q.double(), k.double(), clean.double())
    torch.testing.assert_close(out[0, 0, :first].double(), expected[0, 0, :first], rtol=1e-4,
                               atol=1e-4)


def test_an_infinite_value_reaches_the_rows_that_see_it_on_the_reference():
    """+inf alone gives +inf, +inf and -inf in one column NaN, in exactly the rows that see
    them (a window of 8): the reference's weighted sum, not a matrix product."""
    attn = flexspec.compile("causal & window(8)", backend="reference")
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 64, 4, generator=generator) for _ in range(3))
    v[0, 0, 20, 0], v[0, 0, 24, 0], v[0, 0, 24, 1] = float("inf"), float("-inf"), float("inf")
    out = attn(q, k, v)[0, 0]
    sees_20, sees_24 = torch.arange(64).sub(20).clamp(min=0).le(8) & (torch.arange(64) >= 20), \
        (torch.arange(64) >= 24) & (torch.arange(64) <= 32)
    assert torch.equal(out[:, 0].isnan(), sees_20 & sees_24)
    assert torch.equal(out[:, 0] == float("inf"), sees_20 & ~sees_24)
    assert torch.equal(out[:, 0] == float("-inf"), sees_24 & ~sees_20)
    assert torch.equal(out[:, 1] == float("inf"), sees_24)
    assert out[~(sees_20 | sees_24)].isfinite().all()
