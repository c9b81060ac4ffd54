"""Known forms read off an IR, for backends that run them with fixed-function kernels, and the
queries those backends ask of a spec.

* :func:`logit_factor`: a score that is the logit times a positive constant;
* :func:`sdpa_form`: full or top-left causal attention times a constant (what
  ``scaled_dot_product_attention`` computes), and :func:`is_causal_mask`;
* :func:`native_form`: a window around the diagonal (causal, sliding windows), documents as
  runs of ids, a constant factor and a softcap (what FlashAttention-4's own kernels compute);
* :func:`constant_lookup` and :func:`nested_lookup`: tensor lookups some code generators
  cannot compile (at a constant index, or indexed by another lookup);
* :func:`distance_span`: the band of distances ``q - kv`` outside which a spec that reads
  positions only through that distance sees nothing (the keys a decoded token needs at all).

Every function is pure and cached by the (frozen, hashable) IR it reads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from flexspec.ir.nodes import (COMPARE_OPS, SCORE, TRUE, And, AttentionIR, Binary, Call, Const,
                               Expr, Lookup, Tensor, Unary, Var, children, free_vars, to_text,
                               walk)


# ---- a constant factor of the logit ------------------------------------------------------------


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


# ---- scaled_dot_product_attention ---------------------------------------------------------------


@dataclass(frozen=True)
class SdpaForm:
    """A spec SDPA can run: ``causal`` or full attention, logits times ``factor``."""

    causal: bool
    factor: float


_CAUSAL_MASKS = (Binary(">=", Var("q"), Var("kv")), Binary("<=", Var("kv"), Var("q")))


def is_causal_mask(spec: AttentionIR) -> bool:
    """Whether ``spec``'s mask is top-left causal, or causal joined by ``&`` to more: no query
    sees a later key (what ``is_causal=True`` says of a mask in torch).

    >>> from flexspec import parse
    >>> is_causal_mask(parse("causal & window(8) + alibi").ir), is_causal_mask(parse("full").ir)
    (True, False)
    """
    atoms = spec.mask.args if isinstance(spec.mask, And) else (spec.mask,)
    return spec.align == "start" and any(atom in _CAUSAL_MASKS for atom in atoms)


def sdpa_form(spec: AttentionIR) -> SdpaForm | None:
    """The SDPA form of a spec, or ``None`` when SDPA cannot run it exactly.

    >>> from flexspec import parse
    >>> sdpa_form(parse("causal + scale(2.0)").ir)
    SdpaForm(causal=True, factor=2.0)
    >>> sdpa_form(parse("causal & window(8)").ir) is None
    True
    """
    if spec.mask == TRUE:
        causal = False
    elif spec.mask in _CAUSAL_MASKS and spec.align == "start":
        causal = True  # is_causal is top-left: an end-aligned causal is another mask
    else:
        return None
    factor = logit_factor(spec.score)
    return None if factor is None else SdpaForm(causal=causal, factor=factor)


# ---- FlashAttention-4's own kernels -------------------------------------------------------------


@dataclass(frozen=True)
class NativeForm:
    """A spec FA4's own interface runs: visible keys ``q - left <= kv <= q + right`` (``None``:
    unbounded on that side), within the query's document when ``documents`` names the ids, with
    logits times ``factor`` then soft-capped at ``softcap``."""

    left: int | None = None
    right: int | None = None
    documents: Tensor | None = None
    softcap: float | None = None
    factor: float = 1.0

    @property
    def causal(self) -> bool:
        return self.left is None and self.right == 0

    @property
    def window(self) -> tuple:
        """FA4's ``window_size`` (``(None, None)``: no window)."""
        return (None, None) if self.causal else (self.left, self.right)


@functools.lru_cache(maxsize=512)
def native_form(spec: AttentionIR) -> NativeForm | None:
    """The native form of ``spec``, or ``None`` when FA4's own kernels cannot run it exactly.

    >>> from flexspec import parse
    >>> native_form(parse("sliding_window(1024)").ir)
    NativeForm(left=1024, right=0, documents=None, softcap=None, factor=1.0)
    >>> native_form(parse("causal & doc + softcap(30)").ir).documents.name
    'doc_ids'
    >>> native_form(parse("causal + alibi").ir) is None
    True
    """
    if spec.align != "start":
        return None
    low, high, documents = -math.inf, math.inf, None
    atoms = spec.mask.args if isinstance(spec.mask, And) else (spec.mask,)
    for atom in atoms:
        if atom == TRUE:
            continue
        tensor = same_document(atom)
        if tensor is not None and documents in (None, tensor):
            documents = tensor
            continue
        bounds = distance_bounds(atom)
        if bounds is None:
            return None
        low, high = max(low, bounds[0]), min(high, bounds[1])
    # FA4 takes non-negative window sizes: the diagonal must be visible
    if not low <= 0 <= high:
        return None
    score = softcap_form(spec.score)
    if score is None:
        return None
    softcap, factor = score
    return NativeForm(left=None if high == math.inf else int(high),
                      right=None if low == -math.inf else int(-low),
                      documents=documents, softcap=softcap, factor=factor)


@functools.lru_cache(maxsize=512)
def distance_span(spec: AttentionIR) -> tuple | None:
    """``(low, high)``: every visible pair has ``low <= q - kv <= high`` (ints or infinities,
    from the mask's conjuncts that bound the distance), for a spec whose mask and score read
    ``q`` and ``kv`` only through ``q - kv`` and never read ``KV_LEN``: moving every position by
    the same amount (cutting keys off the front of the cache and the queries' offset with them)
    then changes nothing. ``None`` for any other spec, or where neither side is bounded.

    >>> from flexspec import parse
    >>> distance_span(parse("sliding_window(1024)").ir)
    (0, 1024)
    >>> distance_span(parse("causal & (window(8) | sink(4))").ir) is None
    True
    """
    if not (_through_distance(spec.mask) and _through_distance(spec.score)):
        return None
    low, high = -math.inf, math.inf
    for atom in spec.mask.args if isinstance(spec.mask, And) else (spec.mask,):
        bounds = distance_bounds(atom)
        if bounds is not None:
            low, high = max(low, bounds[0]), min(high, bounds[1])
    if low == -math.inf and high == math.inf:
        return None
    return low, high


def _through_distance(node: Expr) -> bool:
    """Whether ``node`` reads ``q`` and ``kv`` only as ``c * (q - kv)`` terms, and no ``KV_LEN``
    (sound, not complete: a sum such as ``q + 1 - kv`` counts, ``2 * q - 2 * kv`` does not)."""
    linear = _linear(node)
    if linear is None and isinstance(node, Binary) and node.op in COMPARE_OPS:
        linear = _linear(Binary("-", node.left, node.right))  # q >= kv is q - kv >= 0
    if linear is not None:
        return linear[0] == -linear[1]
    if isinstance(node, Var):
        return node.name not in ("q", "kv", "KV_LEN")
    return all(_through_distance(child) for child in children(node))


def same_document(atom: Expr) -> Tensor | None:
    """``T`` when ``atom`` is ``T[b, q] == T[b, kv]`` (the batch index may be a broadcast 0).

    >>> from flexspec import parse
    >>> same_document(parse("doc").ir.mask).name
    'doc_ids'
    """
    if not (isinstance(atom, Binary) and atom.op == "=="):
        return None
    left, right = atom.left, atom.right
    if not (isinstance(left, Lookup) and isinstance(right, Lookup)
            and left.tensor == right.tensor and len(left.index) == 2):
        return None
    row = left.index[0]
    if right.index[0] != row or row not in (Var("b"), Const(0)):
        return None
    if {left.index[1], right.index[1]} != {Var("q"), Var("kv")}:
        return None
    return left.tensor


_MIRRORED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def distance_bounds(atom: Expr) -> tuple | None:
    """``(low, high)`` with ``atom`` equivalent to ``low <= q - kv <= high`` (ints or
    infinities), or ``None`` when it is not a bound on the distance.

    >>> from flexspec import parse
    >>> distance_bounds(parse("window(4)").ir.mask)
    (-4, 4)
    """
    if not isinstance(atom, Binary) or atom.op not in COMPARE_OPS:
        return None
    if (atom.op == "<=" and isinstance(atom.left, Call) and atom.left.fn == "abs"
            and isinstance(atom.right, Const) and type(atom.right.value) is int):
        inner = _difference(atom.left.args[0])
        if inner is None or abs(inner[0]) != 1 or inner[1] != 0:
            return None
        return (-atom.right.value, atom.right.value)
    difference = _difference(Binary("-", atom.left, atom.right))
    if difference is None or abs(difference[0]) != 1:
        # s * (q - kv) + c op 0 for |s| > 1 bounds q - kv by -c / s, rounded: not read here
        return None
    sign, constant = difference  # atom: sign * (q - kv) + constant  op  0
    op = atom.op if sign > 0 else _MIRRORED[atom.op]
    bound = -constant * sign      # (q - kv)  op  bound
    if op == "==":
        return (bound, bound)
    if op == "<=":
        return (-math.inf, bound)
    if op == "<":
        return (-math.inf, bound - 1)
    if op == ">=":
        return (bound, math.inf)
    if op == ">":
        return (bound + 1, math.inf)
    return None  # "!=" is not a window


def _difference(node: Expr) -> tuple | None:
    """``(s, c)`` when ``node`` equals ``s * (q - kv) + c`` for ints s and c, else ``None``."""
    linear = _linear(node)
    if linear is None:
        return None
    q, kv, constant = linear
    return (q, constant) if q == -kv else None


def _linear(node: Expr) -> tuple | None:
    """``(a, b, c)`` with ``node == a*q + b*kv + c`` for int sums and differences of ``q``,
    ``kv`` and int constants."""
    if node == Var("q"):
        return (1, 0, 0)
    if node == Var("kv"):
        return (0, 1, 0)
    if isinstance(node, Const) and type(node.value) is int:
        return (0, 0, node.value)
    if isinstance(node, Unary) and node.op == "neg":
        inner = _linear(node.operand)
        return None if inner is None else tuple(-n for n in inner)
    if isinstance(node, Binary) and node.op in ("+", "-"):
        left, right = _linear(node.left), _linear(node.right)
        if left is None or right is None:
            return None
        sign = 1 if node.op == "+" else -1
        return tuple(a + sign * b for a, b in zip(left, right))
    return None


def softcap_form(score: Expr) -> tuple | None:
    """``(softcap, factor)`` when ``score`` is ``c * tanh(x / c)`` (softcap c) or ``x``, with x
    the logit times positive constants (``factor``); ``None`` otherwise.

    >>> from flexspec import parse
    >>> softcap_form(parse("softcap(30.0)").ir.score)
    (30.0, 1.0)
    """
    softcap = None
    if isinstance(score, Binary) and score.op == "*":
        for cap, rest in ((score.left, score.right), (score.right, score.left)):
            if (isinstance(cap, Const) and isinstance(rest, Call) and rest.fn == "tanh"
                    and isinstance(rest.args[0], Binary) and rest.args[0].op == "/"
                    and rest.args[0].right == cap):
                softcap, score = float(cap.value), rest.args[0].left
                break
    factor = logit_factor(score)
    if factor is None:
        return None
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        return None
    return softcap, factor


# ---- lookups some code generators cannot compile -----------------------------------------------


@functools.lru_cache(maxsize=512)
def constant_lookup(spec: AttentionIR) -> str | None:
    """The first tensor lookup of ``spec`` with a constant index in some dimension (as text:
    ``doc_ids[0, q]``), or ``None``.

    >>> from flexspec import ir
    >>> ids = ir.Tensor("doc_ids", (ir.Var("B"), ir.Var("KV_LEN")), "int")
    >>> constant_lookup(AttentionIR(ir.Binary("==", ir.Lookup(ids, (ir.Const(0), ir.Var("q"))),
    ...                                       ir.Const(1))))
    'doc_ids[0, q]'
    """
    for node in lookups(spec):
        if not all(free_vars(index) for index in node.index):
            return to_text(node)
    return None


@functools.lru_cache(maxsize=512)
def nested_lookup(spec: AttentionIR) -> str | None:
    """The first tensor lookup of ``spec`` whose index reads another tensor (as text:
    ``doc_ids[b, q + q_offset[b]]``), or ``None``."""
    for node in lookups(spec):
        if any(isinstance(inner, Lookup) for index in node.index for inner in walk(index)):
            return to_text(node)
    return None


def lookups(spec: AttentionIR):
    """Every tensor lookup of the mask and the score, in order."""
    for root in (spec.mask, spec.score):
        yield from (node for node in walk(root) if isinstance(node, Lookup))
