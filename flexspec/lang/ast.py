"""The syntax tree: what the parser produces, and its canonical text (:func:`format_node`).

One family of frozen dataclasses covers both spec expressions and definition expressions (their
syntax shares atoms, calls and ``& | ~``); :class:`Chain` only appears in spec expressions and the
arithmetic operators only in definitions. Every node carries its source :class:`~flexspec.errors.Span`
for error messages; the span is excluded from equality and hashing, so two trees are equal when
they say the same thing, wherever they were written.

Canonical text has one space around binary operators, none inside parentheses and brackets, a
space after commas, and exactly the parentheses the precedence (from the operator table,
:mod:`flexspec.ir.ops`) needs. Parsing it gives back an equal tree (``parse(str(node)) == node``),
which the tests check on random trees. Like Python's own ``ast.unparse``, the printer lives with
the tree it prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from flexspec.errors import Span
from flexspec.ir.nodes import format_number
from flexspec.ir.ops import ATOM, BINARY_SOURCE, NEG, OR, UNARY_SOURCE


def _span():
    return field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class Node:
    span: Optional[Span] = _span()

    def __str__(self) -> str:
        return format_node(self)


# ---- literals and names ------------------------------------------------------------------------


@dataclass(frozen=True)
class Int(Node):
    value: int


@dataclass(frozen=True)
class Float(Node):
    value: float


@dataclass(frozen=True)
class Bool(Node):
    value: bool


@dataclass(frozen=True)
class Str(Node):
    value: str


@dataclass(frozen=True)
class Name(Node):
    """A bare identifier: a pattern, parameter, index, size, or (as a spec argument) a binding."""

    name: str


Literal = Union[Int, Float, Bool, Str]

# ---- operators ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyword(Node):
    """``name=value`` inside a call."""

    name: str
    value: Node


@dataclass(frozen=True)
class Call(Node):
    """``func(args...)``; positional arguments first, then keywords (the grammar allows any order
    but the checker rejects a positional argument after a keyword)."""

    func: str
    args: tuple = ()


@dataclass(frozen=True)
class Unary(Node):
    """``-x`` (op ``-``) or ``~x`` (op ``~``)."""

    op: str
    operand: Node


@dataclass(frozen=True)
class Binary(Node):
    """Arithmetic (``+ - * / // %``), comparison (``< <= > >= == !=``) or logic (``& |``)."""

    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Index(Node):
    """``tensor[i, j]``."""

    target: Node
    indices: tuple


@dataclass(frozen=True)
class Chain(Node):
    """A spec's ``a + s1 + s2``: one mask term and score modifiers, applied left to right."""

    terms: tuple


# ---- statements of .attn files -----------------------------------------------------------------


@dataclass(frozen=True)
class TypeExpr(Node):
    """``int``, ``float``, ``bool``, ``tensor`` or an element type with dims: ``int[B, KV_LEN]``."""

    name: str
    dims: Optional[tuple] = None


@dataclass(frozen=True)
class Param(Node):
    name: str
    type: TypeExpr
    default: Optional[Node] = None


@dataclass(frozen=True)
class Definition(Node):
    """``mask NAME(params) = expr`` or ``score NAME(params) = expr``."""

    kind: str  # "mask" or "score"
    name: str
    params: Optional[tuple]  # None when written without parentheses
    body: Node
    name_span: Optional[Span] = _span()


@dataclass(frozen=True)
class SpecDef(Node):
    """``spec NAME = spec-expression``."""

    name: str
    expr: Node
    name_span: Optional[Span] = _span()


@dataclass(frozen=True)
class Module(Node):
    """The statements of one ``.attn`` file, in order."""

    statements: tuple


# ---- canonical text ------------------------------------------------------------------------------

# Binding strength of the spec's `+` chain, below every operator of the table.
CHAIN = 0

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t"}


def format_string(value: str) -> str:
    return '"' + "".join(_ESCAPES.get(ch, ch) for ch in value) + '"'


def precedence(node: Node) -> int:
    if isinstance(node, Chain):
        return CHAIN
    if isinstance(node, Binary):
        return BINARY_SOURCE[node.op].prec
    if isinstance(node, Unary):
        return UNARY_SOURCE[node.op].prec
    if isinstance(node, (Int, Float)) and math.copysign(1.0, node.value) < 0:
        return NEG
    return ATOM


def format_node(node: Node) -> str:
    """Canonical text of any syntax-tree node (expressions, types, statements, modules)."""
    def wrap(child: Node, minimum: int) -> str:
        text = format_node(child)
        return f"({text})" if precedence(child) < minimum else text

    if isinstance(node, (Bool, Int, Float)):
        return format_number(node.value)
    if isinstance(node, Str):
        return format_string(node.value)
    if isinstance(node, Name):
        return node.name
    if isinstance(node, Keyword):
        return f"{node.name}={format_node(node.value)}"
    if isinstance(node, Call):
        return f"{node.func}({', '.join(format_node(a) for a in node.args)})"
    if isinstance(node, Index):
        indices = ", ".join(format_node(i) for i in node.indices)
        return f"{wrap(node.target, ATOM)}[{indices}]"
    if isinstance(node, Unary):
        p = precedence(node)
        if node.op == "~":
            return "~" + wrap(node.operand, p)
        # `- 1` would fold into the literal -1 when parsed again, so a negated non-negative
        # literal keeps explicit parentheses.
        operand = node.operand
        if isinstance(operand, (Int, Float)) and math.copysign(1.0, operand.value) > 0:
            return f"-({format_node(operand)})"
        return "-" + wrap(operand, p)
    if isinstance(node, Binary):
        p = precedence(node)
        # Comparisons do not associate; the others associate to the left.
        left_min = p if BINARY_SOURCE[node.op].associative else p + 1
        return f"{wrap(node.left, left_min)} {node.op} {wrap(node.right, p + 1)}"
    if isinstance(node, Chain):
        return " + ".join(wrap(term, OR) for term in node.terms)
    if isinstance(node, TypeExpr):
        if node.dims is None:
            return node.name
        return f"{node.name}[{', '.join(format_node(d) for d in node.dims)}]"
    if isinstance(node, Param):
        text = f"{node.name}: {format_node(node.type)}"
        return text if node.default is None else f"{text} = {format_node(node.default)}"
    if isinstance(node, Definition):
        params = "" if node.params is None else f"({', '.join(format_node(p) for p in node.params)})"
        return f"{node.kind} {node.name}{params} = {format_node(node.body)}"
    if isinstance(node, SpecDef):
        return f"spec {node.name} = {format_node(node.expr)}"
    if isinstance(node, Module):
        return "".join(format_node(s) + "\n" for s in node.statements)
    raise TypeError(f"cannot print {type(node).__name__}")
