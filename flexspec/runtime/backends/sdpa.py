"""The ``sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention`` (cuDNN first on a
GPU), for specs whose IR is exactly full attention or top-left causal attention with
Q_LEN == KV_LEN, times an optional positive constant (:func:`flexspec.ir.forms.sdpa_form`)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexspec import ir
from flexspec.ir.forms import SdpaForm, sdpa_form
from flexspec.runtime.contract import Backend, Prepared


@functools.lru_cache(maxsize=256)
def not_sdpa(spec: ir.AttentionIR) -> str:
    """Why SDPA cannot run a spec that :func:`sdpa_form` rejects."""
    return ("SDPA runs only full attention or top-left causal attention, optionally times a "
            f"positive constant; this spec has mask `{ir.to_text(spec.mask)}` and score "
            f"`{ir.to_text(spec.score)}`")


# The smallest normal float32: a scale below it is 0 (or a denormal) in the kernels' arithmetic,
# and SDPA's softmax then divides 0 by 0 (torch's own SDPA gives NaN for scale=0.0).
SMALLEST_SCALE = 1.1754943508222875e-38


# Calls with at most this many query rows are decoding steps, whose key lengths change every
# step: they run SDPA without cuDNN (flexspec.workarounds: cudnn-decode-plans).
DECODING_ROWS = 16
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A decoding call on CUDA runs as SDPA calls over runs of batch rows of at most this many
# (batch row, KV head) pairs: without cuDNN, one call over more ran up to 1.8x slower than the
# same rows in runs (docs/performance.md, "large batches, SDPA in runs of batch rows").
DECODING_PAIRS = 128


class SdpaBackend(Backend):
    name = "sdpa"

    def cannot_run(self, spec):
        return not_sdpa(spec) if sdpa_form(spec) is None else None

    def why_not(self, request, spec):
        form = sdpa_form(spec)
        if form is None:
            return not_sdpa(spec)
        if request.lse:
            return "SDPA does not return the log-sum-exp that return_lse=True asks for"
        base = 1.0 / math.sqrt(request.head_dim) if request.scale is None else request.scale
        if not abs(base * form.factor) >= SMALLEST_SCALE:
            return (f"SDPA returns NaN for a scale that rounds to zero in float32 "
                    f"({base * form.factor!r})")
        if form.causal and request.q_len != request.kv_len:
            return (f"SDPA's is_causal equals `causal` only when Q_LEN == KV_LEN, got "
                    f"{request.q_len} and {request.kv_len}")
        return None

    def prepare(self, plan, values):
        return Prepared(state=sdpa_form(plan.spec))

    def run(self, plan, q, k, v, scale, bindings, values, step=None):
        return self.launcher(plan, scale, bindings, values, step)(q, k, v)

    def launcher(self, plan, scale, bindings, values, step):
        form: SdpaForm = plan.state
        base = 1.0 / math.sqrt(plan.request.head_dim) if scale is None else float(scale)
        causal, scale, gqa = form.causal, base * form.factor, plan.gqa
        decoding = plan.request.q_len <= DECODING_ROWS
        rows = decoding_rows(plan.request.batch, plan.request.kv_heads)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)

        def launch(q, k, v):
            if not (decoding and q.is_cuda):
                return attend(q, k, v)
            with sdpa_kernel(_NOT_CUDNN):
                if rows is None:
                    return attend(q, k, v)
                return torch.cat([attend(q[start:start + rows], k[start:start + rows],
                                         v[start:start + rows])
                                  for start in range(0, q.shape[0], rows)])
        return launch


def decoding_rows(batch: int, kv_heads: int) -> int | None:
    """How many batch rows each SDPA call of a decoding call takes (:data:`DECODING_PAIRS`
    (batch row, KV head) pairs), or None where one call takes them all."""
    rows = max(1, DECODING_PAIRS // kv_heads)
    return rows if batch > rows else None


BACKEND = SdpaBackend()
