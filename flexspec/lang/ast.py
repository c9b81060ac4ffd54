"""The syntax tree: what the parser produces and the canonical printer prints.

One family of frozen dataclasses covers both spec expressions and definition expressions (their
syntax shares atoms, calls and ``& | ~``); :class:`Chain` only appears in spec expressions and the
arithmetic operators only in definitions. Every node carries its source :class:`~flexspec.errors.Span`
for error messages; the span is excluded from equality and hashing, so two trees are equal when
they say the same thing, wherever they were written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from flexspec.errors import Span


def _span():
    return field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class Node:
    span: Optional[Span] = _span()

    def __str__(self) -> str:
        from flexspec.lang.printer import format_node  # the printer imports this module
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
