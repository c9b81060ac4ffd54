"""runtime.inputs: lookups that interval analysis cannot prove in range are evaluated exactly at
any length (in chunks of bounded memory), and refused with the fix where that would take too
long. Red-team item 13: above 2^24 index points the check became a warning, then inductor's
"index out of bounds" error."""

from __future__ import annotations

import pytest
import torch

import flexspec
from flexspec import limits
from flexspec.runtime.inputs import _index_range

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


def test_too_many_points_to_check_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(limits, "MAX_INDEX_CHECK_POINTS", 32)
    with pytest.raises(flexspec.BindingError, match=r"evaluating it at 64 points .* "
                                                    r"clamp\(ids\[q\], 0, 3\)"):
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
    assert _index_range(index, [1, 1, 13, 1], values, "cpu") == (int(ids.min()), int(ids.max()))


@pytest.mark.parametrize("text, backend", [("causal & window(3)", "auto"), ("causal", "auto"),
                                           ("causal + alibi", "reference")])
def test_meta_tensors_are_a_binding_error(text, backend):
    """Red-team item 9: all tensors on meta gave torch's nonzero/Tensor.item() errors."""
    q = torch.randn(1, 2, 200, 8, device="meta")
    with pytest.raises(flexspec.BindingError, match="meta device, which holds shapes but no "
                                                    "values"):
        flexspec.compile(text, backend=backend)(q, q, q)
