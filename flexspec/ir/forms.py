"""Known forms read off an IR expression, for backends that run them with fixed-function kernels
(SDPA, FA4's own interface): a score that is the logit times a constant."""

from __future__ import annotations

import math

from flexspec.ir.nodes import SCORE, Binary, Const, Expr


def logit_factor(score: Expr) -> float | None:
    """``c`` when ``score`` is the logit times the positive, finite constant ``c`` (a product of
    ``* c``, ``c *`` and ``/ c`` steps), else ``None``.

    >>> from flexspec import parse
    >>> logit_factor(parse("scale(2.0) + scale(3.0)").ir.score)
    6.0
    >>> logit_factor(parse("softcap(20.0)").ir.score) is None
    True
    """
    factor = 1.0
    while score != SCORE:
        step = _constant_step(score)
        if step is None:
            return None
        constant, score = step
        factor *= constant
    # a negative or zero factor breaks the kernels' running row maximum; infinity is not a scale
    return factor if math.isfinite(factor) and factor > 0 else None


def _number(node: Expr) -> float | None:
    if isinstance(node, Const) and type(node.value) in (int, float):
        return float(node.value)
    return None


def _constant_step(node: Expr) -> tuple | None:
    """``(c, rest)`` when ``node`` is ``rest * c``, ``c * rest`` or ``rest / c`` for a number c."""
    if not isinstance(node, Binary):
        return None
    if node.op == "*" and _number(node.right) is not None:
        return _number(node.right), node.left
    if node.op == "*" and _number(node.left) is not None:
        return _number(node.left), node.right
    if node.op == "/" and _number(node.right):
        return 1.0 / _number(node.right), node.left
    return None
