"""Tests of flexspec.kernels.evaluate (what an IR expression means on index grids) against
definitions written out by hand in plain Python."""

import math
import re

import pytest
import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.kernels.evaluate import evaluate, index_grid, query_offsets
from flexspec.kernels.reference import dense_mask, dense_scores
from ir_examples import (CAUSAL, DOC_IDS, KV_LEN, Q_LEN, SCORE, B, C, H, b, call, h, kv, lookup,
                         op, q, softcap, spec)
from test_reference import python_mask


# --- expression semantics ------------------------------------------------------------------


GRID = index_grid(2, 3, 5, 7)


def value_of(expr, **extra):
    return evaluate(expr, {**GRID, **extra}, {})


@pytest.mark.parametrize("expr, fn", [
    (op("//", op("-", q, kv), C(3)), lambda q_, k_: (q_ - k_) // 3),
    (op("%", op("-", q, kv), C(3)), lambda q_, k_: (q_ - k_) % 3),
    (op("%", op("-", q, kv), C(-4)), lambda q_, k_: (q_ - k_) % -4),
    (op("//", C(7), op("-", op("-", q, kv), C(10))), lambda q_, k_: 7 // (q_ - k_ - 10)),
    (call("sign", op("-", q, kv)), lambda q_, k_: (q_ > k_) - (q_ < k_)),
    (call("clamp", op("-", q, kv), C(-2), C(3)), lambda q_, k_: min(max(q_ - k_, -2), 3)),
    (call("min", q, op("*", kv, C(2))), lambda q_, k_: min(q_, 2 * k_)),
    (call("where", op(">", q, kv), q, kv), lambda q_, k_: q_ if q_ > k_ else k_),
    (call("floor", op("/", op("-", q, kv), C(2))), lambda q_, k_: math.floor((q_ - k_) / 2)),
    (call("ceil", op("/", op("-", q, kv), C(2))), lambda q_, k_: math.ceil((q_ - k_) / 2)),
    (op("-", KV_LEN, Q_LEN), lambda q_, k_: 2),
    (call("floor", op("-", q, kv)), lambda q_, k_: q_ - k_),
    (call("ceil", op("-", kv, q)), lambda q_, k_: k_ - q_),
])
def test_integer_semantics_follow_python(expr, fn):
    got = value_of(expr)
    assert got.dtype == torch.int64
    expected = [[fn(qi, ki) for ki in range(7)] for qi in range(5)]
    assert got.expand(2, 3, 5, 7)[1, 2].tolist() == expected


@pytest.mark.parametrize("expr, fn", [
    (op("/", q, op("+", kv, C(1))), lambda q_, k_: q_ / (k_ + 1)),
    (call("tanh", op("/", q, C(3))), lambda q_, k_: math.tanh(q_ / 3)),
    (call("exp2", op("-", C(0), q)), lambda q_, k_: 2.0 ** -q_),
    (call("log", op("+", q, C(1))), lambda q_, k_: math.log(q_ + 1)),
    (call("log2", op("+", kv, C(1))), lambda q_, k_: math.log2(k_ + 1)),
    (call("sqrt", op("*", q, kv)), lambda q_, k_: math.sqrt(q_ * k_)),
    (call("sigmoid", op("-", q, kv)), lambda q_, k_: 1 / (1 + math.exp(k_ - q_))),
    (call("exp", op("*", C(0.5), q)), lambda q_, k_: math.exp(0.5 * q_)),
    (call("sin", op("/", q, C(3))), lambda q_, k_: math.sin(q_ / 3)),
    (call("cos", op("-", q, kv)), lambda q_, k_: math.cos(q_ - k_)),
    (call("log1p", op("*", q, C(0.5))), lambda q_, k_: math.log1p(0.5 * q_)),
    (call("erf", op("-", q, kv)), lambda q_, k_: math.erf(q_ - k_)),
    (op("*", call("abs", op("-", q, kv)), C(0.1)), lambda q_, k_: abs(q_ - k_) * 0.1),
])
def test_float_semantics_are_float64(expr, fn):
    got = value_of(expr)
    assert got.dtype == torch.float64
    expected = [fn(qi, ki) for qi in range(5) for ki in range(7)]
    assert got.expand(2, 3, 5, 7)[0, 0].flatten().tolist() == pytest.approx(expected, rel=1e-14)


def test_boolean_connectives():
    expr = ir.Or((ir.Unary("not", CAUSAL), ir.And((op("==", b, C(1)), op("==", h, C(2))))))
    got = value_of(expr).expand(2, 3, 5, 7)
    expected = python_mask(lambda b_, h_, q_, k_: not q_ >= k_ or (b_ == 1 and h_ == 2),
                           2, 3, 5, 7)
    assert got.dtype == torch.bool and torch.equal(got, expected)
    assert value_of(ir.And(())).item() is True and value_of(ir.Or(())).item() is False


def test_score_is_read_from_the_grid():
    score = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    got = value_of(softcap(2.0), score=score)
    assert torch.allclose(got, 2.0 * torch.tanh(score / 2.0))


def test_values_read_become_int64_or_float64():
    grid = {**index_grid(1, 1, 2, 3), "score": torch.ones(1, 1, 2, 3, dtype=torch.float32)}
    assert evaluate(SCORE, grid, {}).dtype == torch.float64
    weights = ir.Tensor("w", (KV_LEN,), dtype="float")
    got = evaluate(lookup(weights, kv), grid, {"w": torch.tensor([0.5, 1.5, 2.5])})
    assert got.dtype == torch.float64 and got.flatten().tolist() == [0.5, 1.5, 2.5]
    ids = torch.tensor([[4, 5, 6]], dtype=torch.int32)
    got = evaluate(lookup(DOC_IDS, b, kv), grid, {"doc_ids": ids})
    assert got.dtype == torch.int64 and got.flatten().tolist() == [4, 5, 6]
    flags = ir.Tensor("flags", (KV_LEN,), dtype="bool")
    got = evaluate(lookup(flags, kv), grid, {"flags": torch.tensor([True, False, True])})
    assert got.dtype == torch.bool and got.flatten().tolist() == [True, False, True]


def test_sizes_evaluate_without_index_grids():
    # a grid of sizes alone (no "b" to take a device from) evaluates on the CPU
    assert evaluate(op("+", Q_LEN, C(1)), {"Q_LEN": 5}, {}).item() == 6
    assert evaluate(op("-", B, C(1)), {"B": 3}, {}).item() == 2


def test_index_grid_shapes_sizes_and_offsets():
    grid = index_grid(2, 3, 4, 5, q_offset=torch.tensor([10, 20]))
    assert [grid[name].shape for name in ("b", "h", "q", "kv")] == [
        (2, 1, 1, 1), (1, 3, 1, 1), (2, 1, 4, 1), (1, 1, 1, 5)]
    assert all(grid[name].dtype == torch.int64 for name in ("b", "h", "q", "kv"))
    assert grid["q"].flatten().tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert grid["kv"].flatten().tolist() == [0, 1, 2, 3, 4]
    assert {name: grid[name] for name in ("B", "H", "Q_LEN", "KV_LEN")} == {
        "B": 2, "H": 3, "Q_LEN": 4, "KV_LEN": 5}
    # the sizes reach a spec through the grid
    last = ir.And((op("==", b, op("-", B, C(1))), op("==", h, op("-", H, C(1)))))
    expected = python_mask(lambda b_, h_, q_, k_: b_ == 1 and h_ == 2, 2, 3, 4, 5)
    assert torch.equal(dense_mask(spec(last), 2, 3, 4, 5), expected)


@pytest.mark.parametrize("value, batch, expected", [
    (3, 2, [3]),
    (torch.tensor(3), 2, [3]),
    (torch.tensor([4], dtype=torch.int32), 3, [4]),
    (torch.tensor([1, 7], dtype=torch.int32), 2, [1, 7]),
])
def test_query_offsets_are_int64_one_per_batch_row(value, batch, expected):
    got = query_offsets(value, batch)
    assert got.dtype == torch.int64 and got.shape == (len(expected), 1, 1, 1)
    assert got.flatten().tolist() == expected


@pytest.mark.parametrize("value, got", [
    (1.5, "torch.float32 of shape []"),
    (True, "torch.bool of shape []"),
    (torch.tensor([[1, 2]]), "torch.int64 of shape [1, 2]"),
    (torch.tensor([1, 2, 3]), "torch.int64 of shape [3]"),
])
def test_query_offsets_refuse_other_values(value, got):
    message = f"q_offset must be an int or an int tensor of shape [2] or [1], got {got}"
    with pytest.raises(SpecError, match=f"^{re.escape(message)}$"):
        query_offsets(value, 2)


@pytest.mark.parametrize("expr, tensors, message", [
    (DOC_IDS, {}, "the reference cannot evaluate 'doc_ids'"),
    (op("@", q, kv), {}, "unknown operator '@'"),
    (call("nope", q), {}, "unknown function 'nope'"),
    (ir.Param("n", "int"), {}, "parameter 'n' has no value; only resolved specs can run"),
    (lookup(ir.Param("t", "int[KV_LEN]"), kv), {}, "tensor parameter 't' has no value"),
    (lookup(DOC_IDS, b, op("/", q, C(2))), {"doc_ids": torch.zeros(1, 4, dtype=torch.long)},
     "index 1 of 'doc_ids[b, q / 2]' is not an int"),
    (lookup(DOC_IDS, b, q), {"doc_ids": torch.zeros(1, 1, 4, dtype=torch.long)},
     "tensor 'doc_ids' has 3 dimensions but is read with 2 indices"),
    (ir.And((CAUSAL, q)), {}, "'q' is not a boolean"),
    (ir.Unary("not", kv), {}, "'kv' is not a boolean"),
    (call("where", q, q, kv), {}, "'q' is not a boolean"),
])
def test_evaluation_errors(expr, tensors, message):
    with pytest.raises(SpecError, match=f"^{re.escape(message)}$"):
        evaluate(expr, index_grid(1, 1, 2, 3), tensors)


def test_a_mask_must_be_boolean_and_a_score_numeric():
    with pytest.raises(SpecError, match=r"^no value for 'q' in this evaluation$"):
        evaluate(q, {}, {})
    with pytest.raises(SpecError, match=r"^'q \+ kv' is not a boolean$"):
        dense_mask(spec(op("+", q, kv)), 1, 1, 2, 2)
    logits = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    with pytest.raises(SpecError, match=r"^the score pipeline 'q >= kv' is not numeric$"):
        dense_scores(spec(score=CAUSAL), logits)
    # an int score pipeline gives float64 scores
    got = dense_scores(spec(score=op("-", q, kv)), logits)
    assert got.dtype == torch.float64 and got[0, 0].tolist() == [[0.0, -1.0], [1.0, 0.0]]


def test_a_dimension_of_size_one_broadcasts_only_where_it_is_declared_longer():
    """``ids: int[B, KV_LEN]`` with one batch row broadcasts over ``b`` (read at 0); with one
    key (KV_LEN = 1) its second dimension is not a broadcast, and a position past it is outside
    the tensor, as the kernels' index checks find (hypothesis found the reference reading it at
    0: a query past a one-key cache, ``doc_ids[b, q]``)."""
    ids = ir.Tensor("ids", (B, KV_LEN), dtype="int")
    read = ir.Lookup(ids, (b, ir.Var("q")))
    one_row = torch.tensor([[5, 6]])
    grid = index_grid(2, 1, 1, 2, q_offset=1)
    assert evaluate(read, grid, {"ids": one_row}).flatten().tolist() == [6, 6]
    with pytest.raises(SpecError, match=r"reads outside tensor 'ids' of shape \[2, 1\]"):
        evaluate(read, index_grid(2, 1, 1, 1, q_offset=1), {"ids": torch.tensor([[5], [7]])})
    assert evaluate(read, index_grid(2, 1, 1, 1), {"ids": torch.tensor([[5], [7]])}
                    ).flatten().tolist() == [5, 7]
