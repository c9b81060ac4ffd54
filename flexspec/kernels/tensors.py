"""Preparing the tensors a spec reads: keys, shapes, built-in and learnable values, broadcasting.

A spec reads three kinds of tensors (see :class:`flexspec.ir.Tensor`): *bindings* the user passes
by name at call time, *builtins* computed from the sizes (``alibi_slopes(H)``) and *learnables*
(model parameters). Every stage that touches tensor values (the reference, the lowering, the
runtime) finds them in one dict keyed by :func:`tensor_key`.

Broadcasting convention. A binding may be smaller than declared, in two ways:

* it may have fewer dimensions: the runtime first reshapes it by prepending size-1 dimensions
  (:func:`add_leading_dims`), so ``doc_ids`` of shape ``[KV_LEN]`` declared ``[B, KV_LEN]``
  becomes ``[1, KV_LEN]``;
* a dimension may have size 1: it is read at index 0 whatever the index expression says.
  :func:`specialize` rewrites the IR that way, so a ``doc_ids`` of shape ``[1, KV_LEN]`` gives a
  mask that does not depend on ``b`` (and its BlockMask can be shared by all batches).

This is where torch starts; it must not import the lowering or the reference.
"""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import SpecError

# The usual scale for learnable attention biases (T5, Swin); "normal" means N(0, 0.02^2).
NORMAL_INIT_STD = 0.02

_TORCH_DTYPES = {"float": torch.float32, "int": torch.int64, "bool": torch.bool}


def tensor_key(t: ir.Tensor) -> str:
    """The stable, unique name under which a tensor's value is stored.

    >>> tensor_key(ir.Tensor("alibi_slopes", (ir.Var("H"),), origin="builtin",
    ...                      builtin="alibi_slopes", args=(ir.Var("H"),)))
    'alibi_slopes(H)'
    """
    # Two builtins with different arguments (alibi_slopes(H) vs alibi_slopes(8)) are different
    # tensors, so a builtin is keyed by its whole call text, not by its name.
    return ir.to_text(t) if t.origin == "builtin" else t.name


def torch_dtype(t: ir.Tensor) -> torch.dtype:
    """The torch dtype of a tensor's declared element type (float32, int64, bool)."""
    return _TORCH_DTYPES[t.dtype]


def eval_size_expr(expr: ir.Expr, sizes: dict) -> int:
    """The integer value of a shape expression over sizes (``B H Q_LEN KV_LEN``) and constants.

    >>> eval_size_expr(ir.Binary("//", ir.Var("KV_LEN"), ir.Const(128)), {"KV_LEN": 300})
    2
    """
    value = _eval_size(expr, sizes)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"the shape expression '{ir.to_text(expr)}' is {value!r}, not an int")
    return value


def _eval_size(expr: ir.Expr, sizes: dict):
    if isinstance(expr, ir.Const):
        return expr.value
    if isinstance(expr, ir.Var):
        if expr.name not in sizes:
            raise SpecError(f"a shape may only use the sizes B, H, Q_LEN, KV_LEN, "
                            f"not '{expr.name}'")
        return int(sizes[expr.name])
    if isinstance(expr, ir.Unary) and expr.op == "neg":
        return -_eval_size(expr.operand, sizes)
    if isinstance(expr, ir.Binary) and expr.op in ir.ARITH_OPS:
        left, right = _eval_size(expr.left, sizes), _eval_size(expr.right, sizes)
        if expr.op == "+":
            return left + right
        if expr.op == "-":
            return left - right
        if expr.op == "*":
            return left * right
        if expr.op == "/":
            return left / right
        if expr.op == "//":
            return left // right
        return left % right
    if isinstance(expr, ir.Call) and expr.fn in ("min", "max"):
        values = [_eval_size(a, sizes) for a in expr.args]
        return min(values) if expr.fn == "min" else max(values)
    raise SpecError(f"'{ir.to_text(expr)}' cannot be used in a tensor shape")


def declared_shape(t: ir.Tensor, sizes: dict) -> tuple[int, ...]:
    """The shape a tensor is declared with, evaluated for concrete sizes."""
    return tuple(eval_size_expr(d, sizes) for d in t.shape)


def builtin_tensor(t: ir.Tensor, sizes: dict, device="cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value of a built-in tensor such as ``alibi_slopes(H)``.

    ``alibi_slopes(n)`` is the geometric sequence ``slope[h] = 2 ** (-8 * (h + 1) / n)`` of the
    ALiBi paper (exact for any ``n``, not only powers of two).
    """
    args = [eval_size_expr(a, sizes) for a in t.args]
    if t.builtin == "alibi_slopes" and len(args) == 1:
        n = args[0]
        # Computed in float64 so every dtype gets the correctly rounded value.
        h = torch.arange(n, dtype=torch.float64, device=device)
        return torch.pow(2.0, -8.0 * (h + 1) / n).to(dtype)
    raise SpecError(f"unknown built-in tensor '{ir.to_text(t)}'")


def init_learnable(t: ir.Tensor, sizes: dict, device="cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh initial value for a learnable tensor (a plain tensor; the caller makes it a
    parameter). ``init`` is ``"zeros"`` or ``"normal"`` (std :data:`NORMAL_INIT_STD`)."""
    shape = declared_shape(t, sizes)
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
    return value.reshape((1,) * (ndim - value.dim()) + tuple(value.shape))


def specialize(expr: ir.Expr, shapes: dict, sizes: dict | None = None) -> ir.Expr:
    """``expr`` with each index into a broadcast size-1 dimension of a tensor replaced by
    ``Const(0)``.

    ``shapes`` maps :func:`tensor_key` to the actual shape of each tensor. A shape with fewer
    dimensions than the lookup has indices counts as having leading size-1 dimensions (the
    runtime prepends them, see :func:`add_leading_dims`). Tensors missing from ``shapes`` are
    left alone. With ``sizes``, a dimension whose declared size is 1 too (``B`` when the batch
    is 1) is not a broadcast and keeps its index: FLASH (CuTeDSL) failed to compile a lookup at
    a constant index where the same lookup at ``b`` compiled.

    >>> doc = ir.Tensor("doc_ids", (ir.Var("B"), ir.Var("KV_LEN")), dtype="int")
    >>> lookup = ir.Lookup(doc, (ir.Var("b"), ir.Var("kv")))
    >>> ir.to_text(specialize(lookup, {"doc_ids": (1, 64)}))
    'doc_ids[0, kv]'
    >>> ir.to_text(specialize(lookup, {"doc_ids": (1, 64)}, {"B": 1, "KV_LEN": 64}))
    'doc_ids[b, kv]'
    """
    def rewrite(node: ir.Expr) -> ir.Expr:
        if not (isinstance(node, ir.Lookup) and isinstance(node.tensor, ir.Tensor)):
            return node
        shape = shapes.get(tensor_key(node.tensor))
        if shape is None:
            return node
        shape = (1,) * (len(node.index) - len(shape)) + tuple(shape)
        declared = (None,) * len(shape)
        if sizes is not None and len(node.tensor.shape) == len(shape):
            declared = tuple(declared_shape(node.tensor, sizes))
        index = tuple(ir.Const(0) if size == 1 and want != 1 else i
                      for i, size, want in zip(node.index, shape, declared))
        return ir.Lookup(node.tensor, index) if index != node.index else node
    return ir.transform(expr, rewrite)


def specialize_ir(spec: ir.AttentionIR, shapes: dict,
                  sizes: dict | None = None) -> ir.AttentionIR:
    """:func:`specialize` applied to both halves of an :class:`~flexspec.ir.AttentionIR`."""
    return ir.AttentionIR(specialize(spec.mask, shapes, sizes),
                          specialize(spec.score, shapes, sizes), spec.notes)


def prepare(spec: ir.AttentionIR, sizes: dict, bindings: dict, device="cpu",
            learnables: dict | None = None) -> dict:
    """Every tensor ``spec`` reads, keyed by :func:`tensor_key`: bindings taken from
    ``bindings`` (by name, with leading dimensions added), builtins computed, learnables taken
    from ``learnables`` or freshly initialised. Checking bindings is the runtime's job."""
    learnables = learnables or {}
    values = {}
    for t in spec.tensors():
        key = tensor_key(t)
        if t.origin == "binding":
            values[key] = add_leading_dims(torch.as_tensor(bindings[t.name], device=device),
                                           len(t.shape))
        elif t.origin == "builtin":
            values[key] = builtin_tensor(t, sizes, device)
        elif key in learnables:
            values[key] = learnables[key]
        else:
            values[key] = init_learnable(t, sizes, device)
    return values

