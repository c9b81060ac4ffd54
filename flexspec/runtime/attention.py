"""The runtime: ``flexspec.compile`` and the :class:`Attention` it returns.

An :class:`Attention` turns a checked spec into attention on real tensors. The first call with a
new input signature (shapes, dtypes, devices, strides, ``requires_grad``, grad mode, scale and
binding names) builds a *plan* (:meth:`Attention._plan`): it checks the inputs and bindings (clear
errors naming the binding and its expected shape), specializes the IR to the bindings' shapes (a
``doc_ids`` of shape ``[KV_LEN]`` gives a mask without ``b``), proves tensor lookups in range,
chooses the backend (:mod:`flexspec.runtime.backends`), and keeps what does not change between calls:
the lowered FlexAttention functions (interned by IR, so equal specs share a compiled kernel), the
compiled entry point, kernel options, and the block mask and ``score_mod`` when they read no
binding. Later calls with that signature only gather their bindings, fetch the block mask (a
bounded LRU cache keyed by binding identity and version) and launch:

* ``flex`` and ``flash``: ``torch.compile(flex_attention)``, the latter with FLASH kernel
  options. Each lowered spec gets its own compiled entry point, so many specs never share one
  recompile budget; if torch's limit is still hit, the call raises :class:`CompileLimitError`
  instead of silently falling back to an unfused kernel. If FLASH fails to compile a spec under
  ``auto``, the plan falls back to the Triton template (one warning) and the failure is
  remembered;
* ``sdpa``: ``scaled_dot_product_attention`` with ``is_causal`` and the scale times the spec's
  constant factor;
* ``reference``: the dense float64 semantics of :mod:`flexspec.kernels.reference`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import linecache
import math
import warnings

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import (BlockMask, create_block_mask, flex_attention,
                                               noop_mask)

from flexspec import ir
from flexspec.runtime.backends import (BackendError, Choice, Explanation, Request, SdpaForm, attention_flops,
                       check_backend_name, choose, flash_installed, not_sdpa, sdpa_form)
from flexspec.errors import BindingError, SpecError, did_you_mean
from flexspec.kernels.blocks import build_block_mask, count_visible
from flexspec.ir.intervals import lookup_ranges
from flexspec.kernels.lower import Lowered, lower
from flexspec.kernels.reference import MAX_BYTES, dense_mask, evaluate, index_grid, reference_attention
from flexspec.lang.spec import Spec
from flexspec.ir import tensor_key
from flexspec.ir.specialize import broadcast_dims, declared_shape, specialize_ir
from flexspec.kernels.tensors import add_leading_dims, builtin_tensor, init_learnable

# How block masks are built: interval analysis refined inside partial tiles (equal to
# create_block_mask), interval analysis alone, or torch's create_block_mask (S^2 evaluations).
BLOCK_MASK_MODES = ("exact", "intervals", "dense")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_MASK_CACHE_SIZE = 32
PLAN_CACHE_SIZE = 64
# The kernel options FLASH is asked for with.
FLASH_OPTIONS = {"BACKEND": "FLASH"}
# Triton's default backward configuration for a score that reads a tensor requiring gradients
# needed 233472 bytes of shared memory at D=128 on the H200 (the limit is 232448); one pipeline
# stage fits. Measured: causal + rel_bias, B4 H16 S8192, bf16, 21 ms forward+backward.
TABLE_GRAD_OPTIONS = {"num_stages": 1}
# Triton's tiles must divide the block mask's blocks, and its default tiles are up to 128 wide
# (H200: 128x64 forward at D=128, 64x128 backward), so smaller blocks get tiles of their own.
LARGEST_SMALL_TILE = 64


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
    text = ("def run(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options):\n"
            "    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,\n"
            "                          scale=scale, enable_gqa=enable_gqa,\n"
            "                          kernel_options=kernel_options)\n")
    filename = f"<flexspec-entry-{next(_entry_counter)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"flex_attention": flex_attention}
    exec(compile(text, filename, "exec"), namespace)
    # Neither dynamic=False nor fullgraph=True: torch.compile then does work around every call
    # (patching dynamo's config: about 25 us on our CPU; fullgraph's bookkeeping: about 9 us).
    # _run_compiled asks for the same (static shapes, an error on a graph break) around the calls
    # that compile instead
    return torch.compile(namespace["run"])


# Dynamo settings for the calls that may compile: static shapes (a kernel per shape, as
# dynamic=False gives), and an error instead of a silent eager fallback at the recompile limit.
_COMPILE_SETTINGS = {"fail_on_recompile_limit_hit": True, "automatic_dynamic_shapes": False,
                     "assume_static_by_default": True}
# torch.compile's graph-break switch as a context manager (torch >= 2.9); fullgraph=True's
# meaning without its per-call cost
_NO_GRAPH_BREAKS = getattr(torch._dynamo, "error_on_graph_break",
                           lambda _: contextlib.nullcontext())


def _run_compiled(entry, *args):
    """Run a compiled entry under :data:`_COMPILE_SETTINGS`, with graph breaks made errors (as
    ``fullgraph=True`` would), turning torch's recompile limit into :class:`CompileLimitError`
    (by default dynamo would silently fall back to an unfused kernel that materialises the
    scores). Calls of a warm plan skip this (see Attention._run)."""
    config = torch._dynamo.config
    before = {name: getattr(config, name) for name in _COMPILE_SETTINGS}
    for name, value in _COMPILE_SETTINGS.items():
        setattr(config, name, value)
    try:
        with _NO_GRAPH_BREAKS(True):
            return entry(*args)
    except Exception as err:  # dynamo's own exception type moves between torch versions
        if "recompile" in type(err).__name__.lower() or "RecompileLimit" in str(err):
            raise CompileLimitError(
                f"torch.compile reached its recompile limit "
                f"({torch._dynamo.config.recompile_limit}) for this spec, because it ran with "
                "too many distinct shapes, dtypes or devices. Pad inputs to a few fixed lengths, "
                "or raise torch._dynamo.config.recompile_limit") from err
        raise
    finally:
        for name, value in before.items():
            setattr(config, name, value)


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
    for dim, (got, want, may_broadcast) in enumerate(zip(value.shape, shape,
                                                         broadcast_dims(tensor))):
        if got != want and not (got == 1 and may_broadcast):
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


def _check_lookups(spec: ir.AttentionIR, sizes: dict, values: dict,
                   unproven: tuple | None = None) -> None:
    """Every index of every lookup must stay inside its tensor, or the kernel reads garbage.

    Interval analysis proves most lookups safe once per spec and shape; an index it cannot
    bound is evaluated exactly where that is cheap, else a one-time warning says it is unchecked.
    """
    if unproven is None:
        unproven = _unproven_lookups(spec, tuple(sorted(sizes.items())), _shapes_key(values))
    for tensor, dim, index in unproven:
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
        check_backend_name(backend)
        if backend == "sdpa" and sdpa_form(spec.ir) is None:
            raise BackendError(f"backend 'sdpa' cannot run '{spec}': {not_sdpa(spec.ir)}. "
                               "backend='auto' chooses one that can")
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
        self._mask_tokens: dict = {}
        self._plans: collections.OrderedDict = collections.OrderedDict()
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
        specialized = specialize_ir(spec, shapes, sizes)
        _check_lookups(specialized, sizes, values)
        return values, specialized

    def _tensor_names(self) -> set:
        return {t.name for t in self.ir.tensors() if t.origin != "builtin"}

    # ---- masks
    def _mask_token(self, spec: ir.AttentionIR, sizes: dict, device) -> tuple:
        """``(token, batch, heads, keys)``: a small int standing for this mask at these sizes
        (so hot paths never hash the IR), its batch and head extents, and the keys of the
        tensors it reads."""
        batch, heads, reads = _mask_extent(spec.mask, sizes)
        key = (spec.mask, batch, heads, sizes["Q_LEN"], sizes["KV_LEN"], str(device))
        token = self._mask_tokens.get(key)
        if token is None:
            token = self._mask_tokens[key] = len(self._mask_tokens)
        return token, batch, heads, tuple(sorted(reads))

    def _block_mask(self, spec: ir.AttentionIR, sizes: dict, values: dict, device,
                    mask: tuple | None = None) -> BlockMask:
        token, batch, heads, reads = mask or self._mask_token(spec, sizes, device)
        key = (token,) + tuple(_identity(values[name]) for name in reads)
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
    def reference(self, q, k, v, *, scale=None, rows=None, **bindings) -> torch.Tensor:
        """The dense float64 reference result (in q's dtype); with ``rows`` (query positions),
        only those rows of it, to check long sequences at a fraction of the memory."""
        sizes = _check_qkv(q, k, v, allow_float64=True)
        values, spec = self._tensors(sizes, bindings, q.device)
        return reference_attention(spec, q, k, v, scale=scale, tensors=values, rows=rows)

    def __call__(self, q, k, v, *, scale=None, **bindings) -> torch.Tensor:
        return self._call(q, k, v, scale, bindings, None)

    def explain(self, q, k, v, *, scale=None, **bindings) -> Explanation:
        """What a call with these inputs would do: the canonical spec, the visible fraction of
        the score matrix, the work in FLOPs, the backend chosen and why (and why not the others).
        Only the shapes, dtypes and devices of ``q``, ``k``, ``v`` matter."""
        plan = self._plan(q, k, v, scale, bindings, None)
        values = self._values(plan, bindings)
        sizes, spec, device = plan.sizes, plan.spec, q.device
        _, batch, heads, _ = plan.mask
        visible = count_visible(spec.mask, sizes, self.block_size, values, device,
                                batch=batch, heads=heads)
        block_mask = self._block_mask(spec, sizes, values, device, plan.mask)
        tiles = int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())
        nq = -(-sizes["Q_LEN"] // self.block_size[0])
        nk = -(-sizes["KV_LEN"] // self.block_size[1])
        pairs = visible * (sizes["B"] // batch) * (sizes["H"] // heads)
        return Explanation(
            spec=str(self.spec), mask=ir.to_text(spec.mask), score=ir.to_text(spec.score),
            sizes={**sizes, "KV_HEADS": k.shape[1]}, head_dim=q.shape[-1], dtype=q.dtype,
            device=str(device),
            density=visible / (batch * heads * sizes["Q_LEN"] * sizes["KV_LEN"]),
            tile_density=tiles / (batch * heads * nq * nk), block_size=self.block_size,
            flops=attention_flops(pairs, q.shape[-1], v.shape[-1], backward=False),
            grads=plan.request.grads, choice=plan.choice)

    # ---- the call path: a plan per input signature, then a few cheap steps per call
    def _call(self, q, k, v, scale, bindings, learnables):
        try:
            key = (_meta(q), _meta(k), _meta(v), scale, torch.is_grad_enabled(),
                   tuple((name, _meta(value)) for name, value in bindings.items()),
                   None if learnables is None else
                   tuple((name, id(value), _meta(value)) for name, value in learnables.items()))
            plan = self._plans.get(key)
        except TypeError:  # an unhashable argument: the checks of _plan say what is wrong
            key, plan = None, None
        if plan is None:
            plan = self._plan(q, k, v, scale, bindings, learnables)
            if plan.choice.backend == "reference" and plan.request.grads \
                    and self.backend == "auto":
                device = q.device.type
                _warn_once(f"no-backward-{device}",
                           f"flexspec: FlexAttention has no backward pass on {device}; inputs "
                           "that require gradients run on the dense reference path instead "
                           "(slower, memory grows with Q_LEN * KV_LEN)")
            if key is not None:
                self._plans[key] = plan
                if len(self._plans) > PLAN_CACHE_SIZE:
                    self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return self._run(plan, q, k, v, scale, bindings)

    def _plan(self, q, k, v, scale, bindings, learnables) -> "_Plan":
        """Check a call's inputs and decide everything that depends only on their shapes,
        dtypes, devices and binding names: sizes, the specialized IR, the backend, the kernel
        options, and the tensors that do not change between calls."""
        sizes = _check_qkv(q, k, v, allow_float64=self.backend == "reference")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale)):
            raise BindingError(f"scale must be a finite number or None, got {scale!r}")
        values, spec = self._tensors(sizes, bindings, q.device, learnables)
        device = q.device
        slots = []
        for tensor in spec.bindings():
            key = tensor_key(tensor)
            if tensor.name in bindings:
                slots.append((tensor.name, key, len(declared_shape(tensor, sizes))))
        for tensor in spec.tensors():  # a learnable may also be given as a binding
            if tensor.origin == "learnable" and tensor.name in bindings:
                slots.append((tensor.name, tensor_key(tensor), len(declared_shape(tensor, sizes))))
        slot_keys = {key for _, key, _ in slots}
        grad_on = torch.is_grad_enabled()
        if not grad_on:  # see _Plan.detach
            values = {key: value.detach() for key, value in values.items()}
        fixed = {key: value for key, value in values.items() if key not in slot_keys}
        score_keys = {tensor_key(t) for t in ir.walk(spec.score) if isinstance(t, ir.Tensor)}
        table_grads = grad_on and any(values[key].requires_grad for key in score_keys)
        grads = table_grads or (grad_on and (q.requires_grad or k.requires_grad
                                             or v.requires_grad))
        request = Request(
            device_type=device.type,
            capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            dtype=q.dtype, batch=sizes["B"], heads=sizes["H"], kv_heads=k.shape[1],
            q_len=sizes["Q_LEN"], kv_len=sizes["KV_LEN"], head_dim=q.shape[-1],
            v_head_dim=v.shape[-1], grads=grads, table_grads=table_grads,
            score_tensors=bool(score_keys),
            block_size=self.block_size,
            reference_fits=math.prod(q.shape[:3]) * k.shape[2] * 8 <= MAX_BYTES,
            flash_installed=device.type == "cuda" and flash_installed())
        lowered = lower(spec)
        failed = _FLASH_FAILED.get(lowered)
        if failed is not None:
            request = dataclasses.replace(request, flash_failed=failed)
        if q.dtype == torch.float64 and self.backend == "reference":
            choice = Choice("reference", "backend='reference' was asked for")
        else:
            choice = choose(self.backend, request, spec)
        plan = _Plan(sizes=sizes, spec=spec, request=request, choice=choice, fixed=fixed,
                     slots=tuple(slots), mask=self._mask_token(spec, sizes, device),
                     unproven=_unproven_lookups(spec, tuple(sorted(sizes.items())),
                                                _shapes_key(values)),
                     gqa=k.shape[1] != q.shape[1],
                     detach=not grad_on)
        plan.checked = _lookup_identity(plan, values)
        if choice.backend == "sdpa":
            plan.sdpa = sdpa_form(spec)
        if choice.backend in ("flex", "flash"):
            plan.lowered = lowered
            plan.entry = _compiled_entry(lowered)
            plan.kernel_options = _kernel_options(choice.backend, request)
            plan.mask_bindings = tuple(name for name, key, _ in slots if key in plan.mask[3])
            if not plan.mask_bindings:
                # a mask-free spec needs no block mask on a GPU (faster: 4.35 vs 5.14 ms for
                # full attention with Triton on the H200); the CPU kernel needs one (see
                # Attention.block_mask)
                if spec.mask != ir.Const(True) or device.type != "cuda":
                    plan.block_mask = self._block_mask(spec, sizes, values, device, plan.mask)
            float64 = any(values[key].dtype == torch.float64 for key in score_keys)
            if not (score_keys & slot_keys) and not float64:
                plan.score_mod = plan.lowered.make_mods(sizes, values)[1]
                plan.score_varies = False
        return plan

    def _values(self, plan: "_Plan", bindings: dict) -> dict:
        """The tensor values of one call: the plan's fixed ones and this call's bindings."""
        if not plan.slots:
            return plan.fixed
        values = dict(plan.fixed)
        for name, key, ndim in plan.slots:
            value = bindings[name]
            value = value if value.dim() == ndim else add_leading_dims(value, ndim)
            values[key] = value.detach() if plan.detach else value
        return values

    def _run(self, plan: "_Plan", q, k, v, scale, bindings):
        backend = plan.choice.backend
        # gathering the values costs a dict and a view per binding: only where they are read
        needs_values = plan.unproven or plan.score_varies or backend == "reference"
        values = self._values(plan, bindings) if needs_values else None
        if plan.unproven:
            identity = _lookup_identity(plan, values)
            if identity != plan.checked:
                _check_lookups(plan.spec, plan.sizes, values, plan.unproven)
                plan.checked = identity
        if backend == "reference":
            return reference_attention(plan.spec, q, k, v, scale=scale, tensors=values)
        if backend == "sdpa":
            base = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=plan.sdpa.causal,
                                                  scale=base * plan.sdpa.factor,
                                                  enable_gqa=plan.gqa)
        if not plan.mask_bindings:
            block_mask = plan.block_mask
        elif self._same_mask_bindings(plan, bindings):
            block_mask = plan.last_block_mask
        else:
            block_mask = self._block_mask(plan.spec, plan.sizes,
                                          values or self._values(plan, bindings), q.device,
                                          plan.mask)
            plan.last_block_mask = block_mask
            plan.last_bindings = tuple((bindings[name], bindings[name]._version)
                                       for name in plan.mask_bindings)
        if plan.score_varies:
            # the kernel computes scores in float32: a float64 table would turn them into float64
            kernel_values = {key: value.float() if value.dtype == torch.float64 else value
                             for key, value in values.items()}
            score_mod = plan.lowered.make_mods(plan.sizes, kernel_values)[1]
        else:
            score_mod = plan.score_mod
        if plan.detach:
            q, k, v = q.detach(), k.detach(), v.detach()
        args = (q, k, v, score_mod, block_mask, scale, plan.gqa, plan.kernel_options)
        if plan.warm:
            # dynamo guards depend only on what the plan's key holds, so a warm plan does not
            # recompile and needs no recompile-limit watch (which costs microseconds per call)
            return plan.entry(*args)
        try:
            out = _run_compiled(plan.entry, *args)
        except CompileLimitError:
            raise
        except Exception as err:  # noqa: BLE001 - inductor's errors have no stable type
            if plan.choice.backend != "flash":
                raise
            return self._flash_failed(plan, err, q, k, v, scale, bindings)
        plan.warm = True
        return out

    @staticmethod
    def _same_mask_bindings(plan: "_Plan", bindings: dict) -> bool:
        """Whether the mask's bindings are the very tensors of the previous call, unchanged in
        place since (same object, same version counter): then so is its block mask, and the
        cache lookup (storage identity, hashing) is skipped."""
        if plan.last_block_mask is None:
            return False
        for name, (value, version) in zip(plan.mask_bindings, plan.last_bindings):
            given = bindings[name]
            if given is not value or given._version != version:
                return False
        return True

    def _flash_failed(self, plan: "_Plan", err: Exception, q, k, v, scale, bindings):
        """FLASH could not compile this spec (CuTeDSL supports fewer score functions than
        Triton; a clamped table lookup failed on the H200). Asked for explicitly, that is an
        error; under ``auto`` the plan switches to the Triton kernel, and later plans of this
        spec skip FLASH (``explain`` says why)."""
        summary = _first_line(err)
        _FLASH_FAILED[plan.lowered] = summary
        if self.backend == "flash":
            raise BackendError(f"backend 'flash' could not compile this spec: {summary}. "
                               "backend='auto' falls back to the Triton kernel") from err
        _warn_once(f"flash-failed-{id(plan.lowered)}",
                   f"flexspec: FLASH could not compile '{self.spec}' ({summary}); running it "
                   "with FlexAttention's Triton kernel instead")
        rejected = tuple((name, reason) for name, reason in plan.choice.rejected
                         if name != "flex") + (("flash", f"failed to compile: {summary}"),)
        plan.choice = Choice("flex", "FlexAttention runs every spec (FLASH could not compile "
                                     "this one)", rejected)
        plan.kernel_options = _kernel_options("flex", plan.request)
        return self._run(plan, q, k, v, scale, bindings)


@dataclass(eq=False)
class _Plan:
    """Everything about a call that depends only on its shapes, dtypes, devices and the names
    of its bindings (see :meth:`Attention._plan`)."""

    sizes: dict
    spec: ir.AttentionIR            # specialized to the bindings' shapes
    request: Request
    choice: Choice
    fixed: dict                     # tensor values that do not change between calls
    slots: tuple                    # (binding name, tensor key, declared dims) per binding
    mask: tuple                     # Attention._mask_token(...)
    unproven: tuple                 # lookups whose indices are checked by value
    gqa: bool
    # Under no_grad, run on detached tensors: FlexAttention refuses inputs that require
    # gradients where it has no backward, and FLASH captured tables that do, even though
    # nothing is recorded under no_grad
    detach: bool
    checked: tuple = ()             # identity of the values whose lookups were last checked
    sdpa: SdpaForm | None = None
    lowered: Lowered | None = None
    entry: object = None
    kernel_options: dict | None = None
    mask_bindings: tuple = ()       # names of the bindings the mask reads (flex and flash)
    block_mask: BlockMask | None = None  # the block mask when the mask reads no binding
    last_bindings: tuple = ()       # (tensor, version) of those in the last call
    last_block_mask: BlockMask | None = None
    score_varies: bool = True       # the score_mod captures this call's bindings
    score_mod: object = None
    warm: bool = False              # the compiled entry has run once for this plan


def _kernel_options(backend: str, request: Request) -> dict | None:
    """The kernel options a compiled FlexAttention call of ``backend`` takes."""
    if backend == "flash":
        return FLASH_OPTIONS
    options = {}
    if request.device_type in ("cuda", "xpu") and not request.blocks_of_128:
        options.update(_small_block_tiles(*request.block_size))
    if request.table_grads and request.device_type == "cuda" and request.head_dim > 64:
        options.update(TABLE_GRAD_OPTIONS)
    return options or None


def _small_block_tiles(q_block: int, kv_block: int) -> dict:
    """Triton tiles that divide blocks of ``q_block`` x ``kv_block`` positions (multiples of
    16): the largest power of two that divides each, at most LARGEST_SMALL_TILE; the backward
    kernels take the smaller of the two on both sides."""
    def tile(size: int) -> int:
        return min(size & -size, LARGEST_SMALL_TILE)

    m, n = tile(q_block), tile(kv_block)
    both = min(m, n)
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "bwd_BLOCK_M1": both, "bwd_BLOCK_N1": both,
            "bwd_BLOCK_M2": both, "bwd_BLOCK_N2": both}


# Lowered specs FLASH failed to compile, with the first line of the error.
_FLASH_FAILED: dict = {}


def _first_line(err: Exception) -> str:
    """The gist of a compile error: its first lines that say something (inductor's start with
    "backend='inductor' raised:" and a banner)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip().strip("=")]
    lines = [line for line in lines if not line.endswith("raised:")]
    text = " ".join(lines[:2]) if lines else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _meta(value) -> tuple:
    """What dynamo's guards and flexspec's checks see of an argument (not its values)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.stride(), value.requires_grad)
    return (type(value),)


def _shapes_key(values: dict) -> tuple:
    return tuple(sorted((key, tuple(value.shape)) for key, value in values.items()))


def _lookup_identity(plan: _Plan, values: dict) -> tuple:
    if not plan.unproven:
        return ()
    return tuple(_identity(values[tensor_key(t)]) for t, _, _ in plan.unproven)


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
    except Exception as err:  # RuntimeError, TypeError, or AssertionError from a torch built
        # without that device
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
        from flexspec import compile as compile_spec

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
