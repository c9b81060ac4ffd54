"""The front end in one call: text to a checked :class:`~flexspec.lang.spec.Spec`.

Both ``flexspec.parse`` and the runtime (``SpecAttention``) call :func:`parse`, so the runtime
never imports the package's ``__init__``.
"""

from __future__ import annotations

from flexspec.errors import SpecTypeError
from flexspec.lang import ast
from flexspec.lang.ast import format_node
from flexspec.lang.checker import check_spec
from flexspec.lang.library import Library
from flexspec.lang.parser import parse_spec
from flexspec.lang.registry import registry
from flexspec.lang.spec import Spec


def parse(text, *, library: Library | None = None) -> Spec:
    """Parse and check a spec expression; names resolve in ``library`` first, then the registry.
    A :class:`Spec` is returned as it is."""
    if isinstance(text, Spec):
        return text
    if library is not None and not isinstance(library, Library):
        raise SpecTypeError(f"library must be a flexspec.Library (from flexspec.load), got "
                        f"{type(library).__name__}")
    scope = library.scope if library is not None else registry().scope
    node = parse_spec(text)
    return Spec(node, check_spec(node, scope), library.origin if library is not None else None)


def with_mask(spec: Spec, mask: str, *, library: Library | None = None) -> Spec:
    """``spec`` with the mask expression ``mask`` joined by ``&`` to its mask term, before its
    score modifiers: ``with_mask(parse("causal + alibi"), "key_padding")`` is
    ``causal & key_padding + alibi``. A spec of score modifiers alone gets ``mask`` as its mask.
    """
    terms = spec.expr.terms if isinstance(spec.expr, ast.Chain) else (spec.expr,)
    head = format_node(terms[0])
    head_only = parse(head, library=library)
    if head_only.ir.has_score and not head_only.ir.has_mask:  # a lone score modifier
        masked, scores = mask, terms
    else:
        masked, scores = f"({head}) & ({mask})", terms[1:]
    return parse(" + ".join([masked] + [format_node(term) for term in scores]), library=library)
