"""Shapes and broadcasting of the tensors a spec reads, on the IR alone (no torch).

A tensor is declared with one expression of sizes per dimension (``doc_ids: int[B, KV_LEN]``);
:func:`declared_shape` evaluates them. A binding may be smaller than declared: it may have fewer
dimensions (leading size-1 dimensions are implied), and a dimension sized ``B`` or ``H``
(:func:`broadcast_dims`) may have size 1, read at index 0 whatever the index says.
:func:`specialize` rewrites the IR that way, so a ``doc_ids`` of shape ``[1, KV_LEN]`` gives a mask
that does not depend on ``b`` (and its BlockMask can be shared by all batches).
"""

from __future__ import annotations

import functools

from flexspec import ir
from flexspec.errors import SpecError

# The sizes a binding may broadcast over (give 1 for them).
BROADCAST_SIZES = ("B", "H")


def broadcast_dims(tensor: ir.Tensor) -> tuple[bool, ...]:
    """Per dimension of ``tensor``: whether it is sized by ``B`` or ``H`` (a binding may give 1).

    >>> broadcast_dims(ir.Tensor("doc_ids", (ir.Var("B"), ir.Var("KV_LEN")), dtype="int"))
    (True, False)
    """
    return tuple(isinstance(d, ir.Var) and d.name in BROADCAST_SIZES for d in tensor.shape)


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
    entry = None
    if isinstance(expr, ir.Call):
        entry = ir.FUNCTIONS[expr.fn]
    elif isinstance(expr, (ir.Unary, ir.Binary)):
        entry = ir.OPERATORS[expr.op]
    if entry is None or not entry.in_shapes:
        raise SpecError(f"'{ir.to_text(expr)}' cannot be used in a tensor shape")
    return entry.python(*(_eval_size(a, sizes) for a in ir.children(expr)))


def declared_shape(t: ir.Tensor, sizes: dict) -> tuple[int, ...]:
    """The shape a tensor is declared with, evaluated for concrete sizes (a negative dimension
    is a :class:`SpecError`)."""
    shape = tuple(eval_size_expr(d, sizes) for d in t.shape)
    if any(n < 0 for n in shape):
        dims = ", ".join(ir.to_text(d) for d in t.shape)
        raise SpecError(f"tensor '{t.name}' is declared as [{dims}], which is "
                        f"{list(shape)} here: a dimension cannot be negative")
    return shape


def specialize(expr: ir.Expr, shapes: dict, sizes: dict | None = None) -> ir.Expr:
    """``expr`` with each index into a broadcast size-1 dimension of a tensor replaced by
    ``Const(0)``.

    ``shapes`` maps :func:`~flexspec.ir.tensor_key` to the actual shape of each tensor. A shape with fewer
    dimensions than the lookup has indices counts as having leading size-1 dimensions (the
    runtime prepends them, see :func:`flexspec.kernels.tensors.add_leading_dims`). Tensors missing from ``shapes`` are
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
        shape = shapes.get(ir.tensor_key(node.tensor))
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
    """:func:`specialize` applied to both halves of an :class:`~flexspec.ir.AttentionIR`:
    ``spec`` itself where no dimension is broadcast, and one IR per pattern of broadcast
    dimensions (the same for every length: a growing cache specializes once)."""
    pattern = tuple(_broadcast(tensor, shapes, sizes) for tensor in spec.tensors())
    if not any(any(flags) for flags in pattern if flags is not None):
        return spec
    return _specialized(spec, pattern)


def _broadcast(tensor: ir.Tensor, shapes: dict, sizes: dict | None) -> tuple | None:
    """Per dimension of ``tensor``'s lookups, whether :func:`specialize` reads it at index 0
    (``None`` for a tensor missing from ``shapes``)."""
    shape = shapes.get(ir.tensor_key(tensor))
    if shape is None:
        return None
    shape = (1,) * (len(tensor.shape) - len(shape)) + tuple(shape)
    declared = (None,) * len(shape)
    if sizes is not None and len(tensor.shape) == len(shape):
        declared = tuple(declared_shape(tensor, sizes))
    return tuple(size == 1 and want != 1 for size, want in zip(shape, declared))


@functools.lru_cache(maxsize=256)
def _specialized(spec: ir.AttentionIR, pattern: tuple) -> ir.AttentionIR:
    """``spec`` with each index into a dimension ``pattern`` flags read at ``Const(0)``."""
    flags = {ir.tensor_key(tensor): found for tensor, found in zip(spec.tensors(), pattern)}

    def rewrite(node: ir.Expr) -> ir.Expr:
        if not (isinstance(node, ir.Lookup) and isinstance(node.tensor, ir.Tensor)):
            return node
        found = flags.get(ir.tensor_key(node.tensor))
        if found is None or len(found) != len(node.index):
            return node
        index = tuple(ir.Const(0) if flag else i for i, flag in zip(node.index, found))
        return ir.Lookup(node.tensor, index) if index != node.index else node

    return ir.AttentionIR(ir.transform(spec.mask, rewrite), ir.transform(spec.score, rewrite),
                          spec.align)
