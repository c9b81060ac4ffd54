"""The intermediate representation every later stage consumes.

After name resolution a spec is two expressions over the same small vocabulary:

* ``mask``: a boolean expression that says whether query ``q`` may attend to key ``kv``;
* ``score``: a numeric expression of ``Var("score")`` (the raw logit) that says how it is changed.

Leaves are constants, variables (indices ``b h q kv``, sizes ``B H Q_LEN KV_LEN`` and ``score``),
symbolic parameters (only while a definition is checked on its own) and tensor lookups. Inner nodes
are unary and binary operators, n-ary ``And``/``Or`` and calls of a fixed set of functions.

Nodes are frozen dataclasses, so an IR value is its own cache key. This module is pure Python.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Union

from flexspec.ir import ops

INDEX_VARS = ("b", "h", "q", "kv")
SIZE_VARS = ("B", "H", "Q_LEN", "KV_LEN")
SCORE_VAR = "score"
# Where a call's query rows stand by default (see AttentionIR.align).
Align = Literal["start", "end"]
ALIGNMENTS: tuple[Align, ...] = ("start", "end")
ALL_VARS = INDEX_VARS + SIZE_VARS + (SCORE_VAR,)

# The operator table owns what operators and functions mean; these names are its views.
ARITH_OPS = ops.ARITH_OPS
COMPARE_OPS = ops.COMPARE_OPS
OPERATORS = ops.OPERATORS
FUNCTIONS = ops.FUNCTIONS


class Expr:
    """Base class of IR nodes."""

    def __getstate__(self):
        # string hashes differ between processes: a copy computes its own (see _keep_hash)
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def type(self) -> str:
        return type_of(self)

    def __str__(self) -> str:
        return to_text(self)


@dataclass(frozen=True)
class Const(Expr):
    value: Union[bool, int, float]

    def __post_init__(self):
        if isinstance(self.value, float) and math.isnan(self.value):
            raise ValueError("NaN is not a flexspec constant")

    def __eq__(self, other):
        # bool is a subclass of int in Python: keep True and 1 (and 1 and 1.0) apart.
        return (isinstance(other, Const) and type(self.value) is type(other.value)
                and self.value == other.value)

    def __hash__(self):
        return hash((Const, type(self.value), self.value))


@dataclass(frozen=True)
class Var(Expr):
    name: str

    def __post_init__(self):
        if self.name not in ALL_VARS:
            raise ValueError(f"unknown IR variable {self.name!r}")


@dataclass(frozen=True)
class Param(Expr):
    """A parameter left symbolic: only while a definition is checked without arguments."""

    name: str
    param_type: str
    shape: tuple = ()


@dataclass(frozen=True)
class Tensor(Expr):
    """A tensor the expression reads from.

    ``origin`` is ``"binding"`` (given at call time under ``name``), ``"builtin"`` (computed from
    sizes by the built-in function ``builtin`` with ``args``, e.g. ``alibi_slopes(H)``) or
    ``"learnable"`` (a parameter of the model, initialised by ``init``). ``shape`` holds one
    expression of sizes and constants per dimension; ``dtype`` is the element type.
    """

    name: str
    shape: tuple
    dtype: str = "float"
    origin: str = "binding"
    builtin: str = ""
    args: tuple = ()
    init: str = ""


@dataclass(frozen=True)
class Lookup(Expr):
    tensor: Union[Tensor, Param]
    index: tuple


@dataclass(frozen=True)
class Unary(Expr):
    op: str
    operand: Expr


@dataclass(frozen=True)
class Binary(Expr):
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class And(Expr):
    args: tuple


@dataclass(frozen=True)
class Or(Expr):
    args: tuple


@dataclass(frozen=True)
class Call(Expr):
    fn: str
    args: tuple


def _keep_hash(node_class: type) -> None:
    """Make ``node_class`` keep its hash after the first call: the runtime's caches are keyed by
    masks on every plan (a growing cache plans every step), and hashing walks the whole tree."""
    computed = node_class.__hash__

    def __hash__(self):
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = computed(self)
            object.__setattr__(self, "_hash", cached)
        return cached
    node_class.__hash__ = __hash__


for _node_class in (Const, Var, Param, Tensor, Lookup, Unary, Binary, And, Or, Call):
    _keep_hash(_node_class)

TRUE = Const(True)
FALSE = Const(False)
SCORE = Var(SCORE_VAR)


@dataclass(frozen=True)
class AttentionIR:
    """A resolved spec: the mask (bool) and the score pipeline (numeric, of ``Var('score')``).

    ``align`` says where a call's query rows stand when the call gives no ``q_offset``:
    ``"start"`` (row ``i`` at position ``i``, top-left) or ``"end"`` (the last row at the last
    key, ``KV_LEN - Q_LEN + i``: bottom-right, as ``causal_bottom_right`` asks). It is one
    setting for the whole spec, so no two parts of a spec can count positions differently.
    """

    mask: Expr = TRUE
    score: Expr = SCORE
    align: Align = "start"

    def __hash__(self):
        # kept after the first call: the runtime's caches are keyed by the IR on every call,
        # and hashing walks the whole tree
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.mask, self.score, self.align))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self):
        # string hashes differ between processes: a copy computes its own (and its own
        # tensor list, which is cheap to make again)
        return {name: value for name, value in self.__dict__.items()
                if name not in ("_hash", "_tensors")}

    @property
    def has_mask(self) -> bool:
        return self.mask != TRUE

    @property
    def has_score(self) -> bool:
        return self.score != SCORE

    def tensors(self) -> list[Tensor]:
        """Every distinct tensor the spec reads, in first-use order (mask first)."""
        # kept after the first call, as the hash is: planning a call asks several times, and
        # a growing cache plans every step
        found = self.__dict__.get("_tensors")
        if found is None:
            seen: dict[Tensor, None] = {}
            for root in (self.mask, self.score):
                for node in walk(root):
                    if isinstance(node, Tensor):
                        seen.setdefault(node, None)
            found = tuple(seen)
            object.__setattr__(self, "_tensors", found)
        return list(found)

    def bindings(self) -> list[Tensor]:
        """The tensors that must be passed at call time, by name."""
        return [t for t in self.tensors() if t.origin == "binding"]

    def __str__(self) -> str:
        return f"mask:  {to_text(self.mask)}\nscore: {to_text(self.score)}"


# ---------------------------------------------------------------------------------------------
# Traversal


def children(node: Expr) -> tuple:
    """The child nodes of ``node``, in a fixed order (leaves have none)."""
    rule = _CHILDREN.get(type(node))
    return rule(node) if rule is not None else ()


def walk(node: Expr) -> Iterator[Expr]:
    """Every node of the tree, parents before children."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(children(current)))


def rebuild(node: Expr, new_children: tuple) -> Expr:
    """``node`` with its children replaced (same order as :func:`children`)."""
    rule = _REBUILD.get(type(node))
    return rule(node, tuple(new_children)) if rule is not None else node


def _rebuilt_tensor(node: Tensor, kids: tuple) -> Tensor:
    n = len(node.shape)
    return Tensor(node.name, kids[:n], node.dtype, node.origin, node.builtin, kids[n:],
                  node.init)


# Each inner node kind's children and how it is rebuilt from new ones.
_CHILDREN = {
    Unary: lambda n: (n.operand,),
    Binary: lambda n: (n.left, n.right),
    And: lambda n: n.args, Or: lambda n: n.args, Call: lambda n: n.args,
    Lookup: lambda n: (n.tensor,) + tuple(n.index),
    Tensor: lambda n: tuple(n.shape) + tuple(n.args),
}
_REBUILD = {
    Unary: lambda n, kids: Unary(n.op, kids[0]),
    Binary: lambda n, kids: Binary(n.op, kids[0], kids[1]),
    And: lambda n, kids: And(kids), Or: lambda n, kids: Or(kids),
    Call: lambda n, kids: Call(n.fn, kids),
    Lookup: lambda n, kids: Lookup(kids[0], kids[1:]),
    Tensor: _rebuilt_tensor,
}


def transform(node: Expr, fn: Callable[[Expr], Expr]) -> Expr:
    """Bottom-up rewrite: ``fn`` sees each node after its children were rewritten."""
    kids = children(node)
    if kids:
        new = tuple(transform(child, fn) for child in kids)
        if new != kids:
            node = rebuild(node, new)
    return fn(node)


def substitute(node: Expr, mapping: dict) -> Expr:
    """Replace ``Var`` and ``Param`` leaves by name (``mapping``: name -> Expr)."""
    def replace(n: Expr) -> Expr:
        if isinstance(n, (Var, Param)) and n.name in mapping:
            return mapping[n.name]
        return n
    return transform(node, replace)


def depth(node: Expr) -> int:
    """The number of nodes on the longest path from ``node`` down to a leaf (counted without
    recursion, so it works on trees too deep for the recursive passes)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        current, level = stack.pop()
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children(current))
    return deepest


def size(node: Expr) -> int:
    """The number of nodes of the tree (a shared subtree counts at each use), without
    recursion."""
    count, stack = 0, [node]
    while stack:
        count += 1
        stack.extend(children(stack.pop()))
    return count


def free_vars(node: Expr) -> frozenset:
    """Names of the variables an expression reads (tensor shapes included)."""
    return frozenset(n.name for n in walk(node) if isinstance(n, Var))


def direct_vars(node: Expr) -> frozenset:
    """The variables ``node`` reads itself, not through a tensor's declared shape (a
    ``doc_ids[b, q]`` of shape ``[B, KV_LEN]`` does not read the size ``B``).

    >>> ids = Tensor("doc_ids", (Var("B"), Var("KV_LEN")), dtype="int")
    >>> sorted(direct_vars(Lookup(ids, (Var("b"), Var("q")))))
    ['b', 'q']
    """
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if isinstance(current, Var):
            found.add(current.name)
        elif not isinstance(current, Tensor):
            stack.extend(children(current))
    return frozenset(found)


def depends_on(node: Expr, name: str) -> bool:
    return name in free_vars(node)


def tensor_key(t: Tensor) -> str:
    """The stable, unique name under which a tensor's value is stored.

    >>> tensor_key(Tensor("alibi_slopes", (Var("H"),), origin="builtin",
    ...                    builtin="alibi_slopes", args=(Var("H"),)))
    'alibi_slopes(H)'
    """
    # Two builtins with different arguments (alibi_slopes(H) vs alibi_slopes(8)) are different
    # tensors, so a builtin is keyed by its whole call text, not by its name.
    return to_text(t) if t.origin == "builtin" else t.name


@functools.lru_cache(maxsize=1024)  # planning asks at every new length of a growing cache
def tensor_keys(e: Expr) -> frozenset:
    """The keys (:func:`tensor_key`) of the tensors ``e`` reads.

    >>> ids = Tensor("doc_ids", (Var("KV_LEN"),), dtype="int")
    >>> slopes = Tensor("alibi_slopes", (Var("H"),), origin="builtin", builtin="alibi_slopes",
    ...                 args=(Var("H"),))
    >>> sorted(tensor_keys(And((Binary("==", Lookup(ids, (Var("q"),)), Lookup(ids, (Var("kv"),))),
    ...                         Binary("<", Lookup(slopes, (Var("h"),)), Const(1))))))
    ['alibi_slopes(H)', 'doc_ids']
    """
    return frozenset(tensor_key(n) for n in walk(e) if isinstance(n, Tensor))


# ---------------------------------------------------------------------------------------------
# Types


def type_of(node: Expr) -> str:
    """``bool``, ``int``, ``float`` or ``tensor`` (for a bare tensor). Assumes a checked tree."""
    kind = type(node)
    if kind in _APPLIED:
        # the operator table's result rule over the children's types, written here rather than
        # in a rule of _TYPES: a frame less per level for the deepest trees the checker takes
        rule = (FUNCTIONS[node.fn] if kind is Call else OPERATORS[node.op]).result
        return ops.result_type(rule, (type_of(child) for child in children(node)))
    rule = _TYPES.get(kind)
    if rule is None:
        raise TypeError(f"not an IR node: {node!r}")
    return rule(node)


def _const_type(node: Const) -> str:
    return "bool" if isinstance(node.value, bool) else (
        "int" if isinstance(node.value, int) else "float")


def _lookup_type(node: Lookup) -> str:
    tensor = node.tensor
    return tensor.dtype if isinstance(tensor, Tensor) else tensor.param_type


_APPLIED = (Unary, Binary, Call)  # typed by the operator table (see type_of)
_TYPES = {
    Const: _const_type,
    Var: lambda n: "float" if n.name == SCORE_VAR else "int",
    Param: lambda n: "tensor" if n.shape else n.param_type,
    Tensor: lambda n: "tensor",
    Lookup: _lookup_type,
    And: lambda n: "bool", Or: lambda n: "bool",
}


# ---------------------------------------------------------------------------------------------
# Text: the IR printed in the definition language (what `flexspec explain` shows).

def format_number(value) -> str:
    """Canonical text of a constant: ``true``, ``3``, ``0.5``, ``inf``, ``-inf``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return str(value)


def _prec(node: Expr) -> int:
    if isinstance(node, Or):
        return OPERATORS["or"].prec
    if isinstance(node, And):
        return OPERATORS["and"].prec
    if isinstance(node, (Unary, Binary)):
        return OPERATORS[node.op].prec
    if isinstance(node, Const) and not isinstance(node.value, bool) and node.value < 0:
        return OPERATORS["neg"].prec
    return ops.ATOM


def to_text(node: Expr) -> str:
    """Readable text for an IR expression, in the definition language's syntax."""
    rule = _TEXT.get(type(node))
    if rule is None:
        raise TypeError(f"not an IR node: {node!r}")
    return rule(node)


def _wrapped(texts, nodes, minimum: int) -> list:
    """Each node's text, in parentheses where it binds looser than ``minimum``."""
    return [f"({text})" if _prec(node) < minimum else text for text, node in zip(texts, nodes)]


def _tensor_text(node: Tensor) -> str:
    if node.origin == "builtin":
        return f"{node.builtin}({', '.join(to_text(a) for a in node.args)})"
    return node.name


def _unary_text(node: Unary) -> str:
    op = OPERATORS[node.op]
    # `-(-x)`, not `--x`; `~~x` reads fine
    (operand,) = _wrapped([to_text(node.operand)], [node.operand], op.prec + (op.symbol == "neg"))
    return op.source + operand


def _binary_text(node: Binary) -> str:
    op = OPERATORS[node.op]
    (left,) = _wrapped([to_text(node.left)], [node.left],
                       op.prec if op.associative else op.prec + 1)
    (right,) = _wrapped([to_text(node.right)], [node.right], op.prec + 1)
    return f"{left} {op.source} {right}"


def _connective_text(node) -> str:
    op = OPERATORS["and" if isinstance(node, And) else "or"]
    if not node.args:
        return "true" if isinstance(node, And) else "false"
    return f" {op.source} ".join(_wrapped([to_text(a) for a in node.args], node.args,
                                          op.prec + 1))


_TEXT = {
    Const: lambda n: format_number(n.value),
    Var: lambda n: n.name, Param: lambda n: n.name,
    Tensor: _tensor_text,
    Lookup: lambda n: f"{to_text(n.tensor)}[{', '.join(to_text(i) for i in n.index)}]",
    Unary: _unary_text, Binary: _binary_text,
    And: _connective_text, Or: _connective_text,
    Call: lambda n: f"{n.fn}({', '.join(to_text(a) for a in n.args)})",
}
