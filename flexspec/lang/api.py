"""The front end in one call: text to a checked :class:`~flexspec.lang.spec.Spec`, and specs
composed from others (:func:`with_mask`, :func:`with_score`) without going through text.

Both ``flexspec.parse`` and the runtime (``SpecAttention``) call :func:`parse`, so the runtime
never imports the package's ``__init__``.
"""

from __future__ import annotations

from flexspec import ir
from flexspec.errors import SpecError, SpecTypeError
from flexspec.ir import rewrites
from flexspec.lang import ast
from flexspec.lang.ast import format_node
from flexspec.lang.checker import check_result, check_spec
from flexspec.lang.library import Library
from flexspec.lang.parser import parse_spec
from flexspec.lang.registry import registry
from flexspec.lang.spec import Spec


def parse(text, *, library: Library | None = None) -> Spec:
    """Parse and check a spec expression; names resolve in ``library`` first, then the registry.
    A :class:`Spec` is returned as it is."""
    if isinstance(text, Spec):
        return text
    scope = _scope(library)
    node = parse_spec(text)
    return Spec(node, check_spec(node, scope), library.origin if library is not None else None)


def _scope(library: Library | None):
    if library is not None and not isinstance(library, Library):
        raise SpecTypeError(f"library must be a flexspec.Library (from flexspec.load), got "
                            f"{type(library).__name__}")
    return library.scope if library is not None else registry().scope


def with_mask(spec: Spec, mask, *, library: Library | None = None) -> Spec:
    """``spec`` with the mask ``mask`` (text or :class:`Spec`) joined by ``&`` to its mask term,
    before its score modifiers: ``with_mask(parse("causal + alibi"), "key_padding")`` is
    ``causal & key_padding + alibi``. A spec of score modifiers alone gets ``mask`` as its mask.

    The IR is joined by :func:`flexspec.ir.rewrites.join_mask` and the syntax tree alongside it,
    so the result's text is the spec a user would write for it."""
    scope = _scope(library)
    joined = parse(mask, library=library)
    if joined.ir.has_score:
        raise SpecError(f"with_mask joins a mask, but '{joined}' has score modifiers")
    terms = spec.expr.terms if isinstance(spec.expr, ast.Chain) else (spec.expr,)
    kinds = [_kind(check_spec(term, scope)) for term in terms]
    if "spec" in kinds:
        term = terms[kinds.index("spec")]
        raise SpecError(f"'{format_node(term)}' is a named spec with score modifiers, so a mask "
                        "cannot be joined to its mask term: write its mask and its score "
                        "modifiers out")
    if "mask" in kinds:
        at = kinds.index("mask")
        terms = terms[:at] + (ast.Binary("&", terms[at], joined.expr),) + terms[at + 1:]
    else:
        terms = (joined.expr,) + terms
    return _checked(terms, rewrites.join_mask(spec.ir, joined.ir), spec.library)


def with_score(spec: Spec, modifier, *, library: Library | None = None) -> Spec:
    """``spec`` with the score modifier ``modifier`` (text or :class:`Spec`) applied after its
    own: ``with_score(parse("causal"), "softcap(30.0)")`` is ``causal + softcap(30.0)``."""
    added = parse(modifier, library=library)
    if added.ir.has_mask:
        raise SpecError(f"with_score adds a score modifier, but '{added}' has a mask")
    terms = spec.expr.terms if isinstance(spec.expr, ast.Chain) else (spec.expr,)
    more = added.expr.terms if isinstance(added.expr, ast.Chain) else (added.expr,)
    return _checked(terms + more, rewrites.join_score(spec.ir, added.ir), spec.library)


def _kind(result: ir.AttentionIR) -> str:
    if result.has_mask or result.score == ir.SCORE:
        return "spec" if result.has_score else "mask"
    return "score"


def _checked(terms: tuple, result: ir.AttentionIR, library) -> Spec:
    node = terms[0] if len(terms) == 1 else ast.Chain(terms)
    check_result(result, node)
    return Spec(node, result, library)
