"""Definitions: the named things a spec can refer to, wherever they were written.

A registry pattern (YAML) and a definition in an ``.attn`` file both become a
:class:`Definition`: a kind (``mask``, ``score`` or ``spec``), typed parameters, and a body in the
flexspec language. A :class:`Scope` maps names (and aliases) to definitions; scopes chain, so an
``.attn`` file's definitions sit in front of the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from flexspec.lang import ast
from flexspec.errors import Span

SCALAR_TYPES = ("int", "float", "bool")


# The arguments of every attention call (Attention.__call__ and SpecAttention.forward): a runtime
# tensor cannot be bound under one of these names, since the call would take it as the argument.
CALL_ARGUMENTS = ("self", "q", "k", "v", "scale", "q_offset", "kv_lengths", "return_lse",
                  "step")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``n: int = 1024`` or ``doc_ids: int[B, KV_LEN]``.

    ``type`` is the element type; ``dims`` (a tuple of expressions over sizes and earlier
    parameters) is set for tensors and ``None`` for scalars.
    """

    name: str
    type: str
    dims: Optional[tuple] = None
    default: Optional[ast.Node] = None
    constraint: Optional[ast.Node] = None
    doc: str = ""
    span: Optional[Span] = field(default=None, compare=False, repr=False)

    @property
    def is_tensor(self) -> bool:
        return self.dims is not None

    def signature(self) -> str:
        """``n: int = 1024`` as written in the language."""
        kind = self.type if self.dims is None else f"{self.type}[{', '.join(str(d) for d in self.dims)}]"
        text = f"{self.name}: {kind}"
        return text if self.default is None else f"{text} = {self.default}"


@dataclass(frozen=True)
class Definition:
    """A named mask, score modifier or spec. ``body`` is a definition expression for masks and
    scores and a spec expression for specs."""

    name: str
    kind: str
    params: tuple
    body: ast.Node
    origin: str = ""  # where it was defined, for messages ("registry", a file name)
    span: Optional[Span] = field(default=None, compare=False, repr=False)
    # "end": a spec that uses this definition counts query positions from the end (see
    # flexspec.ir.AttentionIR.align)
    align: str = "start"

    def signature(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}({', '.join(p.signature() for p in self.params)})"


class Scope:
    """Names visible to a spec: definitions and aliases, then those of the parent scope."""

    def __init__(self, definitions=(), aliases=None, parent: "Scope | None" = None):
        self.definitions: dict[str, Definition] = {d.name: d for d in definitions}
        self.aliases: dict[str, str] = dict(aliases or {})
        self.parent = parent
        # definitions of this scope that expand beyond the inlining budget, with the error:
        # every definition that uses one fails with it at once instead of expanding it again
        self.oversized: dict = {}

    def lookup(self, name: str) -> Definition | None:
        target = self.aliases.get(name, name)
        if target in self.definitions:
            return self.definitions[target]
        return self.parent.lookup(name) if self.parent is not None else None

    def names(self) -> set[str]:
        own = set(self.definitions) | set(self.aliases)
        return own | (self.parent.names() if self.parent is not None else set())
