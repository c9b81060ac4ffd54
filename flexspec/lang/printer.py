"""The canonical printer: syntax tree -> text.

Canonical text has one space around binary operators, none inside parentheses and brackets, a
space after commas, and exactly the parentheses the precedence needs. Parsing it gives back an
equal tree (``parse(str(node)) == node``), which the tests check on random trees.
"""

from __future__ import annotations

import math

from flexspec.ir.ops import ATOM, BINARY_SOURCE, NEG, OR, UNARY_SOURCE
from flexspec.lang import ast

# Binding strength of the spec's `+` chain, below every operator of the table.
CHAIN = 0

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t"}


def format_float(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def format_string(value: str) -> str:
    return '"' + "".join(_ESCAPES.get(ch, ch) for ch in value) + '"'


def precedence(node: ast.Node) -> int:
    if isinstance(node, ast.Chain):
        return CHAIN
    if isinstance(node, ast.Binary):
        return BINARY_SOURCE[node.op].prec
    if isinstance(node, ast.Unary):
        return UNARY_SOURCE[node.op].prec
    if isinstance(node, (ast.Int, ast.Float)) and math.copysign(1.0, node.value) < 0:
        return NEG
    return ATOM


def format_node(node: ast.Node) -> str:
    """Canonical text of any syntax-tree node (expressions, types, statements, modules)."""
    def wrap(child: ast.Node, minimum: int) -> str:
        text = format_node(child)
        return f"({text})" if precedence(child) < minimum else text

    if isinstance(node, ast.Bool):
        return "true" if node.value else "false"
    if isinstance(node, ast.Int):
        return str(node.value)
    if isinstance(node, ast.Float):
        return format_float(node.value)
    if isinstance(node, ast.Str):
        return format_string(node.value)
    if isinstance(node, ast.Name):
        return node.name
    if isinstance(node, ast.Keyword):
        return f"{node.name}={format_node(node.value)}"
    if isinstance(node, ast.Call):
        return f"{node.func}({', '.join(format_node(a) for a in node.args)})"
    if isinstance(node, ast.Index):
        indices = ", ".join(format_node(i) for i in node.indices)
        return f"{wrap(node.target, ATOM)}[{indices}]"
    if isinstance(node, ast.Unary):
        p = precedence(node)
        if node.op == "~":
            return "~" + wrap(node.operand, p)
        # `- 1` would fold into the literal -1 when parsed again, so a negated non-negative
        # literal keeps explicit parentheses.
        operand = node.operand
        if isinstance(operand, (ast.Int, ast.Float)) and math.copysign(1.0, operand.value) > 0:
            return f"-({format_node(operand)})"
        return "-" + wrap(operand, p)
    if isinstance(node, ast.Binary):
        p = precedence(node)
        # Comparisons do not associate; the others associate to the left.
        left_min = p if BINARY_SOURCE[node.op].associative else p + 1
        return f"{wrap(node.left, left_min)} {node.op} {wrap(node.right, p + 1)}"
    if isinstance(node, ast.Chain):
        return " + ".join(wrap(term, OR) for term in node.terms)
    if isinstance(node, ast.TypeExpr):
        if node.dims is None:
            return node.name
        return f"{node.name}[{', '.join(format_node(d) for d in node.dims)}]"
    if isinstance(node, ast.Param):
        text = f"{node.name}: {format_node(node.type)}"
        return text if node.default is None else f"{text} = {format_node(node.default)}"
    if isinstance(node, ast.Definition):
        params = "" if node.params is None else f"({', '.join(format_node(p) for p in node.params)})"
        return f"{node.kind} {node.name}{params} = {format_node(node.body)}"
    if isinstance(node, ast.SpecDef):
        return f"spec {node.name} = {format_node(node.expr)}"
    if isinstance(node, ast.Module):
        return "".join(format_node(s) + "\n" for s in node.statements)
    raise TypeError(f"cannot print {type(node).__name__}")
