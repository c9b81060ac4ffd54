"""The ``flex`` backend: FlexAttention through ``torch.compile`` with its default kernel (the
Triton template on a GPU, the C++ template on the CPU). FLASH (:mod:`.flash`) is the same call
with other kernel options, so it subclasses this one.

A plan keeps the lowered spec, its compiled entry point, the kernel options, and the block mask
and ``score_mod`` when they read no binding; a call fetches the block mask of its bindings and
launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.ir import rewrites
from flexspec.kernels.fused_blocks import compile_error
from flexspec.kernels.lower import Lowered, lower
from flexspec.runtime import compiled
from flexspec.runtime.backends.base import Backend, BackendError, Rank, Request
from flexspec.runtime.inputs import capturing

try:
    from torch.nn.attention.flex_attention import FlexKernelOptions
except ImportError:  # torch before FlexKernelOptions was public
    FlexKernelOptions = dict

# On the CPU, sequences shorter than one 128-position block run elsewhere: torch 2.13's compiled
# CPU kernel gave wrong results for them (see docs/performance.md, the backend rules).
SHORT_CPU_LENGTH = 128
# A score that reads a tensor requiring gradients gets one pipeline stage in Triton's backward:
# the default ran out of shared memory at D=128 on the H200 (see docs/performance.md).
TABLE_GRAD_OPTIONS: FlexKernelOptions = {"num_stages": 1}
# Triton's tiles must divide the block mask's blocks, and its default tiles are up to 128 wide,
# so smaller blocks get tiles of their own, at most this wide.
LARGEST_SMALL_TILE = 64


@dataclass(eq=False)
class FlexCall:
    """What a FlexAttention plan keeps between calls."""

    lowered: Lowered
    entry: object                            # compiled.compiled_entry(lowered)
    kernel_options: FlexKernelOptions | None
    masks: object                            # the Attention's BlockMasks cache
    mask_bindings: tuple = ()                # names of the bindings the mask reads
    block_mask: BlockMask | None = None      # the block mask when the mask reads no binding
    # ((tensor, version) of the mask's bindings, block mask) of the last call: one tuple,
    # replaced whole, so that concurrent calls never pair one call's bindings with another's mask
    last: tuple | None = None
    score_varies: bool = True                # the score_mod captures this call's bindings
    score_mod: object = None
    lse: dict | None = None                  # compiled.lse_request(return_lse)
    scale_values: dict = field(default_factory=dict)  # the scale as a tensor (rewrites.scaled)
    warm: bool = False                       # the compiled entry has run once for this plan

    def last_block_mask(self, bindings: dict) -> BlockMask | None:
        """The previous call's block mask when the mask's bindings are the very tensors of that
        call, unchanged in place since (same object, same version counter): the cache lookup
        (storage identity, hashing) is then skipped. ``None`` otherwise."""
        last = self.last  # read once: another thread may replace it meanwhile
        if last is None:
            return None
        for name, (value, version) in zip(self.mask_bindings, last[0]):
            given = bindings[name]
            if given is not value or given._version != version:
                return None
        return last[1]


class FlexBackend(Backend):
    name = "flex"

    def why_not(self, request, spec):
        device = request.device_type
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

    def rank(self, request: Request) -> Rank:
        # behind the specialised kernels, ahead of the reference where the kernel can run
        place = 1 if request.device_type != "cuda" and not (
            request.grads and request.device_type in ("cpu", "mps")) else 2
        return Rank(place, "FlexAttention runs every spec; its block mask skips the empty tiles")

    def index_dtype(self, device_type):
        # FlexAttention's GPU kernels (and FLASH's) pass b, h, q_idx and kv_idx as int32, and
        # integer arithmetic on them stays int32: on an H200, q * 16777216 >= kv * 16777216
        # wrapped from q = 128 on (output off by 0.75); its CPU kernels compute in int64
        return "int32" if device_type == "cuda" else "int64"

    def kernel_options(self, request: Request) -> FlexKernelOptions | None:
        """The kernel options of a compiled FlexAttention call for ``request``."""
        options = {}
        if request.device_type in ("cuda", "xpu") and not request.blocks_of_128:
            options.update(small_block_tiles(*request.block_size))
        if request.table_grads and request.device_type == "cuda" and request.head_dim > 64:
            options.update(TABLE_GRAD_OPTIONS)
        return options or None

    def prepare(self, plan, values, masks):
        spec, scale_values = plan.spec, {}
        if plan.scale is not None:
            # the kernel keeps its default 1/sqrt(D) and the score is multiplied by a tensor:
            # a new scale is a new value, not a new kernel
            spec = rewrites.scaled(plan.spec)
            ratio = float(plan.scale) * math.sqrt(plan.request.head_dim)
            scale_values = {rewrites.SCALE: torch.full((plan.sizes["B"],), ratio,
                                                  dtype=torch.float32, device=plan.device)}
            values = {**values, **scale_values}
        lowered = lower(spec, cute=self.cute)
        call = FlexCall(lowered=lowered, entry=compiled.compiled_entry(lowered),
                        kernel_options=self.kernel_options(plan.request), masks=masks,
                        lse=compiled.lse_request(plan.request.lse), scale_values=scale_values)
        call.mask_bindings = tuple(slot.name for slot in plan.slots
                                   if slot.key in plan.mask.reads)
        if not call.mask_bindings:
            # a mask-free spec needs no block mask on a GPU (faster there); the CPU kernel needs
            # one (see Attention.block_mask)
            if plan.spec.mask != ir.Const(True) or plan.request.device_type != "cuda":
                call.block_mask = masks.get(plan.spec, plan.sizes, values, plan.device, plan.mask)
        score_keys = plan.score_keys
        float64 = any(values[key].dtype == torch.float64 for key in score_keys)
        if not (score_keys & {slot.key for slot in plan.slots}) and not float64:
            call.score_mod = lowered.make_mods(plan.sizes, values)[1]
            call.score_varies = False
        plan.prepared = call
        plan.needs_values = plan.needs_values or call.score_varies

    def run(self, plan, q, k, v, scale, bindings, values):
        call: FlexCall = plan.prepared
        if not call.mask_bindings:
            block_mask = call.block_mask
        else:
            # inside a CUDA graph capture the mask is built, so that replays rebuild it from
            # what the bindings hold then (the last mask would be replayed as it was)
            captured = capturing(q.device)
            block_mask = None if captured else call.last_block_mask(bindings)
            if block_mask is None:
                seen = tuple((bindings[name], bindings[name]._version)
                             for name in call.mask_bindings)
                block_mask = call.masks.get(plan.spec, plan.sizes,
                                            values or plan.values(bindings), q.device, plan.mask)
                if not captured:
                    call.last = (seen, block_mask)
        if call.score_varies:
            # the kernel computes scores in float32: a float64 table would turn them into float64
            kernel_values = {key: value.float() if value.dtype == torch.float64 else value
                             for key, value in values.items()}
            score_mod = call.lowered.make_mods(plan.sizes,
                                               {**kernel_values, **call.scale_values})[1]
        else:
            score_mod = call.score_mod
        if plan.detach:
            q, k, v = q.detach(), k.detach(), v.detach()
        # a given scale is in the score_mod (see prepare): the kernel keeps its default
        args = (q, k, v, score_mod, block_mask, None, plan.gqa, call.kernel_options, call.lse)
        if call.warm:
            # a warm plan cannot recompile (see compiled.run_compiled): no watch needed
            out = call.entry(*args)
        else:
            out = self.launch(plan, args)
            call.warm = True
        return compiled.split_lse(out) if call.lse is not None else out

    def launch(self, plan, args: tuple):
        """The first call of a plan, which may compile: a compile that torch's compiler gives
        up on is a :class:`BackendError` (no raw dynamo or inductor exception reaches the
        caller)."""
        try:
            return self.compile_and_run(plan, args)
        except Exception as err:  # noqa: BLE001 - narrowed below
            if not compile_error(err):
                raise
            raise BackendError(
                f"backend '{self.name}' could not compile this spec: torch.compile failed "
                f"({compiled.first_line(err)}). This is a limit of the compiled path (torch's "
                "compiler, or flexspec's lowering for it), not an error in the spec: please "
                "report it; backend='reference' computes it densely (float64 math, memory "
                "growing as Q_LEN x KV_LEN)") from err

    def compile_and_run(self, plan, args: tuple):
        """:meth:`launch` without turning compile failures into flexspec errors (FLASH's
        launch catches them itself, to fall back to Triton)."""
        entry = plan.prepared.entry
        compiled.mark_lengths_dynamic(entry, *args[:5])
        return compiled.run_compiled(entry, *args)


def small_block_tiles(q_block: int, kv_block: int) -> FlexKernelOptions:
    """Triton tiles that divide blocks of ``q_block`` x ``kv_block`` positions (multiples of
    16): the largest power of two that divides each, at most LARGEST_SMALL_TILE; the backward
    kernels take the smaller of the two on both sides."""
    def tile(size: int) -> int:
        return min(size & -size, LARGEST_SMALL_TILE)

    m, n = tile(q_block), tile(kv_block)
    both = min(m, n)
    # the fwd_/bwd_ prefixed names are accepted by torch though FlexKernelOptions lists only the
    # unprefixed ones
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "bwd_BLOCK_M1": both, "bwd_BLOCK_N1": both,
            "bwd_BLOCK_M2": both, "bwd_BLOCK_N2": both}
