"""Rewrites of a whole spec's IR, each a pure ``AttentionIR -> AttentionIR`` function: where a
call's queries stand (:func:`placed`, or row by row: :func:`at_rows`), a call's scale
(:func:`scaled`), a jagged batch laid end to end (:func:`packed`), and a mask or a score
modifier joined to a spec (:func:`join_mask`, :func:`join_score`). Also the one rule for where
the rows of an end-aligned spec stand by default (:func:`default_offset`).

The tensors these rewrites introduce are read like any binding, so a new offset, length or scale
is a new tensor value at run time, never new code.

>>> from flexspec import parse
>>> print(placed(parse("causal").ir, offset=True, lengths=True).mask)
q + q_offset[b] >= kv & kv < kv_lengths[b]
"""

from __future__ import annotations

import functools

from flexspec.ir.nodes import (SCORE, SCORE_VAR, TRUE, And, AttentionIR, Binary, Expr, Lookup,
                               Tensor, Var, children, free_vars, rebuild, substitute)
from flexspec.ir.simplify import simplify

# The tensors of a call's placement, one entry per batch row. Their names are reserved: a
# spec's own bindings cannot take them (the checker says so).
Q_OFFSET = "q_offset"
KV_LENGTHS = "kv_lengths"
SCALE = "scale"
_PER_ROW = (Var("B"),)
OFFSET_TENSOR = Tensor(Q_OFFSET, _PER_ROW, "int")
LENGTHS_TENSOR = Tensor(KV_LENGTHS, _PER_ROW, "int")
# one entry per batch row, read at b: a code generator that cannot read a tensor at a constant
# index (see forms.constant_lookup) would otherwise keep a given scale off its kernel
SCALE_TENSOR = Tensor(SCALE, _PER_ROW, "float")


@functools.lru_cache(maxsize=512)
def reads_positions(spec: AttentionIR) -> bool:
    """Whether the spec reads ``q`` at all (else an offset changes nothing)."""
    return "q" in free_vars(spec.mask) | free_vars(spec.score)


@functools.lru_cache(maxsize=256)
def placed(spec: AttentionIR, offset: bool, lengths: bool) -> AttentionIR:
    """``spec`` with ``q`` read as ``q + q_offset[b]`` (with ``offset``) and the mask limited to
    ``kv < kv_lengths[b]`` (with ``lengths``)."""
    mask, score = spec.mask, spec.score
    if offset:
        position = Binary("+", Var("q"), Lookup(OFFSET_TENSOR, (Var("b"),)))
        mask, score = (substitute(mask, {"q": position}) if "q" in free_vars(mask) else mask,
                       substitute(score, {"q": position}) if "q" in free_vars(score) else score)
    if lengths:
        valid = Binary("<", Var("kv"), Lookup(LENGTHS_TENSOR, (Var("b"),)))
        mask = valid if mask == TRUE else And((mask, valid))
    # with the offset written into the IR, its q is the row number: aligned at the start (an
    # end-aligned IR would be shifted a second time by whoever places its rows)
    return AttentionIR(mask, score, "start" if offset else spec.align)


# The absolute position of each query row of a call whose rows are not consecutive (see at_rows).
ROW_POSITION = Tensor("context_q_position", (Var("Q_LEN"),), "int")


@functools.lru_cache(maxsize=256)
def at_rows(spec: AttentionIR) -> AttentionIR:
    """``spec`` (aligned at the start) with query row ``i`` read at the absolute position
    ``context_q_position[i]``: one call over rows that are not consecutive, such as the blocks
    a context-parallel rank computes.

    >>> from flexspec import parse
    >>> print(at_rows(parse("causal & doc").ir).mask)
    context_q_position[q] >= kv & doc_ids[b, context_q_position[q]] == doc_ids[b, kv]
    """
    position = {"q": Lookup(ROW_POSITION, (Var("q"),))}
    return AttentionIR(_outside_tensors(spec.mask, position),
                       _outside_tensors(spec.score, position), "start")


# The tensors of a jagged batch laid end to end (see packed): per packed query row, its
# sequence, its position in it, and its sequence's query and key lengths; per packed key row,
# its sequence and its position in it.
Q_SEQUENCE = Tensor("jagged_q_sequence", (Var("Q_LEN"),), "int")
Q_POSITION = Tensor("jagged_q_position", (Var("Q_LEN"),), "int")
Q_LENGTH = Tensor("jagged_q_length", (Var("Q_LEN"),), "int")
KV_LENGTH = Tensor("jagged_kv_length", (Var("Q_LEN"),), "int")
KV_SEQUENCE = Tensor("jagged_kv_sequence", (Var("KV_LEN"),), "int")
KV_POSITION = Tensor("jagged_kv_position", (Var("KV_LEN"),), "int")
JAGGED_TENSORS = (Q_SEQUENCE, Q_POSITION, Q_LENGTH, KV_LENGTH, KV_SEQUENCE, KV_POSITION)


@functools.lru_cache(maxsize=256)
def packed(spec: AttentionIR) -> AttentionIR:
    """``spec`` over the sequences of a jagged batch laid end to end in one row: ``q`` and
    ``kv`` read as positions within their sequences, ``b`` as the query's sequence, ``Q_LEN``
    and ``KV_LEN`` as its lengths (an end-aligned spec's rows stand at the end of their own
    sequence), and the mask limited to the keys of the query's own sequence. The caller refuses
    specs this cannot express (bindings, tensors sized by the lengths, the size ``B``).

    >>> from flexspec import parse
    >>> print(packed(parse("causal").ir).mask)
    jagged_q_sequence[q] == jagged_kv_sequence[kv] & jagged_q_position[q] >= jagged_kv_position[kv]
    """
    sequence = Lookup(Q_SEQUENCE, (Var("q"),))
    position: Expr = Lookup(Q_POSITION, (Var("q"),))
    q_length, kv_length = Lookup(Q_LENGTH, (Var("q"),)), Lookup(KV_LENGTH, (Var("q"),))
    if spec.align == "end":
        position = Binary("+", position, Binary("-", kv_length, q_length))
    mapping = {"q": position, "kv": Lookup(KV_POSITION, (Var("kv"),)), "b": sequence,
               "Q_LEN": q_length, "KV_LEN": kv_length}
    same = Binary("==", sequence, Lookup(KV_SEQUENCE, (Var("kv"),)))
    mask = _outside_tensors(spec.mask, mapping)
    return AttentionIR(same if mask == TRUE else simplify(And((same, mask))),
                       _outside_tensors(spec.score, mapping), "start")


def _outside_tensors(node: Expr, mapping: dict) -> Expr:
    """``node`` with the variables of ``mapping`` replaced, except inside tensors' declared
    shapes (a table sized ``[H]`` stays so)."""
    if isinstance(node, Tensor):
        return node
    if isinstance(node, Var):
        return mapping.get(node.name, node)
    kids = children(node)
    if not kids:
        return node
    new = tuple(_outside_tensors(kid, mapping) for kid in kids)
    return rebuild(node, new) if new != kids else node


def default_offset(align: str, q_len: int, kv_len: int, kv_lengths=None):
    """Where row 0 of a call without ``q_offset`` stands: ``None`` (position 0) for a spec
    aligned at the start; for one aligned at the end, the position that puts the last row on the
    last (valid) key: ``KV_LEN - Q_LEN``, or ``kv_lengths - Q_LEN`` per batch row (``kv_lengths``
    anything that subtracts an int: an int tensor at run time).

    >>> default_offset("start", 4, 10), default_offset("end", 4, 10)
    (None, 6)
    """
    if align == "start":
        return None
    return kv_len - q_len if kv_lengths is None else kv_lengths - q_len


@functools.lru_cache(maxsize=256)
def scaled(spec: AttentionIR) -> AttentionIR:
    """``spec`` with its logits multiplied by ``scale[b]`` before the score pipeline: a kernel
    that keeps its default scale then runs any other one as a tensor value."""
    logit = Binary("*", SCORE, Lookup(SCALE_TENSOR, (Var("b"),)))
    return AttentionIR(spec.mask, substitute(spec.score, {SCORE_VAR: logit}), spec.align)


def join_mask(spec: AttentionIR, mask: AttentionIR) -> AttentionIR:
    """``spec`` with ``mask``'s mask joined to its own by ``&`` (its score unchanged), aligned at
    the end when either is.

    >>> from flexspec import parse
    >>> print(join_mask(parse("causal + alibi").ir, parse("window(4)").ir).mask)
    q >= kv & abs(q - kv) <= 4
    """
    return AttentionIR(simplify(And((spec.mask, mask.mask))), spec.score,
                       _joined_align(spec, mask))


def join_score(spec: AttentionIR, modifier: AttentionIR) -> AttentionIR:
    """``spec`` with ``modifier``'s score applied after its own (``spec + modifier``), masks
    joined as by :func:`join_mask`.

    >>> from flexspec import parse
    >>> print(join_score(parse("causal + scale(2.0)").ir, parse("softcap(5.0)").ir).score)
    5.0 * tanh(score * 2.0 / 5.0)
    """
    score: Expr = simplify(substitute(modifier.score, {SCORE_VAR: spec.score}))
    return AttentionIR(simplify(And((spec.mask, modifier.mask))), score,
                       _joined_align(spec, modifier))


def _joined_align(a: AttentionIR, b: AttentionIR) -> str:
    return "end" if "end" in (a.align, b.align) else "start"
