"""The ``flex`` backend: FlexAttention through ``torch.compile`` with its default kernel (the
Triton template on a GPU, the C++ template on the CPU). The call itself is
:mod:`flexspec.runtime.flexattention`'s, which ``flash`` makes too with other kernel options. It
reads paged pools in place (:mod:`flexspec.runtime.flexpages`)."""

from __future__ import annotations

from flexspec.kernels.fused_blocks import compile_error
from flexspec.limits import kernel_int_dtype
from flexspec.runtime import compiled, flexpages
from flexspec.runtime.contract import BackendError, Replan
from flexspec.runtime.flexattention import (DECODE_ROWS, DECODING_OPTIONS,
                                             FlexAttentionBackend, FlexKernelOptions, decodes,
                                             wide_indices)
from flexspec.runtime.tuning import default_candidates

# On the CPU, sequences shorter than one 128-position block run elsewhere (flexspec.workarounds:
# cpu-short-sequences).
SHORT_CPU_LENGTH = 128
# A score that reads a tensor requiring gradients gets one pipeline stage in Triton's backward
# (flexspec.workarounds: triton-table-grad-stages).
TABLE_GRAD_OPTIONS: FlexKernelOptions = {"num_stages": 1}
# Triton's tiles must divide the block mask's blocks, and its default tiles are up to 128 wide,
# so smaller blocks get tiles of their own, at most this wide.
LARGEST_SMALL_TILE = 64


class FlexBackend(FlexAttentionBackend):
    name = "flex"
    decoding = True
    reads_pages = True

    def why_not(self, request, spec):
        if request.pages is not None:
            return flexpages.why_not(request)
        device = request.device_type
        if request.grads and device in ("cpu", "mps"):
            return f"FlexAttention has no backward pass on {device}"
        if request.grads and device == "cuda" and not request.blocks_of_128:
            # flexspec.workarounds: triton-backward-small-blocks
            return ("FlexAttention's Triton backward finds no kernel for blocks of "
                    f"{request.block_size[0]}x{request.block_size[1]}: use block_size=128 for "
                    "training, or call without gradients")
        if device == "cpu" and request.lse:
            return ("torch's compiled CPU FlexAttention does not return the log-sum-exp "
                    "(flexspec.workarounds: cpu-flex-lse): return_lse=True runs on the dense "
                    "reference on the CPU")
        if device == "cpu" and min(request.q_len, request.kv_len) < SHORT_CPU_LENGTH:
            return (f"torch's compiled CPU FlexAttention is wrong for sequences shorter than one "
                    f"block ({SHORT_CPU_LENGTH} positions; flexspec.workarounds: "
                    "cpu-short-sequences), so flexspec does not run it there")
        return None

    def auto_veto(self, request, spec):
        return None if request.pages is None else flexpages.auto_veto(request)

    def prepare(self, plan, values):
        if plan.request.pages is not None:
            return flexpages.prepare(plan, values)
        return super().prepare(plan, values)

    def launcher(self, plan, scale, bindings, values, step, pages=None):
        if pages is not None:
            return flexpages.launcher(plan, values, pages)
        return super().launcher(plan, scale, bindings, values, step)

    def run(self, plan, q, k, v, scale, bindings, values, step=None, pages=None):
        if pages is not None:
            return flexpages.launcher(plan, values, pages)(q, k, v)
        return super().run(plan, q, k, v, scale, bindings, values, step)

    def tune_candidates(self, plan):
        if plan.request.pages is not None:
            return flexpages.read_candidates(plan.request.pages.page_size,
                                             plan.state.kernel.options or {})
        return default_candidates(plan.request)

    def kernel(self, plan):
        request = plan.request
        if request.pages is not None:
            return flexpages.kernel(plan)
        if request.device_type != "cuda" or request.q_len >= DECODE_ROWS:
            return None
        if decodes(plan):
            return (f"FlexAttention's decoding kernel (split-KV: the keys of each row are shared "
                    f"among the kernel's programs), {DECODING_OPTIONS['num_stages']} pipeline "
                    "stages, full tiles listed as partial so that the programs share a row's "
                    "tiles evenly")
        if wide_indices(request):
            why = ("the keys hold 2**31 elements or more, where torch's decoding kernel does not "
                   "compile (flexspec.workarounds: flex-decoding-wide-indices)")
        elif request.grads:
            why = "the call needs gradients, which the decoding kernel has none of"
        else:
            why = ("torch runs its decoding kernel only for a power-of-two number of query heads "
                   "per key head and block masks with one head")
        return (f"FlexAttention's main kernel, though the call has fewer than {DECODE_ROWS} "
                f"rows: {why}")

    def index_dtype(self, device_type):
        # b, h, q_idx, kv_idx and integer arithmetic on them: int32 on CUDA, int64 on the CPU
        return kernel_int_dtype(device_type)

    def kernel_options(self, request) -> FlexKernelOptions | None:
        options = {}
        if request.device_type == "cuda" and request.q_len < DECODE_ROWS \
                and wide_indices(request):
            # flexspec.workarounds: flex-decoding-wide-indices
            options["FORCE_USE_FLEX_ATTENTION"] = True
        if request.device_type in ("cuda", "xpu") and not request.blocks_of_128:
            options.update(small_block_tiles(*request.block_size))
        if request.table_grads and request.device_type == "cuda" and request.head_dim > 64:
            options.update(TABLE_GRAD_OPTIONS)
        return options or None

    def compile_failed(self, plan, err):
        """A compile that torch's compiler gives up on: under ``auto``, the call goes to the
        next backend that can run it (:class:`Replan`, remembered for the spec, with a
        warning); asked for by name, a :class:`BackendError` (no raw dynamo or inductor
        exception reaches the caller)."""
        if not compile_error(err):
            raise err
        if plan is not None and plan.asked == "auto":
            # flexspec.workarounds: cpu-dynamic-row-binding
            raise Replan(f"torch.compile failed ({compiled.first_line(err)})",
                         lasting=True) from err
        raise BackendError(
            f"backend '{self.name}' could not compile this spec: torch.compile failed "
            f"({compiled.first_line(err)}). This is a limit of the compiled path (torch's "
            "compiler, or flexspec's lowering for it), not an error in the spec: please "
            "report it; backend='reference' computes it densely (float64 math, memory "
            "growing as Q_LEN x KV_LEN)") from err


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


BACKEND = FlexBackend()
