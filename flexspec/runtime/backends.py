"""Backends and the rules that choose one per call.

A backend is a way to run a spec's attention:

* ``flex``: FlexAttention through ``torch.compile`` with its default kernel (the Triton template
  on a GPU, the C++ template on the CPU);
* ``flash``: FlexAttention with ``kernel_options={"BACKEND": "FLASH"}``, i.e. FlashAttention-4
  generated through CuTeDSL (needs the ``flash_attn.cute`` package and a Hopper or Blackwell GPU);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (cuDNN first on a GPU), only
  for specs whose IR is exactly full attention or top-left causal attention with
  Q_LEN == KV_LEN, times an optional positive constant;
* ``reference``: the dense float64 semantics of :mod:`flexspec.kernels.reference`.

:func:`choose` takes the facts of one call (:class:`Request`) and the backend asked for, and
returns a :class:`Choice`: the backend, the reason, and why each other backend was not taken.
``"auto"`` ranks the eligible backends by rules measured on an H200 (torch 2.11, FA4
4.0.0b36, bf16; docs/performance.md) and on the 2-core CPU of CI (torch 2.13):

* FLASH beat the Triton template for every spec measured at B4 H16 S8192 D128, forward (causal
  1.65 vs 2.68 ms, softcap 3.25 vs 5.64 ms, sliding window 0.52 vs 0.81 ms) and forward+backward
  (causal 6.7 vs 10.0 ms), and beat cuDNN SDPA for causal (1.65 vs 1.79 ms; 6.7 vs 7.05 ms
  forward+backward). But each FLASH call costs about 0.22 ms however small the problem
  (1000 x 1500: 0.23 ms against Triton's 0.09 ms), so below :data:`FLASH_MIN_FLOPS` of dense
  work Triton (or SDPA) is taken instead.
* cuDNN SDPA beat Triton for plain causal (1.79 vs 2.68 ms) and full attention.
* On the CPU, SDPA's flash kernel beat compiled FlexAttention for plain causal (146 vs 317 ms at
  B1 H8 S4096 D64), and it has a backward, which FlexAttention lacks there (and on MPS).
* FLASH's backward gave NaN gradients for a score that reads a tensor (sliding window + ALiBi,
  ragged lengths, GQA), and CuTeDSL cannot compile some scores (``rel_bias``'s clamp): such
  backward passes run elsewhere, and a failed FLASH compile falls back to Triton (runtime).
* torch 2.13's compiled CPU kernel gave wrong results for sequences shorter than one 128 block:
  those run on SDPA or the dense reference.
* Triton's backward on the H200 (torch 2.11) found no kernel for blocks smaller than 128: torch
  drops its tile configurations that do not divide the blocks before it reads kernel options.
  The forward runs them with tiles flexspec picks (runtime); training needs 128 blocks.

This module decides; :mod:`flexspec.runtime.attention` runs. It does not import the runtime.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass, field

import torch

from flexspec import ir
from flexspec.errors import SpecError, did_you_mean

BACKENDS = ("auto", "flash", "sdpa", "flex", "reference")
# FLASH pays a fixed cost per call (about 0.22 ms on the H200); below this much dense forward
# work (B * H * Q_LEN * KV_LEN * 2 * (D + Dv) FLOPs) Triton or SDPA is faster. At causal
# B4 H16 2048^2 D128 (1.4e11) the two tied (0.23 vs 0.25 ms).
FLASH_MIN_FLOPS = 2e11
# Head dimensions FLASH ran correctly with the block sizes flexspec uses (H200, FA4 4.0.0b36);
# 256 failed there ("sparse_block_size[1] must be a multiple of tile_n=80").
FLASH_HEAD_DIMS = (64, 128)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Compute capabilities (major) of the GPUs FA4 supports: Hopper (9) and Blackwell (10).
FLASH_CAPABILITIES = (9, 10)
# On the CPU, sequences shorter than this run on the dense reference (or SDPA): torch 2.13's
# compiled CPU kernel gave wrong results (NaN, or differing run to run) for sequences of 8 to 120
# positions, i.e. shorter than one 128-position block (plain torch reproduces it; 127, 129 and
# longer sequences were right in every run).
SHORT_CPU_LENGTH = 128
# Forward+backward work in forwards: the backward does 2.5 forwards' matrix products (five
# against two), as FlashAttention counts it.
FORWARD_AND_BACKWARD = 3.5


class BackendError(SpecError):
    """The backend asked for cannot run this spec on these inputs."""


@dataclass(frozen=True)
class Request:
    """The facts of one call that the choice of backend depends on."""

    device_type: str                 # "cuda", "cpu", "mps", "xpu"
    capability: tuple | None         # CUDA compute capability, e.g. (9, 0); None elsewhere
    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    grads: bool                      # q, k, v or a captured tensor require gradients
    table_grads: bool                # a tensor the score reads requires gradients
    score_tensors: bool = False      # the score reads a tensor (alibi slopes, a bias table)
    block_size: tuple = (128, 128)
    reference_fits: bool = True      # the dense reference fits its memory budget
    flash_installed: bool = False
    flash_failed: str | None = None  # FLASH failed to compile this spec before (the error)

    @property
    def blocks_of_128(self) -> bool:
        """Both block sizes are multiples of 128: what FLASH needs, and what Triton's default
        tiles (up to 128 wide) divide."""
        return not any(size % 128 for size in self.block_size)

    @property
    def dense_flops(self) -> float:
        """Forward FLOPs of the two matrix products if nothing were masked."""
        return 2.0 * self.batch * self.heads * self.q_len * self.kv_len * (
            self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class SdpaForm:
    """A spec SDPA can run: ``causal`` or full attention, logits times ``factor``."""

    causal: bool
    factor: float


@dataclass(frozen=True)
class Choice:
    """The backend a call runs on, why, and why each other backend was not taken."""

    backend: str
    reason: str
    rejected: tuple = field(default=())   # (backend, reason) pairs


# ---------------------------------------------------------------------------------------------
# What each backend can run


def sdpa_form(spec: ir.AttentionIR) -> SdpaForm | None:
    """The SDPA form of a spec, or ``None`` when SDPA cannot run it exactly.

    >>> from flexspec import parse
    >>> sdpa_form(parse("causal + scale(2.0)").ir)
    SdpaForm(causal=True, factor=2.0)
    >>> sdpa_form(parse("causal & window(8)").ir) is None
    True
    """
    mask = spec.mask
    if mask == ir.Const(True):
        causal = False
    elif mask in (ir.Binary(">=", ir.Var("q"), ir.Var("kv")),
                  ir.Binary("<=", ir.Var("kv"), ir.Var("q"))):
        causal = True
    else:
        return None
    factor, score = 1.0, spec.score
    while score != ir.Var("score"):
        step = _constant_factor(score)
        if step is None:
            return None
        constant, score = step
        factor *= constant
    # a negative or zero scale breaks the kernels' running row maximum; infinity is not a scale
    if not (math.isfinite(factor) and factor > 0):
        return None
    return SdpaForm(causal=causal, factor=factor)


def _number(node: ir.Expr) -> float | None:
    if isinstance(node, ir.Const) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _constant_factor(node: ir.Expr) -> tuple | None:
    """``(c, rest)`` when ``node`` is ``rest * c``, ``c * rest`` or ``rest / c`` for a number c."""
    if not isinstance(node, ir.Binary):
        return None
    if node.op == "*" and _number(node.right) is not None:
        return _number(node.right), node.left
    if node.op == "*" and _number(node.left) is not None:
        return _number(node.left), node.right
    if node.op == "/" and _number(node.right):
        return 1.0 / _number(node.right), node.left
    return None


@functools.cache
def flash_installed() -> bool:
    """Whether FlashAttention-4's CuTeDSL package (``flash_attn.cute``) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:  # a missing or broken parent package raises while being looked up
        return False


def why_not(backend: str, request: Request, spec: ir.AttentionIR) -> str | None:
    """Why ``backend`` cannot run ``spec`` for ``request``, or ``None`` when it can."""
    device = request.device_type
    if backend == "reference":
        if not request.reference_fits:
            return ("the dense reference would exceed its memory budget "
                    "(flexspec.kernels.reference.MAX_BYTES) at these sizes")
        return None
    if backend == "sdpa":
        form = sdpa_form(spec)
        if form is None:
            return not_sdpa(spec)
        if form.causal and request.q_len != request.kv_len:
            return (f"SDPA's is_causal equals `causal` only when Q_LEN == KV_LEN, got "
                    f"{request.q_len} and {request.kv_len}")
        return None
    if backend == "flash":
        if device != "cuda":
            return f"FLASH runs on CUDA GPUs only, not on {device}"
        if not request.flash_installed:
            return ("FLASH needs FlashAttention-4 (the flash_attn.cute package), which is not "
                    "installed: pip install flash-attn-4")
        if request.capability is None or request.capability[0] not in FLASH_CAPABILITIES:
            found = "unknown" if request.capability is None else \
                ".".join(str(n) for n in request.capability)
            return ("FLASH needs a Hopper or Blackwell GPU (compute capability 9.x or 10.x), "
                    f"this one is {found}")
        if request.dtype not in FLASH_DTYPES:
            return f"FLASH needs float16 or bfloat16 inputs, got {request.dtype}"
        if request.head_dim not in FLASH_HEAD_DIMS or request.v_head_dim != request.head_dim:
            return ("FLASH is verified for head dimensions "
                    f"{' and '.join(str(d) for d in FLASH_HEAD_DIMS)} (equal for q, k and v), "
                    f"got {request.head_dim} and {request.v_head_dim}")
        if request.table_grads:
            return ("FLASH cannot compute gradients of tensors the score reads (a learnable "
                    "table requires gradients)")
        if request.grads and request.score_tensors:
            return ("FLASH's backward gave NaN gradients for a score that reads a tensor "
                    "(sliding_window + alibi on the H200, FA4 4.0.0b36), so flexspec runs such "
                    "backward passes elsewhere")
        if not request.blocks_of_128:
            return f"FLASH needs block sizes that are multiples of 128, got {request.block_size}"
        if request.flash_failed is not None:
            return f"FLASH failed to compile this spec: {request.flash_failed}"
        return None
    if backend == "flex":
        if request.grads and device in ("cpu", "mps"):
            return f"FlexAttention has no backward pass on {device}"
        if request.grads and device == "cuda" and not request.blocks_of_128:
            return ("FlexAttention's Triton backward found no kernel for blocks of "
                    f"{request.block_size[0]}x{request.block_size[1]} (torch filters its backward "
                    "tiles, up to 128 wide, before it reads kernel options; H200, torch 2.11): "
                    "use block_size=128 for training, or call without gradients")
        if device == "cpu" and min(request.q_len, request.kv_len) < SHORT_CPU_LENGTH:
            return (f"torch's compiled CPU FlexAttention gave wrong results for sequences "
                    f"shorter than one block ({SHORT_CPU_LENGTH} positions), so flexspec does "
                    "not run it there")
        return None
    check_backend_name(backend)
    raise BackendError("'auto' is not one backend but a choice among them: use choose()")


def check_backend_name(backend: str) -> None:
    """A :class:`BackendError` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend '{backend}'.{did_you_mean(backend, BACKENDS)} "
                           f"Backends: {', '.join(BACKENDS)}")


def not_sdpa(spec: ir.AttentionIR) -> str:
    """Why SDPA cannot run a spec that :func:`sdpa_form` rejects."""
    return ("SDPA runs only full attention or top-left causal attention, optionally times a "
            f"positive constant; this spec has mask `{ir.to_text(spec.mask)}` and score "
            f"`{ir.to_text(spec.score)}`")


def _auto_order(request: Request) -> list[tuple[str, str]]:
    """The backends ``auto`` tries, best first, each with the reason it would be chosen."""
    flash = ("flash", "FlashAttention-4 was the fastest kernel measured on Hopper for every "
                      "spec at this size, forward and backward")
    sdpa_gpu = ("sdpa", "plain full or causal attention: cuDNN SDPA beat FlexAttention's "
                        "Triton kernel for it")
    flex = ("flex", "FlexAttention runs every spec; its block mask skips the empty tiles")
    if request.device_type == "cuda":
        return [flash, sdpa_gpu, flex]
    if request.grads and request.device_type in ("cpu", "mps"):
        return [("sdpa", f"SDPA has a backward pass on {request.device_type}"),
                ("reference", f"FlexAttention has no backward pass on {request.device_type}; "
                              "the dense reference has (slower, memory grows with "
                              "Q_LEN * KV_LEN)"),
                flex]
    return [("sdpa", "plain full or causal attention: SDPA beat compiled FlexAttention for it "
                     f"on {request.device_type}"),
            flex,
            ("reference", f"sequences shorter than {SHORT_CPU_LENGTH} positions run densely "
                          "(torch's compiled CPU kernel was wrong for some of them)")]


def choose(backend: str, request: Request, spec: ir.AttentionIR) -> Choice:
    """The backend for one call: ``backend`` itself when it can run (else a
    :class:`BackendError` saying why), or for ``"auto"`` the first eligible one of the measured
    order (see the module docstring)."""
    if backend != "auto":
        reason = why_not(backend, request, spec)
        if reason is not None:
            raise BackendError(f"backend '{backend}' cannot run this call: {reason}. "
                               "backend='auto' chooses one that can")
        return Choice(backend, f"backend='{backend}' was asked for")
    rejected = []
    for name, because in _auto_order(request):
        reason = why_not(name, request, spec)
        if reason is None and name == "flash" and request.dense_flops < FLASH_MIN_FLOPS:
            reason = (f"the problem is small ({request.dense_flops / 1e9:.3g} GFLOP dense < "
                      f"{FLASH_MIN_FLOPS / 1e9:.3g}): FLASH's fixed cost per call (about "
                      "0.22 ms) outweighs its speed")
        if reason is None:
            taken = {name} | {n for n, _ in rejected}
            rejected += [(n, why_not(n, request, spec) or "ranked lower for this call")
                         for n in BACKENDS[1:] if n not in taken]
            return Choice(name, because, tuple(rejected))
        rejected.append((name, reason))
    reasons = "; ".join(f"{name}: {reason}" for name, reason in rejected)
    raise BackendError(f"no backend can run this call ({reasons})")


# ---------------------------------------------------------------------------------------------
# What `explain` shows


def attention_flops(pairs: float, head_dim: int, v_head_dim: int, *, backward: bool) -> float:
    """FLOPs of attention over ``pairs`` visible (query, key) pairs: 2*D for q.k and 2*Dv for
    p.v per pair forward; the backward does 2.5 times the forward's work (five products against
    two), as FlashAttention counts it."""
    forward = 2.0 * pairs * (head_dim + v_head_dim)
    return forward * FORWARD_AND_BACKWARD if backward else forward


@dataclass(frozen=True)
class Explanation:
    """What ``Attention.explain`` reports: the canonical spec, the call's sizes, how much of the
    score matrix is visible, the work, and the backend chosen with its reason."""

    spec: str
    mask: str             # the canonical IR the backends are chosen from
    score: str
    sizes: dict
    head_dim: int
    dtype: torch.dtype
    device: str
    density: float        # visible (q, kv) pairs / all pairs
    tile_density: float   # tiles a block-sparse kernel computes / all tiles
    block_size: tuple
    flops: float          # forward FLOPs of the visible pairs
    grads: bool
    choice: Choice

    def __str__(self) -> str:
        s = self.sizes
        kv_heads = s.get("KV_HEADS", s["H"])
        heads = f"H={s['H']}" + (f" (KV heads {kv_heads})" if kv_heads != s["H"] else "")
        lines = [
            f"spec:     {self.spec}",
            f"mask:     {self.mask}",
            f"score:    {self.score}",
            f"call:     B={s['B']} {heads} Q_LEN={s['Q_LEN']} KV_LEN={s['KV_LEN']} "
            f"D={self.head_dim} {str(self.dtype).replace('torch.', '')} on {self.device}"
            + (", with gradients" if self.grads else ""),
            f"density:  {self.density:.2%} of (q, kv) pairs visible; {self.tile_density:.2%} "
            f"of {self.block_size[0]}x{self.block_size[1]} tiles computed",
            f"work:     {_flops_text(self.flops)} forward"
            + (f", {_flops_text(self.flops * FORWARD_AND_BACKWARD)} forward+backward"
               if self.grads else ""),
            f"backend:  {self.choice.backend}: {self.choice.reason}",
        ]
        for name, reason in self.choice.rejected:
            lines.append(f"  not {name}: {reason}")
        return "\n".join(lines)


def _flops_text(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"
