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
        form = draw(st.integers(0, 5))
        if values.dim() and form >= 2:  # mostly sorted, like document ids
            values = values.sort(dim=-1).values
        elif values.numel() and form == 1:  # one entry set, often the last: per-block min/max
            values = torch.zeros(shape, dtype=torch.int64)
            last = draw(st.booleans())
            at = values.numel() - 1 if last else draw(st.integers(0, values.numel() - 1))
            values.view(-1)[at] = draw(st.sampled_from((1, 3, -2)))
        return values  # form 0: scattered values, no runs
    if tensor.dtype == "bool":
        density = draw(st.sampled_from((0.0, 0.05, 0.3, 0.7, 1.0)))
        values = torch.rand(shape, generator=gen) < density
        if values.numel() and draw(st.integers(0, 5)) == 0:  # a single True entry
            values = torch.zeros(shape, dtype=torch.bool)
            values.view(-1)[draw(st.integers(0, values.numel() - 1))] = True
        return values
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


def _like(value, gen):
    """New random values of ``value``'s shape and dtype."""
    import torch

    if value.dtype == torch.bool:
        return torch.rand(value.shape, generator=gen) < 0.5
    if value.dtype.is_floating_point:
        return torch.randn(value.shape, generator=gen, dtype=value.dtype) * 2
    return torch.randint(0, 4, value.shape, generator=gen).sort(dim=-1).values


@st.composite
def binding_calls(draw, spec, shape: Shape, *, calls: int = 2, broadcast: bool = True) -> list:
    """Bindings for ``calls`` successive calls of one compiled object: a list of dicts like
    :func:`bindings`' with the same shapes. Each tensor of each call is, half the time, a view of
    one shared tensor at its own storage offset (``stack[i]``: same storage, shape, strides and
    version, only the offset differs), so that caches keyed by a tensor's identity are put to the
    test; mask and score bindings change from call to call alike."""
    import torch

    first = draw(bindings(spec, shape, broadcast=broadcast))
    rows = [first]
    for _ in range(calls - 1):
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        rows.append({name: _like(value, gen) for name, value in first.items()})
    for name in first:
        if draw(st.booleans()):
            stack = torch.stack([row[name] for row in rows])
            for i, row in enumerate(rows):
                row[name] = stack[i]
    return rows


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


def document_ids(starts, length: int):
    """Document ids per batch row (an int64 ``[len(starts), length]`` tensor): each row counts
    from 0 and a new document begins at each of its ``starts``.

    >>> document_ids(((2, 4), (1,)), 5).tolist()
    [[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]]
    """
    import torch
    rows = []
    for row in starts:
        ids = torch.zeros(length, dtype=torch.int64)
        for start in row:
            ids[start:] += 1
        rows.append(ids)
    return torch.stack(rows)
