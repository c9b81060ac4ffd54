"""Limits a checked spec must fit: the depth the recursive passes handle, the size inlining may
reach, and the constants the kernels can hold. :mod:`flexspec.lang.checker` applies them."""

from __future__ import annotations

import math

from flexspec import ir
from flexspec.errors import SpecCheckError
from flexspec.lang import ast


class Oversized(SpecCheckError):
    """A spec or definition that expands beyond :data:`MAX_INLINED_NODES`."""


# The most IR nodes inlining may write for one spec or definition: the registry's largest
# pattern writes 122; a chain that doubles at every line reaches this in 14 lines.
MAX_INLINED_NODES = 20_000

# The deepest IR the recursive passes handle within Python's default recursion limit, with
# room to spare (about three frames per level when two IRs are compared).
MAX_IR_DEPTH = 200


# What the kernels compute with: int64 indices and float32 scores. A constant outside these
# ranges would be computed wrongly (or not at all) where the reference, in float64 and Python
# ints, computes it exactly.
INT64 = (-2**63, 2**63 - 1)
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32; less rounds to 0


def check_runnable(result: ir.AttentionIR, node: ast.Node) -> None:
    """Constants the kernels can hold, and no integer division by a constant zero."""
    for root in (result.mask, result.score):
        for part in ir.walk(root):
            if isinstance(part, ir.Const) and not isinstance(part.value, bool):
                value = part.value
                if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
                    raise SpecCheckError(f"{value} does not fit in a 64-bit int, which the "
                                         "kernels compute positions with", node.span)
                if isinstance(value, float) and value != 0 and math.isfinite(value) and not (
                        FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):
                    raise SpecCheckError(f"{value!r} is beyond float32 (the kernels compute "
                                         "scores in float32, from 1.4e-45 to 3.4e38 in "
                                         "magnitude); use a value in that range", node.span)
            if isinstance(part, ir.Binary) and part.op in ("//", "%") \
                    and part.right == ir.Const(0):
                raise SpecCheckError(f"'{ir.to_text(part)}' divides by zero", node.span)
