"""Interval analysis of IR expressions. Pure Python; array libraries plug in through ``ops``.

Given a range ``[lo, hi]`` for every variable, each node gets sound bounds:

* a numeric node gets ``(lo, hi)``: every value it can take lies inside;
* a boolean node gets ``(must, may)``: ``must`` means true everywhere in the ranges, ``may``
  means true somewhere. A mask tile is FULL when ``must``, EMPTY when ``not may``, else PARTIAL.

The rules follow tinygrad's ``vmin``/``vmax``: for ``a - b`` the range is
``[a.lo - b.hi, a.hi - b.lo]``; a comparison ``a < b`` must hold when ``a.hi < b.lo`` and may
hold when ``a.lo < b.hi``. Bounds are floats (``inf`` means unbounded), exact for integers up to
2**53. The same rules run on Python numbers (:class:`ScalarOps`, used by the runtime to prove that
lookups stay inside their tensors) and, vectorised over every tile of a block mask at once, on
torch tensors (:mod:`flexspec.kernels.blocks` passes its own ops).

>>> from flexspec.ir import Binary, Var
>>> bounds(Binary("-", Var("q"), Var("kv")), {"q": (0, 9), "kv": (0, 4)})
(-4, 9)
"""

from __future__ import annotations

import math

from flexspec import ir
from flexspec.ir.ops import FUNCTIONS, OPERATORS

INF = math.inf
_TAU = 2 * math.pi


class ScalarOps:
    """Interval arithmetic on Python floats and bools."""

    @staticmethod
    def const(value):
        return value

    minimum = staticmethod(min)
    maximum = staticmethod(max)

    @staticmethod
    def where(cond, a, b):
        return a if cond else b

    @staticmethod
    def all(*values):
        return all(values)

    @staticmethod
    def any(*values):
        return any(values)

    @staticmethod
    def logical_not(value):
        return not value

    @staticmethod
    def fix_nan(value, replacement):
        return replacement if isinstance(value, float) and math.isnan(value) else value

    @staticmethod
    def floor(value):
        return float(math.floor(value)) if math.isfinite(value) else value

    @staticmethod
    def ceil(value):
        return float(math.ceil(value)) if math.isfinite(value) else value

    @staticmethod
    def apply(fn, value):
        """``fn`` (an entry of the operator table) on a Python float, with IEEE results where
        Python raises instead."""
        try:
            return fn.python(value)
        except ValueError:  # a domain error: log(-1), sqrt(-1)
            return math.nan
        except OverflowError:  # exp(1000)
            return INF

    @staticmethod
    def lookup(node, index_bounds):
        return None


class Analyzer:
    """Computes bounds of IR nodes for the variable ranges in ``ranges`` (name -> (lo, hi)).

    ``ops`` supplies the array operations (see :class:`ScalarOps`); its ``lookup(node, index)``
    bounds a tensor lookup from the bounds of its indices, or returns ``None`` for "unknown".
    An unknown numeric bound is ``(-inf, inf)``; an unknown boolean is ``(False, True)``.
    """

    def __init__(self, ops, ranges: dict):
        self.ops = ops
        self.ranges = ranges

    # ---- numbers
    def number(self, node: ir.Expr):
        rule = _NUMBER_RULES.get(type(node))
        return rule(self, node) if rule is not None else self._unknown()

    def _unknown(self):
        return self.ops.const(-INF), self.ops.const(INF)

    def _const_number(self, node: ir.Const):
        value = self.ops.const(float(node.value))
        return value, value

    def _var_number(self, node: ir.Var):
        if node.name in self.ranges:
            lo, hi = self.ranges[node.name]
            return self.ops.const(lo), self.ops.const(hi)
        return self._unknown()

    def _unary_number(self, node: ir.Unary):
        if node.op != "neg":
            return self._unknown()
        lo, hi = self.number(node.operand)
        return -hi, -lo

    def _binary_number(self, node: ir.Binary):
        rule = _OPERATOR_RULES.get(OPERATORS[node.op].interval)
        if rule is None:  # a comparison: a boolean, bounded by boolean()
            return self._unknown()
        return rule(self, self.number(node.left), self.number(node.right))

    def _lookup_number(self, node: ir.Lookup):
        found = self.ops.lookup(node, [self.number(i) for i in node.index])
        return found if found is not None else self._unknown()

    def _corners(self, values):
        ops = self.ops
        values = [ops.fix_nan(v, 0.0) for v in values]  # 0 * inf: the bound is 0 at that corner
        lo, hi = values[0], values[0]
        for v in values[1:]:
            lo, hi = ops.minimum(lo, v), ops.maximum(hi, v)
        return lo, hi

    # ---- operator rules, named by the operator table's ``interval``
    def _add(self, a, b):
        return a[0] + b[0], a[1] + b[1]

    def _sub(self, a, b):
        return a[0] - b[1], a[1] - b[0]

    def _mul(self, a, b):
        (alo, ahi), (blo, bhi) = a, b
        return self._corners([alo * blo, alo * bhi, ahi * blo, ahi * bhi])

    def _safe_divisor(self, b):
        """Whether ``b`` spans 0, and ``b`` with such an interval replaced by 1 (to compute with,
        then discard)."""
        ops = self.ops
        spans_zero = ops.all(b[0] <= 0, b[1] >= 0)
        return spans_zero, (ops.where(spans_zero, ops.const(1.0), b[0]),
                            ops.where(spans_zero, ops.const(1.0), b[1]))

    def _unless_zero(self, spans_zero, lo, hi):
        ops = self.ops
        return ops.where(spans_zero, ops.const(-INF), lo), ops.where(spans_zero, ops.const(INF), hi)

    def _div(self, a, b, floor=False):
        ops = self.ops
        (alo, ahi) = a
        spans_zero, (safe_lo, safe_hi) = self._safe_divisor(b)
        lo, hi = self._corners([alo / safe_lo, alo / safe_hi, ahi / safe_lo, ahi / safe_hi])
        if floor:
            lo, hi = ops.floor(lo), ops.floor(hi)
        return self._unless_zero(spans_zero, lo, hi)

    def _floordiv(self, a, b):
        return self._div(a, b, floor=True)

    def _mod(self, a, b):
        # Python's modulo by a positive divisor lies in [0, divisor - 1] (by a negative one in
        # [divisor + 1, 0]); it is exact (and rises with the dividend) while the dividend stays
        # inside one period of a fixed divisor, of either sign.
        ops = self.ops
        (alo, ahi), (blo, bhi) = a, b
        spans_zero, (safe_lo, _) = self._safe_divisor(b)
        exact = blo == bhi
        same_period = ops.all(exact, ops.floor(alo / safe_lo) == ops.floor(ahi / safe_lo))
        period_lo = alo - ops.floor(alo / safe_lo) * safe_lo
        period_hi = ahi - ops.floor(ahi / safe_lo) * safe_lo
        positive = blo > 0
        lo = ops.where(same_period, period_lo, ops.where(positive, ops.const(0.0), blo + 1))
        hi = ops.where(same_period, period_hi, ops.where(positive, bhi - 1, ops.const(0.0)))
        return self._unless_zero(spans_zero, lo, hi)

    # ---- function rules, named by the operator table's ``interval``
    def _call_number(self, node: ir.Call):
        fn = FUNCTIONS[node.fn]
        if fn.interval == "where":
            return self._where(node)
        return _FUNCTION_RULES[fn.interval](self, fn, [self.number(a) for a in node.args])

    def _where(self, node: ir.Call):
        ops = self.ops
        must, may = self.boolean(node.args[0])
        (alo, ahi) = self._narrow(node.args[0], node.args[1], self.number(node.args[1]), True)
        (blo, bhi) = self._narrow(node.args[0], node.args[2], self.number(node.args[2]), False)
        lo = ops.where(must, alo, ops.where(ops.logical_not(may), blo, ops.minimum(alo, blo)))
        hi = ops.where(must, ahi, ops.where(ops.logical_not(may), bhi, ops.maximum(ahi, bhi)))
        return lo, hi

    def _abs(self, fn, args):
        ops = self.ops
        lo, hi = args[0]
        low = ops.where(lo >= 0, lo, ops.where(hi <= 0, -hi, ops.const(0.0)))
        return low, ops.maximum(-lo, hi)

    def _min(self, fn, args):
        return self.ops.minimum(args[0][0], args[1][0]), self.ops.minimum(args[0][1], args[1][1])

    def _max(self, fn, args):
        return self.ops.maximum(args[0][0], args[1][0]), self.ops.maximum(args[0][1], args[1][1])

    def _clamp(self, fn, args):  # min(max(x, lo), hi)
        return self._min(fn, [self._max(fn, args[:2]), args[2]])

    def _round(self, fn, args):
        # ops.floor and ops.ceil: safe on infinities
        rounding = {"floor": self.ops.floor, "ceil": self.ops.ceil}[fn.name]
        return rounding(args[0][0]), rounding(args[0][1])

    def _periodic(self, fn, args):
        """A function of period 2*pi and range [-1, 1] (sin, cos), at most 1 at ``fn.peak`` and
        at least -1 half a period later: the extremes the interval holds, else its endpoints."""
        ops = self.ops
        lo, hi = args[0]
        # An interval a whole period wide holds every value. Beyond 2**20 (and for infinite
        # bounds) the same answer keeps the rest exact: there k * 2pi is off by ~1e-10 at most,
        # so a peak missed at an endpoint leaves fn(endpoint) within 1e-20 of 1, which rounds to 1.
        wide = ops.any(hi - lo >= _TAU, ops.maximum(-lo, hi) > 2.0 ** 20)
        lo, hi = ops.where(wide, ops.const(0.0), lo), ops.where(wide, ops.const(0.0), hi)
        at_lo, at_hi = ops.apply(fn, lo), ops.apply(fn, hi)

        def holds(point):  # some point + 2*pi*k lies in [lo, hi]: the last one below hi does
            return ops.floor((hi - point) / _TAU) * _TAU + point >= lo

        top = ops.where(ops.any(wide, holds(fn.peak)), ops.const(1.0), ops.maximum(at_lo, at_hi))
        bottom = ops.where(ops.any(wide, holds(fn.peak + math.pi)), ops.const(-1.0),
                           ops.minimum(at_lo, at_hi))
        return bottom, top

    def _increasing(self, fn, args):
        # outside the domain (log of a negative) the bound gives way instead of becoming NaN
        lo, hi = args[0]
        ops = self.ops
        return ops.fix_nan(ops.apply(fn, lo), -INF), ops.fix_nan(ops.apply(fn, hi), INF)

    def _narrow(self, cond: ir.Expr, branch: ir.Expr, bounds, taken: bool):
        """Bounds of a ``where`` branch that the condition itself limits: in
        ``where(d < 8, d, f(d))`` the first branch is below 8 and the second at least 8."""
        if not (isinstance(cond, ir.Binary) and cond.op in ("<", "<=", ">", ">=")):
            return bounds
        op = cond.op if taken else {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}[cond.op]
        if cond.right == branch and cond.left != branch:  # flip `y < x` into `x > y`
            other = cond.left
            op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
        elif cond.left == branch:
            other = cond.right
        else:
            return bounds
        lo, hi = bounds
        olo, ohi = self.number(other)
        step = 1.0 if branch.type == "int" and other.type == "int" else 0.0
        ops = self.ops
        if op == "<":
            hi = ops.minimum(hi, ohi - step)
        elif op == "<=":
            hi = ops.minimum(hi, ohi)
        elif op == ">":
            lo = ops.maximum(lo, olo + step)
        else:
            lo = ops.maximum(lo, olo)
        return lo, hi

    # ---- booleans
    def boolean(self, node: ir.Expr):
        rule = _BOOLEAN_RULES.get(type(node))
        found = rule(self, node) if rule is not None else None
        return found if found is not None else (self.ops.const(False), self.ops.const(True))

    def _const_boolean(self, node: ir.Const):
        value = self.ops.const(bool(node.value))
        return value, value

    def _unary_boolean(self, node: ir.Unary):
        if node.op != "not":
            return None
        must, may = self.boolean(node.operand)
        return self.ops.logical_not(may), self.ops.logical_not(must)

    def _connective_boolean(self, node):
        parts = [self.boolean(a) for a in node.args]
        combine = self.ops.all if isinstance(node, ir.And) else self.ops.any
        return combine(*[p[0] for p in parts]), combine(*[p[1] for p in parts])

    def _binary_boolean(self, node: ir.Binary):
        if node.op not in ir.COMPARE_OPS:
            return None
        if node.left.type == "bool":
            return self._bool_equality(node)
        must, may = self._compare(node.op, self.number(node.left), self.number(node.right))
        nan = self.ops.any(self.may_be_nan(node.left), self.may_be_nan(node.right))
        # a NaN operand makes every comparison false, except != which it makes true
        if node.op == "!=":
            return must, self.ops.any(may, nan)
        return self.ops.all(must, self.ops.logical_not(nan)), may

    def _call_boolean(self, node: ir.Call):
        if node.fn != "where":
            return None
        ops = self.ops
        cond = self.boolean(node.args[0])
        a, b = self.boolean(node.args[1]), self.boolean(node.args[2])
        pick = [ops.where(cond[0], a[i], ops.where(ops.logical_not(cond[1]), b[i],
                                                    (ops.all if i == 0 else ops.any)(a[i], b[i])))
                for i in (0, 1)]
        return pick[0], pick[1]

    def _lookup_boolean(self, node: ir.Lookup):
        found = self.ops.lookup(node, [self.number(i) for i in node.index])
        if found is None:
            return None
        lo, hi = found
        return lo >= 1, hi >= 1

    def may_be_nan(self, node: ir.Expr):
        """Whether a numeric node can be NaN somewhere in the ranges: a square root or logarithm
        of a range reaching below 0, 0 / 0, inf - inf, 0 * inf, or a NaN operand. Ints never are."""
        ops = self.ops
        if node.type != "float":
            return ops.const(False)
        if isinstance(node, ir.Unary):
            return self.may_be_nan(node.operand)
        if isinstance(node, ir.Binary):
            nan = ops.any(self.may_be_nan(node.left), self.may_be_nan(node.right))
            (alo, ahi), (blo, bhi) = self.number(node.left), self.number(node.right)
            a_zero, b_zero = ops.all(alo <= 0, ahi >= 0), ops.all(blo <= 0, bhi >= 0)
            a_inf = ops.any(alo == -INF, ahi == INF)
            b_inf = ops.any(blo == -INF, bhi == INF)
            if node.op in ("/", "//", "%"):
                return ops.any(nan, ops.all(a_zero, b_zero), ops.all(a_inf, b_inf))
            if node.op == "*":
                return ops.any(nan, ops.all(a_zero, b_inf), ops.all(b_zero, a_inf))
            return ops.any(nan, ops.all(a_inf, b_inf))  # inf - inf, -inf + inf
        if isinstance(node, ir.Call):
            args = [a for a in node.args if a.type != "bool"]
            nan = ops.any(*[self.may_be_nan(a) for a in args]) if args else ops.const(False)
            fn = FUNCTIONS[node.fn]
            if fn.nan_below is not None:
                nan = ops.any(nan, self.number(node.args[0])[0] < fn.nan_below)
            if fn.nan_at_inf:
                lo, hi = self.number(node.args[0])
                nan = ops.any(nan, lo == -INF, hi == INF)
            return nan
        return ops.const(False)

    def _compare(self, op: str, a, b):
        ops = self.ops
        (alo, ahi), (blo, bhi) = a, b
        if op == "<":
            return ahi < blo, alo < bhi
        if op == "<=":
            return ahi <= blo, alo <= bhi
        if op == ">":
            return alo > bhi, ahi > blo
        if op == ">=":
            return alo >= bhi, ahi >= blo
        equal_must = ops.all(alo == ahi, blo == bhi, alo == blo)
        equal_may = ops.all(alo <= bhi, blo <= ahi)
        if op == "==":
            return equal_must, equal_may
        return ops.logical_not(equal_may), ops.logical_not(equal_must)

    def _bool_equality(self, node: ir.Binary):
        ops = self.ops
        (am, ay), (bm, by) = self.boolean(node.left), self.boolean(node.right)
        not_ay, not_by = ops.logical_not(ay), ops.logical_not(by)
        equal_must = ops.any(ops.all(am, bm), ops.all(not_ay, not_by))
        differ_must = ops.any(ops.all(am, not_by), ops.all(not_ay, bm))
        equal_may = ops.logical_not(differ_must)
        if node.op == "==":
            return equal_must, equal_may
        return differ_must, ops.logical_not(equal_must)


# The rules by node kind (a node of another kind is unbounded) and by the operator table's
# ``interval`` names (the names the node rules handle themselves: compare, neg, not, and, or,
# where).
_NUMBER_RULES = {ir.Const: Analyzer._const_number, ir.Var: Analyzer._var_number,
                 ir.Unary: Analyzer._unary_number, ir.Binary: Analyzer._binary_number,
                 ir.Call: Analyzer._call_number, ir.Lookup: Analyzer._lookup_number}
_BOOLEAN_RULES = {ir.Const: Analyzer._const_boolean, ir.Unary: Analyzer._unary_boolean,
                  ir.And: Analyzer._connective_boolean, ir.Or: Analyzer._connective_boolean,
                  ir.Binary: Analyzer._binary_boolean, ir.Call: Analyzer._call_boolean,
                  ir.Lookup: Analyzer._lookup_boolean}
_OPERATOR_RULES = {"add": Analyzer._add, "sub": Analyzer._sub, "mul": Analyzer._mul,
                   "div": Analyzer._div, "floordiv": Analyzer._floordiv, "mod": Analyzer._mod}
_FUNCTION_RULES = {"abs": Analyzer._abs, "min": Analyzer._min, "max": Analyzer._max,
                   "clamp": Analyzer._clamp, "round": Analyzer._round,
                   "periodic": Analyzer._periodic, "increasing": Analyzer._increasing}

def always(expr: ir.Expr, ranges: dict) -> bool:
    """Whether the boolean ``expr`` provably holds everywhere in ``ranges`` (a mask every query
    row and key of a call satisfies).

    >>> from flexspec.ir import Binary, Var
    >>> always(Binary(">=", Var("q"), Var("kv")), {"q": (9, 9), "kv": (0, 9)})
    True
    """
    return bool(Analyzer(ScalarOps, ranges).boolean(expr)[0])


class _TableOps(ScalarOps):
    """:class:`ScalarOps` that bound a lookup of a tensor by the range of its values, where
    ``tables`` knows it (tensor key -> (lo, hi))."""

    def __init__(self, tables: dict):
        self.tables = tables

    def lookup(self, node, index_bounds):
        found = self.tables.get(ir.tensor_key(node.tensor))
        return None if found is None else (float(found[0]), float(found[1]))


def bounds(expr: ir.Expr, ranges: dict, tables: dict | None = None):
    """``(lo, hi)`` of a numeric expression over Python ranges, or ``None`` when unbounded.
    ``tables`` gives the range of the values of tensors it reads (tensor key -> (lo, hi))."""
    ops = ScalarOps if not tables else _TableOps(tables)
    lo, hi = Analyzer(ops, ranges).number(expr)
    if lo == -INF and hi == INF:
        return None
    return lo, hi


def index_ranges(sizes: dict, q_offset: int = 0) -> dict:
    """The ranges of the index variables over a call of ``sizes`` (``q`` over the positions of
    its rows, ``q_offset .. q_offset + Q_LEN - 1``) and of the sizes themselves."""
    ranges = {"b": (0, sizes["B"] - 1), "h": (0, sizes["H"] - 1),
              "q": (q_offset, q_offset + sizes["Q_LEN"] - 1), "kv": (0, sizes["KV_LEN"] - 1)}
    ranges.update((name, (sizes[name], sizes[name])) for name in ir.SIZE_VARS)
    return ranges


def lookup_ranges(spec: ir.AttentionIR, sizes: dict | None, q_offset: int = 0) -> list:
    """For every tensor lookup of ``spec``: ``(tensor, dim, index_expr, (lo, hi) | None)`` with the
    range of the index when ``b h kv`` range over the given sizes and ``q`` over the positions
    of the rows, ``q_offset .. q_offset + Q_LEN - 1`` (every range ``None`` without sizes)."""
    ranges = None if sizes is None else index_ranges(sizes, q_offset)
    found = []
    for root in (spec.mask, spec.score):
        for node in ir.walk(root):
            if isinstance(node, ir.Lookup) and isinstance(node.tensor, ir.Tensor):
                for dim, index in enumerate(node.index):
                    span = None if ranges is None else bounds(index, ranges)
                    found.append((node.tensor, dim, index, span))
    return found
