"""Strategies for the values of a spec's tensors (bindings, learnable tables) and whole test cases."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st

from flexspec import ir
from flexspec.lang.spec import Spec
from flexspec.testing.shapes import Shape, as_ir, shapes
from flexspec.testing.specs import DEFAULT_KINDS, specs

def _tensor_value(draw, tensor: ir.Tensor, sizes: dict, broadcast: bool):
    import torch

    from flexspec.ir.specialize import broadcast_dims, declared_shape

    shape = list(declared_shape(tensor, sizes))
    if broadcast:
        may_broadcast = broadcast_dims(tensor)
        for dim, allowed in enumerate(may_broadcast):
            if allowed and draw(st.integers(0, 3)) == 0:
                shape[dim] = 1
        # Leading size-1 dimensions may be left out: [KV_LEN] for [1, KV_LEN].
        lead = 0
        while lead < len(shape) and shape[lead] == 1 and may_broadcast[lead]:
            lead += 1
        if lead and draw(st.booleans()):
            shape = shape[lead:]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if tensor.dtype == "int":
        groups = draw(st.integers(1, 5))
        values = torch.randint(0, groups, shape, generator=gen)
        if values.dim() and draw(st.integers(0, 4)):  # mostly sorted, like document ids
            values = values.sort(dim=-1).values
        return values
    if tensor.dtype == "bool":
        density = draw(st.sampled_from((0.0, 0.05, 0.3, 0.7, 1.0)))
        return torch.rand(shape, generator=gen) < density
    scale = draw(st.sampled_from((0.1, 1.0, 4.0)))
    return torch.randn(shape, generator=gen) * scale


@st.composite
def bindings(draw, spec, shape: Shape, *, broadcast: bool = True, learnables: bool = False):
    """Valid values for ``spec``'s runtime bindings at ``shape``: a dict ``name -> tensor`` to
    pass as ``attn(q, k, v, **values)``.

    int tensors hold a few ids (mostly sorted, like ``doc_ids``), bool tensors a random density
    from 0 to 1, float tensors random normal values. With ``broadcast``, a ``B`` or ``H``
    dimension is sometimes 1 and leading size-1 dimensions are sometimes left out. With
    ``learnables``, learnable tables (``rel_bias_table``...) get random values too, bound by
    name, so that tests see non-zero tables.
    """
    spec_ir = as_ir(spec)
    sizes = shape.sizes
    values = {}
    for tensor in spec_ir.tensors():
        if tensor.origin == "binding" or (learnables and tensor.origin == "learnable"):
            if tensor.name not in values:
                values[tensor.name] = _tensor_value(
                    draw, tensor, sizes, broadcast and tensor.origin == "binding")
    return values


@st.composite
def tensor_values(draw, spec, shape: Shape, *, broadcast: bool = True):
    """Values for *every* tensor ``spec`` (an IR, or anything :func:`specs` gives) reads, keyed by
    :func:`flexspec.kernels.tensors.tensor_key`: bindings and learnables drawn as in :func:`bindings`,
    builtins (``alibi_slopes(H)``) computed. What :mod:`flexspec.kernels.reference` takes."""
    from flexspec.kernels.tensors import builtin_tensor, tensor_key

    spec_ir = as_ir(spec)
    values = {}
    for tensor in spec_ir.tensors():
        key = tensor_key(tensor)
        if key in values:
            continue
        if tensor.origin == "builtin":
            values[key] = builtin_tensor(tensor, shape.sizes)
        else:
            values[key] = _tensor_value(draw, tensor, shape.sizes,
                                        broadcast and tensor.origin == "binding")
    return values


class Case(NamedTuple):
    """One test case: a spec, a shape that fits it, and its bindings."""

    spec: Spec
    shape: Shape
    bindings: dict

    def attention(self, **kwargs):
        """``flexspec.compile(self.spec, **kwargs)``."""
        from flexspec import compile as compile_spec

        return compile_spec(self.spec, **kwargs)


@st.composite
def cases(draw, max_len: int = 300, *, learnables: bool | None = None, broadcast: bool = True,
          shape_options: dict | None = None, **spec_options) -> Case:
    """A :class:`Case`: a spec from :func:`specs` (``spec_options`` go there), a shape from
    :func:`shapes` that fits it, and :func:`bindings` for both. ``learnables`` (default: whether
    ``kinds`` includes ``"learnable"``) also binds random learnable tables."""
    spec = draw(specs(**spec_options))
    shape = draw(shapes(max_len, spec=spec, **(shape_options or {})))
    if learnables is None:
        learnables = "learnable" in spec_options.get("kinds", DEFAULT_KINDS)
    values = draw(bindings(spec, shape, broadcast=broadcast, learnables=learnables))
    return Case(spec, shape, values)
