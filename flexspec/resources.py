"""The data files that ship with flexspec: the grammar, the pattern registry and the examples.

Installed, they sit inside the package (``flexspec/grammar`` ...); in a checkout, at its top
(``grammar/`` beside ``flexspec/``). :func:`data_path` finds either, so nothing else needs to know.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_path(folder: str, name: str | None = None) -> Path | None:
    """``folder`` (``"grammar"``, ``"patterns"``, ``"examples"``), or the file ``name`` inside it,
    from the installed package or the checkout; ``None`` when neither has it."""
    for root in (_PACKAGE, _PACKAGE.parent):
        candidate = root / folder if name is None else root / folder / name
        if candidate.exists():
            return candidate
    return None
