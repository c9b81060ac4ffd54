"""Replaying a compiled call for the later layers of a model step, without dynamo's guards.

Every call of a ``torch.compile``d function first has dynamo evaluate the guards of its cached
code (the profiler's "TorchDynamo Cache Lookup", a large part of a decoding call's host time:
docs/performance.md), while a later layer of a step calls the same function with the same
score, block mask and options as the first layer, on q, k and v of the same signature
(:func:`flexspec.runtime.step.launch_signature`). :class:`Replay` finds the compiled code
dynamo's guards accept for one call's arguments (a step's first call of a plan, or a launch's
first call), and runs it directly for a later layer that passes the very same score, block mask
and options and whose q, k and v agree with that call's in everything else dynamo guards on:
each tensor's type, dispatch keys and ``requires_grad``, which of q, k and v are one object, and
the global state (grad and autocast modes, deterministic algorithms...: dynamo's own
``GlobalStateGuard``) and torch-function modes. A layer that differs in any of these, or a torch
whose dynamo lacks the internals used here, takes the compiled call as before. Repeated calls
of one plan outside a step replay the same way (:func:`flexspec.runtime.flexattention.warm_call`).
"""

from __future__ import annotations

import types

import torch

try:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._C._dynamo.guards import GlobalStateGuard
except ImportError:  # a torch without these internals: no replays
    _debug_get_cache_entry_list = GlobalStateGuard = None

# The errors that mean this torch's dynamo is not laid out as expected: no replay then.
_UNEXPECTED = (AttributeError, TypeError, ValueError, RuntimeError, KeyError)


def tensor_facts(q, k, v) -> tuple:
    """What dynamo guards on per tensor beyond a launch's signature (type, dispatch keys,
    ``requires_grad``), which of q, k and v are the same object (dynamo passes such an argument
    once), and the depth of the torch-function mode stack."""
    return (type(q), type(k), type(v), torch._C._dispatch_keys(q), torch._C._dispatch_keys(k),
            torch._C._dispatch_keys(v), q.requires_grad, k.requires_grad, v.requires_grad,
            q is k, q is v, k is v, torch._C._len_torch_function_stack())


def cached_code(entry, args: tuple):
    """The code dynamo compiled for ``entry(*args)`` (a ``torch.compile``d function, already
    called with these arguments), as a plain function of the same arguments that runs it with
    no guard evaluation; ``None`` where no cached code's guards accept the arguments or dynamo's
    internals are not as expected."""
    original = getattr(entry, "_torchdynamo_orig_callable", None)
    if _debug_get_cache_entry_list is None or not isinstance(original, types.FunctionType):
        return None
    code = original.__code__
    names = code.co_varnames[:code.co_argcount]
    defaults = original.__defaults__ or ()
    if len(args) > len(names) or len(args) + len(defaults) < len(names):
        return None
    given = dict(zip(names, args))
    given.update((name, value) for name, value in zip(names[len(names) - len(defaults):],
                                                      defaults) if name not in given)
    try:
        for cached in _debug_get_cache_entry_list(code):
            if cached.guard_manager.check(given):
                return types.FunctionType(cached.code, original.__globals__, original.__name__,
                                          original.__defaults__, original.__closure__)
    except _UNEXPECTED:
        return None
    return None


class Replay:
    """The compiled code of one call, for later calls with the same score, block mask and
    options (see the module docstring): :meth:`run` gives ``None`` where a call must take the
    compiled call. It keeps those arguments alive (they are compared by identity)."""

    def __init__(self, function, args: tuple):
        self.function = function
        self.state = GlobalStateGuard()
        self.facts = tensor_facts(*args[:3])
        self.others = args[3:]  # the score, block mask, options...: the very same objects

    @classmethod
    def of(cls, entry, args: tuple) -> "Replay | None":
        """The replay of ``entry(*args)`` (q, k and v its first three arguments), just run, or
        ``None`` where it has none."""
        function = cached_code(entry, args)
        return None if function is None else cls(function, args)

    def run(self, args: tuple):
        """The output of the compiled code on ``args``, or ``None`` where their arguments after
        q, k and v are not the first call's very objects, or their tensors or the global state
        differ from the first call's in what dynamo guards on."""
        others = args[3:]
        if len(others) != len(self.others) or any(
                given is not seen for given, seen in zip(others, self.others)):
            return None
        if not self.state.check() or tensor_facts(*args[:3]) != self.facts:
            return None
        return self.function(*args)
