"""Checking definition expressions (the index language of mask and score bodies): names,
function calls, tensor indexing and operators, each typed by the operator table
(:mod:`flexspec.ir.ops`) and turned into IR.

:class:`ExpressionChecker` is the base of :class:`~flexspec.lang.checker.Checker`, which adds
what a name can refer to beyond the indices and sizes: parameters, and definitions it inlines
(``_inline``). Pure Python; no torch.
"""

from __future__ import annotations

import math

from flexspec import ir
from flexspec.errors import SpecCheckError, did_you_mean
from flexspec.ir import ops
from flexspec.lang import ast
from flexspec.lang.ast import format_node
from flexspec.ir.intervals import bounds
from flexspec.ir.simplify import simplify
from flexspec.lang.definitions import Definition

INDEX_NAMES = set(ir.INDEX_VARS)
SIZE_NAMES = set(ir.SIZE_VARS)
LOGIC = {"and": ir.And, "or": ir.Or}
_NUMBERS = ("int", "float")


def describe(node: ast.Node) -> str:
    text = format_node(node)
    return text if len(text) <= 40 else text[:37] + "..."


def type_name(t: str) -> str:
    return {"bool": "a bool", "int": "an int", "float": "a float", "tensor": "a tensor"}[t]


# What each index variable runs over and what each broadcast size counts, for messages.
_POSITIONS = {"q": ("a query position", "Q_LEN"), "kv": ("a key position", "KV_LEN")}
_COUNTS = {"H": ("head", "h"), "B": ("batch row", "b")}
# Where the indices and sizes can lie when nothing about a call is known: q can be anywhere
# (q_offset may be negative), the others from 0 (sizes from 1) without bound.
_ANY_CALL = {"q": (-math.inf, math.inf), "kv": (0, math.inf), "b": (0, math.inf),
             "h": (0, math.inf), **{size: (1, math.inf) for size in ir.SIZE_VARS}}


def _check_index_range(target: ir.Expr, dim: int, index: ir.Expr, target_node: ast.Node,
                       index_node: ast.Node) -> None:
    """Refuse an index that is out of its tensor's range for every call: below 0 or beyond a
    dimension of constant size whatever the sizes, or a position (``q``, ``kv``) used on a
    dimension declared with one entry per head or batch row (``w[q]`` on ``w: float[H]``), which
    only a call with few enough positions would survive."""
    size = simplify(target.shape[dim])
    name = describe(target_node)
    declared = f"{target.param_type if isinstance(target, ir.Param) else target.dtype}" \
               f"[{', '.join(ir.to_text(d) for d in target.shape)}]"
    if isinstance(index, ir.Var) and index.name in _POSITIONS and isinstance(size, ir.Var) \
            and size.name in _COUNTS:
        what, length = _POSITIONS[index.name]
        entry, var = _COUNTS[size.name]
        raise SpecCheckError(
            f"'{name}' is declared {declared}, one entry per {entry} in dimension {dim + 1}, but "
            f"is indexed there by '{index.name}', {what} (up to {length} - 1): index it by "
            f"{var}, or declare that dimension {length}", index_node.span)
    found = bounds(index, _ANY_CALL)
    if found is None:
        return
    lo, hi = found
    if hi < 0:
        raise SpecCheckError(f"the index '{describe(index_node)}' of '{name}' is negative "
                             f"wherever it is read (at most {hi:g}): indices start at 0",
                             index_node.span)
    # (an empty or negative declared size is refused, with its own message, where the tensor
    # is made)
    if isinstance(size, ir.Const) and size.value >= 1 and lo >= size.value:
        raise SpecCheckError(
            f"the index '{describe(index_node)}' of '{name}' is at least {lo:g}, beyond "
            f"dimension {dim + 1} of {declared}, which has {size.value} entr"
            f"{'y' if size.value == 1 else 'ies'} (0 .. {size.value - 1})", index_node.span)


class ExpressionChecker:
    """Definition expressions to IR. Subclasses provide ``scope`` and ``_inline`` (a pattern
    used inside a definition)."""

    scope = None

    def expr(self, node: ast.Node, env: dict, definition: Definition | None) -> ir.Expr:
        if isinstance(node, ast.Bool):
            return ir.Const(node.value)
        if isinstance(node, (ast.Int, ast.Float)):
            return ir.Const(node.value)
        if isinstance(node, ast.Str):
            raise SpecCheckError("strings are not values in definitions", node.span)
        if isinstance(node, ast.Name):
            return self._name(node, env, definition)
        if isinstance(node, ast.Call):
            return self._call(node, env, definition)
        if isinstance(node, ast.Index):
            return self._index(node, env, definition)
        if isinstance(node, ast.Unary):
            operand = self.expr(node.operand, env, definition)
            op = ops.UNARY_SOURCE[node.op]
            if op.operands == "bool":
                self._expect(operand, ("bool",), node.operand, f"'{node.op}' needs a boolean")
            else:
                self._expect(operand, _NUMBERS, node.operand, f"'{node.op}' needs a number")
            return ir.Unary(op.symbol, operand)
        if isinstance(node, ast.Binary):
            return self._binary(node, env, definition)
        if isinstance(node, ast.Chain):
            raise SpecCheckError("'+' chains of patterns belong in specs; inside a definition "
                                 "'+' is arithmetic", node.span)
        raise SpecCheckError(f"unexpected '{describe(node)}' in a definition", node.span)

    def _expect(self, value: ir.Expr, types: tuple, node: ast.Node, message: str) -> None:
        if value.type not in types:
            raise SpecCheckError(f"{message}, but '{describe(node)}' is {type_name(value.type)}",
                                 node.span)

    def _name(self, node: ast.Name, env: dict, definition: Definition | None) -> ir.Expr:
        name = node.name
        if name in env:
            return env[name]
        if name in INDEX_NAMES or name in SIZE_NAMES:
            return ir.Var(name)
        if name == "score":
            raise SpecCheckError("'score' is only available in score definitions", node.span)
        if name in ir.FUNCTIONS:
            raise SpecCheckError(f"'{name}' is a function; call it, e.g. {name}(x)", node.span)
        target = self.scope.lookup(name)
        if target is None:
            candidates = set(env) | INDEX_NAMES | SIZE_NAMES | self.scope.names()
            hint = did_you_mean(name, candidates)
            raise SpecCheckError(f"unknown name '{name}'." + (hint or
                                 " Names in scope: the indices b h q kv, the sizes B H Q_LEN "
                                 "KV_LEN, parameters and patterns"), node.span)
        return self._inline(target, (), node, env, definition)

    def _call(self, node: ast.Call, env: dict, definition: Definition | None) -> ir.Expr:
        name = node.func
        if name in ir.FUNCTIONS:
            fn = ir.FUNCTIONS[name]
            arity = fn.arity
            if any(isinstance(a, ast.Keyword) for a in node.args):
                raise SpecCheckError(f"{name}() takes positional arguments only", node.span)
            if len(node.args) != arity:
                raise SpecCheckError(f"{name}() takes {arity} argument{'s' if arity > 1 else ''}, "
                                     f"got {len(node.args)}", node.span)
            args = tuple(self.expr(a, env, definition) for a in node.args)
            if fn.operands == "where":
                self._expect(args[0], ("bool",), node.args[0], f"{name}()'s condition must be a boolean")
                branches = {args[1].type, args[2].type}
                if "bool" in branches and branches != {"bool"}:
                    raise SpecCheckError(f"{name}()'s two branches must both be booleans or both "
                                         "be numbers", node.span)
            else:
                for arg, arg_node in zip(args, node.args):
                    self._expect(arg, _NUMBERS, arg_node, f"{name}() needs numbers")
            return ir.Call(name, args)
        if name in ("alibi_slopes", "learnable"):
            raise SpecCheckError(f"{name}() can only be the default of a tensor parameter",
                                 node.span)
        target = self.scope.lookup(name)
        if target is None:
            hint = did_you_mean(name, set(ir.FUNCTIONS) | self.scope.names())
            raise SpecCheckError(f"unknown function or pattern '{name}'." + (hint or ""), node.span)
        return self._inline(target, node.args, node, env, definition)

    def _index(self, node: ast.Index, env: dict, definition: Definition | None) -> ir.Expr:
        target = self.expr(node.target, env, definition)
        if target.type != "tensor":
            raise SpecCheckError(f"only tensors can be indexed, but '{describe(node.target)}' is "
                                 f"{type_name(target.type)}", node.target.span)
        rank = len(target.shape)
        if len(node.indices) != rank:
            raise SpecCheckError(f"'{describe(node.target)}' has {rank} dimension"
                                 f"{'s' if rank != 1 else ''} but is indexed with "
                                 f"{len(node.indices)}", node.span)
        indices = tuple(self.expr(i, env, definition) for i in node.indices)
        for dim, (index, index_node) in enumerate(zip(indices, node.indices)):
            self._expect(index, ("int",), index_node, "tensor indices must be ints")
            _check_index_range(target, dim, index, node.target, index_node)
        return ir.Lookup(target, indices)

    def _binary(self, node: ast.Binary, env: dict, definition: Definition | None) -> ir.Expr:
        left = self.expr(node.left, env, definition)
        right = self.expr(node.right, env, definition)
        op = ops.BINARY_SOURCE[node.op]
        if op.operands == "bool":
            for value, side in ((left, node.left), (right, node.right)):
                self._expect(value, ("bool",), side, f"'{node.op}' combines booleans")
            return LOGIC[op.symbol]((left, right))
        if op.operands == "eq" and left.type == right.type == "bool":
            return ir.Binary(op.symbol, left, right)
        hint = " (use where(c, 1, 0) to turn a boolean into a number)" if op.prec in (
            ops.ADD, ops.MUL) else ""
        for value, side in ((left, node.left), (right, node.right)):
            self._expect(value, _NUMBERS, side, f"'{node.op}' needs numbers{hint}")
        if op.operands == "int" and "float" in (left.type, right.type):
            raise SpecCheckError(f"'{node.op}' needs ints; use floor(x / y) for floats", node.span)
        return ir.Binary(op.symbol, left, right)
