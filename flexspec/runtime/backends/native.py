"""The ``fa4`` backend: FlashAttention-4's own kernels (``flash_attn.cute.flash_attn_func`` and
``flash_attn_varlen_func``) for specs whose structure they implement natively, with no block
mask: full or causal attention, sliding windows, and packed documents given as contiguous runs of
ids (run as variable-length sequences), optionally with a constant scale and a softcap.

:func:`flexspec.ir.forms.native_form` reads that structure off the IR. Documents need one look at the ids per call
(:func:`document_segments`, O(S) on the device plus one host read of the number of documents):
ids that are not contiguous runs, such as ``[0, 0, 1, 1, 0]``, are valid flexspec documents that
FA4's variable-length interface cannot express, so those calls run on the backend ``auto`` would
have chosen without this one. So do documents inside a CUDA graph capture, where the host read
cannot happen; the first call outside one builds that backend's block mask once, so that a
capture after a warm-up does not compile its program.

FA4 aligns causal masks and windows at the bottom right; they equal flexspec's top-left ones when
Q_LEN == KV_LEN, the only case this backend takes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.ir.forms import NativeForm, native_form
from flexspec.limits import fits_int
from flexspec.runtime.backends.base import (REGISTRY, Backend, BackendError, Choice, Rank,
                                            Request, auto_order)
from flexspec.runtime.backends.flash import fa4_unavailable, too_small
from flexspec.runtime.inputs import capturing


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


def _runs_are_distinct(ids: torch.Tensor, starts: torch.Tensor) -> bool:
    """Whether every row has as many runs as distinct ids (no id comes back)."""
    ordered = ids.sort(dim=1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)
    return bool((starts.sum(1) == distinct).all())


@dataclass(eq=False)
class NativeCall:
    """What a plan of this backend keeps: the form, and for documents the plan of the backend
    that runs calls whose ids are not contiguous runs."""

    form: NativeForm
    fallback: object = None  # a Plan, or the BackendError that says why there is none
    masks: object = None     # the plan's BlockMasks, which build the fallback's block masks
    fallback_warm: bool = False  # the fallback's block mask was built once outside a capture


class NativeBackend(Backend):
    name = "fa4"

    def cannot_run(self, spec):
        return None if native_form(spec) is not None else _not_native(spec)

    def why_not(self, request, spec):
        unavailable = fa4_unavailable(request, "FA4's own interface")
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

    def rank(self, request: Request) -> Rank | None:
        if request.device_type != "cuda":
            return None
        # ahead of FLASH (place 0): every place on a device is distinct, so the order is the
        # places' and never the registry's
        return Rank(-1, "FA4's own kernels ran this structure (causal, windows, documents as "
                       "variable-length sequences) faster than any block-sparse kernel on the "
                       "H200, and need no block mask")

    def auto_veto(self, request, spec):
        small = too_small(request, "FA4's own interface")
        if small is not None:
            return small
        if native_form(spec).softcap is not None:
            return ("FA4's own softcap ran at 0.90x the speed of FlexAttention's FLASH kernel "
                    "(causal + softcap(30), 4x16x8192x128, H200)")
        return None

    def prepare(self, plan, values, masks):
        form = native_form(plan.spec)
        call = NativeCall(form, masks=masks)
        if form.documents is not None:
            call.fallback = _fallback_plan(plan, values, masks)
            plan.needs_values = True
        plan.prepared = call

    def run(self, plan, q, k, v, scale, bindings, values):
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        call: NativeCall = plan.prepared
        form = call.form
        segments = None
        if form.documents is not None:
            batch, length = q.shape[0], q.shape[2]
            ids = values[ir.tensor_key(form.documents)]
            # cumulative lengths need a host read, which a CUDA graph capture cannot make: there
            # the fallback runs the documents (its block mask is built inside the graph)
            segments = None if capturing(q.device) else document_segments(
                ids.expand(batch, length))
            if segments is None:
                if isinstance(call.fallback, BackendError):
                    raise call.fallback
                return call.fallback.backend.run(call.fallback, q, k, v, scale, bindings, values)
            if not call.fallback_warm:
                call.fallback_warm = True
                _warm_fallback_mask(call, values, q.device)
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


def _warm_fallback_mask(call: NativeCall, values: dict, device) -> None:
    """Builds the fallback's block mask once, outside any capture. A CUDA graph captured after a
    warm-up runs the documents on the fallback (see ``run``), whose block-mask program would
    otherwise compile for the first time inside the capture, which can fail."""
    fallback = call.fallback
    if call.masks is None or isinstance(fallback, BackendError):
        return
    try:
        call.masks.get(fallback.spec, fallback.sizes, values, device, fallback.mask)
    except BindingError:
        # a mask the fallback could not build (too large): FA4's own call needs none, and a
        # capture, which would need it, gets the same error then
        pass


def _fallback_plan(plan, values, masks):
    """A copy of ``plan`` for the backend ``auto`` would take without this one, prepared: it runs
    the calls whose document ids are not contiguous runs. A :class:`BackendError` saying why
    when no other backend can."""
    rejected = []
    for name, because in auto_order(plan.request):
        if name == NativeBackend.name:
            continue
        backend = REGISTRY[name]
        reason = backend.why_not(plan.request, plan.spec) or backend.auto_veto(plan.request,
                                                                                plan.spec)
        if reason is not None:
            rejected.append((name, reason))
            continue
        choice = Choice(name, f"{because} (document ids that are not contiguous runs, which "
                              "FA4's own kernels cannot run)", tuple(rejected))
        fallback = dataclasses.replace(
            plan, choice=choice, backend=backend, prepared=None,
            mask=masks.key(plan.spec, plan.sizes, plan.device, backend.cute))
        backend.prepare(fallback, values, masks)
        return fallback
    reasons = "; ".join(f"{name}: {reason}" for name, reason in rejected)
    return BackendError("FA4's own kernels cannot run document ids that are not contiguous runs "
                        f"(an id that comes back after another), and no other backend can run "
                        f"this call ({reasons})")


def _not_native(spec: ir.AttentionIR) -> str:
    return ("FA4's own kernels run full or causal attention, sliding windows and documents "
            "(`doc_ids[b, q] == doc_ids[b, kv]`), times a constant and soft-capped; this spec "
            f"has mask `{ir.to_text(spec.mask)}` and score `{ir.to_text(spec.score)}`")


__all__ = ["NativeBackend", "document_segments"]
