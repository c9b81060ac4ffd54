"""Hand-built IR for the tests of the torch layers (reference, lowering, tensors).

Built without the parser so these tests do not depend on it. Each spec follows the settled
conventions (``causal`` is ``q >= kv``, ``window(n)`` is ``abs(q - kv) <= n``).
"""

from flexspec import ir

b, h, q, kv = ir.Var("b"), ir.Var("h"), ir.Var("q"), ir.Var("kv")
B, H, Q_LEN, KV_LEN = ir.Var("B"), ir.Var("H"), ir.Var("Q_LEN"), ir.Var("KV_LEN")
SCORE = ir.SCORE


def C(value):
    return ir.Const(value)


def op(symbol, left, right):
    return ir.Binary(symbol, left, right)


def call(fn, *args):
    return ir.Call(fn, tuple(args))


def lookup(tensor, *index):
    return ir.Lookup(tensor, tuple(index))


def distance():
    return call("abs", op("-", q, kv))


CAUSAL = op(">=", q, kv)
# Bottom-right aligned causal, for Q_LEN != KV_LEN (decoding with a KV cache).
CAUSAL_BR = op(">=", op("-", op("+", q, KV_LEN), Q_LEN), kv)


def window(n):
    return op("<=", distance(), C(n))


def sliding_window(n):
    return ir.And((CAUSAL, window(n)))


DOC_IDS = ir.Tensor("doc_ids", (B, KV_LEN), dtype="int")
DOCUMENT = op("==", lookup(DOC_IDS, b, q), lookup(DOC_IDS, b, kv))

LENGTHS = ir.Tensor("lengths", (B,), dtype="int")
# Batch-dependent padding: both the query and the key must lie inside the sequence.
PADDING = ir.And((op("<", q, lookup(LENGTHS, b)), op("<", kv, lookup(LENGTHS, b))))

# Head-dependent: head h sees every (h+1)-th key before the query (dilated causal).
DILATED = ir.And((CAUSAL, op("==", op("%", op("-", q, kv), op("+", h, C(1))), C(0))))

SLOPES = ir.Tensor("alibi_slopes", (H,), origin="builtin", builtin="alibi_slopes", args=(H,))
ALIBI = op("-", SCORE, op("*", lookup(SLOPES, h), distance()))

BIAS = ir.Tensor("bias", (H,), origin="learnable", init="normal")


def softcap(c, inner=SCORE):
    return op("*", C(c), call("tanh", op("/", inner, C(c))))


def spec(mask=ir.TRUE, score=SCORE):
    return ir.AttentionIR(mask, score)
