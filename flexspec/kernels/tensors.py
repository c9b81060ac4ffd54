"""Preparing the tensors a spec reads: keys, shapes, built-in and learnable values, broadcasting.

A spec reads three kinds of tensors (see :class:`flexspec.ir.Tensor`): *bindings* the user passes
by name at call time, *builtins* computed from the sizes (``alibi_slopes(H)``) and *learnables*
(model parameters). Every stage that touches tensor values (the reference, the lowering, the
runtime) finds them in one dict keyed by :func:`flexspec.ir.tensor_key`.

Broadcasting convention. A binding may be smaller than declared, in two ways:

* it may have fewer dimensions: the runtime first reshapes it by prepending size-1 dimensions
  (:func:`add_leading_dims`), so ``doc_ids`` of shape ``[KV_LEN]`` declared ``[B, KV_LEN]``
  becomes ``[1, KV_LEN]``;
* a dimension sized ``B`` or ``H`` may have size 1: it is read at index 0 whatever the index
  expression says (:mod:`flexspec.ir.specialize` rewrites the IR that way).

This is where torch starts; it must not import the lowering or the reference.
"""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.ir import tensor_key
from flexspec.ir.specialize import declared_shape, eval_size_expr
from flexspec.limits import check_table

# The usual scale for learnable attention biases (T5, Swin); "normal" means N(0, 0.02^2).
NORMAL_INIT_STD = 0.02

_TORCH_DTYPES = {"float": torch.float32, "int": torch.int64, "bool": torch.bool}




def torch_dtype(t: ir.Tensor) -> torch.dtype:
    """The torch dtype of a tensor's declared element type (float32, int64, bool)."""
    return _TORCH_DTYPES[t.dtype]


def builtin_tensor(t: ir.Tensor, sizes: dict, device="cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value of a built-in tensor such as ``alibi_slopes(H)``.

    ``alibi_slopes(n)`` is the geometric sequence ``slope[h] = 2 ** (-8 * (h + 1) / n)`` of the
    ALiBi paper (exact for any ``n``, not only powers of two).
    """
    args = [eval_size_expr(a, sizes) for a in t.args]
    if t.builtin == "alibi_slopes" and len(args) == 1:
        n = args[0]
        if n < 1:
            raise SpecError(f"'{ir.to_text(t)}' needs a positive number of heads, got {n}")
        check_table(t.name, (n,))
        # Computed in float64 so every dtype gets the correctly rounded value.
        h = torch.arange(n, dtype=torch.float64, device=device)
        return torch.pow(2.0, -8.0 * (h + 1) / n).to(dtype)
    raise SpecError(f"unknown built-in tensor '{ir.to_text(t)}'")


def init_learnable(t: ir.Tensor, sizes: dict, device="cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh initial value for a learnable tensor (a plain tensor; the caller makes it a
    parameter). ``init`` is ``"zeros"`` or ``"normal"`` (std :data:`NORMAL_INIT_STD`)."""
    shape = declared_shape(t, sizes)
    check_table(t.name, shape)
    if t.init in ("zeros", ""):
        return torch.zeros(shape, dtype=dtype, device=device)
    if t.init == "normal":
        return torch.randn(shape, dtype=dtype, device=device) * NORMAL_INIT_STD
    raise SpecError(f"unknown initialisation '{t.init}' for learnable tensor '{t.name}'")


def add_leading_dims(value: torch.Tensor, ndim: int) -> torch.Tensor:
    """``value`` viewed with size-1 dimensions prepended up to ``ndim`` dimensions."""
    if value.dim() > ndim:
        raise SpecError(f"a tensor with {value.dim()} dimensions was given where {ndim} are "
                        "declared")
    if value.dim() == ndim:  # a view costs microseconds, and plans gather at every new length
        return value
    return value.reshape((1,) * (ndim - value.dim()) + tuple(value.shape))


def prepare(spec: ir.AttentionIR, sizes: dict, bindings: dict, device="cpu",
            learnables: dict | None = None, builtins: dict | None = None) -> dict:
    """Every tensor ``spec`` reads, keyed by :func:`tensor_key`: bindings taken from
    ``bindings`` (by name, with leading dimensions added), builtins taken from ``builtins`` or
    computed, learnables taken from ``learnables`` or freshly initialised. Checking bindings is
    the runtime's job."""
    learnables, builtins = learnables or {}, builtins or {}
    values = {}
    for t in spec.tensors():
        key = tensor_key(t)
        if t.origin == "binding":
            values[key] = add_leading_dims(torch.as_tensor(bindings[t.name], device=device),
                                           len(t.shape))
        elif t.origin == "builtin":
            found = builtins.get(key)
            values[key] = builtin_tensor(t, sizes, device) if found is None else found
        elif key in learnables:
            values[key] = learnables[key]
        else:
            values[key] = init_learnable(t, sizes, device)
    return values

