"""Feedback on slow work: the ``flexspec`` logger says when a kernel compiles (seconds on a
CPU, the first call of each spec and shape), how long it took, and which backend each new plan
took. It is a standard :mod:`logging` logger, silent by default; the one switch is the
environment variable ``FLEXSPEC_LOG`` (``info`` or ``debug``), which gives it a handler on
standard error at that level when flexspec's runtime is imported. Configuring
``logging.getLogger("flexspec")`` yourself works as for any library."""

from __future__ import annotations

import contextlib
import logging
import os
import time

log = logging.getLogger("flexspec")
# The switch: FLEXSPEC_LOG=info (or debug, warning...) prints the log on standard error.
SWITCH = "FLEXSPEC_LOG"


def _switch_on() -> None:
    level = os.environ.get(SWITCH, "").strip().upper()
    if not level:
        return
    if not isinstance(logging.getLevelName(level), int):
        log.warning("%s=%r is not a logging level (info, debug, warning): ignored", SWITCH,
                    os.environ[SWITCH])
        return
    if not any(getattr(h, "_flexspec_switch", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("flexspec: %(message)s"))
        handler._flexspec_switch = True
        log.addHandler(handler)
    log.setLevel(level)


_switch_on()


@contextlib.contextmanager
def timed(what: str):
    """Log ``what`` at the start (with a note that it takes a while) and its time at the end."""
    log.info("%s (may take seconds)...", what)
    start = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)
