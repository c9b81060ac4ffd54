"""The ``flash`` backend: FlexAttention with ``kernel_options={"BACKEND": "FLASH"}``, i.e.
FlashAttention-4 generated through CuTeDSL (needs the ``flash_attn.cute`` package and a Hopper or
Blackwell GPU).

It is the ``flex`` call with other kernel options and stricter rules. CuTeDSL supports fewer
score functions than Triton, so a first call may fail to compile: asked for explicitly, that is a
:class:`BackendError`; under ``auto`` the plan is handed to the ``flex`` backend (one warning),
and the failure is remembered so later plans of the spec skip FLASH (``explain`` says why).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from flexspec.ir.forms import constant_lookup, nested_lookup
from flexspec.runtime.backends.base import REGISTRY, BackendError, Choice, Rank, Request
from flexspec.runtime.backends.flex import FlexBackend, FlexKernelOptions
from flexspec.runtime.compiled import CompileLimitError, first_line
from flexspec.runtime.notices import warn_once

FLASH_OPTIONS: FlexKernelOptions = {"BACKEND": "FLASH"}
# Below this much dense forward work (B * H * Q_LEN * KV_LEN * 2 * (D + Dv) FLOPs) FLASH's fixed
# cost per call outweighs its speed (docs/performance.md#why-the-backend-rules-are-what-they-are).
FLASH_MIN_FLOPS = 2e11
# Head dimensions FLASH ran correctly with flexspec's block sizes (see docs/performance.md,
# why-the-backend-rules-are-what-they-are).
FLASH_HEAD_DIMS = (64, 128)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Compute capabilities (major) of the GPUs FA4 supports: Hopper (9) and Blackwell (10).
FLASH_CAPABILITIES = (9, 10)

# Specs (specialized IR) FLASH failed to compile, with the gist of the error.
FAILED: dict = {}


@functools.cache
def flash_installed() -> bool:
    """Whether FlashAttention-4's CuTeDSL package (``flash_attn.cute``) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:  # a missing or broken parent package raises while being looked up
        return False


class FlashBackend(FlexBackend):
    name = "flash"
    cute = True

    def why_not(self, request, spec):
        unavailable = fa4_unavailable(request, "FLASH")
        if unavailable is not None:
            return unavailable
        if request.table_grads:
            return ("FLASH cannot compute gradients of tensors the score reads (a learnable "
                    "table requires gradients)")
        if request.grads and request.score_tensors and request.kv_heads != request.heads:
            return ("FLASH's backward gave wrong gradients for a score that reads a tensor "
                    "with grouped-query attention (ALiBi, 4 query heads over 2 KV heads: "
                    "relative errors 1.7 to 72, or NaN; H200, FA4 4.0.0b36), so flexspec runs "
                    "such backward passes elsewhere")
        if not request.blocks_of_128:
            return f"FLASH needs block sizes that are multiples of 128, got {request.block_size}"
        constant = request.constant_lookup
        if constant is not None:
            return (f"FLASH's code generator (CuTeDSL) cannot read a tensor at a constant index "
                    f"('{constant}'; FA4 4.0.0b36: 'Expected TensorSSA, but got int'), which a "
                    "binding with a broadcast batch or head dimension becomes: pass bindings "
                    "with their full B and H dimensions to run on FLASH")
        if request.nested_lookup is not None:
            return (f"FLASH's code generator (CuTeDSL) could not compile a lookup whose index "
                    f"reads another tensor ('{request.nested_lookup}', such as a document id at "
                    "a q_offset; FA4 4.0.0b36: 'Type mismatch, store Int64 to Tensor with "
                    "element type Int32')")
        if request.lse:
            return ("FLASH's log-sum-exp disagreed with the reference (causal & window(200) + "
                    "alibi at q_offset=5, H200, FA4 4.0.0b36), so return_lse=True runs "
                    "elsewhere")
        if request.flash_failed is not None:
            return f"FLASH failed to compile this spec: {request.flash_failed}"
        return None

    def rank(self, request: Request) -> Rank | None:
        if request.device_type != "cuda":
            return None
        return Rank(0, "FlashAttention-4 was the fastest kernel measured on Hopper for every "
                       "spec at this size, forward and backward")

    def auto_veto(self, request, spec):
        return too_small(request, "FLASH")

    def facts(self, device, lowered):
        return {"flash_installed": device.type == "cuda" and flash_installed(),
                "flash_failed": FAILED.get(lowered.ir),
                "constant_lookup": constant_lookup(lowered.ir),
                "nested_lookup": nested_lookup(lowered.ir)}

    def kernel_options(self, request):
        return FLASH_OPTIONS

    def launch(self, plan, args):
        try:
            return self.compile_and_run(plan, args)
        except CompileLimitError:
            raise
        except Exception as err:  # noqa: BLE001 - inductor's errors have no stable type
            return self._fall_back(plan, args, err)

    @staticmethod
    def _fall_back(plan, args: tuple, err: Exception):
        """Hand a plan whose FLASH compile failed to the ``flex`` backend, or raise when FLASH
        was asked for."""
        summary = first_line(err)
        FAILED[plan.spec] = summary
        if plan.asked == "flash":
            raise BackendError(f"backend 'flash' could not compile this spec: {summary}. "
                               "backend='auto' falls back to the Triton kernel") from err
        warn_once(f"flash-failed-{id(plan.prepared.lowered)}",
                  f"flexspec: FLASH could not compile '{plan.text}' ({summary}); running it "
                  "with FlexAttention's Triton kernel instead", stacklevel=5)
        flex = REGISTRY["flex"]
        rejected = tuple((name, reason) for name, reason in plan.choice.rejected
                         if name != "flex") + (("flash", f"failed to compile: {summary}"),)
        plan.choice = Choice("flex", "FlexAttention runs every spec (FLASH could not compile "
                                     "this one)", rejected)
        plan.backend = flex
        plan.prepared.kernel_options = flex.kernel_options(plan.request)
        # the kernel options are the second to last argument (see FlexBackend.run)
        return flex.launch(plan, args[:-2] + (plan.prepared.kernel_options, args[-1]))


def fa4_unavailable(request: Request, kernel: str) -> str | None:
    """Why FlashAttention-4's kernels (``kernel`` names which, for the message) cannot run on
    ``request``'s device, dtype and head dimensions, or ``None``."""
    device = request.device_type
    if device != "cuda":
        return f"{kernel} runs on CUDA GPUs only, not on {device}"
    if not request.flash_installed:
        return (f"{kernel} needs FlashAttention-4 (the flash_attn.cute package), which is not "
                "installed: pip install flash-attn-4")
    if request.capability is None or request.capability[0] not in FLASH_CAPABILITIES:
        found = "unknown" if request.capability is None else \
            ".".join(str(n) for n in request.capability)
        return (f"{kernel} needs a Hopper or Blackwell GPU (compute capability 9.x or 10.x), "
                f"this one is {found}")
    if request.dtype not in FLASH_DTYPES:
        return f"{kernel} needs float16 or bfloat16 inputs, got {request.dtype}"
    if request.head_dim not in FLASH_HEAD_DIMS or request.v_head_dim != request.head_dim:
        return (f"{kernel} is verified for head dimensions "
                f"{' and '.join(str(d) for d in FLASH_HEAD_DIMS)} (equal for q, k and v), "
                f"got {request.head_dim} and {request.v_head_dim}")
    return None


def too_small(request: Request, kernel: str) -> str | None:
    """Why ``auto`` passes over FlashAttention-4's kernels for a problem below
    :data:`FLASH_MIN_FLOPS`, or ``None``."""
    if request.dense_flops < FLASH_MIN_FLOPS:
        return (f"the problem is small ({request.dense_flops / 1e9:.3g} GFLOP dense < "
                f"{FLASH_MIN_FLOPS / 1e9:.3g}): {kernel}'s fixed cost per call (about 0.22 ms "
                "for FLASH) outweighs its speed")
    return None
