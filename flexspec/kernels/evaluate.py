"""The IR's meaning on index grids: :func:`evaluate` computes an expression densely (int64 and
float64, plain torch ops on broadcastable grids of ``b h q kv``). It is the definition of what
an expression means; the reference attention (:mod:`flexspec.kernels.reference`) is built on
it, and so are the production steps that need exact values: the refinement of partial tiles
(:mod:`flexspec.kernels.blocks`), the exact checks of lookup indices
(:mod:`flexspec.runtime.lookups`) and the pictures (:mod:`flexspec.tools.render`). It must never
import the lowering nor call FlexAttention, or the tests that compare the two would compare the
code with itself.

Semantics of the IR, as implemented by :func:`evaluate`:

* indices, sizes and int constants are int64; ``//`` floors and ``%`` takes the sign of the
  divisor (Python's rules); ``/`` is true division in float64; every float is float64;
* comparisons give bools; ``&``, ``|``, ``~`` work on bools only;
* each operator and function is the torch function the operator table
  (:mod:`flexspec.ir.ops`) names for it; a float function (``tanh exp log ...``) first turns its
  argument to float64; ``floor`` and ``ceil`` give int64 and leave an int unchanged;
  ``clamp(x, lo, hi)`` is ``min(max(x, lo), hi)``; ``sign`` keeps its argument's type;
* a tensor lookup reads the value at the evaluated indices; a tensor with fewer dimensions
  than indices gains leading size-1 dimensions, and a size-1 dimension is read at index 0
  whatever the index (broadcasting); an index out of range is an error.
"""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.ir.ops import FUNCTIONS, OPERATORS
from flexspec.ir.specialize import declared_shape
from flexspec.kernels.tensors import tensor_key

FLOAT = torch.float64
INT = torch.int64


def index_grid(batch: int, heads: int, q_len: int, kv_len: int, device="cpu",
               q_offset=None) -> dict:
    """The variables of the IR for a dense evaluation: broadcastable int64 index grids for
    ``b h q kv`` (shaped ``[B,1,1,1]``, ``[1,H,1,1]``, ...) and the sizes as Python ints.

    ``q`` holds absolute query positions: row ``i`` stands at ``q_offset + i`` (``q_offset`` an
    int, or an int tensor of one offset per batch row, ``[B]`` or ``[1]``; 0 when ``None``)."""
    def axis(n: int, dim: int) -> torch.Tensor:
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, dtype=INT, device=device).reshape(shape)
    positions = axis(q_len, 2)
    if q_offset is not None:
        positions = positions + query_offsets(q_offset, batch, device)
    return {"b": axis(batch, 0), "h": axis(heads, 1), "q": positions, "kv": axis(kv_len, 3),
            "B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}


def query_offsets(q_offset, batch: int, device="cpu") -> torch.Tensor:
    """``q_offset`` (an int, or an int tensor ``[B]`` or ``[1]``) as an int64 tensor shaped
    ``[B or 1, 1, 1, 1]``, to add to the rows of a grid."""
    offsets = torch.as_tensor(q_offset, device=device)
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool or offsets.dim() > 1 \
            or (offsets.dim() == 1 and offsets.shape[0] not in (1, batch)):
        raise SpecError(f"q_offset must be an int or an int tensor of shape [{batch}] or [1], "
                        f"got {offsets.dtype} of shape {list(offsets.shape)}")
    return offsets.to(INT).reshape(-1, 1, 1, 1)


def evaluate(expr: ir.Expr, grid: dict, tensors: dict, *, reads_checked: bool = True) \
        -> torch.Tensor:
    """The value of ``expr`` as a tensor broadcastable to ``[B, H, Q_LEN, KV_LEN]``.

    ``grid`` holds the index grids and sizes of :func:`index_grid`, and ``score`` (a float64
    ``[B, H, Q_LEN, KV_LEN]`` tensor) when the expression reads it. ``tensors`` maps
    :func:`flexspec.ir.tensor_key` to each tensor's value. With ``reads_checked`` a tensor read
    outside its shape is a :class:`SpecError`, which reads a value back from the device; without
    it, for a caller that asserts its lookups on the device (a GPU call that must not wait, or
    a CUDA graph capture, where reading back is not allowed), nothing is read back.
    """
    device = grid["b"].device if "b" in grid else "cpu"
    return _Evaluator(grid, tensors, device, reads_checked).eval(expr)


class _Evaluator:
    def __init__(self, grid: dict, tensors: dict, device, reads_checked: bool = True):
        self.grid = grid
        self.tensors = tensors
        self.device = device
        self.reads_checked = reads_checked

    def eval(self, node: ir.Expr) -> torch.Tensor:
        rule = _RULES.get(type(node))
        if rule is None:
            raise SpecError(f"the reference cannot evaluate '{ir.to_text(node)}'")
        return rule(self, node)

    def _const(self, node: ir.Const) -> torch.Tensor:
        value = node.value
        if isinstance(value, bool):
            dtype = torch.bool
        else:
            dtype = INT if isinstance(value, int) else FLOAT
        # a fill on the device, not a copy from the host, which a CUDA graph capture refuses
        return torch.full((), value, dtype=dtype, device=self.device)

    def _var(self, node: ir.Var) -> torch.Tensor:
        if node.name not in self.grid:
            raise SpecError(f"no value for '{node.name}' in this evaluation")
        value = self.grid[node.name]
        if isinstance(value, torch.Tensor):
            return value.to(FLOAT) if node.name == ir.SCORE_VAR else value
        return torch.full((), int(value), dtype=INT, device=self.device)

    def _param(self, node: ir.Param) -> torch.Tensor:
        raise SpecError(f"parameter '{node.name}' has no value; only resolved specs can run")

    def _declared(self, tensor: ir.Tensor, count: int) -> tuple:
        """The declared length of each of a lookup's ``count`` dimensions where the grid's sizes
        are ints (``None`` elsewhere: such a dimension broadcasts whenever it has size 1; a
        traced program's symbolic sizes are not made constants here)."""
        if len(tensor.shape) != count or not all(
                type(self.grid.get(name)) is int for name in ir.SIZE_VARS):
            return (None,) * count
        sizes = {name: self.grid[name] for name in ir.SIZE_VARS}
        return tuple(declared_shape(tensor, sizes))

    def _lookup(self, node: ir.Lookup) -> torch.Tensor:
        tensor = node.tensor
        if not isinstance(tensor, ir.Tensor):
            raise SpecError(f"tensor parameter '{tensor.name}' has no value")
        key = tensor_key(tensor)
        if key not in self.tensors:
            raise SpecError(f"no value was given for tensor '{key}'")
        value = self.tensors[key].to(self.device)
        if value.dim() > len(node.index):
            raise SpecError(f"tensor '{key}' has {value.dim()} dimensions but is read with "
                            f"{len(node.index)} indices")
        value = value.reshape((1,) * (len(node.index) - value.dim()) + tuple(value.shape))
        declared = self._declared(tensor, len(node.index)) if 1 in value.shape \
            else (None,) * len(node.index)
        index = []
        for position, (expr, size, want) in enumerate(zip(node.index, value.shape, declared)):
            i = self.eval(expr)
            if i.dtype != INT:
                raise SpecError(f"index {position} of '{ir.to_text(node)}' is not an int")
            # A size-1 dimension broadcasts: read at 0 whatever the index says; not one
            # declared 1 long too (KV_LEN = 1), whose index is read as it is and must be 0 (as
            # the kernels read it: flexspec.ir.specialize)
            index.append(torch.zeros_like(i) if size == 1 and want != 1 else i)
        if self.reads_checked and any(((i < 0) | (i >= size)).any()
                                      for i, size in zip(index, value.shape)):
            raise SpecError(f"'{ir.to_text(node)}' reads outside tensor '{key}' of shape "
                            f"{list(value.shape)}")
        result = value[tuple(index)]
        if result.dtype.is_floating_point:
            return result.to(FLOAT)
        return result if result.dtype == torch.bool else result.to(INT)

    def _apply(self, entry, operands: tuple) -> torch.Tensor:
        """``entry`` (an operator or function of the table) on the values of ``operands``."""
        args = [self.eval(a) for a in operands]
        args = [as_bool(x, a) if entry.wants_bool(i) else x
                for i, (x, a) in enumerate(zip(args, operands))]
        if entry.float_math:
            args = [x.to(FLOAT) for x in args]
        if entry.int_identity and all(x.dtype == INT for x in args):
            return args[0]
        value = entry.torch_fn(torch)(*args)
        return value.to(INT) if entry.result == "int" else value

    def _unary(self, node: ir.Unary) -> torch.Tensor:
        return self._apply(OPERATORS[node.op], (node.operand,))

    def _binary(self, node: ir.Binary) -> torch.Tensor:
        if node.op not in OPERATORS:
            raise SpecError(f"unknown operator '{node.op}'")
        return self._apply(OPERATORS[node.op], (node.left, node.right))

    def _and(self, node: ir.And) -> torch.Tensor:
        return self._chain(OPERATORS["and"], node.args)

    def _or(self, node: ir.Or) -> torch.Tensor:
        return self._chain(OPERATORS["or"], node.args)

    def _chain(self, entry, args) -> torch.Tensor:
        # the table's Python function of no operands is the neutral element (all() is True)
        result = torch.full((), entry.python(), dtype=torch.bool, device=self.device)
        combine = entry.torch_fn(torch)
        for arg in args:
            result = combine(result, as_bool(self.eval(arg), arg))
        return result

    def _call(self, node: ir.Call) -> torch.Tensor:
        if node.fn not in FUNCTIONS:
            raise SpecError(f"unknown function '{node.fn}'")
        return self._apply(FUNCTIONS[node.fn], node.args)



# How each kind of node is evaluated (a node of another kind cannot be).
_RULES = {ir.Const: _Evaluator._const, ir.Var: _Evaluator._var, ir.Param: _Evaluator._param,
          ir.Lookup: _Evaluator._lookup, ir.Unary: _Evaluator._unary,
          ir.Binary: _Evaluator._binary, ir.And: _Evaluator._and, ir.Or: _Evaluator._or,
          ir.Call: _Evaluator._call}

def as_bool(value: torch.Tensor, node: ir.Expr) -> torch.Tensor:
    if value.dtype != torch.bool:
        raise SpecError(f"'{ir.to_text(node)}' is not a boolean")
    return value
