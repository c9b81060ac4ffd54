"""Strategies for the shapes of an attention call, and whether a spec's tensor lookups fit them."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import assume
from hypothesis import strategies as st

from flexspec import ir
from flexspec.lang.spec import Spec

class Shape(NamedTuple):
    """Sizes of one attention call: q is ``(B, Hq, Q_LEN, D)``, k and v ``(B, Hkv, KV_LEN, D)``."""

    B: int
    Hq: int
    Hkv: int
    Q_LEN: int
    KV_LEN: int
    D: int

    @property
    def sizes(self) -> dict:
        """The sizes a spec sees: ``B``, ``H`` (the query heads), ``Q_LEN``, ``KV_LEN``."""
        return {"B": self.B, "H": self.Hq, "Q_LEN": self.Q_LEN, "KV_LEN": self.KV_LEN}

    def qkv(self, seed: int = 0, dtype=None, device="cpu", requires_grad: bool = False):
        """Random ``q, k, v`` of this shape (float32 unless ``dtype`` says otherwise)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        dtype = torch.float32 if dtype is None else dtype

        def make(*shape):
            t = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            return t.requires_grad_(requires_grad)

        return (make(self.B, self.Hq, self.Q_LEN, self.D),
                make(self.B, self.Hkv, self.KV_LEN, self.D),
                make(self.B, self.Hkv, self.KV_LEN, self.D))


def as_ir(spec) -> ir.AttentionIR:
    if isinstance(spec, ir.AttentionIR):
        return spec
    if isinstance(spec, Spec):
        return spec.ir
    if hasattr(spec, "ir") and isinstance(spec.ir, ir.AttentionIR):  # Attention
        return spec.ir
    from flexspec import parse

    return parse(spec).ir


def lookups_fit(spec, shape: Shape, *, exact: bool = True) -> bool:
    """Whether every tensor lookup of ``spec`` stays inside the tensor's declared shape at these
    sizes.

    With ``exact`` (the default) each index expression is evaluated at every position with the
    reference evaluator (what the semantics require); an index that reads another tensor or the
    score falls back to interval analysis. With ``exact=False`` only interval analysis is used,
    which is what the runtime checks before a call: sound, but it may refuse shapes that fit.
    """
    from flexspec.ir.intervals import lookup_ranges
    from flexspec.ir.specialize import declared_shape
    from flexspec.kernels.evaluate import evaluate, index_grid
    from flexspec.kernels.reference import placement

    spec_ir = as_ir(spec)
    sizes = shape.sizes
    # where the rows stand when a call gives no q_offset (an end-aligned spec counts from the end)
    offset = placement(spec_ir, None, None, shape.Q_LEN, shape.KV_LEN) or 0
    grid = index_grid(shape.B, shape.Hq, shape.Q_LEN, shape.KV_LEN, q_offset=offset) \
        if exact else None
    for tensor, dim, index, span in lookup_ranges(spec_ir, sizes, offset):
        size = declared_shape(tensor, sizes)[dim]
        plain = not any(isinstance(n, ir.Lookup) or (isinstance(n, ir.Var) and n.name == "score")
                        for n in ir.walk(index))
        if exact and plain:
            values = evaluate(index, grid, {})
            if values.min().item() < 0 or values.max().item() >= size:
                return False
        elif span is not None and (span[0] < 0 or span[1] >= size):
            return False
    return True


def _length(max_len: int):
    # near block edges, and odd multiples of half a block (16 mod 32, 64 mod 128), where a rule
    # that reads the wrong one of two unequal block sizes goes wrong
    edges = [n for n in (1, 2, 3, 17, 48, 64, 80, 127, 129, 144, 192, 255, 257, 320, 383, 385)
             if n <= max_len]
    return st.one_of(st.integers(1, max_len), st.sampled_from(edges)).filter(
        lambda n: n % 128 != 0)


@st.composite
def shapes(draw, max_len: int = 300, *, spec=None, max_batch: int = 3, max_kv_heads: int = 3,
           max_group: int = 3, head_dims=(8, 16, 32)) -> Shape:
    """``Shape(B, Hq, Hkv, Q_LEN, KV_LEN, D)``: lengths in ``1..max_len`` that are not multiples
    of 128, ``Q_LEN == KV_LEN`` about a third of the time, ``Hq`` a multiple of ``Hkv``.

    Given ``spec`` (text, :class:`~flexspec.Spec`, ``Attention`` or IR), only shapes whose tensor
    lookups stay in range (see :func:`lookups_fit`): where that needs it, ``Q_LEN`` is made
    ``<= KV_LEN`` (document-style masks index ``[B, KV_LEN]`` tensors by ``q``).
    """
    if max_len < 1:
        raise ValueError("max_len must be at least 1")
    batch = draw(st.integers(1, max_batch))
    kv_heads = draw(st.integers(1, max_kv_heads))
    heads = kv_heads * draw(st.integers(1, max_group))
    kv_len = draw(_length(max_len))
    q_len = kv_len if draw(st.integers(0, 2)) == 0 else draw(_length(max_len))
    shape = Shape(batch, heads, kv_heads, q_len, kv_len, draw(st.sampled_from(head_dims)))
    if spec is not None and not lookups_fit(spec, shape):
        shape = shape._replace(Q_LEN=min(q_len, kv_len), KV_LEN=max(q_len, kv_len))
        assume(lookups_fit(spec, shape))
    return shape
