"""A call's inputs: checks of q, k, v, the scale and every binding (errors that name the binding
and its expected shape), the tensor values a spec reads at given sizes, and the range checks of
its tensor lookups."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from flexspec import ir, limits
from flexspec.errors import BindingError, did_you_mean
from flexspec.ir import tensor_key
from flexspec.ir.intervals import lookup_ranges
from flexspec.ir.specialize import broadcast_dims, declared_shape, specialize_ir
from flexspec.kernels.reference import evaluate, index_grid
from flexspec.kernels.tensors import add_leading_dims, init_learnable, prepare

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Sizes(NamedTuple):
    """The sizes a spec's IR reads."""

    B: int
    H: int
    Q_LEN: int
    KV_LEN: int

    def as_dict(self) -> dict:
        """The sizes as the kernels take them (``{"B": ..., "H": ..., ...}``)."""
        return self._asdict()


def check_qkv(q, k, v, *, allow_float64: bool = False) -> Sizes:
    """The sizes of a call, or a :class:`BindingError` saying what is wrong with q, k or v."""
    dtypes = FLOAT_DTYPES + ((torch.float64,) if allow_float64 else ())
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise BindingError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise BindingError(f"{name} must have 4 dimensions (B, H, S, D), got shape "
                               f"{list(t.shape)}")
        if t.dtype == torch.float64 and not allow_float64:
            raise BindingError(f"{name} has dtype torch.float64, which only the reference "
                               "backend runs (compile(..., backend='reference'), or "
                               ".reference(q, k, v)); the kernels take float32, float16 or "
                               "bfloat16")
        if t.dtype not in dtypes:
            allowed = "float32, float16, bfloat16" + (", float64" if allow_float64 else "")
            raise BindingError(f"{name} has dtype {t.dtype}; use {allowed}")
    if not (q.dtype == k.dtype == v.dtype):
        raise BindingError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise BindingError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        # block masks, lookup checks and tables read values, which meta tensors do not hold
        raise BindingError("q, k and v are on the meta device, which holds shapes but no values; "
                           "flexspec reads values (block masks, checks of indices, tables), so "
                           "run it on a real device (the output's shape is [B, Hq, Q_LEN, Dv])")
    batch, heads, q_len, dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise BindingError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != dim:
        raise BindingError(f"q and k must have the same head dimension, got {dim} and {k.shape[3]}")
    if v.shape[1:3] != k.shape[1:3]:
        raise BindingError(f"k {list(k.shape)} and v {list(v.shape)} must have the same heads "
                           "and length")
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise BindingError(f"{heads} query heads must be a multiple of {kv_heads} key/value heads")
    if q_len == 0 or k.shape[2] == 0:
        raise BindingError("q and k must have at least one position")
    if dim == 0 or v.shape[3] == 0:
        raise BindingError(f"the head dimension must be at least 1, got q/k {dim} and v "
                           f"{v.shape[3]}")
    return Sizes(batch, heads, q_len, k.shape[2])


def check_scale(scale) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise BindingError(f"scale must be a finite number or None, got {scale!r}")


def given_sizes(q_len, kv_len, batch, heads) -> Sizes:
    """Sizes given by the user (``block_mask(q_len, kv_len, batch=...)``), checked."""
    sizes = Sizes(1 if batch is None else batch, 1 if heads is None else heads, q_len, kv_len)
    for name, value in zip(Sizes._fields, sizes):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BindingError(f"{name} must be a positive int, got {value!r}")
    return sizes


def as_device(device) -> torch.device:
    """A device as tensors report it ("cuda" becomes "cuda:0"), so comparisons are exact."""
    try:
        return torch.empty(0, device=device).device
    except Exception as err:  # RuntimeError, TypeError, or AssertionError from a torch built
        # without that device
        raise BindingError(f"cannot use device {device!r}: {err}") from None


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
    expected = shape_text(tensor, sizes)
    if not isinstance(value, torch.Tensor):
        raise BindingError(f"binding '{name}' must be a torch.Tensor of {expected}, got "
                           f"{type(value).__name__}")
    if not _DTYPE_OK[tensor.dtype](value.dtype):
        raise BindingError(f"binding '{name}' has dtype {value.dtype}, but {tensor.dtype} "
                           f"elements are declared ({expected})")
    if value.device != device:
        raise BindingError(f"binding '{name}' is on {value.device}, but q is on {device}; "
                           f"move it with .to('{device}')")
    shape = declared_shape(tensor, sizes)
    if value.dim() > len(shape):
        raise BindingError(f"binding '{name}' has shape {list(value.shape)}, expected {expected}")
    given = list(value.shape)
    value = contiguous(add_leading_dims(value, len(shape)))
    added = len(shape) - len(given)  # leading dimensions of size 1, for broadcasting
    for dim, (got, want, may_broadcast) in enumerate(zip(value.shape, shape,
                                                         broadcast_dims(tensor))):
        if got != want and not (got == 1 and may_broadcast):
            where = (f"its dimension {dim - added} should be {want}" if dim >= added else
                     f"a leading dimension of size {want} is missing")
            raise BindingError(f"binding '{name}' has shape {given}, expected {expected} "
                               f"({where})")
    return value


class Tensors:
    """The tensors one spec reads, gathered for a call: bindings checked, builtins computed,
    learnable tensors taken from the caller or initialised once per shape and device."""

    def __init__(self, spec: ir.AttentionIR):
        self.ir = spec
        self._fresh_learnables: dict = {}
        self._names = {t.name for t in spec.tensors() if t.origin != "builtin"}

    def gather(self, sizes: dict, bindings: dict, device, learnables: dict | None = None,
               mask_only: bool = False) -> tuple:
        """Checked tensor values (keyed by tensor_key) and the IR specialized to their shapes.
        With ``mask_only``, only the tensors the mask reads are required."""
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
        checked, given = {}, {}
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
        values = prepare(spec, sizes, checked, device, learnables=given)
        shapes = {key: tuple(value.shape) for key, value in values.items()}
        specialized = specialize_ir(spec, shapes, sizes)
        check_lookups(specialized, sizes, values)
        return values, specialized

    def _fresh(self, tensor: ir.Tensor, sizes: dict, device) -> torch.Tensor:
        """The initial value of a learnable tensor nobody passed, the same for every call."""
        cache_key = (tensor_key(tensor), tuple(declared_shape(tensor, sizes)), str(device))
        if cache_key not in self._fresh_learnables:
            self._fresh_learnables[cache_key] = init_learnable(tensor, sizes, device)
        return self._fresh_learnables[cache_key]


def shapes_key(values: dict) -> tuple:
    return tuple(sorted((key, tuple(value.shape)) for key, value in values.items()))


@functools.lru_cache(maxsize=1024)
def unproven_lookups(spec: ir.AttentionIR, sizes: tuple, shapes: tuple) -> tuple:
    """The (tensor, dim, index) lookups that interval analysis cannot keep inside their tensor."""
    sizes, shapes = dict(sizes), dict(shapes)
    unproven = []
    for tensor, dim, index, span in lookup_ranges(spec, sizes):
        size = shapes[tensor_key(tensor)][dim]
        if span is None or span[0] < 0 or span[1] >= size:
            unproven.append((tensor, dim, index))
    return tuple(unproven)


def check_lookups(spec: ir.AttentionIR, sizes: dict, values: dict,
                  unproven: tuple | None = None) -> None:
    """Every index of every lookup must stay inside its tensor, or the kernel reads garbage (an
    inductor error on the CPU).

    Interval analysis proves most lookups safe once per spec and shape; an index it cannot
    bound is evaluated exactly, in chunks, on every point it reads; an index with more points
    than :data:`flexspec.limits.MAX_INDEX_CHECK_POINTS` is refused, with the fix (clamp it).
    """
    if unproven is None:
        unproven = unproven_lookups(spec, tuple(sorted(sizes.items())), shapes_key(values))
    extent = {"b": sizes["B"], "h": sizes["H"], "q": sizes["Q_LEN"], "kv": sizes["KV_LEN"]}
    where = f"for Q_LEN={sizes['Q_LEN']}, KV_LEN={sizes['KV_LEN']}"
    for tensor, dim, index in unproven:
        size = values[tensor_key(tensor)].shape[dim]
        used = ir.free_vars(index)
        dims = [n if name in used else 1 for name, n in extent.items()]
        if not math.prod(dims):
            continue
        limits.check_index_points(math.prod(dims), tensor.name, dim, str(index), size, where,
                                  error=BindingError)
        low, high = _index_range(index, dims, values, values[tensor_key(tensor)].device)
        if low < 0 or high >= size:
            raise BindingError(
                f"'{tensor.name}' is indexed by {index} in dimension {dim}, which reaches "
                f"{low}..{high} {where}, but that dimension has {size} entries")


def _index_range(index: ir.Expr, dims: list, values: dict, device) -> tuple:
    """``(min, max)`` of ``index`` over the grid of ``dims`` (b, h, q, kv), evaluated in slices
    of the longest axis holding at most :data:`flexspec.limits.EXACT_INDEX_CHECK_LIMIT` points
    each, so memory stays bounded at any length."""
    grid = index_grid(*dims, device=device)
    axis = max(range(4), key=lambda i: dims[i])
    name = ("b", "h", "q", "kv")[axis]
    step = max(1, limits.EXACT_INDEX_CHECK_LIMIT // (math.prod(dims) // dims[axis]))
    low, high = math.inf, -math.inf
    for start in range(0, dims[axis], step):
        part = {**grid, name: grid[name].narrow(axis, start, min(step, dims[axis] - start))}
        found = evaluate(index, part, values)
        low, high = min(low, int(found.min())), max(high, int(found.max()))
    return low, high


def contiguous(value: torch.Tensor) -> torch.Tensor:
    """``value`` in contiguous memory: inductor failed to compile a kernel that captures a
    strided view (``doc_ids=ids[::2]``)."""
    return value if value.is_contiguous() else value.contiguous()


def identity(value: torch.Tensor) -> tuple:
    """What identifies a tensor's contents: its memory, layout and version counter. Not
    ``id()``: bindings arrive as fresh views (leading dimensions added), so their ids never
    repeat. Whoever keys a cache by it keeps the tensor alive, so no other tensor can reuse its
    memory while the entry exists; an in-place change bumps the version shared by all views."""
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            tuple(value.stride()), value._version)


def capturing(device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now (a captured call may
    not read the device from the host, and its results are replayed with new inputs)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def meta(value) -> tuple:
    """What dynamo's guards and flexspec's checks see of an argument (not its values)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.stride(), value.requires_grad)
    return (type(value),)
