"""The tensors a spec reads, gathered for a call: every binding checked against its declared
shape and dtype (errors that name the binding and its expected shape), built-in tensors
computed, learnable ones taken from the caller or initialised once, and the IR specialized to
their shapes; and the rows of a call's per-row values, for a call run as several of some of its
batch rows (:func:`batch_rows_of`)."""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError, did_you_mean
from flexspec.ir import tensor_key
from flexspec.ir.specialize import (broadcast_dims, declared_shape, eval_size_expr,
                                     specialize_ir)
from flexspec.kernels.tensors import add_leading_dims, builtin_tensor, init_learnable, prepare
from flexspec.runtime.capture import in_graph_memory
from flexspec.runtime.identity import KeptByIdentity, identity

# Strided bindings copied into contiguous memory, kept by the identity of the tensor given: a
# caller that passes the same unchanged view again (doc_ids[:, :length] at every decode step)
# gets the same copy, so the block-mask cache, keyed by identity, finds its mask instead of
# building it anew on every call.
_CONTIGUOUS_KEPT = 8
# Values of built-in tensors kept per spec (one per number of heads and device, in practice).
_BUILTINS_KEPT = 16
_contiguous_kept = KeptByIdentity(_CONTIGUOUS_KEPT)


def shape_text(tensor: ir.Tensor, sizes: dict) -> str:
    dims = ", ".join(str(d) for d in tensor.shape)
    values = ", ".join(str(n) for n in declared_shape(tensor, sizes))
    return f"{tensor.dtype}[{dims}] = [{values}]"


_DTYPE_OK = {
    "int": lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool,
    "bool": lambda d: d == torch.bool,
    "float": lambda d: d.is_floating_point,
}


def check_binding(tensor: ir.Tensor, value, sizes: dict, device) -> torch.Tensor:
    """``value`` as the tensor the spec declares (leading dimensions added), or a
    :class:`BindingError` naming the binding and its expected shape."""
    name = tensor.name
    # the expected shape is spelled out only in an error: plans of a growing cache check their
    # bindings at every step
    if not isinstance(value, torch.Tensor):
        raise BindingTypeError(f"binding '{name}' must be a torch.Tensor of "
                               f"{shape_text(tensor, sizes)}, got {type(value).__name__}")
    if not _DTYPE_OK[tensor.dtype](value.dtype):
        raise BindingError(f"binding '{name}' has dtype {value.dtype}, but {tensor.dtype} "
                           f"elements are declared ({shape_text(tensor, sizes)})")
    if value.device != device:
        raise BindingError(f"binding '{name}' is on {value.device}, but q is on {device}; "
                           f"move it with .to('{device}')")
    shape = declared_shape(tensor, sizes)
    if value.dim() > len(shape):
        raise BindingError(f"binding '{name}' has shape {list(value.shape)}, expected "
                           f"{shape_text(tensor, sizes)}")
    given = list(value.shape)
    value = contiguous(add_leading_dims(value, len(shape)))
    added = len(shape) - len(given)  # leading dimensions of size 1, for broadcasting
    for dim, (got, want, may_broadcast) in enumerate(zip(value.shape, shape,
                                                         broadcast_dims(tensor))):
        if got != want and not (got == 1 and may_broadcast):
            where = (f"its dimension {dim - added} should be {want}" if dim >= added else
                     f"a leading dimension of size {want} is missing")
            raise BindingError(f"binding '{name}' has shape {given}, expected "
                               f"{shape_text(tensor, sizes)} ({where})")
    return value


class Tensors:
    """The tensors one spec reads, gathered for a call: bindings checked, builtins computed,
    learnable tensors taken from the caller or initialised once per shape and device."""

    def __init__(self, spec: ir.AttentionIR):
        self.ir = spec
        self._fresh_learnables: dict = {}
        self._builtins: dict = {}  # (tensor key, its arguments, device) -> value
        self._names = {t.name for t in spec.tensors() if t.origin != "builtin"}

    def gather(self, sizes: dict, bindings: dict, device, learnables: dict | None = None,
               mask_only: bool = False) -> tuple:
        """Checked tensor values (keyed by tensor_key) and the IR specialized to their shapes.
        With ``mask_only``, only the tensors the mask reads are required. The lookups' indices
        are not checked here: whoever runs the IR checks them once (:mod:`.lookups`)."""
        spec = ir.AttentionIR(mask=self.ir.mask, align=self.ir.align) if mask_only else self.ir
        expected = {t.name: t for t in spec.bindings()}
        learnable = {t.name: t for t in spec.tensors() if t.origin == "learnable"}
        if mask_only:  # a binding of the score is not needed here, but is not unexpected either
            bindings = {k: v for k, v in bindings.items()
                        if k in expected or k in learnable or k not in self._names}
        for name in bindings:
            if name not in expected and name not in learnable:
                known = sorted(expected) + sorted(learnable)
                hint = did_you_mean(name, known)
                takes = ", ".join(known) if known else "no tensors"
                raise BindingError(f"unexpected binding '{name}'.{hint} This spec takes {takes}")
        checked, given, builtins = {}, {}, {}
        for tensor in spec.tensors():
            key = tensor_key(tensor)
            if tensor.origin == "binding":
                if tensor.name not in bindings:
                    raise BindingError(f"missing binding '{tensor.name}': "
                                       f"{shape_text(tensor, sizes)}; pass {tensor.name}=... "
                                       "to the call")
                checked[tensor.name] = check_binding(tensor, bindings[tensor.name], sizes, device)
            elif tensor.origin == "learnable":
                if tensor.name in bindings:
                    given[key] = check_binding(tensor, bindings[tensor.name], sizes, device)
                elif learnables is not None and key in learnables:
                    given[key] = learnables[key]
                else:
                    given[key] = self._fresh(tensor, sizes, device)
            elif tensor.origin == "builtin" and not in_graph_memory(device):
                builtins[key] = self._builtin(tensor, sizes, device)
        values = prepare(spec, sizes, checked, device, learnables=given, builtins=builtins)
        shapes = {key: tuple(value.shape) for key, value in values.items()}
        return values, specialize_ir(spec, shapes, sizes)

    def _builtin(self, tensor: ir.Tensor, sizes: dict, device) -> torch.Tensor:
        """The value of a built-in tensor (``alibi_slopes(H)``), made once per argument values
        and device: a growing cache plans at every step, and each making is a few launches.
        Not inside a CUDA graph capture, whose tensors live in the graph's memory pool."""
        cache_key = (tensor_key(tensor), tuple(eval_size_expr(a, sizes) for a in tensor.args),
                     str(device))
        found = self._builtins.get(cache_key)
        if found is None:
            with torch.inference_mode(False):  # kept for calls of every mode
                found = builtin_tensor(tensor, sizes, device)
            if len(self._builtins) >= _BUILTINS_KEPT:
                self._builtins.pop(next(iter(self._builtins)))
            self._builtins[cache_key] = found
        return found

    def _fresh(self, tensor: ir.Tensor, sizes: dict, device) -> torch.Tensor:
        """The initial value of a learnable tensor nobody passed, the same for every call."""
        cache_key = (tensor_key(tensor), tuple(declared_shape(tensor, sizes)), str(device))
        if cache_key not in self._fresh_learnables:
            with torch.inference_mode(False):  # kept for calls of every mode
                self._fresh_learnables[cache_key] = init_learnable(tensor, sizes, device)
        return self._fresh_learnables[cache_key]


def contiguous(value: torch.Tensor) -> torch.Tensor:
    """``value`` in contiguous memory (flexspec.workarounds: inductor-strided-capture): the
    same copy again for the same unchanged strided ``value`` (see _CONTIGUOUS_KEPT). Not kept
    for a tensor that requires gradients (its copy belongs to one autograd graph), inside a
    CUDA graph capture or the warm-up before one (the copy must be recorded), nor for an
    inference tensor (its changes cannot be seen)."""
    if value.is_contiguous():
        return value
    seen = None if value.requires_grad or in_graph_memory(value.device) else identity(value)
    if seen is None:
        return value.contiguous()

    def copy():
        with torch.inference_mode(False):  # it serves calls in every mode
            return value.contiguous()
    return _contiguous_kept.get(seen, value, copy)


_SIZE_ARGUMENTS = {"B": "batch", "H": "heads", "Q_LEN": "q_len", "KV_LEN": "kv_len"}


def implied_sizes(spec: ir.AttentionIR, given: dict, bindings: dict, needed: set) -> tuple:
    """``(sizes, device)`` of a call that gives only some sizes (``given``: ``B H Q_LEN KV_LEN``
    to an int or None), the rest read off the bindings' shapes where they are longer than 1
    (``doc_ids`` of shape ``[2, 4096]`` gives B=2, KV_LEN=4096); ``needed``: the sizes that must
    be known (a :class:`BindingError` names the missing ones), the others default to 1. The
    device is the bindings' (None when no binding is a tensor)."""
    given, device = dict(given), None
    for tensor in spec.tensors():
        value = bindings.get(tensor.name)
        if not isinstance(value, torch.Tensor):
            continue
        dims = tuple(tensor.shape)[len(tensor.shape) - value.dim():] if value.dim() else ()
        for expr, size in zip(dims, value.shape):
            if isinstance(expr, ir.Var) and given.get(expr.name) is None and size > 1:
                given[expr.name] = size
        if device is None:
            device = value.device
    missing = sorted(name for name in needed if given[name] is None)
    if missing:
        raise BindingError("this spec needs " + ", ".join(missing) + "; pass "
                           + ", ".join(f"{_SIZE_ARGUMENTS[n]}=..." for n in missing))
    return {name: given[name] or 1 for name in ("B", "H", "Q_LEN", "KV_LEN")}, device


def sizes_tensors_read(spec: ir.AttentionIR) -> set:
    """The sizes the spec's tensors need to be built: a binding broadcasts over B and H;
    computed and learnable tensors need every size their shape reads."""
    needed = set()
    for tensor in spec.tensors():
        used = ir.free_vars(tensor) & set(ir.SIZE_VARS)
        needed |= used - {"B", "H"} if tensor.origin == "binding" else used
    return needed


def batch_bindings(spec_tensors) -> dict:
    """The bindings indexed by the batch (declared ``[B, ...]``): name -> declared dimensions
    (a value given with fewer leaves its batch dimension out, and is broadcast)."""
    return {tensor.name: len(tensor.shape) for tensor in spec_tensors
            if tensor.shape and isinstance(tensor.shape[0], ir.Var)
            and tensor.shape[0].name == "B"}


def batch_rows_of(bindings: dict, by_batch: dict, cut) -> dict:
    """``bindings`` with those declared ``[B, ...]`` and given with their batch dimension
    (``by_batch``, :func:`batch_bindings`) passed through ``cut``; the others as they are."""
    return {name: cut(value) if isinstance(value, torch.Tensor)
            and value.dim() == by_batch.get(name) else value for name, value in bindings.items()}


def rows_between(value, start: int, stop: int, batch: int):
    """Rows ``start`` to ``stop`` of a per-row value (a tensor with a row per batch row), as a
    view; anything else (an int, a batch dimension of 1, broadcast) as it is."""
    return value[start:stop] if per_row(value, batch) else value


def rows_at(value, index: torch.Tensor, batch: int):
    """The rows ``index`` of a per-row value (a tensor with a row per batch row); anything else
    (an int, a batch dimension of 1, broadcast) as it is."""
    return value.index_select(0, index.to(value.device)) if per_row(value, batch) else value


def per_row(value, batch: int) -> bool:
    """Whether ``value`` has a row per batch row (of a batch of more than one)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch \
        and batch > 1
