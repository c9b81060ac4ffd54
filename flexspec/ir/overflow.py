"""Integer arithmetic a kernel cannot compute at given lengths: values that leave the int dtype
it computes in (overflow), and divisors of ``//`` and ``%`` that can be 0.

Overflow: the integer arithmetic of a spec that, at given lengths, leaves the int
dtype a kernel computes it in. A kernel wraps around silently (``q * 2**62`` in int64 gave the
reference and FlexAttention different answers), so every int node is bounded by interval
analysis over the ranges of ``b h q kv`` and the sizes, and one whose bounds leave the dtype is an
error before anything runs.

Only what a kernel's result depends on is checked: a ``where`` branch is bounded under its
condition (``where(q < 10, q * 2**60, 0)`` computes ``q * 2**60`` only for ``q < 10``; elsewhere
its wrapped value is discarded), and a branch its condition never takes is not checked at all.
Bounds that interval analysis cannot find (a tensor's values, a divisor that may be 0) are not
errors: only a sound, finite bound outside the dtype is.

Division by zero: an int ``//`` or ``%`` whose divisor's bounds hold 0 (``Q_LEN // (Q_LEN - 24)``
at Q_LEN = 24, ``q // (kv - q)``) is an error, in a ``where`` branch too: torch computes both
branches of a ``where`` at every point, and an integer division by zero raises on the CPU and
gives garbage on a GPU. A divisor with unknown bounds (a tensor's values) is not checked.

>>> from flexspec.ir import Binary, Const, Var
>>> spec = AttentionIR(mask=Binary(">=", Binary("*", Var("q"), Const(2**62)), Var("kv")))
>>> check_int_ranges(spec, {"q": (0, 7), "kv": (0, 7)}, "int64", "here")
Traceback (most recent call last):
...
flexspec.errors.SpecError: 'q * 4611686018427387904' reaches 0..3.23e+19 here, beyond ...
"""

from __future__ import annotations

import functools
import math

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.ir.intervals import INF, Analyzer, ScalarOps
from flexspec.ir.nodes import AttentionIR
from flexspec.limits import check_int_range, fits_int

_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


class _Bounds(Analyzer):
    """Interval analysis on Python numbers, each node bounded once (a spec may be large)."""

    def __init__(self, ranges: dict):
        super().__init__(ScalarOps, ranges)
        self.memo: dict = {}

    def number(self, node: ir.Expr):
        key = id(node)  # the nodes live as long as the spec: their ids are stable here
        if key not in self.memo:
            self.memo[key] = super().number(node)
        return self.memo[key]


def position_ranges(sizes: dict, q_low: int = 0, q_high: int | None = None) -> dict:
    """The ranges of the IR's variables for ``sizes`` (``B H Q_LEN KV_LEN``, each an int or a
    ``(low, high)`` range of them, as :func:`length_buckets` gives), with query positions
    ``q_low .. q_high`` (``0 .. Q_LEN - 1`` when ``q_high`` is None)."""
    q_high = largest(sizes["Q_LEN"]) - 1 + q_low if q_high is None else q_high
    ranges = {"b": (0, largest(sizes["B"]) - 1), "h": (0, largest(sizes["H"]) - 1),
              "q": (q_low, q_high), "kv": (0, largest(sizes["KV_LEN"]) - 1)}
    ranges.update((name, sizes[name] if isinstance(sizes[name], tuple)
                   else (sizes[name], sizes[name])) for name in ir.SIZE_VARS)
    return ranges


def largest(size) -> int:
    """The largest value of a size given as an int or as a ``(low, high)`` range."""
    return size[1] if isinstance(size, tuple) else size


def length_buckets(sizes: dict) -> dict:
    """``sizes`` with Q_LEN and KV_LEN widened to the range of lengths a check at them may stand
    for: ``2**(k - 1) + 1 .. 2**k``, the smallest power of two at least the length. Interval
    analysis over a range is sound for every length in it, so a check that passes there need not
    be made again as a cache grows by one key per decoding step (the range may be too loose to
    pass: then the caller checks the exact sizes)."""
    widened = dict(sizes)
    for name in ("Q_LEN", "KV_LEN"):
        length = sizes[name]
        if length > 2:
            high = 1 << (length - 1).bit_length()
            widened[name] = (high // 2 + 1, high)
    return widened


def check_int_ranges(spec: AttentionIR, ranges: dict, dtype: str, where: str) -> None:
    """A :class:`~flexspec.errors.SpecError` naming the first int expression of ``spec`` whose
    values over ``ranges`` (name -> (lo, hi)) leave ``dtype`` ("int64" or "int32"); ``where``
    says for which lengths, in the message."""
    bounds = _Bounds(ranges)  # both checks bound the same nodes over the same ranges
    for root in (spec.mask, spec.score):
        _check(root, ranges, dtype, where, bounds)
        _check_divisors(root, where, bounds)


@functools.lru_cache(maxsize=512)
def fits_int_ranges(spec: AttentionIR, sizes: tuple, q_low: int, q_high: int,
                    dtype: str) -> bool:
    """Whether :func:`check_int_ranges` passes for ``sizes`` (sorted ``(name, size)`` pairs, a
    size an int or a range as :func:`length_buckets` gives) with query positions ``q_low ..
    q_high``, remembered: a check over a bucket of lengths, which stands for every length in
    it, is then made once per bucket (the caller checks the exact sizes where it fails, for the
    message)."""
    try:
        check_int_ranges(spec, position_ranges(dict(sizes), q_low, q_high), dtype, "")
    except SpecError:
        return False
    return True


def _check_divisors(root: ir.Expr, where: str, bounds: _Bounds) -> None:
    for node in ir.walk(root):
        if isinstance(node, ir.Binary) and node.op in ("//", "%") and node.type == "int":
            lo, hi = bounds.number(node.right)
            if math.isfinite(lo) and math.isfinite(hi) and lo <= 0 <= hi:
                divisor = ir.to_text(node.right)
                raise SpecError(
                    f"'{ir.to_text(node)}' divides by '{divisor}', which can be 0 {where}: an "
                    "integer division by zero has no value (torch raises on the CPU, a GPU "
                    "computes garbage), in a where branch too, since both branches are "
                    f"computed; keep the divisor away from 0, e.g. max({divisor}, 1)")


def _check(node: ir.Expr, ranges: dict, dtype: str, where: str, bounds=None) -> None:
    bounds = bounds or _Bounds(ranges)
    if isinstance(node, ir.Call) and node.fn == "where":
        cond, taken, other = node.args
        _check(cond, ranges, dtype, where, bounds)
        must, may = bounds.boolean(cond)
        for branch, holds, runs in ((taken, True, may), (other, False, not must)):
            narrowed = _narrowed(cond, holds, ranges, bounds) if runs else None
            if narrowed is not None:
                _check(branch, narrowed, dtype, where,
                       bounds if narrowed is ranges else None)
        return
    for child in ir.children(node):
        _check(child, ranges, dtype, where, bounds)
    if node.type == "int" and not isinstance(node, ir.Const):
        lo, hi = bounds.number(node)
        # an unknown bound (a tensor's values, a divisor that may be 0) is not an error
        if (math.isfinite(lo) and not fits_int(lo, dtype)) or \
                (math.isfinite(hi) and not fits_int(hi, dtype)):
            check_int_range(ir.to_text(node), lo, hi, dtype, where)


def _narrowed(cond: ir.Expr, holds: bool, ranges: dict, bounds: _Bounds) -> dict | None:
    """``ranges`` with the variables ``cond`` compares limited to where ``cond`` is ``holds``:
    ``ranges`` itself when nothing narrows, None when no point is left."""
    if isinstance(cond, ir.Unary) and cond.op == "not":
        return _narrowed(cond.operand, not holds, ranges, bounds)
    if isinstance(cond, (ir.And, ir.Or)) and holds == isinstance(cond, ir.And):
        for part in cond.args:  # every conjunct holds (every disjunct fails)
            ranges = _narrowed(part, holds, ranges, bounds if part is cond.args[0] else
                               _Bounds(ranges))
            if ranges is None:
                return None
        return ranges
    if not (isinstance(cond, ir.Binary) and cond.op in _FLIP and cond.left.type == "int"):
        return ranges
    op = cond.op if holds else _NEGATE[cond.op]
    for var, other, rel in ((cond.left, cond.right, op), (cond.right, cond.left, _FLIP[op])):
        if isinstance(var, ir.Var) and var.name in ranges:
            lo, hi = ranges[var.name]
            olo, ohi = bounds.number(other)
            if rel == "<":
                hi = min(hi, ohi - 1)
            elif rel == "<=":
                hi = min(hi, ohi)
            elif rel == ">":
                lo = max(lo, olo + 1)
            elif rel == ">=":
                lo = max(lo, olo)
            elif rel == "==":
                lo, hi = max(lo, olo), min(hi, ohi)
            if lo > hi:
                return None
            if (lo, hi) != ranges[var.name] and lo > -INF and hi < INF:
                ranges = {**ranges, var.name: (lo, hi)}
    return ranges


@functools.lru_cache(maxsize=256)
def position_range(spec: AttentionIR, sizes: tuple, dtype: str,
                   known: tuple | None = None) -> tuple | None:
    """``(low, high)``: the query positions at which the spec's integer arithmetic provably fits
    ``dtype`` at these sizes (``sizes``: sorted ``(name, value)`` pairs), a range that holds
    ``0 .. max(Q_LEN, KV_LEN) - 1`` and, where the spec allows it, as many negative positions
    as positive ones; its ends are powers of two. ``None`` when even that first range does not
    fit (the spec's own check says why). Offsets that put a row outside it are refused or
    bounded by the runtime: the kernels would wrap around silently there.

    ``known`` is a range this function gave for sizes that stand for these (their lengths'
    buckets, :func:`length_buckets`): sound here too, so the search starts at its end and checks
    only beyond it. The result is the same with or without it; a growing cache then pays at most
    two checks per new length (none where ``known`` is already the widest) instead of a search.

    >>> from flexspec.ir import Binary, Const, Var
    >>> spec = AttentionIR(mask=Binary(">=", Binary("*", Var("q"), Const(4)), Var("kv")))
    >>> position_range(spec, (("B", 1), ("H", 1), ("KV_LEN", 8), ("Q_LEN", 8)), "int32")
    (-268435456, 268435456)
    """
    sizes = dict(sizes)
    bits = 62 if dtype == "int64" else 30
    first = max(1, (max(largest(sizes["Q_LEN"]), largest(sizes["KV_LEN"])) - 1).bit_length())
    for negative in (True, False):
        if known is not None and (known[0] < 0) == negative and known[1] >= 2**first:
            low = known[1].bit_length() - 1  # fits at 2**low: known holds for these sizes
        elif _fits_at(spec, sizes, dtype, first, negative):
            low = first
        else:
            continue
        high = bits  # fits at 2**low; find the largest that does, trying the next one first
        if low < high and not _fits_at(spec, sizes, dtype, low + 1, negative):
            high = low
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if _fits_at(spec, sizes, dtype, middle, negative) \
                else (low, middle - 1)
        return (-2**low if negative else 0, 2**low)
    return None


def _fits_at(spec: AttentionIR, sizes: dict, dtype: str, exponent: int, negative: bool) -> bool:
    reach = 2**exponent
    try:
        check_int_ranges(spec, position_ranges(sizes, -reach if negative else 0, reach), dtype,
                         "")
    except SpecError:
        return False
    return True
