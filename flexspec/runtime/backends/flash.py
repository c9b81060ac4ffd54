"""The ``flash`` backend: FlexAttention with ``kernel_options={"BACKEND": "FLASH"}``, i.e.
FlashAttention-4 generated through CuTeDSL (needs the ``flash_attn.cute`` package and a Hopper or
Blackwell GPU).

It is the FlexAttention call of :mod:`flexspec.runtime.flexattention` with other kernel options,
the lowering's ``cute`` dialect and stricter rules. CuTeDSL supports fewer score functions than
Triton, so a first call may fail to compile: it hands the call back to the runtime
(:class:`~flexspec.runtime.contract.Replan`), which says so when ``flash`` was asked for and
otherwise plans the call anew without it, once, remembering why.
"""

from __future__ import annotations

from flexspec.ir.forms import constant_lookup, nested_lookup
from flexspec.limits import kernel_int_dtype
from flexspec.runtime import fa4
from flexspec.runtime.compiled import CompileLimitError, first_line
from flexspec.runtime.contract import Replan
from flexspec.runtime.flexattention import FlexAttentionBackend, FlexKernelOptions

OPTIONS: FlexKernelOptions = {"BACKEND": "FLASH"}


class FlashBackend(FlexAttentionBackend):
    name = "flash"
    dialect = "cute"

    def why_not(self, request, spec):
        unavailable = fa4.unavailable(request, "FLASH")
        if unavailable is not None:
            return unavailable
        if request.table_grads:
            return ("FLASH cannot compute gradients of tensors the score reads (a learnable "
                    "table requires gradients)")
        if request.grads and request.score_tensors and request.kv_heads != request.heads:
            return ("FLASH's backward gives wrong gradients for a score that reads a tensor "
                    "under grouped-query attention (flexspec.workarounds: "
                    "flash-gqa-score-backward), so flexspec runs such backward passes elsewhere")
        if not request.blocks_of_128:
            return f"FLASH needs block sizes that are multiples of 128, got {request.block_size}"
        constant = constant_lookup(spec)
        if constant is not None:
            return (f"FLASH's code generator (CuTeDSL) cannot read a tensor at a constant index "
                    f"('{constant}'; flexspec.workarounds: flash-constant-index), which a "
                    "binding with a broadcast batch or head dimension becomes: pass bindings "
                    "with their full B and H dimensions to run on FLASH")
        nested = nested_lookup(spec)
        if nested is not None:
            return (f"FLASH's code generator (CuTeDSL) cannot compile a lookup whose index "
                    f"reads another tensor ('{nested}', such as a document id at a q_offset; "
                    "flexspec.workarounds: flash-nested-lookup)")
        if request.lse:
            return ("FLASH's log-sum-exp disagrees with the reference (flexspec.workarounds: "
                    "flash-lse), so return_lse=True runs elsewhere")
        return None

    def auto_veto(self, request, spec):
        return fa4.too_small(request, "FLASH")

    def facts(self, device):
        return fa4.facts(device)

    def index_dtype(self, device_type):
        return kernel_int_dtype(device_type)

    def kernel_options(self, request):
        return OPTIONS

    def compile_failed(self, plan, err):
        if isinstance(err, CompileLimitError):
            raise err
        raise Replan(first_line(err), lasting=True) from err


BACKEND = FlashBackend()
