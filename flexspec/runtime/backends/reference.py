"""The ``reference`` backend: the dense float64 semantics of :mod:`flexspec.kernels.reference`,
the backend of last resort (and the one with a backward pass everywhere)."""

from __future__ import annotations

from flexspec.kernels.reference import reference_attention
from flexspec.runtime.contract import Backend, Prepared


class ReferenceBackend(Backend):
    name = "reference"
    float64 = True
    dense = True

    def why_not(self, request, spec):
        if not request.reference_fits:
            return ("the dense reference would exceed its memory budget "
                    "(flexspec.limits.MAX_DENSE_ARRAY_BYTES) at these sizes")
        return None

    def prepare(self, plan, values):
        return Prepared(needs_values=True)

    def run(self, plan, q, k, v, scale, bindings, values, step=None):
        return reference_attention(plan.spec, q, k, v, scale=scale, tensors=values,
                                   return_lse=plan.request.lse)


BACKEND = ReferenceBackend()
