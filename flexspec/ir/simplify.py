"""Simplification of IR expressions: a pure ``Expr -> Expr`` function.

The passes run in the order of :data:`PASSES`, bottom-up, until nothing changes:

* ``fold_constants``: operators and functions of constants become constants (``2 * 64`` -> ``128``,
  ``0 >= 0`` -> ``true``), and a comparison with a NaN of constants its IEEE value
  (``0.0 * inf < Q_LEN`` -> ``false``);
* ``flatten``: nested ``And``/``Or`` become one n-ary node and duplicates go
  (``causal & causal`` -> ``causal``);
* ``boolean_identities``: ``true & x`` -> ``x``, ``false | x`` -> ``x``, ``~~x`` -> ``x``,
  ``x | ~x`` -> ``true``, ``x & ~x`` -> ``false``, ``~(a < b)`` -> ``a >= b``;
* ``arithmetic_identities``: ``x + 0``, ``x - 0``, ``x * 1``, ``x / 1`` -> ``x``, and for ints
  ``x // 1`` -> ``x``, ``x % 1`` -> ``0`` (never ``x * 0``, which is not 0 when x is infinite);

>>> from flexspec.ir import Var, Const, And, Binary
>>> causal = Binary(">=", Var("q"), Var("kv"))
>>> print(simplify(And((causal, Const(True), causal))))
q >= kv
"""

from __future__ import annotations

import math

from flexspec.ir import (COMPARE_OPS, FALSE, FUNCTIONS, OPERATORS, TRUE, And, Binary, Call, Const,
                         Expr, Or, Unary, children, transform, type_of)
from flexspec.limits import fits_int


def _const(value, like_type: str) -> Expr | None:
    """A Const of the IR type ``like_type``, or None when the value is not representable."""
    if like_type == "bool":
        return Const(bool(value))
    if like_type == "int":
        if isinstance(value, float):
            if not math.isfinite(value):
                return None
            value = int(value)
        if not fits_int(value):
            return None  # beyond the device's int64: not folded (and never a 4300-digit int)
        return Const(int(value))
    value = float(value)
    return None if math.isnan(value) else Const(value)


def fold_constants(node: Expr) -> Expr:
    """Evaluate operators and functions whose operands are all constants, with the operator
    table's Python functions. What Python refuses (a division by zero, a log of -1, an overflow)
    is left for the device to decide (inf, NaN or an error) and not folded here."""
    try:
        if isinstance(node, Call) and node.fn == "where" and isinstance(node.args[0], Const):
            # the chosen branch, with the type of the where (where(true, 1, 2.5) is 1.0)
            chosen = node.args[1] if node.args[0].value else node.args[2]
            if type_of(chosen) == type_of(node):
                return chosen
            return (_const(chosen.value, type_of(node)) or node) if isinstance(chosen, Const) else node
        if isinstance(node, (Unary, Binary, Call)) and all(
                isinstance(a, Const) for a in children(node)):
            return _const(_constant_value(node), type_of(node)) or node
        if isinstance(node, Binary) and node.op in COMPARE_OPS and (
                _is_nan(node.left) or _is_nan(node.right)):
            # NaN compares false, and unequal, to everything; left unfolded, a NaN constant
            # compared with a length breaks torch.compile (flexspec.workarounds:
            # dynamo-nan-comparison)
            return Const(node.op == "!=")
    except (ArithmeticError, ValueError):
        return node
    return node


def _is_nan(node: Expr) -> bool:
    """Whether ``node`` reads no variable and evaluates to NaN (which no Const holds)."""
    value = _constant_value(node)
    return isinstance(value, float) and math.isnan(value)


def _constant_value(node: Expr):
    """The Python value of an expression of constants alone, else None."""
    if isinstance(node, Const):
        return node.value
    if not isinstance(node, (Unary, Binary, Call)):
        return None
    values = [_constant_value(a) for a in children(node)]
    if any(v is None for v in values):
        return None
    entry = FUNCTIONS[node.fn] if isinstance(node, Call) else OPERATORS[node.op]
    return entry.python(*values)


def flatten(node: Expr) -> Expr:
    """Merge nested And/Or into one node and drop repeated operands (first occurrence kept)."""
    if not isinstance(node, (And, Or)):
        return node
    kind = type(node)
    args: dict = {}
    for arg in node.args:
        for part in (arg.args if isinstance(arg, kind) else (arg,)):
            args.setdefault(part, None)
    new = tuple(args)
    return node if new == node.args else kind(new)


def _complement(node: Expr) -> Expr:
    """An expression equal to ``~node``: ``~(a < b)`` is ``a >= b`` for ints (not for floats,
    where NaN compares false both ways)."""
    if isinstance(node, Unary) and node.op == "not":
        return node.operand
    negation = OPERATORS[node.op].negation if isinstance(node, Binary) else ""
    if negation and type_of(node.left) != "float" and type_of(node.right) != "float":
        return Binary(negation, node.left, node.right)
    return Unary("not", node)


def boolean_identities(node: Expr) -> Expr:
    """Neutral and absorbing constants, double negation, excluded middle, negated comparisons."""
    if isinstance(node, Unary) and node.op == "not":
        return _complement(node.operand)
    if isinstance(node, (And, Or)):
        neutral, absorbing = (TRUE, FALSE) if isinstance(node, And) else (FALSE, TRUE)
        if absorbing in node.args:
            return absorbing
        args = tuple(a for a in node.args if a != neutral)
        for a in args:
            if _complement(a) in args:
                return absorbing
        if not args:
            return neutral
        if len(args) == 1:
            return args[0]
        return type(node)(args) if args != node.args else node
    return node


def arithmetic_identities(node: Expr) -> Expr:
    """``x + 0``, ``0 + x``, ``x - 0``, ``x * 1``, ``1 * x``, ``x / 1``, ``x // 1`` (ints) -> ``x``."""
    if not isinstance(node, Binary):
        return node

    def is_const(expr, value):
        return isinstance(expr, Const) and not isinstance(expr.value, bool) and expr.value == value

    left, right, op = node.left, node.right, node.op
    keep_type = type_of(node)

    def same_type(expr):
        return expr if type_of(expr) == keep_type else node

    if op == "+" and is_const(right, 0):
        return same_type(left)
    if op == "+" and is_const(left, 0):
        return same_type(right)
    if op == "-" and is_const(right, 0):
        return same_type(left)
    if op == "*" and is_const(right, 1):
        return same_type(left)
    if op == "*" and is_const(left, 1):
        return same_type(right)
    if op == "/" and is_const(right, 1):
        return same_type(left)
    if op == "//" and is_const(right, 1) and keep_type == "int":
        return left
    if op == "%" and is_const(right, 1) and keep_type == "int":
        return Const(0)
    return node


PASSES = (fold_constants, flatten, boolean_identities, arithmetic_identities)


def simplify_once(node: Expr) -> Expr:
    def rewrite(n: Expr) -> Expr:
        for rule in PASSES:
            n = rule(n)
        return n
    return transform(node, rewrite)


def simplify(node: Expr, max_rounds: int = 20) -> Expr:
    """Apply the passes until a fixed point (or ``max_rounds``)."""
    for _ in range(max_rounds):
        new = simplify_once(node)
        if new == node:
            return node
        node = new
    return node
