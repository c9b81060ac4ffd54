"""The ``fa4`` backend: FlashAttention-4's own kernels (``flash_attn.cute.flash_attn_func`` and
``flash_attn_varlen_func``) for specs whose structure they implement natively, with no block
mask: full or causal attention, sliding windows, and packed documents given as contiguous runs of
ids (run as variable-length sequences), optionally with a constant scale and a softcap.

:func:`native_form` reads that structure off the IR. Documents need one look at the ids per call
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
import functools
import math
from dataclasses import dataclass

import torch

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.ir.forms import logit_factor
from flexspec.limits import fits_int
from flexspec.runtime.backends.base import (REGISTRY, Backend, BackendError, Choice, Rank,
                                            Request, auto_order)
from flexspec.runtime.backends.flash import fa4_unavailable, too_small
from flexspec.runtime.inputs import capturing


@dataclass(frozen=True)
class NativeForm:
    """A spec FA4's own interface runs: visible keys ``q - left <= kv <= q + right`` (``None``:
    unbounded on that side), within the query's document when ``documents`` names the ids, with
    logits times ``factor`` then soft-capped at ``softcap``."""

    left: int | None = None
    right: int | None = None
    documents: ir.Tensor | None = None
    softcap: float | None = None
    factor: float = 1.0

    @property
    def causal(self) -> bool:
        return self.left is None and self.right == 0

    @property
    def window(self) -> tuple:
        """FA4's ``window_size`` (``(None, None)``: no window)."""
        return (None, None) if self.causal else (self.left, self.right)


@functools.lru_cache(maxsize=512)
def native_form(spec: ir.AttentionIR) -> NativeForm | None:
    """The native form of ``spec``, or ``None`` when FA4's own kernels cannot run it exactly.

    >>> from flexspec import parse
    >>> native_form(parse("sliding_window(1024)").ir)
    NativeForm(left=1024, right=0, documents=None, softcap=None, factor=1.0)
    >>> native_form(parse("causal & doc + softcap(30)").ir).documents.name
    'doc_ids'
    >>> native_form(parse("causal + alibi").ir) is None
    True
    """
    if spec.align != "start":
        return None
    low, high, documents = -math.inf, math.inf, None
    atoms = spec.mask.args if isinstance(spec.mask, ir.And) else (spec.mask,)
    for atom in atoms:
        if atom == ir.TRUE:
            continue
        tensor = _same_document(atom)
        if tensor is not None and documents in (None, tensor):
            documents = tensor
            continue
        bounds = _distance_bounds(atom)
        if bounds is None:
            return None
        low, high = max(low, bounds[0]), min(high, bounds[1])
    # FA4 takes non-negative window sizes: the diagonal must be visible
    if not low <= 0 <= high:
        return None
    score = _score_form(spec.score)
    if score is None:
        return None
    softcap, factor = score
    return NativeForm(left=None if high == math.inf else int(high),
                      right=None if low == -math.inf else int(-low),
                      documents=documents, softcap=softcap, factor=factor)


def _same_document(atom: ir.Expr) -> ir.Tensor | None:
    """``T`` when ``atom`` is ``T[b, q] == T[b, kv]`` (the batch index may be a broadcast 0)."""
    if not (isinstance(atom, ir.Binary) and atom.op == "=="):
        return None
    left, right = atom.left, atom.right
    if not (isinstance(left, ir.Lookup) and isinstance(right, ir.Lookup)
            and left.tensor == right.tensor and len(left.index) == 2):
        return None
    row = left.index[0]
    if right.index[0] != row or row not in (ir.Var("b"), ir.Const(0)):
        return None
    if {left.index[1], right.index[1]} != {ir.Var("q"), ir.Var("kv")}:
        return None
    return left.tensor


def _distance_bounds(atom: ir.Expr) -> tuple | None:
    """``(low, high)`` with ``atom`` equivalent to ``low <= q - kv <= high`` (ints or
    infinities), or ``None`` when it is not a bound on the distance."""
    if not isinstance(atom, ir.Binary) or atom.op not in ir.COMPARE_OPS:
        return None
    if (atom.op == "<=" and isinstance(atom.left, ir.Call) and atom.left.fn == "abs"
            and isinstance(atom.right, ir.Const) and type(atom.right.value) is int):
        inner = _difference(atom.left.args[0])
        if inner is None or abs(inner[0]) != 1 or inner[1] != 0:
            return None
        return (-atom.right.value, atom.right.value)
    difference = _difference(ir.Binary("-", atom.left, atom.right))
    if difference is None or difference[0] == 0:
        return None
    sign, constant = difference  # atom: sign * (q - kv) + constant  op  0
    op = atom.op if sign > 0 else {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(atom.op,
                                                                                   atom.op)
    bound = -constant * sign      # (q - kv)  op  bound
    if op == "==":
        return (bound, bound)
    if op == "<=":
        return (-math.inf, bound)
    if op == "<":
        return (-math.inf, bound - 1)
    if op == ">=":
        return (bound, math.inf)
    if op == ">":
        return (bound + 1, math.inf)
    return None  # "!=" is not a window


def _difference(node: ir.Expr) -> tuple | None:
    """``(s, c)`` when ``node`` equals ``s * (q - kv) + c`` for ints s and c, else ``None``."""
    linear = _linear(node)
    if linear is None:
        return None
    q, kv, constant = linear
    return (q, constant) if q == -kv else None


def _linear(node: ir.Expr) -> tuple | None:
    """``(a, b, c)`` with ``node == a*q + b*kv + c`` for int sums and differences of ``q``,
    ``kv`` and int constants."""
    if node == ir.Var("q"):
        return (1, 0, 0)
    if node == ir.Var("kv"):
        return (0, 1, 0)
    if isinstance(node, ir.Const) and type(node.value) is int:
        return (0, 0, node.value)
    if isinstance(node, ir.Unary) and node.op == "-":
        inner = _linear(node.operand)
        return None if inner is None else tuple(-n for n in inner)
    if isinstance(node, ir.Binary) and node.op in ("+", "-"):
        left, right = _linear(node.left), _linear(node.right)
        if left is None or right is None:
            return None
        sign = 1 if node.op == "+" else -1
        return tuple(a + sign * b for a, b in zip(left, right))
    return None


def _score_form(score: ir.Expr) -> tuple | None:
    """``(softcap, factor)`` when ``score`` is ``c * tanh(x / c)`` (softcap c) or ``x``, with x
    the logit times positive constants; ``None`` otherwise."""
    softcap = None
    if isinstance(score, ir.Binary) and score.op == "*":
        for cap, rest in ((score.left, score.right), (score.right, score.left)):
            if (isinstance(cap, ir.Const) and isinstance(rest, ir.Call) and rest.fn == "tanh"
                    and isinstance(rest.args[0], ir.Binary) and rest.args[0].op == "/"
                    and rest.args[0].right == cap):
                softcap, score = float(cap.value), rest.args[0].left
                break
    factor = logit_factor(score)
    if factor is None:
        return None
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        return None
    return softcap, factor


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


__all__ = ["NativeBackend", "NativeForm", "document_segments", "native_form"]
