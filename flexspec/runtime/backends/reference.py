"""The ``reference`` backend: the dense float64 semantics of :mod:`flexspec.kernels.reference`,
the backend of last resort (and the one with a backward pass everywhere)."""

from __future__ import annotations

from flexspec.kernels.reference import reference_attention
from flexspec.runtime.backends.base import Backend, Rank, Request
from flexspec.runtime.backends.flex import SHORT_CPU_LENGTH


class ReferenceBackend(Backend):
    name = "reference"

    def why_not(self, request, spec):
        if not request.reference_fits:
            return ("the dense reference would exceed its memory budget "
                    "(flexspec.limits.MAX_DENSE_ARRAY_BYTES) at these sizes")
        return None

    def rank(self, request: Request) -> Rank | None:
        # never on CUDA; on other devices it stands in where FlexAttention cannot run
        device = request.device_type
        if device == "cuda":
            return None
        if request.grads and device in ("cpu", "mps"):
            return Rank(1, f"FlexAttention has no backward pass on {device}; the dense "
                           "reference has (slower, memory grows with Q_LEN * KV_LEN)")
        return Rank(2, f"sequences shorter than {SHORT_CPU_LENGTH} positions run densely "
                       "(torch's compiled CPU kernel was wrong for some of them)")

    def prepare(self, plan, values, masks):
        plan.needs_values = True

    def run(self, plan, q, k, v, scale, bindings, values):
        return reference_attention(plan.spec, q, k, v, scale=scale, tensors=values,
                                   return_lse=plan.request.lse)
