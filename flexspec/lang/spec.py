"""The checked spec: a syntax tree together with its resolved IR.

``str(spec)`` is the canonical text; two specs are equal when their trees and IR are equal, so a
spec round-trips through its text: ``parse(str(spec)) == spec`` (with the same ``library``).
``repr(spec)`` is the call that makes it again where one can: ``flexspec.parse('causal')``, or
with ``library=flexspec.load(path)`` for a spec whose names resolved in an ``.attn`` file.

>>> import flexspec
>>> flexspec.parse("causal&window(128)")
flexspec.parse('causal & window(128)')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from flexspec.lang import ast
from flexspec.ir import AttentionIR
from flexspec.lang.ast import format_node


@dataclass(frozen=True)
class LibraryOrigin:
    """Where the names of a spec resolved besides the registry: the ``.attn`` library's name,
    and its path when it was read from a file (``flexspec.load``; ``None`` for ``loads``)."""

    name: str
    path: Optional[str] = None


@dataclass(frozen=True)
class Spec:
    expr: ast.Node
    ir: AttentionIR
    # not part of what the spec means (two specs with equal trees and IR are equal), only of
    # how its repr can make it again
    library: Optional[LibraryOrigin] = field(default=None, compare=False)

    def __str__(self) -> str:
        return format_node(self.expr)

    def __repr__(self) -> str:
        text = str(self)
        if self.library is None:
            return f"flexspec.parse({text!r})"
        if self.library.path is not None:
            return f"flexspec.parse({text!r}, library=flexspec.load({self.library.path!r}))"
        # text given to flexspec.loads is not kept: no call can make the spec again
        return f"<Spec {text!r}, names resolved in the .attn text {self.library.name!r}>"

    @property
    def bindings(self) -> list[str]:
        """Names of the tensors that must be passed at call time."""
        return [t.name for t in self.ir.bindings()]

    def explain(self) -> str:
        """The resolved, simplified IR as text."""
        lines = [f"spec:  {self}", f"mask:  {self.ir.mask}", f"score: {self.ir.score}"]
        if self.ir.align == "end":
            lines.append("align: end (without q_offset, query row i stands at KV_LEN - Q_LEN + i)")
        for tensor in self.ir.tensors():
            dims = ", ".join(str(d) for d in tensor.shape)
            origin = {"binding": "runtime binding", "builtin": "computed",
                      "learnable": f"learnable, init {tensor.init}"}[tensor.origin]
            name = tensor.name if tensor.origin != "builtin" else str(tensor)
            lines.append(f"tensor {name}: {tensor.dtype}[{dims}] ({origin})")
        return "\n".join(lines)
