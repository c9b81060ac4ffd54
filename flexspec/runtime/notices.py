"""Warnings the runtime gives once per process (a fallback taken, a check skipped)."""

from __future__ import annotations

import warnings

_warned: set = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn with ``message`` unless a warning of ``key`` was given before."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=stacklevel)
