"""runtime.identity: what the caches see of a tensor (its identity), the memo kept by it, and
what they see of an argument (meta)."""

from __future__ import annotations

import pytest
import torch

from flexspec.runtime.identity import KeptByIdentity, identity, known_range, meta, remember_range


def test_the_identity_of_a_tensor_is_its_memory_layout_dtype_and_version():
    base = torch.arange(12).reshape(3, 4)
    assert identity(base) == identity(base) == identity(base.view(3, 4))
    assert identity(base) != identity(base.clone())           # other memory
    assert identity(base[0]) != identity(base[1])             # other offset
    assert identity(base[:2]) != identity(base[:1])           # other shape
    square = torch.zeros(3, 3)
    assert identity(square) != identity(square.t())           # other strides
    floats = torch.zeros(4)
    assert identity(floats) != identity(floats.view(torch.int32))  # other dtype, same memory
    before = identity(base)
    base.add_(1)                                              # in place: a new version
    assert identity(base) != before
    assert identity(base) == identity(base)


def test_meta_is_what_guards_see_of_an_argument():
    t = torch.zeros(2, 3)
    assert meta(t) == meta(torch.ones(2, 3))
    others = [torch.zeros(3, 2), t.double(), t.to("meta"), torch.zeros(3, 2).t(),
              t.clone().requires_grad_()]
    assert all(meta(other) != meta(t) for other in others)
    assert meta(3) == meta(4) == (int,) and meta(3.0) == (float,) and meta(None) == (type(None),)


def test_the_memo_keeps_the_last_results_and_their_tensors_and_nothing_that_failed():
    memo = KeptByIdentity(2)
    tensors = [torch.tensor([n]) for n in range(3)]
    made = [memo.get((identity(t),), t, lambda t=t: t * 10) for t in tensors[:2]]
    assert memo.get((identity(tensors[0]),), tensors[0], lambda: "made again") is made[0]
    memo.get((identity(tensors[2]),), tensors[2], lambda: tensors[2] * 10)
    # the least recently used (tensors[1]) went
    assert memo.get((identity(tensors[1]),), tensors[1], lambda: "made again") == "made again"
    assert memo._kept[(identity(tensors[2]),)][0] is tensors[2]  # kept alive with its result

    def refuse():
        raise ValueError("refused")
    for _ in range(2):  # a failure is not kept: the same key fails again
        with pytest.raises(ValueError):
            memo.get(("bad",), None, refuse)


def test_a_remembered_range_holds_for_the_tensor_and_its_views_until_it_changes():
    made = torch.full((3,), 7)
    remember_range(made, 7, 7)
    assert known_range(made) == (7, 7) and known_range(made.detach()) == (7, 7)
    assert known_range(torch.full((3,), 7)) is None  # equal values, another tensor
    made.add_(1)  # changed in place: the range is no longer known
    assert known_range(made) is None
    with torch.inference_mode():
        inference = torch.full((3,), 7)
    remember_range(inference, 7, 7)  # no version counter: nothing is remembered
    assert known_range(inference) is None
