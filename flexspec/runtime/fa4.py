"""What FlashAttention-4's kernels need, shared by the two backends that run them (``fa4``, its
own interface, and ``flash``, through FlexAttention): the package, the GPU, dtypes and head
dimensions, and the problem size below which their fixed cost per call outweighs their speed."""

from __future__ import annotations

import functools
import importlib.util

import torch

from flexspec.runtime.contract import Request

# The fact (see contract.Request.facts) that flash_attn.cute can be imported on this device.
INSTALLED = "fa4.installed"
# Below this much dense forward work (B * H * Q_LEN * KV_LEN * 2 * (D + Dv) FLOPs) FA4's fixed
# cost per call outweighs its speed (docs/performance.md#why-the-backend-rules-are-what-they-are).
MIN_FLOPS = 2e11
# Head dimensions FA4 ran correctly with flexspec's block sizes (flexspec.workarounds:
# flash-head-dims).
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
# Compute capabilities (major) of the GPUs FA4 supports: Hopper (9) and Blackwell (10).
CAPABILITIES = (9, 10)


@functools.cache
def installed() -> bool:
    """Whether FlashAttention-4's CuTeDSL package (``flash_attn.cute``) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:  # a missing or broken parent package raises while being looked up
        return False


def facts(device: torch.device) -> dict:
    """The FA4 facts of a call on ``device``."""
    return {INSTALLED: device.type == "cuda" and installed()}


def unavailable(request: Request, kernel: str) -> str | None:
    """Why FlashAttention-4's kernels (``kernel`` names which, for the message) cannot run on
    ``request``'s device, dtype and head dimensions, or ``None``."""
    device = request.device_type
    if device != "cuda":
        return f"{kernel} runs on CUDA GPUs only, not on {device}"
    if not request.fact(INSTALLED, False):
        return (f"{kernel} needs FlashAttention-4 (the flash_attn.cute package), which is not "
                "installed: pip install flash-attn-4")
    if request.capability is None or request.capability[0] not in CAPABILITIES:
        found = "unknown" if request.capability is None else \
            ".".join(str(n) for n in request.capability)
        return (f"{kernel} needs a Hopper or Blackwell GPU (compute capability 9.x or 10.x), "
                f"this one is {found}")
    if request.dtype not in DTYPES:
        return f"{kernel} needs float16 or bfloat16 inputs, got {request.dtype}"
    if request.head_dim not in HEAD_DIMS or request.v_head_dim != request.head_dim:
        return (f"{kernel} is verified for head dimensions "
                f"{' and '.join(str(d) for d in HEAD_DIMS)} (equal for q, k and v), "
                f"got {request.head_dim} and {request.v_head_dim}")
    return None


def too_small(request: Request, kernel: str) -> str | None:
    """Why ``auto`` passes over FlashAttention-4's kernels for a problem below
    :data:`MIN_FLOPS`, or ``None``."""
    if request.dense_flops < MIN_FLOPS:
        return (f"the problem is small ({request.dense_flops / 1e9:.3g} GFLOP dense < "
                f"{MIN_FLOPS / 1e9:.3g}): {kernel}'s fixed cost per call outweighs its speed "
                "(docs/performance.md, FLASH's small-problem veto)")
    return None
