"""Warnings the runtime gives once per process (a fallback taken, a slow path), pointed at the
user's line: the first frame of the call stack outside flexspec and torch."""

from __future__ import annotations

import os
import sys
import warnings

import torch

_warned: set = set()
# Frames in these folders are not the user's: flexspec's own package, and torch's (its compile
# and module wrappers stand between a model's call and flexspec).
_NOT_THE_USERS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                  os.path.dirname(torch.__file__) + os.sep)


def warn_once(key: str, message: str) -> None:
    """Warn with ``message`` unless a warning of ``key`` was given before."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=_users_level())


def _users_level() -> int:
    """The ``stacklevel`` of the innermost frame outside flexspec and torch, for a warning
    raised by :func:`warn_once` (its caller's, where every frame is flexspec's or torch's)."""
    frame, level = sys._getframe(2), 2  # warn_once's caller, which warnings counts as level 2
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_USERS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
