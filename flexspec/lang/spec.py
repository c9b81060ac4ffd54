"""The checked spec: a syntax tree together with its resolved IR.

``str(spec)`` is the canonical text; two specs are equal when their trees and IR are equal, so a
spec round-trips through its text: ``parse(str(spec)) == spec``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexspec.lang import ast
from flexspec.ir import AttentionIR
from flexspec.lang.ast import format_node


@dataclass(frozen=True)
class Spec:
    expr: ast.Node
    ir: AttentionIR

    def __str__(self) -> str:
        return format_node(self.expr)

    def __repr__(self) -> str:
        return f"Spec({str(self)!r})"

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
