"""The ``fa4`` backend: FlashAttention-4's own kernels (``flash_attn.cute.flash_attn_func`` and
``flash_attn_varlen_func``) for specs whose structure they implement natively, with no block
mask: full or causal attention, sliding windows, and packed documents given as contiguous runs of
ids (run as variable-length sequences), optionally with a constant scale and a softcap.

:func:`flexspec.ir.forms.native_form` reads that structure off the IR. Documents need one look
at the ids per call (:func:`document_segments`, O(S) on the device plus one host read of the
number of documents): ids that are not contiguous runs, such as ``[0, 0, 1, 1, 0]``, are valid
flexspec documents that FA4's variable-length interface cannot express, so such a call is handed
back to the runtime (:class:`~flexspec.runtime.contract.Replan`), which runs it on the plan's
fallback: the backend ``auto`` would have chosen without this one. So are documents inside a
CUDA graph capture, where the host read cannot happen.

FA4 aligns causal masks and windows at the bottom right; they equal flexspec's top-left ones when
Q_LEN == KV_LEN, the only case this backend takes.
"""

from __future__ import annotations

import math

import torch

from flexspec import ir
from flexspec.ir.forms import NativeForm, native_form
from flexspec.limits import fits_int
from flexspec.runtime import fa4
from flexspec.runtime.capture import capturing
from flexspec.runtime.contract import Backend, Prepared, Replan
from flexspec.runtime.identity import identity
from flexspec.runtime.step import NO_STEP

# Why a call with documents may be handed back (see the module docstring).
HANDS_BACK = ("document ids that are not contiguous runs, which FA4's own kernels cannot run, "
              "or documents inside a CUDA graph capture")
NOT_RUNS = "document ids that are not contiguous runs"
CAPTURED = "documents inside a CUDA graph capture (their lengths need a host read)"


def document_segments(ids: torch.Tensor) -> tuple | None:
    """The cumulative lengths (int32, ``[n + 1]``) of the ``n`` documents of ``ids``
    (``[B, S]``, rows laid end to end) and the longest one, or ``None`` when some row's ids are
    not contiguous runs of distinct documents (an id that comes back after another).

    O(S) work on the device and one host read (the number of documents decides the size of the
    result); ids that decrease somewhere (which may or may not come back) take a sort per row
    and a second read.

    >>> lengths, longest = document_segments(torch.tensor([[0, 0, 1, 1, 1], [5, 5, 5, 5, 7]]))
    >>> lengths.tolist(), longest
    ([0, 2, 5, 9, 10], 4)
    >>> document_segments(torch.tensor([[0, 0, 1, 1, 0]])) is None
    True
    """
    batch, length = ids.shape
    starts = torch.ones(batch, length, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    decreasing = (ids[:, 1:] < ids[:, :-1]).any()
    # each run's length, counted at its last position: its distance to the run's start
    position = torch.arange(length, device=ids.device).expand(batch, length)
    run_start = torch.where(starts, position, 0).cummax(dim=1).values
    longest = (position - run_start).max() + 1
    count, decreasing, longest = torch.stack((starts.sum(), decreasing.long(), longest)).tolist()
    if decreasing and not _runs_are_distinct(ids, starts):
        return None
    first = torch.nonzero_static(starts.reshape(-1), size=count).reshape(-1)
    total = torch.full((1,), batch * length, dtype=first.dtype, device=ids.device)
    return torch.cat((first, total)).to(torch.int32), longest


def _step_segments(step, ids: torch.Tensor, batch: int, length: int):
    """:func:`document_segments` of ``ids`` (or :data:`NOT_RUNS`), made once per step for the
    same unchanged ids: kept by their identity, with the ids alive (a key by ``id()`` of a view
    made for one call could be taken by another call's ids once the view is freed)."""
    seen = identity(ids)
    if seen is None:  # an inference tensor: its changes cannot be seen
        return document_segments(ids.expand(batch, length)) or NOT_RUNS
    return step.shared(("segments", seen, batch, length),
                       lambda: (ids, document_segments(ids.expand(batch, length)) or NOT_RUNS))[1]


def _runs_are_distinct(ids: torch.Tensor, starts: torch.Tensor) -> bool:
    """Whether every row has as many runs as distinct ids (no id comes back)."""
    ordered = ids.sort(dim=1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)
    return bool((starts.sum(1) == distinct).all())


class NativeBackend(Backend):
    name = "fa4"

    def cannot_run(self, spec):
        return None if native_form(spec) is not None else _not_native(spec)

    def why_not(self, request, spec):
        unavailable = fa4.unavailable(request, "FA4's own interface")
        if unavailable is not None:
            return unavailable
        form = native_form(spec)
        if form is None:
            return _not_native(spec)
        if form.documents is not None and not fits_int(request.batch * request.q_len, "int32"):
            return (f"FA4's cumulative sequence lengths are int32: {request.batch} rows of "
                    f"{request.q_len} positions ({request.batch * request.q_len:,}) do not fit")
        if request.q_len != request.kv_len:
            return ("FA4 aligns causal masks and windows at the bottom right, flexspec at the "
                    f"top left: they agree only when Q_LEN == KV_LEN, got {request.q_len} and "
                    f"{request.kv_len}")
        return None

    def auto_veto(self, request, spec):
        small = fa4.too_small(request, "FA4's own interface")
        if small is not None:
            return small
        if native_form(spec).softcap is not None:
            return ("FA4's own softcap ran slower than FlexAttention's FLASH kernel "
                    "(docs/performance.md, the order auto tries)")
        return None

    def facts(self, device):
        return fa4.facts(device)

    def prepare(self, plan, values):
        form = native_form(plan.spec)
        documents = form.documents is not None
        return Prepared(state=form, needs_values=documents,
                        hands_back=HANDS_BACK if documents else None)

    def run(self, plan, q, k, v, scale, bindings, values, step=NO_STEP):
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        form: NativeForm = plan.state
        segments = None
        if form.documents is not None:
            batch, length = q.shape[0], q.shape[2]
            ids = values[ir.tensor_key(form.documents)]
            # boundaries the step was given need no look at the ids; else one look per step
            segments = step.segments(bindings.get(form.documents.name))
            if segments is None:
                if capturing(q.device):
                    raise Replan(CAPTURED)
                segments = _step_segments(step, ids, batch, length)
                if segments is NOT_RUNS:
                    raise Replan(NOT_RUNS)
        if plan.detach:
            q, k, v = q.detach(), k.detach(), v.detach()
        base = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        options = {"softmax_scale": base * form.factor, "causal": form.causal,
                   "window_size": form.window, "softcap": form.softcap or 0.0}
        if plan.request.lse:
            options["return_lse"] = True
        # FA4 takes (batch, sequence, heads, dim): a transposed view, free when q, k and v are
        # themselves views of such tensors (the usual layout after the projections)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if segments is None:
            out, lse = flash_attn_func(q, k, v, **options)
            out = out.transpose(1, 2)  # lse is (batch, heads, sequence) already
        else:
            cumulative, longest = segments
            flat = [t.reshape(batch * length, *t.shape[2:]) for t in (q, k, v)]
            out, lse = flash_attn_varlen_func(*flat, cu_seqlens_q=cumulative,
                                              cu_seqlens_k=cumulative, max_seqlen_q=longest,
                                              max_seqlen_k=longest, **options)
            out = out.reshape(batch, length, *out.shape[1:]).transpose(1, 2)
            # the variable-length lse is (heads, rows laid end to end)
            lse = None if lse is None else lse.unflatten(1, (batch, length)).transpose(0, 1)
        return (out, lse) if plan.request.lse else out


def _not_native(spec: ir.AttentionIR) -> str:
    return ("FA4's own kernels run full or causal attention, sliding windows and documents "
            "(`doc_ids[b, q] == doc_ids[b, kv]`), times a constant and soft-capped; this spec "
            f"has mask `{ir.to_text(spec.mask)}` and score `{ir.to_text(spec.score)}`")


BACKEND = NativeBackend()
