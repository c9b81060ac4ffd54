"""The front end in one call: text to a checked :class:`~flexspec.lang.spec.Spec`.

Both ``flexspec.parse`` and the runtime (``SpecAttention``) call :func:`parse`, so the runtime
never imports the package's ``__init__``.
"""

from __future__ import annotations

from flexspec.errors import SpecError
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
        raise SpecError(f"library must be a flexspec.Library (from flexspec.load), got "
                        f"{type(library).__name__}")
    scope = library.scope if library is not None else registry().scope
    node = parse_spec(text)
    return Spec(node, check_spec(node, scope))
