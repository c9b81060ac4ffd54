"""Running the code dynamo compiled for flexspec's own compiled functions without going through
dynamo's frame evaluation: checked by dynamo's guards (:func:`run_cached`, every call of
:mod:`flexspec.kernels.generations`), or replayed with no guards at all for the later layers of
a model step (:class:`Replay`) and for a block-mask program's calls that repeat their shapes
(:class:`ExactReplays`).

A call of a ``torch.compile``d function enters dynamo's frame evaluation: Python wrappers that
set dynamo's callback and stance around the call, then the guards of each cached code until
one accepts the arguments (the profiler's "TorchDynamo Cache Lookup"). For a call that needs no
compile, :func:`run_cached` does only the last part: it finds the cached code whose guards (the
same guard managers dynamo evaluates) accept the arguments and runs it as a plain function.
That skips the wrappers, and the trace-guarded helpers through which the code of a call at
dynamic lengths reads each length (:class:`_OutsideDynamo`), but not the guards themselves
(docs/performance.md says what each part costs). A call no cached code accepts goes through
dynamo as before, and may compile.

A later layer of a step calls the same function with the same score, block mask and options as
the first layer, on q, k and v of the same signature
(:func:`flexspec.runtime.step.launch_signature`). :class:`Replay` keeps the code the first
call's guards accepted and runs it for a later layer that passes the very same score, block
mask and options and whose q, k and v agree with that call's in everything else dynamo guards
on: each tensor's type, dispatch keys and ``requires_grad``, which of q, k and v are one object,
and the global state (grad and autocast modes, deterministic algorithms...: dynamo's own
``GlobalStateGuard``) and torch-function modes. A layer that differs in any of these takes the
compiled call. Repeated calls of one plan outside a step replay the same way
(:func:`flexspec.runtime.flexattention.warm_call`).

None of them runs where dynamo would not run the cached code as it is: while dynamo traces
(the call is then part of an outer graph), under a compile stance other than the default
(``force_eager`` and the like), while a dynamo callback is set (it would take the plain
function's frames for its own), or on a torch whose dynamo lacks the internals used here.
"""

from __future__ import annotations

import threading
import types
import weakref

import torch

try:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._C._dynamo.guards import GlobalStateGuard
    from torch._dynamo import eval_frame as _eval_frame
    from torch._dynamo import utils as _dynamo_utils
except ImportError:  # a torch without these internals: no replays
    _debug_get_cache_entry_list = GlobalStateGuard = _eval_frame = _dynamo_utils = None
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
except ImportError:  # flexspec's own calls run with none set (runtime.calls disables dynamo)
    def get_eval_frame_callback():
        return None

# The errors that mean this torch's dynamo is not laid out as expected: no replay then.
_UNEXPECTED = (AttributeError, TypeError, ValueError, RuntimeError, KeyError)


def tensor_facts(q, k, v) -> tuple:
    """What dynamo guards on per tensor beyond a launch's signature (type, dispatch keys,
    ``requires_grad``), which of q, k and v are the same object (dynamo passes such an argument
    once), and the depth of the torch-function mode stack."""
    return (type(q), type(k), type(v), torch._C._dispatch_keys(q), torch._C._dispatch_keys(k),
            torch._C._dispatch_keys(v), q.requires_grad, k.requires_grad, v.requires_grad,
            q is k, q is v, k is v, torch._C._len_torch_function_stack())


class _Compiled:
    """What :func:`run_cached` keeps of one compiled function: the function it compiles, its
    code, its parameters' names and defaults, and the plain function made of each cached code."""

    def __init__(self, original: types.FunctionType):
        self.original = original
        self.code = original.__code__
        self.names = self.code.co_varnames[:self.code.co_argcount]
        self.defaults = original.__defaults__ or ()
        # a frame's locals include the variables of the closure, and guards may read them
        self.free = tuple(zip(self.code.co_freevars, original.__closure__ or ()))
        self.functions: dict = {}  # cached code -> the plain function that runs it
        self.last = None  # the cached code accepted last

    def arguments(self, args: tuple) -> dict | None:
        """The call's frame locals as the guards read them: its arguments by parameter name
        and the closure's variables (``None`` for a call that does not fit the parameters)."""
        names, defaults = self.names, self.defaults
        if len(args) > len(names) or len(args) + len(defaults) < len(names):
            return None
        given = dict(zip(names, args))
        if len(args) < len(names):
            given.update((name, value) for name, value in zip(
                names[len(names) - len(defaults):], defaults) if name not in given)
        for name, cell in self.free:
            given[name] = cell.cell_contents
        return given

    def accepted(self, given: dict):
        """The plain function of the cached code whose guards accept ``given``, or ``None``.
        The code accepted last is tried first (dynamo moves the entry that served a call to
        the front of its list, which these calls, made without dynamo, do not)."""
        entries = _debug_get_cache_entry_list(self.code)
        last = self.last
        if last is not None and len(entries) > 1:
            entries = sorted(entries, key=lambda cached: cached.code is not last)
        for cached in entries:
            if cached.guard_manager.check(given):
                function = self.functions.get(cached.code)
                if function is None:
                    if len(self.functions) >= _FUNCTIONS_KEPT:  # codes dynamo has dropped
                        self.functions.clear()
                    function = self.functions[cached.code] = self.plain(cached.code)
                self.last = cached.code
                return function
        return None

    def plain(self, code: types.CodeType) -> types.FunctionType:
        """The plain function that runs ``code`` (a cached code of the compiled function). Its
        globals are those of the compiled function the code names, taken now (dynamo's names
        for its graphs and imports, which it never rebinds, and the module's own), with
        ``torch._dynamo.utils`` read through :class:`_OutsideDynamo`."""
        namespace = self.original.__globals__
        names = {name: _OUTSIDE_DYNAMO if namespace[name] is _dynamo_utils else namespace[name]
                 for name in _global_names(code) if name in namespace}
        names.update((name, namespace[name]) for name in ("__builtins__", "__name__")
                     if name in namespace)
        original = self.original
        return types.FunctionType(code, names, original.__name__, original.__defaults__,
                                  original.__closure__)


def _global_names(code: types.CodeType) -> set:
    """The names ``code`` and the code objects inside it may read as globals."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


class _OutsideDynamo:
    """``torch._dynamo.utils`` as cached code run outside dynamo reads it: the helpers that
    read a tensor's sizes and strides as plain calls. dynamo's own wrap each in a guard against
    being traced (its cost per call is in docs/performance.md), and the code of a call at
    dynamic lengths makes one call per length it reads. Everything else is dynamo's own."""

    def __getattr__(self, name):
        return getattr(_dynamo_utils, name)

    @staticmethod
    def call_size(x, i):
        return x.size(i)

    @staticmethod
    def call_stride(x, i):
        return x.stride(i)

    @staticmethod
    def call_storage_offset(x):
        return x.storage_offset()


_OUTSIDE_DYNAMO = _OutsideDynamo()


# Plain functions kept per compiled function: more than dynamo's recompile limit, so that only
# codes a torch._dynamo.reset() dropped are ever cleared.
_FUNCTIONS_KEPT = 32

_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _compiled(entry) -> _Compiled | None:
    """What :func:`run_cached` keeps of ``entry`` (a ``torch.compile``d function), or ``None``
    for anything else."""
    try:
        return _COMPILED[entry]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: not a compiled function
        return None
    original = getattr(entry, "_torchdynamo_orig_callable", None)
    if not isinstance(original, types.FunctionType):
        return None
    found = _COMPILED[entry] = _Compiled(original)
    return found


def _runs_cached_code() -> bool:
    """Whether dynamo, called now, would run cached code as it is (see the module docstring),
    and no dynamo callback is set, which would take the plain function's frames for its own."""
    return (_debug_get_cache_entry_list is not None and not torch.compiler.is_compiling()
            and getattr(getattr(_eval_frame, "_stance", None), "stance", None) == "default"
            and not get_eval_frame_callback())


def cached_code(entry, args: tuple):
    """The code dynamo compiled for ``entry(*args)`` (a ``torch.compile``d function, already
    called with these arguments), as a plain function of the same arguments that runs it with
    no guard evaluation; ``None`` where no cached code's guards accept the arguments or dynamo's
    internals are not as expected."""
    if not _runs_cached_code():
        return None
    compiled = _compiled(entry)
    if compiled is None:
        return None
    try:
        given = compiled.arguments(args)
        return None if given is None else compiled.accepted(given)
    except _UNEXPECTED:  # ValueError: a closure's variable not yet bound
        return None


MISSED = object()
"""What :func:`run_cached` gives for a call it did not run."""


def run_cached(entry, args: tuple):
    """``entry(*args)`` (``entry`` a ``torch.compile``d function) run by the cached code whose
    guards accept the arguments, without dynamo's frame evaluation (see the module docstring);
    :data:`MISSED` where no cached code accepts them (the call may compile: make it through
    dynamo) or dynamo would not run cached code now."""
    function = cached_code(entry, args)
    return MISSED if function is None else function(*args)


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
        q, k and v are not the first call's very objects, their tensors or the global state
        differ from the first call's in what dynamo guards on, or dynamo would not run cached
        code now."""
        others = args[3:]
        if len(others) != len(self.others) or any(
                given is not seen for given, seen in zip(others, self.others)):
            return None
        if not self.state.check() or tensor_facts(*args[:3]) != self.facts \
                or not _runs_cached_code():
            return None
        return self.function(*args)


def signature(args: tuple) -> tuple | None:
    """Everything dynamo's guards can tell apart in ``args`` (tensors, dicts and lists of them,
    and plain numbers and strings), or ``None`` for arguments of any other kind: each tensor's
    type, dispatch keys, dtype, device, shape, strides, storage offset and ``requires_grad``,
    every number's value, which tensors are one object, and the depth of the torch-function
    mode stack: all that the guards of a function of such arguments read of them, so two calls
    with one signature pass the same guards, given the same global state (which
    :class:`ExactReplays` checks apart) and the same closure."""
    seen: dict = {}
    try:
        parts = _signature(args, seen)
    except _Unsupported:
        return None
    return parts, torch._C._len_torch_function_stack()


class _Unsupported(Exception):
    pass


def _signature(value, seen: dict):
    if isinstance(value, torch.Tensor):
        # a tensor passed twice is one input to dynamo: its first place stands for it
        first = seen.setdefault(id(value), len(seen))
        return (type(value), torch._C._dispatch_keys(value).raw_repr(), value.dtype, value.device,
                value.shape, value.stride(), value.storage_offset(), value.requires_grad, first)
    if type(value) in (int, float, bool, str) or value is None:
        return type(value), value
    if type(value) is dict:
        return dict, tuple((key, _signature(item, seen)) for key, item in value.items())
    if type(value) in (tuple, list):
        return type(value), tuple(_signature(item, seen) for item in value)
    raise _Unsupported


# Signatures kept per compiled function: a few shapes (a training step's, a static cache's),
# then the oldest out; as many again remembered as seen once, and as many lengths.
_SIGNATURES_KEPT = 8


class ExactReplays:
    """The cached code of one compiled function per exact :func:`signature` of its arguments,
    run with no guard evaluation for later calls of that signature made in the same global
    state (grad and autocast modes, deterministic algorithms...: dynamo's own
    ``GlobalStateGuard``): what calls that repeat their shapes (a static cache's decoding
    steps, a training step's fresh bindings) skip of dynamo's work per call. The function must
    read nothing else that can change (its closure's variables stay as they are).

    Calls that never repeat (a growing cache's new length at every step) should pay next to
    nothing for it: each call names its ``lengths`` (any cheap key that changes with them), a
    signature is computed only for lengths seen before, and a signature's code is kept at its
    second call."""

    def __init__(self, entry):
        self.entry = entry
        self._kept: dict = {}  # signature -> (plain function, GlobalStateGuard)
        self._seen: dict = {}  # signatures called once, in order
        self._lengths: dict = {}  # the lengths of the last calls, in order
        self._lock = threading.Lock()  # threads may share the function: one change at a time

    def call(self, args: tuple, lengths, through):
        """``entry(*args)``: by the code kept for ``args``' signature where the global state is
        the one it was kept in and dynamo would run cached code now, else by ``through()``
        (the call through dynamo's guards, which may compile)."""
        if lengths not in self._lengths:
            with self._lock:
                _bounded_put(self._lengths, lengths, None)
            return through()
        key = signature(args)
        found = None if key is None else self._kept.get(key)
        if found is not None and found[1].check() and _runs_cached_code():
            return found[0](*args)
        out = through()
        if key is not None and found is None:
            if self._seen.pop(key, False) is None:  # its second call: keep its code
                function = cached_code(self.entry, args)
                if function is not None:
                    with self._lock:
                        _bounded_put(self._kept, key, (function, GlobalStateGuard()))
            else:
                with self._lock:
                    _bounded_put(self._seen, key, None)
        return out


def _bounded_put(kept: dict, key, value) -> None:
    if len(kept) >= _SIGNATURES_KEPT:
        kept.pop(next(iter(kept)))
    kept[key] = value
