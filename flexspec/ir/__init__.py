"""The intermediate representation and the pure-Python passes over it (no torch).

``flexspec.ir`` re-exports the node classes and helpers of :mod:`flexspec.ir.nodes`, so code reads
``ir.Const``, ``ir.walk``, and the operator table's ``ir.OPERATORS`` and ``ir.FUNCTIONS`` (see
:mod:`flexspec.ir.ops`). The passes live in their own modules: :mod:`~flexspec.ir.simplify` and
:mod:`~flexspec.ir.intervals`.
"""

from flexspec.ir.nodes import (ALIGNMENTS, ALL_VARS, ARITH_OPS, COMPARE_OPS, FALSE, FUNCTIONS,
                               INDEX_VARS, OPERATORS, SCORE, SCORE_VAR, SIZE_VARS, TRUE, Align,
                               And, AttentionIR, Binary, Call, Const, Expr, Lookup, Or, Param,
                               Tensor, Unary, Var, children, depends_on, depth, direct_vars,
                               format_number, free_vars, rebuild, size, substitute, tensor_key,
                               tensor_keys, to_text, transform, type_of, walk)

__all__ = ["ALIGNMENTS", "ALL_VARS", "ARITH_OPS", "COMPARE_OPS", "FALSE", "FUNCTIONS",
           "INDEX_VARS", "OPERATORS", "SCORE", "SCORE_VAR", "SIZE_VARS", "TRUE", "Align", "And",
           "AttentionIR", "Binary", "Call", "Const", "Expr", "Lookup", "Or", "Param", "Tensor",
           "Unary", "Var", "children", "depends_on", "depth", "direct_vars", "format_number",
           "free_vars", "rebuild", "size", "substitute", "tensor_key", "tensor_keys", "to_text",
           "transform", "type_of", "walk"]
