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
