"""runtime.identity: what the caches see of a tensor (its identity) and of an argument (meta)."""

from __future__ import annotations

import torch

from flexspec.runtime.identity import identity, meta


def test_the_identity_of_a_tensor_is_its_memory_layout_and_version():
    base = torch.arange(12).reshape(3, 4)
    assert identity(base) == identity(base) == identity(base.view(3, 4))
    assert identity(base) != identity(base.clone())           # other memory
    assert identity(base[0]) != identity(base[1])             # other offset
    assert identity(base[:2]) != identity(base[:1])           # other shape
    square = torch.zeros(3, 3)
    assert identity(square) != identity(square.t())           # other strides
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
