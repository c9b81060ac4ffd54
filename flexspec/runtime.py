"""The runtime: ``flexspec.compile`` and the :class:`Attention` it returns.

An :class:`Attention` turns a checked spec into attention on real tensors. Per call it checks the
inputs and bindings (clear errors naming the binding and its expected shape), specializes the IR
to the bindings' shapes (a ``doc_ids`` of shape ``[KV_LEN]`` gives a mask without ``b``), takes the
lowered FlexAttention functions (interned by IR, so equal specs share function objects and a
compiled kernel), fetches or builds the block mask (a bounded LRU cache keyed by shapes, device and
binding identity and version) and runs the backend:

* ``flex``: ``torch.compile(flex_attention)``; on the GPU the Triton template (forward and
  backward), on the CPU the C++ template (inference). Each lowered spec gets its own compiled entry
  point, so many specs never share one recompile budget; if torch's limit is still hit, the call
  raises :class:`CompileLimitError` instead of silently falling back to an unfused kernel;
* ``reference``: the dense float64 semantics of :mod:`flexspec.reference`.

FlexAttention has no backward on the CPU (or MPS): a call there with inputs that require gradients
takes the reference path, with a one-time warning. Very short sequences on the CPU take it too,
because torch 2.13's compiled CPU kernel gave wrong results for them.
"""

from __future__ import annotations

import collections
import functools
import itertools
import linecache
import math
import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import (BlockMask, create_block_mask, flex_attention,
                                               noop_mask)

from . import ir
from .errors import BindingError, SpecError, did_you_mean
from .blocks import build_block_mask
from .intervals import lookup_ranges
from .lower import Lowered, lower
from .reference import MAX_BYTES, dense_mask, evaluate, index_grid, reference_attention
from .spec import Spec
from .tensors import (add_leading_dims, builtin_tensor, declared_shape, init_learnable,
                      specialize_ir, tensor_key)

BACKENDS = ("auto", "flex", "reference")
# How block masks are built: interval analysis refined inside partial tiles (equal to
# create_block_mask), interval analysis alone, or torch's create_block_mask (S^2 evaluations).
BLOCK_MASK_MODES = ("exact", "intervals", "dense")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_MASK_CACHE_SIZE = 32
# On the CPU, sequences this short run on the dense reference (see Attention._choose_backend).
SHORT_CPU_LENGTH = 64


class CompileLimitError(SpecError):
    """torch.compile reached its recompile limit for one spec (too many distinct shapes)."""


_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Compiled entry points, one per lowered spec


_entry_counter = itertools.count(1)


@functools.lru_cache(maxsize=256)
def _compiled_entry(lowered: Lowered):
    """A compiled ``flex_attention`` call whose code object belongs to this spec alone, so each
    spec has its own dynamo cache and recompile budget."""
    text = ("def run(q, k, v, score_mod, block_mask, scale, enable_gqa):\n"
            "    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,\n"
            "                          scale=scale, enable_gqa=enable_gqa)\n")
    filename = f"<flexspec-entry-{next(_entry_counter)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"flex_attention": flex_attention}
    exec(compile(text, filename, "exec"), namespace)
    return torch.compile(namespace["run"], fullgraph=True, dynamic=False)


def _run_compiled(lowered: Lowered, *args):
    entry = _compiled_entry(lowered)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return entry(*args)
    except Exception as err:  # dynamo's own exception type moves between torch versions
        if "recompile" in type(err).__name__.lower() or "RecompileLimit" in str(err):
            raise CompileLimitError(
                f"torch.compile reached its recompile limit "
                f"({torch._dynamo.config.recompile_limit}) for this spec, because it ran with "
                "too many distinct shapes, dtypes or devices. Pad inputs to a few fixed lengths, "
                "or raise torch._dynamo.config.recompile_limit") from err
        raise


# ---------------------------------------------------------------------------------------------
# Input checks


def _check_qkv(q, k, v, *, allow_float64: bool = False) -> dict:
    dtypes = FLOAT_DTYPES + ((torch.float64,) if allow_float64 else ())
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise BindingError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise BindingError(f"{name} must have 4 dimensions (B, H, S, D), got shape "
                               f"{list(t.shape)}")
        if t.dtype not in dtypes:
            extra = ", float64 (reference backend only)" if not allow_float64 else ", float64"
            raise BindingError(f"{name} has dtype {t.dtype}; use float32, float16, bfloat16"
                               f"{extra}")
    if not (q.dtype == k.dtype == v.dtype):
        raise BindingError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise BindingError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
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
    return {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": k.shape[2]}


def _shape_text(tensor: ir.Tensor, sizes: dict) -> str:
    dims = ", ".join(str(d) for d in tensor.shape)
    values = ", ".join(str(n) for n in declared_shape(tensor, sizes))
    return f"{tensor.dtype}[{dims}] = [{values}]"


_DTYPE_OK = {
    "int": lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool,
    "bool": lambda d: d == torch.bool,
    "float": lambda d: d.is_floating_point,
}


def _check_binding(tensor: ir.Tensor, value, sizes: dict, device) -> torch.Tensor:
    name = tensor.name
    expected = _shape_text(tensor, sizes)
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
    value = add_leading_dims(value, len(shape))
    for dim, (got, want, expr) in enumerate(zip(value.shape, shape, tensor.shape)):
        broadcast = got == 1 and isinstance(expr, ir.Var) and expr.name in ("B", "H")
        if got != want and not broadcast:
            raise BindingError(f"binding '{name}' has shape {list(value.shape)}, expected "
                               f"{expected} (dimension {dim} should be {want})")
    return value


@functools.lru_cache(maxsize=1024)
def _unproven_lookups(spec: ir.AttentionIR, sizes: tuple, shapes: tuple) -> tuple:
    """The (tensor, dim, index) lookups that interval analysis cannot keep inside their tensor."""
    sizes, shapes = dict(sizes), dict(shapes)
    unproven = []
    for tensor, dim, index, span in lookup_ranges(spec, sizes):
        size = shapes[tensor_key(tensor)][dim]
        if span is None or span[0] < 0 or span[1] >= size:
            unproven.append((tensor, dim, index))
    return tuple(unproven)


# Index expressions that intervals cannot bound are evaluated exactly up to this many points.
EXACT_INDEX_CHECK_LIMIT = 1 << 24


def _check_lookups(spec: ir.AttentionIR, sizes: dict, values: dict) -> None:
    """Every index of every lookup must stay inside its tensor, or the kernel reads garbage.

    Interval analysis proves most lookups safe once per spec and shape; an index it cannot
    bound is evaluated exactly where that is cheap, else a one-time warning says it is unchecked.
    """
    shapes = tuple(sorted((key, tuple(value.shape)) for key, value in values.items()))
    for tensor, dim, index in _unproven_lookups(spec, tuple(sorted(sizes.items())), shapes):
        size = values[tensor_key(tensor)].shape[dim]
        extent = {"b": sizes["B"], "h": sizes["H"], "q": sizes["Q_LEN"], "kv": sizes["KV_LEN"]}
        used = ir.free_vars(index)
        points = math.prod(n for name, n in extent.items() if name in used)
        if points > EXACT_INDEX_CHECK_LIMIT:
            _warn_once(f"unchecked-{tensor.name}-{dim}",
                       f"flexspec: cannot prove that '{tensor.name}' stays in range in dimension "
                       f"{dim} (index {index}); an out-of-range read gives undefined results")
            continue
        grid = index_grid(*(extent[n] if n in used else 1 for n in ("b", "h", "q", "kv")),
                          device=values[tensor_key(tensor)].device)
        found = evaluate(index, grid, values)
        low, high = int(found.min()), int(found.max())
        if low < 0 or high >= size:
            raise BindingError(
                f"'{tensor.name}' is indexed by {index} in dimension {dim}, which reaches "
                f"{low}..{high} for Q_LEN={sizes['Q_LEN']}, KV_LEN={sizes['KV_LEN']}, but that "
                f"dimension has {size} entries")


# ---------------------------------------------------------------------------------------------
# The public object


class Attention:
    """A compiled spec. Call it like ``attn(q, k, v, doc_ids=ids)``; see the module docstring."""

    def __init__(self, spec: Spec, *, backend: str = "auto", block_size=128,
                 block_masks: str = "exact"):
        if backend not in BACKENDS:
            raise SpecError(f"unknown backend '{backend}'.{did_you_mean(backend, BACKENDS)} "
                            f"Backends: {', '.join(BACKENDS)}")
        if block_masks not in BLOCK_MASK_MODES:
            raise SpecError(f"unknown block_masks mode '{block_masks}'."
                            f"{did_you_mean(block_masks, BLOCK_MASK_MODES)} Modes: "
                            f"{', '.join(BLOCK_MASK_MODES)}")
        sizes = block_size if isinstance(block_size, tuple) else (block_size, block_size)
        if len(sizes) != 2 or not all(isinstance(s, int) and s > 0 and s % 16 == 0 for s in sizes):
            raise SpecError(f"block_size must be a positive multiple of 16 or a pair of them, got "
                            f"{block_size!r}")
        self.spec = spec
        self.ir = spec.ir
        self.backend = backend
        self.block_size = sizes
        self.block_masks = block_masks
        self._block_masks: collections.OrderedDict = collections.OrderedDict()
        self._learnables: dict = {}

    # ---- descriptions
    def __repr__(self) -> str:
        return f"Attention({str(self.spec)!r}, backend={self.backend!r})"

    @property
    def bindings(self) -> list[str]:
        return self.spec.bindings

    def source(self) -> str:
        """Readable Python source of the generated ``mask_mod`` and ``score_mod``."""
        return lower(self.ir).source()

    # ---- tensors
    def _tensors(self, sizes: dict, bindings: dict, device, learnables=None,
                 mask_only: bool = False) -> tuple:
        """Checked tensor values (keyed by tensor_key) and the IR specialized to their shapes.
        With ``mask_only``, only the tensors the mask reads are required."""
        spec = ir.AttentionIR(mask=self.ir.mask) if mask_only else self.ir
        expected = {t.name: t for t in spec.bindings()}
        learnable = {t.name: t for t in spec.tensors() if t.origin == "learnable"}
        if mask_only:  # a binding of the score is not needed here, but is not unexpected either
            bindings = {k: v for k, v in bindings.items()
                        if k in expected or k in learnable or k not in self._tensor_names()}
        for name in bindings:
            if name not in expected and name not in learnable:
                known = sorted(expected) + sorted(learnable)
                hint = did_you_mean(name, known)
                takes = ", ".join(known) if known else "no tensors"
                raise BindingError(f"unexpected binding '{name}'.{hint} This spec takes {takes}")
        values = {}
        for tensor in spec.tensors():
            key = tensor_key(tensor)
            if tensor.origin == "binding":
                if tensor.name not in bindings:
                    raise BindingError(f"missing binding '{tensor.name}': {_shape_text(tensor, sizes)}"
                                       f"; pass {tensor.name}=... to the call")
                values[key] = _check_binding(tensor, bindings[tensor.name], sizes, device)
            elif tensor.origin == "builtin":
                values[key] = builtin_tensor(tensor, sizes, device)
            elif tensor.name in bindings:
                values[key] = _check_binding(tensor, bindings[tensor.name], sizes, device)
            elif learnables is not None and key in learnables:
                values[key] = learnables[key]
            else:
                cache_key = (key, tuple(declared_shape(tensor, sizes)), str(device))
                if cache_key not in self._learnables:
                    self._learnables[cache_key] = init_learnable(tensor, sizes, device)
                values[key] = self._learnables[cache_key]
        shapes = {key: tuple(value.shape) for key, value in values.items()}
        specialized = specialize_ir(spec, shapes)
        _check_lookups(specialized, sizes, values)
        return values, specialized

    def _tensor_names(self) -> set:
        return {t.name for t in self.ir.tensors() if t.origin != "builtin"}

    # ---- masks
    def _block_mask(self, spec: ir.AttentionIR, sizes: dict, values: dict, device) -> BlockMask:
        batch, heads, reads = _mask_extent(spec.mask, sizes)
        identity = tuple((key, _identity(v)) for key, v in sorted(values.items()) if key in reads)
        key = (spec, batch, heads, sizes["Q_LEN"], sizes["KV_LEN"], str(device), identity)
        cached = self._block_masks.get(key)
        if cached is not None:
            self._block_masks.move_to_end(key)
            return cached[0]
        mask_mod, _ = lower(spec).make_mods(sizes, values)
        if self.block_masks == "dense":
            block_mask = create_block_mask(mask_mod or noop_mask, batch, heads, sizes["Q_LEN"],
                                           sizes["KV_LEN"], device=device,
                                           BLOCK_SIZE=self.block_size)
        else:
            block_mask = build_block_mask(spec.mask, sizes, self.block_size, values, device,
                                          batch=batch, heads=heads, mask_mod=mask_mod,
                                          exact=self.block_masks == "exact")
        # the values stay alive with the mask, so their memory cannot be reused while cached
        self._block_masks[key] = (block_mask, values)
        if len(self._block_masks) > BLOCK_MASK_CACHE_SIZE:
            self._block_masks.popitem(last=False)
        return block_mask

    def block_mask(self, q_len: int, kv_len: int, *, batch: int | None = None,
                   heads: int | None = None, device="cpu", **bindings) -> BlockMask:
        """The BlockMask for these sizes. Batch and head dimensions are 1 unless the mask depends
        on ``b`` or ``h``. A spec without a mask gets an all-full block mask: torch 2.13's
        compiled CPU kernel gave wrong results (NaN, or differing run to run) with
        ``block_mask=None`` and a score_mod, so flexspec always passes one."""
        sizes = _sizes(q_len, kv_len, batch, heads)
        device = _device(device)
        values, spec = self._tensors(sizes, bindings, device, mask_only=True)
        return self._block_mask(spec, sizes, values, device)

    def dense_mask(self, q_len: int, kv_len: int, *, batch: int | None = None,
                   heads: int | None = None, device="cpu", **bindings) -> torch.Tensor:
        """The mask from the reference semantics: bool ``[B or 1, H or 1, Q_LEN, KV_LEN]``."""
        sizes = _sizes(q_len, kv_len, batch, heads)
        device = _device(device)
        values, spec = self._tensors(sizes, bindings, device, mask_only=True)
        batch, heads, _ = _mask_extent(spec.mask, sizes)
        return dense_mask(spec, batch, heads, q_len, kv_len, values, device)

    def mods(self, *, q_len: int | None = None, kv_len: int | None = None,
             batch: int | None = None, heads: int | None = None, device=None,
             **bindings) -> tuple:
        """``(mask_mod, score_mod)`` for raw ``flex_attention`` (``None`` for a missing half).

        Sizes the generated code or the bindings' shapes need must be known: pass them, or let
        them be read off the bindings (``doc_ids`` of shape ``[2, 4096]`` gives B=2,
        KV_LEN=4096). ``device`` defaults to the bindings' device.
        """
        given = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
        for tensor in self.ir.tensors():
            value = bindings.get(tensor.name)
            if not isinstance(value, torch.Tensor):
                continue
            dims = tuple(tensor.shape)[len(tensor.shape) - value.dim():] if value.dim() else ()
            for expr, size in zip(dims, value.shape):
                if isinstance(expr, ir.Var) and given.get(expr.name) is None and size > 1:
                    given[expr.name] = size
            if device is None:
                device = value.device
        needed = set(lower(self.ir).size_names)
        for tensor in self.ir.tensors():
            sizes_used = ir.free_vars(tensor) & set(ir.SIZE_VARS)
            # a binding broadcasts over B and H; computed and learnable tensors need their sizes
            needed |= sizes_used - {"B", "H"} if tensor.origin == "binding" else sizes_used
        missing = sorted(n for n in needed if given[n] is None)
        if missing:
            names = {"B": "batch", "H": "heads", "Q_LEN": "q_len", "KV_LEN": "kv_len"}
            raise BindingError("this spec needs " + ", ".join(missing) + "; pass "
                               + ", ".join(f"{names[n]}=..." for n in missing))
        sizes = _sizes(*(given[n] or 1 for n in ("Q_LEN", "KV_LEN", "B", "H")))
        device = _device(device or "cpu")
        values, spec = self._tensors(sizes, bindings, device)
        return lower(spec).make_mods(sizes, values)

    # ---- attention
    def reference(self, q, k, v, *, scale=None, **bindings) -> torch.Tensor:
        """The dense float64 reference result (in q's dtype)."""
        sizes = _check_qkv(q, k, v, allow_float64=True)
        values, spec = self._tensors(sizes, bindings, q.device)
        return reference_attention(spec, q, k, v, scale=scale, tensors=values)

    def __call__(self, q, k, v, *, scale=None, **bindings) -> torch.Tensor:
        return self._call(q, k, v, scale, bindings, None)

    def _call(self, q, k, v, scale, bindings, learnables):
        sizes = _check_qkv(q, k, v, allow_float64=self.backend == "reference")
        values, spec = self._tensors(sizes, bindings, q.device, learnables)
        backend = self._choose_backend(q, k, v, values)
        if backend == "reference":
            return reference_attention(spec, q, k, v, scale=scale, tensors=values)
        lowered = lower(spec)
        block_mask = self._block_mask(spec, sizes, values, q.device)
        # the kernel computes scores in float32: a float64 table would turn them into float64
        kernel_values = {key: value.float() if value.dtype == torch.float64 else value
                         for key, value in values.items()}
        _, score_mod = lowered.make_mods(sizes, kernel_values)
        enable_gqa = k.shape[1] != q.shape[1]
        return _run_compiled(lowered, q, k, v, score_mod, block_mask, scale, enable_gqa)

    def _choose_backend(self, q, k, v, values) -> str:
        if self.backend == "reference":
            return "reference"
        grads = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or any(t.requires_grad for t in values.values()))
        if grads and q.device.type in ("cpu", "mps"):
            _warn_once(f"no-backward-{q.device.type}",
                       f"flexspec: FlexAttention has no backward pass on {q.device.type}; inputs "
                       "that require gradients run on the dense reference path instead (slower, "
                       "memory grows with Q_LEN * KV_LEN)")
            return "reference"
        if q.device.type == "cpu" and min(q.shape[2], k.shape[2]) <= SHORT_CPU_LENGTH and \
                math.prod(q.shape[:3]) * k.shape[2] * 8 <= MAX_BYTES:
            # torch 2.13's compiled CPU kernel returned wrong values (NaN, or differing from run
            # to run) for sequences of 8 to 40 positions; these sizes are cheap to do densely.
            return "reference"
        return "flex"


def _identity(value: torch.Tensor) -> tuple:
    """What identifies a tensor's contents for the block-mask cache: its memory, layout and
    version counter. Not ``id()``: bindings arrive as fresh views (leading dimensions added), so
    their ids never repeat. The cache keeps its values alive, so no other tensor can reuse their
    memory while an entry exists; an in-place change bumps the version shared by all views."""
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            tuple(value.stride()), value._version)


def _mask_extent(mask: ir.Expr, sizes: dict) -> tuple:
    """``(batch, heads, keys)``: the batch and head extents a mask needs (1 unless it reads ``b``
    or ``h``) and the keys of the tensors it reads."""
    reads_b, reads_h, keys = _mask_facts(mask)
    return sizes["B"] if reads_b else 1, sizes["H"] if reads_h else 1, keys


@functools.lru_cache(maxsize=1024)
def _mask_facts(mask: ir.Expr) -> tuple:
    free = ir.free_vars(mask)
    keys = frozenset(tensor_key(n) for n in ir.walk(mask) if isinstance(n, ir.Tensor))
    return "b" in free, "h" in free, keys


def _device(device) -> torch.device:
    """A device as tensors report it ("cuda" becomes "cuda:0"), so comparisons are exact."""
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, TypeError) as err:
        raise BindingError(f"cannot use device {device!r}: {err}") from None


def _sizes(q_len, kv_len, batch, heads) -> dict:
    sizes = {"B": 1 if batch is None else batch, "H": 1 if heads is None else heads,
             "Q_LEN": q_len, "KV_LEN": kv_len}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BindingError(f"{name} must be a positive int, got {value!r}")
    return sizes


# ---------------------------------------------------------------------------------------------
# nn.Module with learnable parameters


class SpecAttention(nn.Module):
    """An ``nn.Module`` that owns a spec's learnable tensors (``rel_bias``, ``t5_bias``...) as
    ``nn.Parameter``s. ``num_heads`` fixes the ``H`` their shapes use."""

    def __init__(self, spec, *, num_heads: int, library=None, backend: str = "auto",
                 block_size=128, block_masks: str = "exact", device=None, dtype=torch.float32):
        super().__init__()
        from . import compile as compile_spec

        self.attention = compile_spec(spec, library=library, backend=backend,
                                      block_size=block_size, block_masks=block_masks)
        self.num_heads = num_heads
        self.tables = nn.ParameterDict()
        self._keys: dict[str, str] = {}
        for tensor in self.attention.ir.tensors():
            if tensor.origin != "learnable":
                continue
            if ir.free_vars(tensor) - {"H"}:
                raise SpecError(f"learnable tensor '{tensor.name}' has a shape that depends on "
                                f"{sorted(ir.free_vars(tensor) - {'H'})}; only H is known when "
                                "the module is built")
            sizes = {"H": num_heads, "B": 1, "Q_LEN": 1, "KV_LEN": 1}
            value = init_learnable(tensor, sizes, device or "cpu").to(dtype)
            self.tables[tensor.name] = nn.Parameter(value)
            self._keys[tensor_key(tensor)] = tensor.name

    def forward(self, q, k, v, *, scale=None, **bindings):
        if q.shape[1] != self.num_heads:
            raise BindingError(f"this module was built for {self.num_heads} heads, but q has "
                               f"{q.shape[1]}")
        learnables = {key: self.tables[name] for key, name in self._keys.items()}
        return self.attention._call(q, k, v, scale, bindings, learnables)

    def extra_repr(self) -> str:
        return f"{str(self.attention.spec)!r}, num_heads={self.num_heads}"
