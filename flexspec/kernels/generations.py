"""Calls of flexspec's own compiled functions (its FlexAttention entry points and block-mask
programs): they run the cached code dynamo's guards accept without dynamo's frame evaluation
where no compile is needed (:func:`flexspec.kernels.replay.run_cached`), leave CUDA graph
trees' generation alone, and the calls that may compile run under dynamo settings of
flexspec's own.

Every entry into a ``torch.compile``d function from eager code counts, for torch's CUDA graph
trees, as a new invocation of the user's compiled model (dynamo's ``GenerationTracker``). Inside
a model compiled with ``mode="reduce-overhead"``, flexspec's attention runs eagerly between the
model's graphs (a graph break); the first graph's outputs (the residual stream) are then read by
the next graph, which saw a new generation and had overwritten them (flexspec.workarounds:
compiled-call-new-generation)."""

from __future__ import annotations

import threading

import torch
from torch._dynamo.mutation_guard import GenerationTracker

from flexspec.kernels.replay import MISSED, Replay, run_cached

# What dynamo builds the guards of flexspec's compiles with: the guards on symbolic lengths (a
# growing cache's) checked in C++ rather than by a Python function, which took tens of
# microseconds a call of a dynamic-length program on our CPU (docs/performance.md, "B=8 again,
# and a growing cache's host time"). A torch without the setting keeps its default.
FAST_GUARDS = {name: True for name in ("enable_cpp_symbolic_shape_guards",)
               if hasattr(torch._dynamo.config, name)}

# Held while dynamo's settings are changed around a call: where torch keeps them process-wide
# (some versions do, others per thread), two threads then never interleave their changes and
# restores; reentrant, as torch may compile a nested function inside one.
SETTINGS_LOCK = threading.RLock()


def call_compiled(function, *args):
    """``function(*args)`` (a compiled function), by its cached code where dynamo's guards
    accept the arguments, else through dynamo, with dynamo's generation as it was before."""
    out = run_cached(function, args)
    return _through_dynamo(function, args) if out is MISSED else out


def call_kept(function, *args) -> tuple:
    """``(output, replay)``: :func:`call_compiled`, and the :class:`Replay` of the cached code
    that made the output (``None`` where no cached code accepts the arguments, even after the
    call). A call that needs no compile checks the guards once, where :func:`call_compiled`
    then ``Replay.of`` would check them twice."""
    found = Replay.of(function, args)
    if found is not None:
        return found.function(*args), found
    return _through_dynamo(function, args), Replay.of(function, args)


def _through_dynamo(function, args: tuple):
    """``function(*args)`` through dynamo (which may compile), its generation left alone."""
    generation = GenerationTracker.generation
    try:
        return function(*args)
    finally:
        GenerationTracker.generation = generation


def call_with_settings(settings: dict, function, *args, wait: bool = True):
    """:func:`call_compiled` with dynamo's ``settings`` in force (restored after). With
    ``wait=False``, a call made while another thread holds the settings runs at once as it is,
    without them (for settings that change how fast a compile's code runs, never what it
    computes), rather than wait for that thread's compile to end. A call that some cached
    code's guards accept needs no compile, so no settings: it runs at once."""
    out = run_cached(function, args)
    if out is not MISSED:
        return out
    if not SETTINGS_LOCK.acquire(blocking=wait):
        return _through_dynamo(function, args)
    config = torch._dynamo.config
    try:
        before = {name: getattr(config, name) for name in settings}
        for name, value in settings.items():
            setattr(config, name, value)
        try:
            return _through_dynamo(function, args)
        finally:
            for name, value in before.items():
                setattr(config, name, value)
    finally:
        SETTINGS_LOCK.release()
