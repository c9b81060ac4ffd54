"""Interval analysis (flexspec.ir.intervals): each rule on Python numbers, and soundness.

The unit tests run every rule of :class:`~flexspec.ir.intervals.Analyzer` with
:class:`~flexspec.ir.intervals.ScalarOps` (the same rules run vectorised on torch tensors in
``flexspec.kernels.blocks``; tests/test_blocks.py covers that side). The property test draws random
well-typed IR over ``q kv b h`` and small ranges, evaluates every node at every integer point of
the ranges with a plain-Python evaluator written here (independent of the analysis and of
``flexspec.kernels.reference``), and checks that each value lies inside its node's bounds, that ``must``
means true everywhere and that ``not may`` means false everywhere. Points where a value is
undefined (division by zero) or NaN (``sqrt``/``log`` below 0, ``inf - inf``) are left out of
the numeric bounds; comparisons of operands that may be NaN (never "must" hold, as NaN compares
false) have their own tests below.

Pure Python: no torch.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec import ir
from flexspec.errors import Source
from flexspec.ir import ops
from flexspec.ir.intervals import INF, Analyzer, ScalarOps, bounds, lookup_ranges
from flexspec.lang.checker import Checker
from flexspec.lang.definitions import Definition, Scope
from flexspec.lang.parser import parse_expr
from flexspec.testing import slow_examples, spec_texts
from ir_examples import C, b, call, h, kv, op, q


def neg(x):
    return ir.Unary("neg", x)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class CheckedOps(ScalarOps):
    """ScalarOps that insists on the types the analysis promises every ops class (torch's
    included): booleans where a truth value goes, numbers where a bound goes. Python would take
    ``None`` as false where ``blocks.TorchOps`` fails, so the rules are tested through this.
    Each method checks, then runs ScalarOps' own."""

    @staticmethod
    def const(value):
        assert isinstance(value, bool) or _is_number(value), value
        return ScalarOps.const(value)

    @staticmethod
    def minimum(a, b):
        assert _is_number(a) and _is_number(b), (a, b)
        return ScalarOps.minimum(a, b)

    @staticmethod
    def maximum(a, b):
        assert _is_number(a) and _is_number(b), (a, b)
        return ScalarOps.maximum(a, b)

    @staticmethod
    def where(cond, a, b):
        assert isinstance(cond, bool), cond
        assert type(a) is bool or _is_number(a), a
        assert isinstance(a, bool) == isinstance(b, bool), (a, b)
        return ScalarOps.where(cond, a, b)

    @staticmethod
    def all(*values):
        assert values and all(isinstance(v, bool) for v in values), values
        return ScalarOps.all(*values)

    @staticmethod
    def any(*values):
        assert values and all(isinstance(v, bool) for v in values), values
        return ScalarOps.any(*values)

    @staticmethod
    def logical_not(value):
        assert isinstance(value, bool), value
        return ScalarOps.logical_not(value)


def num(expr, **ranges):
    lo, hi = Analyzer(CheckedOps, ranges).number(expr)
    assert _is_number(lo) and _is_number(hi), (lo, hi)
    return lo, hi


def boolean(expr, **ranges):
    must, may = Analyzer(CheckedOps, ranges).boolean(expr)
    assert isinstance(must, bool) and isinstance(may, bool), (must, may)
    return must, may


# ---------------------------------------------------------------------------------------------
# Leaves


def test_constants_and_variables():
    assert num(C(3)) == (3, 3)
    assert num(C(-2.5)) == (-2.5, -2.5)
    assert num(q, q=(2, 7)) == (2, 7)
    assert num(kv, q=(2, 7)) == (-INF, INF)  # a variable without a range is unbounded
    assert boolean(C(True)) == (True, True)
    assert boolean(C(False)) == (False, False)


def test_lookups_are_unknown_without_tensor_values():
    t = ir.Tensor("t", (ir.Var("KV_LEN"),), "int")
    flags = ir.Tensor("f", (ir.Var("KV_LEN"),), "bool")
    assert num(ir.Lookup(t, (q,)), q=(0, 3)) == (-INF, INF)
    assert boolean(ir.Lookup(flags, (q,)), q=(0, 3)) == (False, True)


def test_bounds_is_none_when_unbounded():
    assert bounds(op("-", q, kv), {"q": (0, 9), "kv": (0, 4)}) == (-4.0, 9.0)
    assert bounds(op("//", q, kv), {"q": (0, 9), "kv": (0, 4)}) is None


# ---------------------------------------------------------------------------------------------
# Arithmetic


@pytest.mark.parametrize("expr, ranges, expected", [
    (op("+", q, kv), {"q": (-3, 2), "kv": (-1, 5)}, (-4, 7)),
    (op("-", q, kv), {"q": (-3, 2), "kv": (-1, 5)}, (-8, 3)),
    (op("-", q, q), {"q": (0, 4)}, (-4, 4)),  # intervals forget that both sides are one value
    (op("*", q, kv), {"q": (-2, 3), "kv": (-5, 4)}, (-15, 12)),
    (op("*", q, kv), {"q": (-2, -1), "kv": (-5, -3)}, (3, 10)),
    (op("*", q, kv), {"q": (-2, -1), "kv": (3, 5)}, (-10, -3)),
    (op("*", q, C(-3)), {"q": (1, 4)}, (-12, -3)),
    (neg(q), {"q": (-2, 5)}, (-5, 2)),
])
def test_add_sub_mul_neg(expr, ranges, expected):
    assert num(expr, **ranges) == expected


@pytest.mark.parametrize("divisor, dividend, expected", [
    ((2, 4), (1, 8), (0.25, 4.0)),
    ((2, 4), (-8, 1), (-4.0, 0.5)),
    ((-4, -2), (1, 8), (-4.0, -0.25)),
    ((-1, 2), (1, 8), (-INF, INF)),    # divisor spans zero
    ((0, 3), (1, 8), (-INF, INF)),     # divisor touches zero
    ((-3, 0), (1, 8), (-INF, INF)),
    ((0, 0), (1, 8), (-INF, INF)),
])
def test_true_division(divisor, dividend, expected):
    assert num(op("/", q, kv), q=dividend, kv=divisor) == expected


@pytest.mark.parametrize("divisor, dividend, expected", [
    ((2, 2), (-7, 7), (-4, 3)),
    ((3, 3), (0, 8), (0, 2)),
    ((2, 5), (-7, 7), (-4, 3)),
    ((-2, -2), (-7, 7), (-4, 3)),      # 7 // -2 == -4, -7 // -2 == 3
    ((-1, 2), (0, 8), (-INF, INF)),    # spans zero
    ((0, 4), (0, 8), (-INF, INF)),
])
def test_floor_division(divisor, dividend, expected):
    assert num(op("//", q, kv), q=dividend, kv=divisor) == expected


@pytest.mark.parametrize("divisor, dividend, expected", [
    ((10, 10), (5, 7), (5, 7)),        # exact inside one period
    ((10, 10), (10, 19), (0, 9)),      # one whole period, shifted
    ((10, 10), (23, 27), (3, 7)),
    ((4, 4), (-3, -1), (1, 3)),        # Python's modulo of negatives: -3 % 4 == 1
    ((10, 10), (8, 12), (0, 9)),       # crosses a period boundary
    ((10, 10), (-1, 1), (0, 9)),
    ((3, 5), (0, 100), (0, 4)),        # divisor not fixed: [0, max divisor - 1]
    ((3, 5), (0, 1), (0, 4)),
    ((-4, -4), (0, 9), (-3, 0)),       # negative divisor: the sign of the divisor
    ((-5, -2), (0, 9), (-4, 0)),
    ((-1, 3), (0, 9), (-INF, INF)),    # spans zero
    ((0, 0), (0, 9), (-INF, INF)),
])
def test_modulo(divisor, dividend, expected):
    assert num(op("%", q, kv), q=dividend, kv=divisor) == expected


def test_modulo_by_a_constant():
    assert num(op("%", op("-", q, kv), C(3)), q=(0, 9), kv=(0, 9)) == (0, 2)
    assert num(op("%", q, C(128)), q=(256, 383)) == (0, 127)
    assert num(op("%", q, C(128)), q=(256, 300)) == (0, 44)


# ---------------------------------------------------------------------------------------------
# Functions


@pytest.mark.parametrize("ranges, expected", [
    ((-3, 5), (0, 5)), ((-7, -2), (2, 7)), ((2, 4), (2, 4)), ((0, 0), (0, 0)),
    ((-4, 0), (0, 4)),
])
def test_abs(ranges, expected):
    assert num(call("abs", q), q=ranges) == expected


def test_min_max_clamp():
    assert num(call("min", q, kv), q=(-3, 5), kv=(0, 2)) == (-3, 2)
    assert num(call("max", q, kv), q=(-3, 5), kv=(0, 2)) == (0, 5)
    assert num(call("clamp", q, C(0), C(10)), q=(-5, 3)) == (0, 3)
    assert num(call("clamp", q, C(0), C(10)), q=(4, 30)) == (4, 10)
    assert num(call("clamp", q, C(0), C(10)), q=(-30, 30)) == (0, 10)
    assert num(call("clamp", q, C(0), C(10)), q=(20, 30)) == (10, 10)
    # bounds that are themselves ranges
    assert num(call("clamp", q, kv, C(10)), q=(-5, 3), kv=(1, 2)) == (1, 3)


def test_where():
    expr = call("where", op("<", q, C(5)), kv, neg(kv))
    assert num(expr, q=(0, 3), kv=(1, 2)) == (1, 2)       # condition must hold
    assert num(expr, q=(6, 9), kv=(1, 2)) == (-2, -1)     # condition never holds
    assert num(expr, q=(0, 9), kv=(1, 2)) == (-2, 2)      # either branch
    flag = call("where", op("<", q, C(5)), op(">", kv, C(0)), C(False))
    assert boolean(flag, q=(0, 3), kv=(1, 2)) == (True, True)
    assert boolean(flag, q=(6, 9), kv=(1, 2)) == (False, False)
    assert boolean(flag, q=(0, 9), kv=(1, 2)) == (False, True)
    either = call("where", op("<", q, C(5)), C(True), op(">", kv, C(0)))
    assert boolean(either, q=(0, 9), kv=(1, 2)) == (True, True)   # both branches are true
    assert boolean(either, q=(0, 9), kv=(-2, 0)) == (False, True)


def test_floor_ceil():
    assert num(call("floor", op("/", q, C(2))), q=(1, 5)) == (0, 2)
    assert num(call("floor", op("/", q, C(2))), q=(-5, -1)) == (-3, -1)
    assert num(call("ceil", op("/", q, C(2))), q=(1, 5)) == (1, 3)
    assert num(call("floor", q), q=(-2, 4)) == (-2, 4)


def test_increasing_functions():
    lo, hi = num(call("tanh", q), q=(-1, 2))
    assert (lo, hi) == (math.tanh(-1), math.tanh(2))
    assert num(call("exp", q), q=(0, 1)) == (1.0, math.e)
    assert num(call("exp2", q), q=(-1, 3)) == (0.5, 8.0)
    assert num(call("sqrt", q), q=(4, 9)) == (2.0, 3.0)
    assert num(call("log2", q), q=(1, 8)) == (0.0, 3.0)
    assert num(call("sigmoid", q), q=(0, 0)) == (0.5, 0.5)
    assert num(call("sign", q), q=(-3, 5)) == (-1.0, 1.0)
    assert num(call("sign", q), q=(2, 5)) == (1.0, 1.0)
    # outside the domain the bound gives way instead of becoming NaN
    assert num(call("log", q), q=(0, 1)) == (-INF, 0.0)
    assert num(call("sqrt", q), q=(-4, 9)) == (-INF, 3.0)
    assert num(call("log", q), q=(-3, -1)) == (-INF, INF)
    # overflow is unbounded, not an error
    assert num(call("exp", q), q=(0, 10**6)) == (1.0, INF)
    assert num(call("exp2", q), q=(0, 10**6)) == (1.0, INF)
    assert num(call("sigmoid", q), q=(-10**6, 10**6)) == (0.0, 1.0)
    assert num(call("log1p", q), q=(0, 3)) == (0.0, math.log1p(3))
    assert num(call("log1p", q), q=(-1, 0)) == (-INF, 0.0)      # log1p(-1) = -inf
    assert num(call("log1p", q), q=(-3, -2)) == (-INF, INF)     # NaN everywhere
    assert num(call("erf", q), q=(-1, 2)) == (math.erf(-1), math.erf(2))
    assert num(call("erf", q), q=(-10**6, 10**6)) == (-1.0, 1.0)


def test_sin_and_cos():
    assert num(call("sin", q), q=(0, 1)) == (0.0, math.sin(1))
    assert num(call("sin", q), q=(1, 2)) == (math.sin(1), 1.0)       # pi/2 inside
    assert num(call("sin", q), q=(4, 5)) == (-1.0, math.sin(4))      # 3pi/2 inside
    assert num(call("sin", q), q=(0, 7)) == (-1.0, 1.0)              # a whole period
    assert num(call("cos", q), q=(0, 3)) == (math.cos(3), 1.0)       # 0 inside, pi not
    assert num(call("cos", q), q=(3, 4)) == (-1.0, math.cos(4))      # pi inside
    assert num(call("sin", op("/", q, kv)), q=(1, 1), kv=(-1, 1)) == (-1.0, 1.0)  # unbounded


def test_nan_of_log1p_sin_and_cos():
    # log1p is NaN below -1: a comparison of it need not hold where q - 3 < -1
    assert boolean(op("<", call("log1p", op("-", q, C(3))), C(100.0)), q=(0, 9)) == (False, True)
    assert boolean(op("<", call("log1p", op("-", q, C(1))), C(100.0)), q=(0, 9)) == (True, True)
    # sin(1 / 0) is sin(inf), NaN: sin < 2 holds only where the argument is finite
    assert boolean(op("<", call("sin", op("/", C(1.0), q)), C(2.0)), q=(0, 3)) == (False, True)
    assert boolean(op("<", call("sin", op("/", C(1.0), q)), C(2.0)), q=(1, 3)) == (True, True)


# ---------------------------------------------------------------------------------------------
# Booleans


@pytest.mark.parametrize("symbol, a, bb, expected", [
    ("<", (0, 3), (4, 9), (True, True)),
    ("<", (0, 4), (4, 9), (False, True)),
    ("<", (5, 9), (0, 5), (False, False)),
    ("<=", (0, 4), (4, 9), (True, True)),
    ("<=", (0, 5), (4, 9), (False, True)),
    ("<=", (5, 9), (0, 4), (False, False)),
    (">", (5, 9), (0, 4), (True, True)),
    (">", (4, 9), (0, 4), (False, True)),
    (">", (0, 4), (4, 9), (False, False)),
    (">=", (4, 9), (0, 4), (True, True)),
    (">=", (3, 9), (0, 4), (False, True)),
    (">=", (0, 3), (4, 9), (False, False)),
    ("==", (2, 2), (2, 2), (True, True)),
    ("==", (0, 4), (4, 9), (False, True)),
    ("==", (0, 3), (4, 9), (False, False)),
    ("!=", (0, 3), (4, 9), (True, True)),
    ("!=", (0, 4), (4, 9), (False, True)),
    ("!=", (2, 2), (2, 2), (False, False)),
])
def test_comparisons(symbol, a, bb, expected):
    assert boolean(op(symbol, q, kv), q=a, kv=bb) == expected


def test_causal_and_window_tiles():
    causal = op(">=", q, kv)
    window = op("<=", call("abs", op("-", q, kv)), C(2))
    tile = lambda lo_q, lo_kv: {"q": (lo_q, lo_q + 15), "kv": (lo_kv, lo_kv + 15)}  # noqa: E731
    assert boolean(causal, **tile(16, 0)) == (True, True)      # below the diagonal: FULL
    assert boolean(causal, **tile(0, 0)) == (False, True)      # on it: PARTIAL
    assert boolean(causal, **tile(0, 16)) == (False, False)    # above: EMPTY
    assert boolean(window, **tile(32, 0)) == (False, False)
    assert boolean(window, **tile(16, 0)) == (False, True)


def test_and_or_not():
    yes, maybe, no = op("<", q, C(100)), op("<", q, C(5)), op(">", q, C(100))
    r = {"q": (0, 9)}
    assert boolean(yes, **r) == (True, True)
    assert boolean(maybe, **r) == (False, True)
    assert boolean(no, **r) == (False, False)
    assert boolean(ir.And((yes, maybe)), **r) == (False, True)
    assert boolean(ir.And((yes, yes)), **r) == (True, True)
    assert boolean(ir.And((yes, maybe, no)), **r) == (False, False)
    assert boolean(ir.Or((no, maybe)), **r) == (False, True)
    assert boolean(ir.Or((no, no)), **r) == (False, False)
    assert boolean(ir.Or((no, maybe, yes)), **r) == (True, True)
    assert boolean(ir.Unary("not", yes), **r) == (False, False)
    assert boolean(ir.Unary("not", no), **r) == (True, True)
    assert boolean(ir.Unary("not", maybe), **r) == (False, True)


def test_bool_equality():
    yes, maybe, no = op("<", q, C(100)), op("<", q, C(5)), op(">", q, C(100))
    r = {"q": (0, 9)}
    for symbol, flip in (("==", False), ("!=", True)):
        def expect(must, may):
            return (not may, not must) if flip else (must, may)
        assert boolean(op(symbol, yes, yes), **r) == expect(True, True)
        assert boolean(op(symbol, no, no), **r) == expect(True, True)
        assert boolean(op(symbol, yes, no), **r) == expect(False, False)
        assert boolean(op(symbol, no, yes), **r) == expect(False, False)
        assert boolean(op(symbol, maybe, yes), **r) == expect(False, True)
        assert boolean(op(symbol, no, maybe), **r) == expect(False, True)
        # the same unknown condition on both sides: intervals do not see that they agree
        assert boolean(op(symbol, maybe, maybe), **r) == expect(False, True)


def test_comparisons_of_nan_are_never_certain():
    # sqrt(q - 2) is NaN at q = 0 and 1 (float64, as in the reference), and NaN < 100.0 is
    # false there: the comparison may hold, it need not.
    assert boolean(op("<", call("sqrt", op("-", q, C(2))), C(100.0)), q=(0, 9)) == (False, True)


def test_nan_does_not_vanish_in_min():
    # min(NaN, 1.0) is NaN in torch (the reference), so the comparison is false at kv = 0..3
    expr = op("<", call("min", call("log", op("-", kv, C(3))), C(1.0)), C(2.0))
    assert boolean(expr, kv=(0, 9)) == (False, True)



def test_zero_times_infinity_is_nan():
    # log(0) * 0.0 is -inf * 0.0, NaN, which is not <= 1.0: the tile holding kv = 0 is not
    # FULL, though every other product is 0.0 (found by mutation testing)
    expr = op("<=", op("*", call("log", kv), C(0.0)), C(1.0))
    assert boolean(expr, kv=(0, 15)) == (False, True)
    assert boolean(expr, kv=(1, 15)) == (True, True)
    flipped = op("<=", op("*", C(0.0), call("log", kv)), C(1.0))
    assert boolean(flipped, kv=(0, 15)) == (False, True)


def test_where_narrows_a_float_branch_without_an_integer_step():
    # q / 4 < 5.5 leaves the taken branch q / 4 below 5.5, not below 4.5: q = 21 gives 5.25,
    # which is > 5.0 (a step of 1 for floats marked this tile EMPTY; mutation testing)
    narrowed = call("where", op("<", op("/", q, C(4)), C(5.5)), op("/", q, C(4)), C(0.0))
    assert boolean(op(">", narrowed, C(5.0)), q=(16, 31)) == (False, True)
    lo, hi = num(narrowed, q=(16, 31))
    assert lo <= 0.0 and hi >= 5.25
    # the other branch, and a condition written the other way round
    other = call("where", op(">=", op("/", q, C(4)), C(5.5)), C(0.0), op("/", q, C(4)))
    assert num(other, q=(16, 31))[1] >= 5.25
    flipped = call("where", op(">", C(5.5), op("/", q, C(4))), op("/", q, C(4)), C(0.0))
    assert num(flipped, q=(16, 31))[1] >= 5.25
    # ints do step by one: where(q < 6, q, 0) is at most 5
    assert num(call("where", op("<", q, C(6)), q, C(0)), q=(0, 9)) == (0, 5)

_SINE = ops.Function(name="sine", arity=1, operands="num", result="float", python=math.sin,
                     torch="torch.sin", interval="periodic", peak=math.pi / 2)
_COSINE = ops.Function(name="cosine", arity=1, operands="num", result="float", python=math.cos,
                       torch="torch.cos", interval="periodic", peak=0.0)


@pytest.mark.parametrize("fn, lo, hi, expected", [
    # inside one monotone stretch: the endpoints (sin rises on [-pi/2, pi/2])
    (_SINE, 0.0, 1.0, (0.0, math.sin(1.0))),
    (_SINE, -1.0, 1.0, (math.sin(-1.0), math.sin(1.0))),
    # the peak pi/2 = 1.5708 lies in [1, 2]: the top is 1, the bottom the lower endpoint value
    (_SINE, 1.0, 2.0, (math.sin(1.0), 1.0)),
    # the trough 3pi/2 = 4.712 lies in [4, 5]
    (_SINE, 4.0, 5.0, (-1.0, math.sin(4.0))),
    # [2, 4] falls from sin 2 = 0.909 through 0 to sin 4 = -0.757
    (_SINE, 2.0, 4.0, (math.sin(4.0), math.sin(2.0))),
    # the peak pi/2 + 2pi = 7.854 in [7, 8], two periods on
    (_SINE, 7.0, 8.0, (math.sin(7.0), 1.0)),
    # the trough -pi/2 in [-2, -1]
    (_SINE, -2.0, -1.0, (-1.0, math.sin(-1.0))),
    # a point
    (_SINE, 3.0, 3.0, (math.sin(3.0), math.sin(3.0))),
    # a whole period or more, unbounded, or far out: everything
    (_SINE, 0.0, 6.3, (-1.0, 1.0)),
    (_SINE, 0.0, INF, (-1.0, 1.0)),
    (_SINE, -INF, -INF, (-1.0, 1.0)),
    (_SINE, 2.0 ** 21, 2.0 ** 21 + 1, (-1.0, 1.0)),
    # cos: peak at 0, trough at pi
    (_COSINE, -1.0, 1.0, (math.cos(1.0), 1.0)),
    (_COSINE, 0.5, 3.0, (math.cos(3.0), math.cos(0.5))),
    (_COSINE, 3.0, 4.0, (-1.0, math.cos(4.0))),
    # the peak 2pi = 6.283 in [6, 7]; cos 7 = 0.754 is below cos 6 = 0.960
    (_COSINE, 6.0, 7.0, (math.cos(7.0), 1.0)),
])
def test_periodic_rule(fn, lo, hi, expected):
    assert Analyzer(CheckedOps, {})._periodic(fn, [(lo, hi)]) == expected


@settings(max_examples=200, deadline=None)
@given(st.floats(-50, 50), st.floats(0, 7), st.sampled_from([_SINE, _COSINE]))
def test_periodic_rule_is_sound(lo, width, fn):
    low, high = Analyzer(CheckedOps, {})._periodic(fn, [(lo, lo + width)])
    for i in range(101):
        value = fn.python(lo + width * (i / 100))
        assert low <= value <= high


# ---------------------------------------------------------------------------------------------
# Golden cases: tests/fixtures/intervals.txt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "intervals.txt"
_BOOL_EXPECTED = {"must": (True, True), "may": (False, True), "never": (False, False)}
# names an expected bound may use, evaluated with Python's math (never the code under test)
_CLOSED_FORMS = {"inf": math.inf, "sin": math.sin, "cos": math.cos, "tanh": math.tanh,
                 "exp": math.exp, "log1p": math.log1p, "erf": math.erf}


def _fixture_ir(text: str) -> ir.Expr:
    context = Definition("fixture", "score", (), None)
    return Checker(Scope()).expr(parse_expr(Source(text, "intervals.txt")), {}, context)


def _load_interval_cases():
    cases = []
    for number, line in enumerate(FIXTURES.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        expr, ranges, expected = (part.strip() for part in line.split(";"))
        cases.append((number, expr, ranges, expected))
    return cases


INTERVAL_CASES = _load_interval_cases()


def test_interval_fixture_has_cases():
    assert len(INTERVAL_CASES) >= 40


@pytest.mark.parametrize("line, text, ranges, expected", INTERVAL_CASES,
                         ids=[f"{n}:{text} ; {r}" for n, text, r, _ in INTERVAL_CASES])
def test_interval_fixture(line, text, ranges, expected):
    bounds_of = {}
    for item in ranges.split(","):
        name, span = (part.strip() for part in item.split("="))
        lo, hi = span.split("..")
        bounds_of[name] = (int(lo), int(hi))
    expr = _fixture_ir(text)
    analyzer = Analyzer(CheckedOps, bounds_of)
    if expected in _BOOL_EXPECTED:
        got = analyzer.boolean(expr)
        assert (bool(got[0]), bool(got[1])) == _BOOL_EXPECTED[expected], f"intervals.txt:{line}"
    else:
        want = eval(expected, {"__builtins__": {}}, _CLOSED_FORMS)  # noqa: S307 - our fixture
        assert list(analyzer.number(expr)) == pytest.approx(want, rel=1e-15), \
            f"intervals.txt:{line}"
    check_sound(expr, bounds_of)  # and the concrete values agree with the bounds


# ---------------------------------------------------------------------------------------------
# lookup_ranges


def test_lookup_ranges_of_causal_doc():
    spec = flexspec.parse("causal & doc").ir
    sizes = {"B": 3, "H": 4, "Q_LEN": 100, "KV_LEN": 150}
    found = lookup_ranges(spec, sizes)
    by_index = {(t.name, dim, ir.to_text(index)): span for t, dim, index, span in found}
    assert by_index == {
        ("doc_ids", 0, "b"): (0, 2),
        ("doc_ids", 1, "q"): (0, 99),
        ("doc_ids", 1, "kv"): (0, 149),
    }
    assert all(t.name == "doc_ids" and t.origin == "binding" for t, *_ in found)
    assert len(found) == 4  # doc_ids[b, q] and doc_ids[b, kv]: two dims each


def test_lookup_ranges_use_sizes_and_report_unbounded_indices():
    t = ir.Tensor("t", (ir.Var("KV_LEN"),), "int")
    index = op("-", op("-", ir.Var("KV_LEN"), C(1)), q)
    spec = ir.AttentionIR(mask=op(">", ir.Lookup(t, (index,)), C(0)))
    ((_, dim, _, span),) = lookup_ranges(spec, {"B": 1, "H": 1, "Q_LEN": 10, "KV_LEN": 20})
    assert (dim, span) == (0, (10, 19))
    spec = ir.AttentionIR(mask=op(">", ir.Lookup(t, (op("//", kv, q),)), C(0)))
    ((_, _, _, span),) = lookup_ranges(spec, {"B": 1, "H": 1, "Q_LEN": 10, "KV_LEN": 20})
    assert span is None  # q spans 0: unbounded


def test_lookup_ranges_cover_the_score():
    spec = flexspec.parse("causal + alibi").ir
    found = lookup_ranges(spec, {"B": 1, "H": 8, "Q_LEN": 10, "KV_LEN": 10})
    assert [(dim, ir.to_text(index), span) for _, dim, index, span in found] == [(0, "h", (0, 7))]


# ---------------------------------------------------------------------------------------------
# Soundness: random IR against brute-force evaluation


class Undefined(Exception):
    """The value is not defined at this point (division by zero, NaN, an int from an infinity)."""


def _float(x: float) -> float:
    if math.isnan(x):
        raise Undefined
    return x


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _exp2(x: float) -> float:
    try:
        return 2.0 ** x
    except OverflowError:
        return math.inf


def _log(fn):
    def apply(x: float) -> float:
        if x < 0:
            raise Undefined  # NaN in float64
        return -math.inf if x == 0 else fn(x)
    return apply


def _sqrt(x: float) -> float:
    if x < 0:
        raise Undefined
    return math.sqrt(x)


def _log1p(x: float) -> float:
    return _log(math.log)(1.0 + x) if x <= -1 else math.log1p(x)


def _periodic(fn):
    def apply(x: float) -> float:
        if math.isinf(x):
            raise Undefined  # sin(inf) is NaN
        return fn(x)
    return apply


_FLOAT_FUNCTIONS = {"tanh": math.tanh, "exp": _exp, "exp2": _exp2, "log": _log(math.log),
                    "log2": _log(math.log2), "sqrt": _sqrt, "sigmoid": _sigmoid,
                    "log1p": _log1p, "erf": math.erf, "sin": _periodic(math.sin),
                    "cos": _periodic(math.cos)}


def evaluate(node: ir.Expr, env: dict, out: dict):
    """Python value of ``node`` at one point (ints stay ints, as in the reference's int64), and
    of every sub-expression into ``out`` (``out[node]``: value, or ``Undefined``)."""
    try:
        value = _evaluate(node, env, out)
    except Undefined:
        out[node] = Undefined
        raise
    out[node] = value
    return value


def _evaluate(node, env, out):
    def ev(child):
        return evaluate(child, env, out)

    if isinstance(node, ir.Const):
        return node.value
    if isinstance(node, ir.Var):
        return env[node.name]
    if isinstance(node, ir.Unary):
        x = ev(node.operand)
        return (not x) if node.op == "not" else -x
    if isinstance(node, ir.And):
        values = [ev(a) for a in node.args]  # no short cut: every node gets its value
        return all(values)
    if isinstance(node, ir.Or):
        values = [ev(a) for a in node.args]
        return any(values)
    if isinstance(node, ir.Binary):
        left, right = ev(node.left), ev(node.right)
        o = node.op
        if o == "+":
            return _float(left + right) if isinstance(left + right, float) else left + right
        if o == "-":
            r = left - right
            return _float(r) if isinstance(r, float) else r
        if o == "*":
            r = left * right
            return _float(r) if isinstance(r, float) else r
        if o in ("/", "//", "%") and right == 0:
            raise Undefined
        if o == "/":
            return _float(left / right)
        if o == "//":
            return left // right
        if o == "%":
            return left % right
        return {"<": left < right, "<=": left <= right, ">": left > right,
                ">=": left >= right, "==": left == right, "!=": left != right}[o]
    if isinstance(node, ir.Call):
        args = [ev(a) for a in node.args]
        fn = node.fn
        if fn == "abs":
            return abs(args[0])
        if fn == "sign":
            x = args[0]
            s = (x > 0) - (x < 0)
            return float(s) if isinstance(x, float) else s
        if fn == "min":
            return min(args)
        if fn == "max":
            return max(args)
        if fn == "clamp":
            return min(max(args[0], args[1]), args[2])
        if fn == "where":
            return args[1] if args[0] else args[2]
        if fn in ("floor", "ceil"):
            x = args[0]
            if isinstance(x, int):
                return x
            if not math.isfinite(x):
                raise Undefined
            return math.floor(x) if fn == "floor" else math.ceil(x)
        return _float(_FLOAT_FUNCTIONS[fn](float(args[0])))
    raise TypeError(f"cannot evaluate {node!r}")


VARIABLES = ("q", "kv", "b", "h")


def _int_leaves():
    return st.one_of(st.sampled_from([ir.Var(n) for n in VARIABLES]),
                     st.integers(-6, 6).map(C))


def _float_leaves():
    return st.sampled_from([0.5, -0.5, 1.5, 2.0, -3.0, 0.25]).map(C)


@st.composite
def _int_expr(draw, depth):
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(_int_leaves())
    sub = lambda: draw(_int_expr(depth - 1))  # noqa: E731
    kind = draw(st.integers(0, 9))
    if kind <= 3:
        return op(draw(st.sampled_from(["+", "-", "*", "//", "%"])), sub(), sub())
    if kind == 4:
        return draw(st.sampled_from([neg, lambda x: call("abs", x), lambda x: call("sign", x)]))(
            sub())
    if kind == 5:
        return call(draw(st.sampled_from(["min", "max"])), sub(), sub())
    if kind == 6:
        return call("clamp", sub(), sub(), sub())
    if kind == 7:
        return call("where", draw(_bool_expr(depth - 1)), sub(), sub())
    if kind == 8:
        return call(draw(st.sampled_from(["floor", "ceil"])), draw(_float_expr(depth - 1)))
    return op(draw(st.sampled_from(["//", "%"])), sub(), draw(_int_leaves()))


@st.composite
def _float_expr(draw, depth):
    if depth == 0 or draw(st.integers(0, 4)) == 0:
        return draw(st.one_of(_float_leaves(), _int_leaves()))
    sub = lambda: draw(_num_expr(depth - 1))  # noqa: E731
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return op("/", sub(), sub())
    if kind == 1:
        return op(draw(st.sampled_from(["+", "-", "*"])), draw(_float_expr(depth - 1)), sub())
    if kind == 2:
        return call(draw(st.sampled_from(["min", "max"])), draw(_float_expr(depth - 1)), sub())
    if kind == 3:
        return call("where", draw(_bool_expr(depth - 1)), draw(_float_expr(depth - 1)), sub())
    return call(draw(st.sampled_from(sorted(_FLOAT_FUNCTIONS))), sub())


def _num_expr(depth):
    return st.one_of(_int_expr(depth), _float_expr(depth))


@st.composite
def _bool_expr(draw, depth):
    if depth == 0 or draw(st.integers(0, 5)) == 0:
        if draw(st.integers(0, 4)) == 0:
            return C(draw(st.booleans()))
        return op(draw(st.sampled_from(ir.COMPARE_OPS)), draw(_int_leaves()), draw(_int_leaves()))
    sub = lambda: draw(_bool_expr(depth - 1))  # noqa: E731
    kind = draw(st.integers(0, 7))
    if kind <= 2:
        return op(draw(st.sampled_from(ir.COMPARE_OPS)), draw(_num_expr(depth - 1)),
                  draw(_num_expr(depth - 1)))
    if kind == 3:
        return ir.And(tuple(sub() for _ in range(draw(st.integers(2, 3)))))
    if kind == 4:
        return ir.Or(tuple(sub() for _ in range(draw(st.integers(2, 3)))))
    if kind == 5:
        return ir.Unary("not", sub())
    if kind == 6:
        return op(draw(st.sampled_from(["==", "!="])), sub(), sub())
    return call("where", sub(), sub(), sub())


@st.composite
def _ranges(draw):
    ranges = {}
    for name in VARIABLES:
        lo = draw(st.integers(-6, 8))
        ranges[name] = (lo, lo + draw(st.integers(0, 4)))
    return ranges


def _close_below(lo, value) -> bool:
    return lo <= value or (isinstance(value, float) and lo - value <= 1e-9 * (1 + abs(value)))


def check_sound(expr: ir.Expr, ranges: dict) -> None:
    """Every node of ``expr``: its concrete values at every point lie in its bounds."""
    nodes = {n: None for n in ir.walk(expr) if isinstance(n, ir.Expr)}
    values = {n: [] for n in nodes}
    names = sorted(ranges)
    for point in itertools.product(*(range(lo, hi + 1) for lo, hi in
                                      (ranges[n] for n in names))):
        out: dict = {}
        try:
            evaluate(expr, dict(zip(names, point)), out)
        except Undefined:
            pass
        for node, value in out.items():
            if value is not Undefined:
                values[node].append(value)
    analyzer = Analyzer(CheckedOps, ranges)
    for node, seen in values.items():
        if node.type == "bool":
            must, may = analyzer.boolean(node)
            where = f"{ir.to_text(node)} over {ranges}: must={must} may={may}"
            assert not (must and not may), where
            if must:
                assert all(seen), where
            if not may:
                assert not any(seen), where
        else:
            lo, hi = analyzer.number(node)
            assert not (math.isnan(lo) or math.isnan(hi)), f"{ir.to_text(node)}: NaN bounds"
            for value in seen:
                assert _close_below(lo, value) and _close_below(-hi, -value), (
                    f"{ir.to_text(node)} = {value!r} outside [{lo}, {hi}] over {ranges}")


def _lt(x, y):
    return op("<", x, y)


# One node per rule, over variables whose ranges the property draws (negative ones included).
RULES = {
    **{symbol: op(symbol, q, kv) for symbol in ("+", "-", "*", "/", "//", "%")},
    "%3": op("%", q, C(3)), "%-3": op("%", q, C(-3)), "//3": op("//", q, C(3)),
    "neg": neg(q),
    **{fn: call(fn, q) for fn in ("abs", "sign", "floor", "ceil")},
    **{f"{fn}(/)": call(fn, op("/", q, C(2))) for fn in ("floor", "ceil", "sign")},
    **{fn: call(fn, op("/", q, C(4))) for fn in sorted(_FLOAT_FUNCTIONS)},
    "min": call("min", q, kv), "max": call("max", q, kv), "clamp": call("clamp", q, kv, b),
    "where": call("where", _lt(q, h), kv, b),
    **{f"cmp{symbol}": op(symbol, q, kv) for symbol in ir.COMPARE_OPS},
    "bool==": op("==", _lt(q, kv), _lt(b, h)), "bool!=": op("!=", _lt(q, kv), _lt(b, h)),
    "and": ir.And((_lt(q, kv), _lt(b, h))), "or": ir.Or((_lt(q, kv), _lt(b, h))),
    "not": ir.Unary("not", _lt(q, kv)),
    "where-bool": call("where", _lt(q, h), _lt(kv, b), _lt(b, C(2))),
}


@pytest.mark.parametrize("name", list(RULES))
@settings(max_examples=25, deadline=None)
@given(ranges=_ranges())
def test_each_rule_is_sound(name, ranges):
    check_sound(RULES[name], ranges)


SOUNDNESS = settings(max_examples=100, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SOUNDNESS
@given(_bool_expr(4), _ranges())
def test_bool_bounds_are_sound(expr, ranges):
    check_sound(expr, ranges)


@SOUNDNESS
@given(_num_expr(4), _ranges())
def test_numeric_bounds_are_sound(expr, ranges):
    check_sound(expr, ranges)


@pytest.mark.slow
@settings(max_examples=slow_examples(1500), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(_bool_expr(5), _num_expr(5)), _ranges())
def test_bounds_are_sound_sweep(expr, ranges):
    check_sound(expr, ranges)


def test_evaluator_agrees_with_python():
    """The test's evaluator itself, on a few hand-checked values."""
    expr = op("%", op("-", q, kv), C(3))
    assert evaluate(expr, {"q": 1, "kv": 5}, {}) == 2     # -4 % 3 == 2
    assert evaluate(op("//", neg(q), C(2)), {"q": 7}, {}) == -4
    with pytest.raises(Undefined):
        evaluate(op("//", q, kv), {"q": 1, "kv": 0}, {})
    with pytest.raises(Undefined):
        evaluate(call("sqrt", q), {"q": -1}, {})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_registry_masks_are_sound(data):
    """The masks of random registry specs (no tensors), over small tiles anywhere in a sequence."""
    text = data.draw(spec_texts(max_masks=3, max_scores=0, kinds=("static",)))
    mask = flexspec.parse(text).ir.mask
    ranges = {}
    for name, size in (("Q_LEN", data.draw(st.integers(1, 300))),
                       ("KV_LEN", data.draw(st.integers(1, 300))),
                       ("B", 2), ("H", 4)):
        ranges[name] = (size, size)
    for name, top in (("q", ranges["Q_LEN"][0]), ("kv", ranges["KV_LEN"][0]), ("b", 2), ("h", 4)):
        lo = data.draw(st.integers(0, top - 1))
        ranges[name] = (lo, min(top - 1, lo + data.draw(st.integers(0, 6))))
    check_sound(mask, ranges)


# ---------------------------------------------------------------------------------------------
# Exact bounds that the soundness properties cannot see (a looser bound is still sound): each
# found by mutation testing (mutation/run.py ir/intervals).


@pytest.mark.parametrize("cond, branch, taken, expected", [
    # q in [0, 9], kv in [3, 6]; the branch q, the other side kv
    (op("<", q, kv), q, True, (0, 5)),
    (op("<", q, kv), q, False, (3, 9)),     # q >= kv
    (op("<=", q, kv), q, True, (0, 6)),
    (op("<=", q, kv), q, False, (4, 9)),    # q > kv: ints step by one
    (op(">", q, kv), q, True, (4, 9)),
    (op(">", q, kv), q, False, (0, 6)),     # q <= kv
    (op(">=", q, kv), q, True, (3, 9)),
    (op(">=", q, kv), q, False, (0, 5)),    # q < kv
    # the branch on the right: `kv > q` read as `q < kv`
    (op(">", kv, q), q, True, (0, 5)),
    (op(">", kv, q), q, False, (3, 9)),
    (op("<=", kv, q), q, True, (3, 9)),
    (op("<=", kv, q), q, False, (0, 5)),
    # neither a bound comparison nor a condition on the branch: nothing to narrow
    (op("==", q, kv), q, True, (0, 9)),
    (op("!=", q, kv), q, False, (0, 9)),
    (op("<", kv, C(5)), q, True, (0, 9)),
    # a float side: no integer step (q / 2 < kv leaves q / 2 below 6.0, not 5.0)
    (op("<", op("/", q, C(2)), kv), op("/", q, C(2)), True, (0.0, 4.5)),
    (op("<", op("/", q, C(1)), kv), op("/", q, C(1)), True, (0.0, 6.0)),
    (op(">", op("/", q, C(1)), kv), op("/", q, C(1)), True, (3.0, 9.0)),
    (op("<", q, op("/", kv, C(1))), q, True, (0, 6.0)),
    (op(">", q, op("/", kv, C(1))), q, True, (3.0, 9)),
])
def test_narrow_each_comparison_exactly(cond, branch, taken, expected):
    analyzer = Analyzer(CheckedOps, {"q": (0, 9), "kv": (3, 6)})
    assert analyzer._narrow(cond, branch, analyzer.number(branch), taken) == expected


def test_where_narrows_both_branches_exactly():
    # where(q < 5, 100, q): the second branch is taken only where q >= 5
    assert num(call("where", op("<", q, C(5)), C(100), q), q=(0, 9)) == (5, 100)
    assert num(call("where", op("<", q, C(5)), q, C(-100)), q=(0, 9)) == (-100, 4)
    assert num(call("where", op("<=", q, C(4)), C(100), q), q=(0, 9)) == (5, 100)
    assert num(call("where", op(">", q, C(4)), C(-100), q), q=(0, 9)) == (-100, 4)
    assert num(call("where", op(">=", q, C(5)), C(-100), q), q=(0, 9)) == (-100, 4)
    # the branch on the right of the condition
    assert num(call("where", op(">", C(5), q), C(100), q), q=(0, 9)) == (5, 100)


def test_where_takes_one_branch_when_the_condition_is_certain():
    # the untaken branch must not widen the bounds, whichever side it lies on
    expr = call("where", op("<", q, C(5)), kv, C(100))
    assert num(expr, q=(0, 3), kv=(1, 2)) == (1, 2)       # always the first
    expr = call("where", op("<", q, C(5)), C(-100), kv)
    assert num(expr, q=(6, 9), kv=(1, 2)) == (1, 2)       # never the first
    expr = call("where", op("<", q, C(5)), C(100), kv)
    assert num(expr, q=(6, 9), kv=(1, 2)) == (1, 2)
    expr = call("where", op("<", q, C(5)), kv, C(-100))
    assert num(expr, q=(0, 3), kv=(1, 2)) == (1, 2)


def test_ceil_of_an_unbounded_value():
    assert num(call("ceil", op("/", q, kv)), q=(1, 2), kv=(-1, 1)) == (-INF, INF)
    assert num(call("floor", op("/", q, kv)), q=(1, 2), kv=(-1, 1)) == (-INF, INF)


def test_bounds_keeps_a_half_bounded_range():
    assert bounds(call("exp", q), {"q": (0, 10**6)}) == (1.0, INF)
    assert bounds(neg(call("exp", q)), {"q": (0, 10**6)}) == (-INF, -1.0)


@pytest.mark.parametrize("lo, hi", [
    (-2.0 ** 21 - 1, -2.0 ** 21),        # far out on the negative side: everything
    (2.0 ** 20 + 10, 2.0 ** 20 + 11),    # just past 2**20
])
def test_periodic_rule_gives_everything_far_out(lo, hi):
    assert Analyzer(CheckedOps, {})._periodic(_SINE, [(lo, hi)]) == (-1.0, 1.0)


@pytest.mark.parametrize("lo, hi", [(100.0, 101.0), (2.0 ** 20 - 1, 2.0 ** 20)])
def test_periodic_rule_is_exact_up_to_two_to_the_twenty(lo, hi):
    # no extreme of sin lies in these ranges (checked here with the peaks' own positions), so
    # the bounds are the endpoint values, not the whole [-1, 1]
    peaks = [math.pi / 2 + k * math.pi for k in range(int(lo / math.pi) - 1, int(hi / math.pi) + 2)]
    assert not any(lo <= p <= hi for p in peaks)
    ends = sorted([math.sin(lo), math.sin(hi)])
    assert Analyzer(CheckedOps, {})._periodic(_SINE, [(lo, hi)]) == (ends[0], ends[1])


@pytest.mark.parametrize("cond, branch, expected", [
    # the branch on the right of each comparison, the condition taken: flipped, then narrowed
    (op("<", kv, q), q, (4, 9)),      # q > kv
    (op("<=", kv, q), q, (3, 9)),     # q >= kv
    (op(">", kv, q), q, (0, 5)),      # q < kv
    (op(">=", kv, q), q, (0, 6)),     # q <= kv
])
def test_narrow_flips_a_condition_on_the_right(cond, branch, expected):
    analyzer = Analyzer(CheckedOps, {"q": (0, 9), "kv": (3, 6)})
    assert analyzer._narrow(cond, branch, analyzer.number(branch), True) == expected


def test_abs_of_fractional_ranges():
    assert num(call("abs", op("/", q, C(2))), q=(1, 4)) == (0.5, 2.0)
    assert num(call("abs", op("/", q, C(2))), q=(-3, 1)) == (0.0, 1.5)
    assert num(call("abs", op("/", q, C(2))), q=(-4, -1)) == (0.5, 2.0)


def test_modulo_by_a_fixed_negative_divisor_inside_one_period():
    # Python's x % -4 lies in [-3, 0] and, like a positive divisor, rises with x inside one
    # period: 1 % -4 == -3, 2 % -4 == -2
    assert num(op("%", q, C(-4)), q=(1, 2)) == (-3, -2)
    assert num(op("%", q, C(-4)), q=(-3, 0)) == (-3, 0)
    assert num(op("%", q, C(-4)), q=(3, 5)) == (-3, 0)   # crosses a multiple of 4


_LOG_KV = call("log", kv)         # kv in [0, 5]: [-inf, log 5], never NaN (log 0 = -inf)
_EXP_Q = call("exp", q)           # q in [0, 10**6]: [1, inf]
_SQRT = call("sqrt", op("-", b, C(2)))   # b in [1, 3]: NaN at b = 1


@pytest.mark.parametrize("expr, expected", [
    (q, False), (C(1.5), False), (op("+", q, kv), False),
    # 0 / 0 and inf / inf
    (op("/", q, kv), True), (op("/", b, kv), False), (op("/", C(0.0), b), False),
    (op("/", C(0.0), kv), True), (op("/", _EXP_Q, _EXP_Q), True), (op("/", _EXP_Q, b), False),
    # 0 * inf, each side, each infinity
    (op("*", _LOG_KV, C(0.0)), True), (op("*", C(0.0), _LOG_KV), True),
    (op("*", _EXP_Q, C(0.0)), True), (op("*", C(0.0), _EXP_Q), True),
    (op("*", C(2.0), _LOG_KV), False), (op("*", C(-2.0), _LOG_KV), False),
    (op("*", C(0.5), _LOG_KV), False), (op("*", _LOG_KV, C(2.0)), False),
    (op("*", _LOG_KV, C(-2.0)), False), (op("*", _LOG_KV, C(0.5)), False),
    # inf - inf
    (op("-", _EXP_Q, _EXP_Q), True), (op("+", _EXP_Q, neg(_EXP_Q)), True),
    (op("+", C(1.0), _EXP_Q), False), (op("/", C(2.0), _EXP_Q), False),
    (op("/", _SQRT, C(2.0)), True), (op("*", _SQRT, C(2.0)), True),
    # 0.0 * exp(q) lies in [0, 0] yet may be NaN: a function of it may be NaN too
    (call("sqrt", op("*", C(0.0), _EXP_Q)), True), (call("sin", op("*", C(0.0), _EXP_Q)), True),
    (op("+", _EXP_Q, C(1.0)), False), (op("-", _EXP_Q, C(1.0)), False),
    # a NaN operand, on either side or under a minus
    (op("+", _SQRT, C(1.0)), True), (op("+", C(1.0), _SQRT), True), (neg(_SQRT), True),
    (neg(_EXP_Q), False),
    # functions: below their domain, at infinity, or of a NaN argument
    (call("sqrt", b), False), (_SQRT, True), (call("log", kv), False), (call("log", h), True),
    (call("sin", _EXP_Q), True), (call("sin", _LOG_KV), True), (call("sin", b), False),
    (call("tanh", _EXP_Q), False), (call("exp", _SQRT), True),
    (call("min", _SQRT, C(1.0)), True), (call("max", C(1.0), _SQRT), True),
    (call("where", op("<", q, C(5)), C(1.0), _SQRT), True),
    (call("where", op("<", q, C(5)), C(1.0), C(2.0)), False),
])
def test_may_be_nan(expr, expected):
    analyzer = Analyzer(CheckedOps, {"q": (0, 10**6), "kv": (0, 5), "b": (1, 3), "h": (-3, -1)})
    assert analyzer.may_be_nan(expr) is expected


def test_equality_of_ranges_exactly():
    assert boolean(op("==", q, kv), q=(2, 2), kv=(2, 5)) == (False, True)
    assert boolean(op("==", q, kv), q=(2, 5), kv=(2, 2)) == (False, True)
    assert boolean(op("==", q, kv), q=(5, 9), kv=(0, 3)) == (False, False)
    assert boolean(op("!=", q, kv), q=(5, 9), kv=(0, 3)) == (True, True)


def test_nan_on_either_side_of_a_comparison():
    nan_at_1 = {"b": (1, 3)}   # _SQRT is NaN at b = 1
    assert boolean(op("<", _SQRT, C(100.0)), **nan_at_1) == (False, True)
    assert boolean(op(">", C(100.0), _SQRT), **nan_at_1) == (False, True)
    # NaN != x is true: != holds everywhere here, NaN or not
    assert boolean(op("!=", _SQRT, C(100.0)), **nan_at_1) == (True, True)
    # 0.0 * exp(q) is 0.0, or NaN where exp(q) overflows: != 0.0 may hold there
    zero_or_nan = op("*", C(0.0), _EXP_Q)
    assert num(zero_or_nan, q=(0, 10**6)) == (0.0, 0.0)
    assert boolean(op("!=", zero_or_nan, C(0.0)), q=(0, 10**6)) == (False, True)
    assert boolean(op("==", zero_or_nan, C(0.0)), q=(0, 10**6)) == (False, True)
    assert boolean(op("!=", zero_or_nan, C(0.0)), q=(0, 10)) == (False, False)


class _LookupOps(CheckedOps):
    """CheckedOps whose tensor lookups have known bounds: ``FOUND[tensor name]``."""

    FOUND = {"t": (2.0, 5.0), "flags": (0.0, 1.0), "ones": (1.0, 1.0), "zeros": (0.0, 0.0)}
    seen: list = []

    @staticmethod
    def lookup(node, index_bounds):
        _LookupOps.seen.append((node, index_bounds))
        return _LookupOps.FOUND[node.tensor.name]


def test_lookups_take_their_bounds_from_the_ops():
    def lookup_of(name, dtype):
        return ir.Lookup(ir.Tensor(name, (ir.Var("KV_LEN"),), dtype), (op("+", q, C(1)),))

    analyzer = Analyzer(_LookupOps, {"q": (0, 3)})
    _LookupOps.seen.clear()
    node = lookup_of("t", "int")
    assert analyzer.number(node) == (2.0, 5.0)
    assert _LookupOps.seen == [(node, [(1, 4)])]   # the lookup node and its index bounds
    _LookupOps.seen.clear()
    flags = lookup_of("flags", "bool")
    assert analyzer.boolean(flags) == (False, True)
    assert _LookupOps.seen == [(flags, [(1, 4)])]
    assert analyzer.boolean(lookup_of("ones", "bool")) == (True, True)
    assert analyzer.boolean(lookup_of("zeros", "bool")) == (False, False)


def test_a_symbolic_parameter_is_unbounded():
    # a parameter left symbolic (a definition checked without arguments) has no bounds
    assert num(ir.Param("n", "int"), q=(0, 3)) == (-INF, INF)
    assert num(op("+", ir.Param("n", "int"), q), q=(0, 3)) == (-INF, INF)


def test_every_interval_rule_the_operator_table_names_exists():
    """A rule named in the operator table and missing here would leave its nodes unbounded
    (or fail): every name is a rule of the tables or one the node rules handle."""
    from flexspec.ir import intervals
    from flexspec.ir.ops import FUNCTIONS, OPERATORS
    by_node = {"compare", "neg", "not", "and", "or"}
    assert {op.interval for op in OPERATORS.values()} == set(intervals._OPERATOR_RULES) | by_node
    assert {fn.interval for fn in FUNCTIONS.values()} == set(intervals._FUNCTION_RULES) | {"where"}
