"""Strategies for specs written in the definition language (``mask m = ...``, ``score s = ...``),
not composed from registry patterns: the expressions where one-line bugs of the lowering, the
interval analysis and the block masks hide (see :func:`definition_texts`).

Every drawn text checks (the checker must accept it), and its values agree between float64 (the
reference) and float32 (the kernels): a float comparison in a mask compares numbers that both
compute exactly or whose single rounding cannot cross the other side (integers divided by powers
of two or by one small integer, square roots and logarithms of integers, functions of sizes,
which the lowering computes in Python floats), and scores stay finite.
"""

from __future__ import annotations

from hypothesis import strategies as st

_INDEXES = ("q", "kv", "b", "h")
_SIZES = ("Q_LEN", "KV_LEN", "B", "H")
# divisors and moduli of both signs, never zero
_DIVISORS = (-5, -4, -3, -2, 2, 3, 4, 7)
# floats that float32 holds exactly, and the infinities
_FLOATS = ("0.5", "-1.5", "5.5", "0.25", "2.0", "-3.0")
_POWERS_OF_TWO = ("2", "4", "8", "-4")


def _paren(text: str) -> str:
    """``text`` as an operand: compound expressions in parentheses."""
    return text if text.replace("_", "").isalnum() else f"({text})"


def _int_leaf(draw, sizes_only: bool) -> str:
    roll = draw(st.integers(0, 9))
    if roll < 3 or (sizes_only and roll % 2):
        return draw(st.sampled_from(_SIZES))
    if roll < 5 or sizes_only:
        return str(draw(st.integers(-6, 8)))
    return draw(st.sampled_from(("q", "kv", "q", "kv", "b", "h")))


def _divisor(draw, depth: int, sizes_only: bool) -> str:
    """A nonzero int: a constant of either sign, or ``abs(x) + 1`` (negated half the time)."""
    if depth <= 0 or draw(st.integers(0, 2)):
        return str(draw(st.sampled_from(_DIVISORS)))
    inner = f"abs({_int(draw, depth - 1, sizes_only)}) + 1"
    return f"-({inner})" if draw(st.booleans()) else inner


def _int(draw, depth: int, sizes_only: bool = False) -> str:
    """An int expression over ``q kv b h`` and the sizes (or the sizes alone)."""
    if depth <= 0 or draw(st.integers(0, 3)) == 0:
        return _int_leaf(draw, sizes_only)
    sub = lambda: _int(draw, depth - 1, sizes_only)  # noqa: E731
    kind = draw(st.integers(0, 8))
    if kind <= 1:
        return f"{_paren(sub())} {draw(st.sampled_from('+-*'))} {_paren(sub())}"
    if kind == 2:  # nested subtraction: the right operand's parentheses matter
        return f"{_paren(sub())} - ({sub()} - {_paren(sub())})"
    if kind == 3:  # floor division and modulo, negative dividends and divisors
        symbol = draw(st.sampled_from(("//", "%")))
        return f"{_paren(sub())} {symbol} {_paren(_divisor(draw, depth - 1, sizes_only))}"
    if kind == 4:  # nested division
        return (f"{_paren(sub())} // (abs({sub()} // "
                f"{_paren(_divisor(draw, 0, sizes_only))}) + 1)")
    if kind == 5:
        return f"{draw(st.sampled_from(('min', 'max')))}({sub()}, {sub()})"
    if kind == 6:
        return f"{draw(st.sampled_from(('abs', '-')))}({sub()})"
    if kind == 7:
        return _where(draw, depth, "int", sizes_only)
    return f"clamp({sub()}, {sub()}, {sub()})"


def _float(draw, depth: int, sizes_only: bool = False, *, infinite: bool = True) -> str:
    """A float expression whose float32 and float64 values compare alike with the constants of
    :data:`_FLOATS` (see the module docstring); with ``infinite``, it may be an infinity or NaN."""
    roll = draw(st.integers(0, 9 if depth > 0 else 3))
    if roll == 0:
        return draw(st.sampled_from(_FLOATS))
    if roll <= 2:
        divisor = draw(st.sampled_from(_POWERS_OF_TWO))
        return f"{_paren(_int(draw, depth - 1, sizes_only))} / {divisor}"
    if roll == 3:  # one rounding: a division by an int
        return f"{_paren(_int(draw, depth - 1, sizes_only))} / ({_divisor(draw, 0, False)} + 0.5)"
    if roll == 4 and infinite:  # -inf at 0, NaN below
        return f"{draw(st.sampled_from(('log', 'sqrt')))}({_int(draw, depth - 1, sizes_only)})"
    if roll == 5 and infinite:  # 0 * inf is NaN
        inner = f"log({_int(draw, depth - 1, sizes_only)})" if draw(st.booleans()) else \
            draw(st.sampled_from(("inf", "-inf")))
        return f"{inner} * 0.0" if draw(st.booleans()) else f"0.0 * {inner}"
    if roll == 6:  # functions of sizes are Python floats in the lowering
        fns = ("sigmoid", "tanh", "exp2") + (("sqrt", "log", "log1p") if infinite else ())
        return f"{draw(st.sampled_from(fns))}({_int(draw, depth - 1, True)} / 10)"
    if roll == 7:
        return _where(draw, depth, "float", sizes_only, infinite=infinite)
    if roll == 8 and infinite:
        return draw(st.sampled_from(("inf", "-inf", "-(inf)")))
    return (f"{_paren(_float(draw, depth - 1, sizes_only, infinite=infinite))} "
            f"{draw(st.sampled_from('+-'))} {draw(st.sampled_from(_FLOATS))}")


def _where(draw, depth: int, kind: str, sizes_only: bool, *, infinite: bool = True) -> str:
    """``where(x < c, ...)`` whose branches often reuse ``x`` or ``c``: interval analysis narrows
    such a branch by the condition (``where(d < 8, d, 8)`` is below 8 in its first branch)."""
    if kind == "int":
        x, c = _int(draw, depth - 1, sizes_only), _int(draw, depth - 1, sizes_only)
        other = lambda: _int(draw, depth - 1, sizes_only)  # noqa: E731
    else:
        x = _float(draw, depth - 1, sizes_only, infinite=infinite)
        c = draw(st.sampled_from(_FLOATS))
        other = lambda: _float(draw, depth - 1, sizes_only, infinite=infinite)  # noqa: E731
    cond = f"{x} {draw(st.sampled_from(('<', '<=', '>', '>=')))} {c}"
    if draw(st.booleans()):
        cond = f"{c} {draw(st.sampled_from(('<', '<=', '>', '>=')))} {x}"
    branches = [draw(st.sampled_from((x, c, other()))) for _ in range(2)]
    if x not in branches and c not in branches:
        branches[draw(st.integers(0, 1))] = x
    return f"where({cond}, {branches[0]}, {branches[1]})"


def _compare(draw, depth: int, sizes_only: bool = False) -> str:
    symbol = draw(st.sampled_from(("<", "<=", ">", ">=", "==", "!=")))
    if draw(st.integers(0, 2)):
        return f"{_int(draw, depth, sizes_only)} {symbol} {_int(draw, depth, sizes_only)}"
    # a float against a constant (or an int): see the module docstring
    right = draw(st.sampled_from(_FLOATS)) if draw(st.booleans()) else _int(draw, 0, sizes_only)
    return f"{_float(draw, depth, sizes_only)} {symbol} {right}"


def _bool(draw, depth: int, sizes_only: bool = False) -> str:
    if depth <= 0 or draw(st.integers(0, 2)) == 0:
        return _compare(draw, max(depth - 1, 0), sizes_only)
    sub = lambda: _bool(draw, depth - 1, sizes_only)  # noqa: E731
    kind = draw(st.integers(0, 5))
    if kind <= 1:
        return f"({sub()}) {draw(st.sampled_from('&|'))} ({sub()})"
    if kind == 2:
        return f"~({sub()})"
    if kind == 3 and not sizes_only:  # a condition of sizes only, picking a mask
        return f"where({_bool(draw, depth - 1, True)}, {sub()}, {sub()})"
    if kind == 4:
        return f"({sub()}) {draw(st.sampled_from(('==', '!=')))} ({sub()})"
    return _compare(draw, depth - 1, sizes_only)


@st.composite
def mask_bodies(draw, depth: int = 3) -> str:
    """The body of a ``mask`` definition: a boolean over ``q kv b h`` and the sizes, with floor
    division and modulo by negative divisors, nested subtraction and division, ``where`` whose
    branches reuse the condition's operands, conditions of sizes only, and floats that may be
    infinite or NaN (``log(kv) * 0.0``, ``-inf``)."""
    return _bool(draw, depth)


@st.composite
def score_bodies(draw, depth: int = 2, *, bias: str | None = None) -> str:
    """The body of a ``score`` definition: ``score`` changed by a finite amount built like
    :func:`mask_bodies`' numbers (no infinities: a score of ``inf`` makes the softmax NaN).
    ``bias`` names a ``float[H]`` tensor parameter to read as ``bias[h]``."""
    amount = _float(draw, depth, infinite=False) if draw(st.booleans()) else _int(draw, depth)
    # bounded, so that float32 keeps the logits' differences (score + 1e5 would not)
    amount = draw(st.sampled_from((f"clamp({amount}, -6, 6)", f"tanh({amount}) * 2.0",
                                   f"sigmoid({amount})")))
    if bias is not None:
        amount = f"{bias}[h] * {_paren(amount)}"
    form = draw(st.integers(0, 2))
    if form == 0:
        return f"score + {amount}"
    if form == 1:
        return f"score * 0.5 - {_paren(amount)}"
    return f"4.0 * tanh((score + {amount}) / 4.0)"


# Lookups of a mask binding: each reads the tensor ``t`` (``int[KV_LEN]``) at an index that
# reaches its last entry when Q_LEN, KV_LEN allow (see flexspec.testing.shapes.lookup_edges).
_LOOKUPS = ("t[kv // 3] > 0", "t[q] == t[kv]", "t[KV_LEN - 1 - kv] <= t[min(q, KV_LEN - 1)]",
            "t[q + 1] != t[kv]", "t[clamp(q - kv, 0, KV_LEN - 1)] > 0", "t[(q + 3) // 2] > 1")


@st.composite
def definition_texts(draw, *, mask: bool | None = None, score: bool | None = None,
                     bindings: bool = True) -> tuple:
    """``(attn_text, spec_text)``: an ``.attn`` file defining a mask ``m`` and/or a score ``s``
    from :func:`mask_bodies` and :func:`score_bodies`, and the spec that uses them (``m + s``,
    ``m`` or ``s``). With ``bindings``, the mask may also read an int binding ``t[KV_LEN]``
    through an index expression (:data:`_LOOKUPS`) and the score a float binding ``w[H]``.

    >>> from hypothesis import find
    >>> attn, spec = find(definition_texts(mask=True, score=False), lambda _: True)
    >>> spec
    'm'
    """
    want_mask = draw(st.booleans()) if mask is None else mask
    want_score = (not want_mask or draw(st.booleans())) if score is None else score
    if not (want_mask or want_score):
        raise ValueError("definition_texts needs a mask, a score or both")
    lines, terms = [], []
    if want_mask:
        body, params = draw(mask_bodies()), ""
        if bindings and draw(st.integers(0, 2)) == 0:
            body = f"({body}) {draw(st.sampled_from('&|'))} {draw(st.sampled_from(_LOOKUPS))}"
            params = "(t: int[KV_LEN])"
        lines.append(f"mask m{params} = {body}")
        terms.append("m")
    if want_score:
        bias = "w" if bindings and draw(st.integers(0, 2)) == 0 else None
        params = "(w: float[H])" if bias else ""
        lines.append(f"score s{params} = {draw(score_bodies(bias=bias))}")
        terms.append("s")
    return "\n".join(lines) + "\n", " + ".join(terms)


def definition_specs(**options):
    """Checked :class:`~flexspec.Spec` objects from :func:`definition_texts` (``options`` go
    there): the spec parsed against its own ``.attn`` text."""
    from flexspec import parse
    from flexspec.lang.library import load_text

    return definition_texts(**options).map(
        lambda pair: parse(pair[1], library=load_text(pair[0], "<definitions>")))
