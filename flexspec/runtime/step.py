"""One model step's shared attention inputs: :class:`Step`.

A model runs the same positions, lengths and documents through every layer of a step. Given as
``attn(q, k, v, step=step)``, a :class:`Step` holds them once, and what the runtime derives from
them (the position tensors of a spec, documents as FA4's variable-length segments, document ids
from boundaries) is computed by the step's first call that needs it and reused by every later
layer, so that a step costs one host read at most, never one per layer. The first layer's call
of a spec also resolves its launch (plan, keys read, block mask, score): a later layer whose q,
k and v have the same signature (:func:`launch_signature`) only launches the kernel. So the
step's tensors must not change while its layers run (a step is one step's inputs), and a CUDA
graph that captures a step captures one build of each block mask, which its layers share.

A paged step (``attn.paged(q, cache, step=step)``) names the slots its rows read, and for a
mixed batch each row's count of new tokens: ``Step(slots=..., new_tokens=...)``. Its first
layer's call makes the read of the pages (the block mask mapped to them, the mods, the plan),
which every later layer runs over its own cache; so every layer's cache must have had the same
appends and releases (the same pages) before the step's calls.

Documents are given as ids (``doc_ids=...``, any binding by name) or as boundaries:
``cu_seqlens`` (int ``[n + 1]``, the start of each of ``n`` documents in the rows laid end to
end, then the total, as FlashAttention's variable-length interface takes them) and, optionally,
``max_seqlen`` (the longest document; found with one host read per step where not given). A
spec reads them as the binding named ``documents`` (``doc_ids`` by default).
"""

from __future__ import annotations

import torch

from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime.capture import capturing


class Step:
    """What the attention calls of one model step share (see the module docstring)."""

    def __init__(self, *, q_offset=None, kv_lengths=None, cu_seqlens=None, max_seqlen=None,
                 documents: str = "doc_ids", slots=None, new_tokens=None, **bindings):
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                    or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                    or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
                raise BindingTypeError("cu_seqlens must be a 1-D int tensor of n + 1 document "
                                       f"starts (0 first, the total last), got {cu_seqlens!r}")
            if cu_seqlens.device.type == "meta":
                raise BindingError("cu_seqlens is on the meta device, which holds no values: "
                                   "give it on the device of q")
            if documents in bindings:
                raise BindingError(f"give the documents once: as cu_seqlens or as {documents}")
        if max_seqlen is not None:
            if cu_seqlens is None:
                raise BindingError("max_seqlen goes with cu_seqlens")
            if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 1:
                raise BindingTypeError(f"max_seqlen must be a positive int (the longest "
                                       f"document), got {max_seqlen!r}")
        if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
            check_bounds(cu_seqlens.tolist(), max_seqlen)
        if slots is not None and (not isinstance(slots, torch.Tensor) or slots.dim() != 1
                                  or slots.dtype.is_floating_point
                                  or slots.dtype == torch.bool):
            raise BindingTypeError(f"slots must be a 1-D int tensor of slot numbers, got "
                                   f"{slots!r}")
        if new_tokens is not None and slots is None:
            raise BindingError("new_tokens goes with slots (a paged step)")
        if slots is not None and (kv_lengths is not None or cu_seqlens is not None):
            raise BindingError("a paged step's lengths are its slots' in the cache: it takes no "
                               "kv_lengths or cu_seqlens")
        self.q_offset, self.kv_lengths = q_offset, kv_lengths
        self.slots, self.new_tokens = slots, new_tokens
        self.cu_seqlens, self.max_seqlen, self.documents = cu_seqlens, max_seqlen, documents
        self.bindings = bindings
        self._shared: dict = {}
        self._segments: dict = {}  # id of a document-ids tensor made here -> its segments
        # (id of a spec's calls, launch_signature) -> (those calls, the launch of their layers)
        self._launches: dict = {}

    def launch(self, calls, signature: tuple):
        """The launch kept for ``calls`` (one compiled spec's) at ``signature``, or ``None``."""
        found = self._launches.get((id(calls), signature))
        return found[1] if found is not None and found[0] is calls else None

    def keep_launch(self, calls, signature: tuple, launch) -> None:
        """Keep the launch the first layer of ``calls`` at ``signature`` resolved: every later
        layer's call is then that launch alone (its plan, positions, block mask and score are
        the first layer's)."""
        self._launches[(id(calls), signature)] = (calls, launch)

    def shared(self, key, make):
        """The value kept under ``key`` for this step, made by ``make()`` on the first ask.
        What is made inside a CUDA graph capture is kept apart from what is made outside one:
        a capture must record its own making, which replays then redo with the step's tensors
        as they are then."""
        key = (key, _capturing_now())
        found = self._shared.get(key)
        if found is None:
            found = self._shared[key] = make()
        return found

    def bindings_for(self, batch: int, length: int) -> dict:
        """The step's bindings for calls of ``batch`` rows of ``length`` positions: those given,
        and the document ids of ``cu_seqlens`` (made once, on the device)."""
        if self.cu_seqlens is None:
            return self.bindings
        return self.shared(("bindings", batch, length), lambda: self._with_ids(batch, length))

    def _with_ids(self, batch: int, length: int) -> dict:
        bounds = self.cu_seqlens.to(torch.int64)
        if bounds.device.type == "cpu" and int(bounds[-1]) != batch * length:
            raise BindingError(f"cu_seqlens ends at {int(bounds[-1])}, but the step's calls lay "
                               f"{batch} rows of {length} positions end to end "
                               f"({batch * length}): the last entry is the total")
        positions = torch.arange(batch * length, device=bounds.device)
        ids = (torch.searchsorted(bounds, positions, right=True) - 1).reshape(batch, length)
        self._segments[id(ids)] = (ids, self._cumulative(batch, length))
        return {**self.bindings, self.documents: ids}

    def _cumulative(self, batch: int, length: int) -> tuple:
        cumulative = self.cu_seqlens.to(torch.int32)
        longest = self.max_seqlen
        if longest is None and cumulative.device.type != "cpu":
            # the one host read of the step, which checks the bounds too
            read = cumulative.tolist()
            check_bounds(read, None, batch * length)
            longest = max(b - a for a, b in zip(read, read[1:]))
        elif longest is None:
            longest = int((cumulative[1:] - cumulative[:-1]).max())
        return cumulative, longest

    def segments(self, ids: torch.Tensor) -> tuple | None:
        """``(cumulative lengths, longest)`` of document ids this step made from ``cu_seqlens``
        (FA4's variable-length arguments, with no look at the ids), or ``None``."""
        found = self._segments.get(id(ids))
        return found[1] if found is not None and found[0] is ids else None


def check_bounds(bounds: list, max_seqlen: int | None, total: int | None = None) -> None:
    """A :class:`BindingError` unless ``bounds`` (``cu_seqlens`` read on the host) start at 0,
    never decrease and end at ``total`` (where known), and ``max_seqlen``, where given, is at
    least the longest document."""
    if bounds[0] != 0:
        raise BindingError(f"cu_seqlens must start at 0 (the first document's start), got "
                           f"{bounds[0]}")
    steps = [b - a for a, b in zip(bounds, bounds[1:])]
    if min(steps) < 0:
        at = steps.index(min(steps))
        raise BindingError(f"cu_seqlens must not decrease: {bounds[at]} then {bounds[at + 1]}")
    if total is not None and bounds[-1] != total:
        raise BindingError(f"cu_seqlens ends at {bounds[-1]}, but the step's calls lay {total} "
                           "positions end to end: the last entry is the total")
    if max_seqlen is not None and max_seqlen < max(steps):
        raise BindingError(f"max_seqlen is {max_seqlen}, but a document of cu_seqlens holds "
                           f"{max(steps)} positions: give the longest, or leave it out")


def _capturing_now() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA never started)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def launch_signature(q, k, v, scale, return_lse) -> tuple | None:
    """What must be the same for two layers' calls of one spec in one step to share a launch:
    the shapes, strides, dtypes and devices of q, k and v, whether they need gradients, the grad
    and inference modes, the scale, ``return_lse``, and whether a CUDA graph is being captured
    (a launch made outside a capture has its block mask built outside it). ``None`` for
    arguments that are not tensors (the whole path says what is wrong)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        return None
    device = q.device
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, device, k.device, v.device,
            q.requires_grad or k.requires_grad or v.requires_grad, torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), scale, return_lse, capturing(device))


class NoStep:
    """A call without a step: nothing is kept from one call to the next."""

    bindings: dict = {}
    q_offset = kv_lengths = slots = new_tokens = None

    def shared(self, key, make):
        return make()

    def bindings_for(self, batch: int, length: int) -> dict:
        return {}

    def segments(self, ids) -> None:
        return None


NO_STEP = NoStep()
