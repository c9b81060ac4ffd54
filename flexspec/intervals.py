"""Interval bounds of IR expressions: the smallest and largest value a node can take when each
variable ranges over an interval. Pure Python.

Used by the runtime to prove that every tensor lookup stays inside its tensor (``doc_ids[b, q]``
needs ``Q_LEN <= KV_LEN``). The rules follow tinygrad's ``vmin``/``vmax``: for ``a - b`` the range
is ``[a.lo - b.hi, a.hi - b.lo]``. Bounds are sound (every value lies inside) but not always tight;
``None`` means "unknown".

>>> from flexspec.ir import Binary, Var
>>> bounds(Binary("-", Var("q"), Var("kv")), {"q": (0, 9), "kv": (0, 4)})
(-4, 9)
"""

from __future__ import annotations

import math

from . import ir

Interval = tuple  # (lo, hi)


def _corners(op, a: Interval, b: Interval) -> Interval | None:
    try:
        values = [op(x, y) for x in a for y in b]
    except (ArithmeticError, ValueError):
        return None
    if any(isinstance(v, float) and math.isnan(v) for v in values):
        return None
    return min(values), max(values)


def bounds(expr: ir.Expr, ranges: dict) -> Interval | None:
    """``(lo, hi)`` of a numeric expression given ``ranges`` (name -> (lo, hi)) for variables
    (indices and sizes); ``None`` where no bound is known (tensor values, scores, divisions by
    intervals containing zero)."""
    if isinstance(expr, ir.Const):
        return None if isinstance(expr.value, bool) else (expr.value, expr.value)
    if isinstance(expr, ir.Var):
        return ranges.get(expr.name)
    if isinstance(expr, ir.Unary) and expr.op == "neg":
        inner = bounds(expr.operand, ranges)
        return None if inner is None else (-inner[1], -inner[0])
    if isinstance(expr, ir.Binary) and expr.op in ir.ARITH_OPS:
        a, b = bounds(expr.left, ranges), bounds(expr.right, ranges)
        if a is None or b is None:
            return None
        if expr.op == "+":
            return a[0] + b[0], a[1] + b[1]
        if expr.op == "-":
            return a[0] - b[1], a[1] - b[0]
        if expr.op == "*":
            return _corners(lambda x, y: x * y, a, b)
        if b[0] <= 0 <= b[1]:
            if expr.op == "%" and b[0] == b[1] == 0:
                return None
            if expr.op == "%" and b[0] >= 0:
                return 0, b[1] - 1
            return None
        if expr.op == "/":
            return _corners(lambda x, y: x / y, a, b)
        if expr.op == "//":
            return _corners(lambda x, y: x // y, a, b)
        # Python modulo by a positive divisor lies in [0, divisor - 1], and is exact when the
        # dividend stays inside one period.
        if b[0] > 0:
            if b[0] == b[1] and a[0] // b[0] == a[1] // b[0]:
                return a[0] % b[0], a[1] % b[0]
            return 0, b[1] - 1
        return b[0] + 1, 0
    if isinstance(expr, ir.Call):
        args = [bounds(arg, ranges) for arg in expr.args] if expr.fn != "where" else None
        if args is not None and any(arg is None for arg in args):
            return None
        if expr.fn == "abs":
            lo, hi = args[0]
            if lo >= 0:
                return lo, hi
            if hi <= 0:
                return -hi, -lo
            return 0, max(-lo, hi)
        if expr.fn in ("min", "max"):
            pick = min if expr.fn == "min" else max
            return pick(args[0][0], args[1][0]), pick(args[0][1], args[1][1])
        if expr.fn == "clamp":  # min(max(x, lo), hi)
            x, low, high = args
            raised = max(x[0], low[0]), max(x[1], low[1])
            return min(raised[0], high[0]), min(raised[1], high[1])
        if expr.fn in ("floor", "ceil", "sign"):
            fn = {"floor": math.floor, "ceil": math.ceil, "sign": lambda x: (x > 0) - (x < 0)}[expr.fn]
            return fn(args[0][0]), fn(args[0][1])
        if expr.fn == "where":
            a, b = bounds(expr.args[1], ranges), bounds(expr.args[2], ranges)
            if a is None or b is None:
                return None
            return min(a[0], b[0]), max(a[1], b[1])
    return None


def lookup_ranges(spec: ir.AttentionIR, sizes: dict) -> list:
    """For every tensor lookup of ``spec``: ``(tensor, dim, index_expr, (lo, hi) | None)`` with the
    range of the index when ``b h q kv`` range over the given sizes."""
    ranges = {"b": (0, sizes["B"] - 1), "h": (0, sizes["H"] - 1),
              "q": (0, sizes["Q_LEN"] - 1), "kv": (0, sizes["KV_LEN"] - 1)}
    ranges.update((name, (sizes[name], sizes[name])) for name in ir.SIZE_VARS)
    found = []
    for root in (spec.mask, spec.score):
        for node in ir.walk(root):
            if isinstance(node, ir.Lookup) and isinstance(node.tensor, ir.Tensor):
                for dim, index in enumerate(node.index):
                    found.append((node.tensor, dim, index, bounds(index, ranges)))
    return found
