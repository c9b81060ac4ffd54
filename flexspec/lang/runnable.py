"""Whether a checked spec's IR can run: every constant fits the dtype the kernels compute it in
(ints in int64, floats in float32) and no integer division is by a constant zero. The limits
themselves, and the checks of ranges that depend on lengths, are in :mod:`flexspec.limits`."""

from __future__ import annotations

from flexspec import ir
from flexspec.errors import SpecCheckError
from flexspec.lang import ast
from flexspec.limits import check_float_constant, check_int_constant


def check_runnable(result: ir.AttentionIR, node: ast.Node) -> None:
    """Constants the kernels can hold, and no integer division by a constant zero."""
    for root in (result.mask, result.score):
        check_constants(root, node.span)


def check_constants(expr: ir.Expr, span) -> None:
    """:func:`check_runnable` for one expression, such as a definition's body checked on its
    own (its parameters symbolic), so that ``flexspec check`` finds its constants too."""
    for part in ir.walk(expr):
        if isinstance(part, ir.Const) and not isinstance(part.value, bool):
            if isinstance(part.value, int):
                check_int_constant(part.value, error=SpecCheckError, span=span)
            else:
                check_float_constant(part.value, error=SpecCheckError, span=span)
        if isinstance(part, ir.Binary) and part.op in ("//", "%") and part.right == ir.Const(0):
            raise SpecCheckError(f"'{ir.to_text(part)}' divides by zero", span)
