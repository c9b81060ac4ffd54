"""Absolute query positions and valid cache lengths: how a call's ``q_offset`` and ``kv_lengths``
enter the spec.

A spec's ``q`` is an absolute position: row ``i`` of a call stands at ``q_offset + i``. The
runtime turns both call arguments into tensors the IR reads like any binding, so new values are
new tensor contents, never new code (no recompilation):

* ``q_offset`` (an int, or an int tensor with one offset per batch row) becomes the tensor
  ``q_offset: int[B]``, and every ``q`` of the spec reads ``q + q_offset[b]`` (the rewrite is
  :func:`flexspec.ir.rewrites.placed`). Without it, the offset is 0, or ``KV_LEN - Q_LEN`` for a
  spec aligned at the end (``causal_bottom_right``);
* ``kv_lengths`` (an int tensor ``[B]``: how many keys of a preallocated cache are valid in each
  batch row) adds ``kv < kv_lengths[b]`` to the mask; an end-aligned spec then counts from each
  row's own end: ``q_offset = kv_lengths - Q_LEN``.

Both names are reserved: a spec's own bindings cannot take them (the checker says so).
:class:`Placement` is one spec's policy: which calls need the tensors at all, the spec each way of
placing rows reads, which slice of the keys a call's rows may see at all (a window's: the call
then reads only that slice), and whether they provably see every key (then it runs unmasked).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError
from flexspec.ir.forms import distance_span
from flexspec.ir.intervals import always
from flexspec.ir.overflow import length_buckets, position_range, position_ranges
from flexspec.ir.rewrites import KV_LENGTHS, Q_OFFSET, default_offset, placed, reads_positions
from flexspec.limits import POSITION_LIMIT, check_position, kernel_int_dtype
from flexspec.runtime.bindings import Tensors
from flexspec.runtime.capture import capturing, in_graph_memory
from flexspec.runtime.checks import as_device, check_qkv
from flexspec.runtime.identity import KeptByIdentity, identity, remember_range

# Ints given as q_offset are turned into tensors once per (value, device): the block-mask cache
# then sees the same tensor when the same offset comes again.
_OFFSET_TENSORS_KEPT = 256
# Calls whose "sees every key" answer is kept per Placement (then forgotten all at once).
_SEEN_KEPT = 64
# The position tensors of calls at an int offset (or none), kept per Placement (then forgotten
# all at once): checked once, then the same tensors for every call there.
_PLACED_KEPT = 64
# Device tensors clamped into their range, kept by the identity of the tensor given: a caller
# that passes the same unchanged tensor again gets the same clamped one, so the block-mask cache
# (keyed by tensor identity) finds its mask instead of building it anew on every call.
_CLAMPED_KEPT = 16


class Placement:
    """Where one spec's calls put their queries (see the module docstring)."""

    def __init__(self, spec: ir.AttentionIR):
        self.ir = spec
        # an end-aligned spec that reads positions places its rows even without q_offset
        self.default_offset = spec.align == "end" and reads_positions(spec)
        # a Tensors per way a call places its queries: (q_offset read, kv_lengths read)
        self._tensors = {(False, False): Tensors(spec)}
        self._sees: dict = {}
        self._placed_ints: dict = {}  # (int offset or None, sizes, device) -> tensors added
        self._span = distance_span(spec)

    def tensors_for(self, bindings: dict) -> Tensors:
        """The gatherer of the spec as placed by the position tensors ``bindings`` hold."""
        variant = (Q_OFFSET in bindings, KV_LENGTHS in bindings)
        tensors = self._tensors.get(variant)
        if tensors is None:
            tensors = self._tensors[variant] = Tensors(placed(self.ir, *variant))
        return tensors

    def bindings(self, bindings: dict, q_offset, kv_lengths, sizes: dict, device) -> dict:
        """``bindings`` with the tensors that place the queries, when the call or the spec's
        alignment asks for them (``sizes``: the call's ``B H Q_LEN KV_LEN``)."""
        if q_offset is None and kv_lengths is None and not self.default_offset:
            return bindings
        host_known = kv_lengths is None and (q_offset is None or type(q_offset) is int)
        key = (q_offset, sizes["B"], sizes["H"], sizes["Q_LEN"], sizes["KV_LEN"], str(device))
        added = self._placed_ints.get(key) if host_known else None
        if added is None:
            device = as_device(device)
            added = call_tensors(self.ir, q_offset, kv_lengths, sizes, device)
            # a decode step at a known offset: its tensors are made once (not inside a CUDA
            # graph capture, whose tensors nothing may keep)
            if host_known and not capturing(device):
                if len(self._placed_ints) >= _PLACED_KEPT:
                    self._placed_ints.clear()
                self._placed_ints[key] = added
        return {**bindings, **added} if added else bindings

    def for_call(self, q, k, bindings: dict, q_offset, kv_lengths) -> dict:
        """:meth:`bindings` for a call, sized by q and k (checked first when they are not what
        a call takes, so that the error names them)."""
        if type(q_offset) is int and q_offset == 0 and not self.default_offset:
            # where the queries stand anyway (transformers' integration passes it on every
            # call): the spec runs as written, so forms such as fa4's documents still apply
            q_offset = None
        if q_offset is None and kv_lengths is None and not self.default_offset:
            return bindings
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and q.dim() == k.dim() == 4):
            check_qkv(q, k, k)
        sizes = {"B": q.shape[0], "H": q.shape[1], "Q_LEN": q.shape[2], "KV_LEN": k.shape[2]}
        return self.bindings(bindings, q_offset, kv_lengths, sizes, q.device)

    def for_reference(self, q_offset, kv_lengths, sizes: dict, device) -> tuple:
        """``(q_offset, kv_lengths)`` of a call, checked as a call checks them but for the
        kernels' ranges (the reference computes every position exactly, and checks its own
        arithmetic at them), for the reference, which places an end-aligned spec's rows
        itself."""
        checked = call_tensors(self.ir, q_offset, kv_lengths, sizes, as_device(device),
                               kernels=False)
        return (checked.get(Q_OFFSET) if q_offset is not None else None,
                checked.get(KV_LENGTHS))

    def read_keys(self, q, k, v, q_offset, kv_lengths) -> tuple:
        """``(k, v, q_offset, keys)`` of a call as it runs: its keys and values cut to the
        slice its rows may see (:meth:`visible_keys`) with the offset moved by as much, and
        ``keys`` the ``(start, end, KV_LEN)`` of that slice; the call as given (``keys`` None)
        where nothing is cut."""
        visible = self.visible_keys(q, k, v, q_offset, kv_lengths)
        if visible is None:
            return k, v, q_offset, None
        start, end, q_offset = visible
        return k[:, :, start:end], v[:, :, start:end], q_offset, (start, end, k.shape[2])

    def _known_rows(self, q, k, q_offset, kv_lengths) -> tuple | None:
        """``(q_offset, Q_LEN, KV_LEN)`` of a call whose rows' positions the host knows (an int
        ``q_offset`` or none, which is the spec's default place, and no ``kv_lengths``), with q
        and k that are what a call takes; ``None`` otherwise."""
        if (kv_lengths is not None
                or not (q_offset is None or (isinstance(q_offset, numbers.Integral)
                                             and not isinstance(q_offset, bool)))
                or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                        and q.dim() == k.dim() == 4)):
            return None
        q_len, kv_len = q.shape[2], k.shape[2]
        if q_offset is None:
            q_offset = kv_len - q_len if self.default_offset else 0
        # before any slice or mask is decided from it: a call that then drops its positions
        # (every key seen) would never reach the check of call_tensors
        check_position(int(q_offset), "q_offset", error=BindingError)
        return int(q_offset), q_len, kv_len

    def visible_keys(self, q, k, v, q_offset, kv_lengths) -> tuple | None:
        """``(start, end, offset)`` when a call's rows provably see no key outside
        ``start:end`` of the cache and the spec is the same when every position moves by one
        amount (:func:`flexspec.ir.forms.distance_span`): the call may then run on
        ``k[:, :, start:end]`` with its rows at ``offset`` (a decoded token under a sliding
        window reads only its window, at any cache length). ``None`` where positions are not
        known on the host (a tensor offset, ``kv_lengths``) or nothing would be cut off, and for
        q, k, v that are not what a call takes (its checks then say what is wrong)."""
        span = self._span
        known = None if span is None else self._known_rows(q, k, q_offset, kv_lengths)
        if known is None or not (isinstance(v, torch.Tensor) and v.dim() == 4
                                 and v.shape[2] == k.shape[2]):
            return None
        q_offset, q_len, kv_len = known
        low, high = span
        start = 0 if high == math.inf else max(0, q_offset - int(high))
        end = kv_len if low == -math.inf else min(kv_len, q_offset + q_len - int(low))
        if end <= start or (start == 0 and end == kv_len):
            return None  # no key visible (the call says so itself), or nothing to cut
        return start, end, q_offset - start

    def sees_every_key(self, q, k, q_offset, kv_lengths) -> bool:
        """Whether a call's rows provably see every key (a decoded token under ``causal``):
        only for positions the host knows (an int ``q_offset`` or none, no ``kv_lengths``) and
        q and k that are what a call takes."""
        known = self._known_rows(q, k, q_offset, kv_lengths)
        if known is None:
            return False
        q_offset, q_len, kv_len = known
        batch, heads = q.shape[0], q.shape[1]
        key = (q_offset, batch, heads, q_len, kv_len)
        sees = self._sees.get(key)
        if sees is None:
            if len(self._sees) > _SEEN_KEPT:
                self._sees.clear()
            sizes = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
            sees = self._sees[key] = always(
                self.ir.mask, position_ranges(sizes, q_offset, q_offset + q_len - 1))
        return sees


def call_tensors(spec: ir.AttentionIR, q_offset, kv_lengths, sizes: dict, device, *,
                 kernels: bool = True) -> dict:
    """The tensors ``q_offset`` and ``kv_lengths`` a call adds to its bindings (either may be
    absent), checked: ints (NumPy's too) and int tensors of shape ``[B]`` or ``[1]`` on q's
    device, lengths within ``0 .. KV_LEN``, and (with ``kernels``) offsets that keep every row at
    a position where the spec's integer arithmetic fits the kernels' int dtype
    (:func:`flexspec.ir.overflow.position_range`).

    Values are refused with the range they must lie in where the host can read them: ints, and
    tensors on the CPU. A tensor on a GPU is bounded on the device instead (clamped into its
    range): reading it would cost a host synchronisation per step, and a captured step cannot
    read at all."""
    batch, q_len, kv_len = sizes["B"], sizes["Q_LEN"], sizes["KV_LEN"]
    added = {}
    if kv_lengths is not None:
        lengths = _per_row(KV_LENGTHS, kv_lengths, batch, device)
        added[KV_LENGTHS] = _bounded(lengths, 0, kv_len, "kv_lengths",
                                     f"0..{kv_len} (the keys given)")
    if q_offset is None and reads_positions(spec):
        q_offset = default_offset(spec.align, q_len, kv_len, added.get(KV_LENGTHS))
        name = "the end-aligned offset kv_lengths - Q_LEN"
    else:
        name = Q_OFFSET
    if q_offset is None:
        return added
    host_value = q_offset if isinstance(q_offset, numbers.Integral) else None
    offset = _per_row(Q_OFFSET, q_offset, batch, device)
    span = _positions_that_fit(spec, sizes, kernel_int_dtype(device.type), host_value) \
        if kernels and reads_positions(spec) else None
    if span is not None:
        low, high = span[0], span[1] - q_len + 1
        allowed = (f"{low}..{high}, so that rows stay at positions {low}..{span[1]}, where this "
                   f"spec's integer arithmetic fits the kernels' "
                   f"{kernel_int_dtype(device.type)} at Q_LEN={q_len}, KV_LEN={kv_len}")
    else:  # the bound an int offset has (check_position), for a tensor too
        low, high = -POSITION_LIMIT, POSITION_LIMIT - 1
        allowed = "+-2**62 (positions must stay well inside int64)"
    if host_value is not None:
        # an int is checked as it is: its tensor is the one kept per value (_int_tensor), which
        # the block-mask cache then recognises on the next call with this offset
        if not low <= int(host_value) <= high:
            raise BindingError(f"{name} must lie in {allowed}; got {int(host_value)}")
    else:
        offset = _bounded(offset, low, high, name, allowed)
    if reads_positions(spec):
        added[Q_OFFSET] = offset
    return added


def _positions_that_fit(spec: ir.AttentionIR, sizes: dict, dtype: str, offset) -> tuple | None:
    """:func:`~flexspec.ir.overflow.position_range` at these sizes. The range of the lengths'
    buckets first (sound for every length in them: a growing cache finds it again at the next
    length); for an int offset that lies inside it, that range; otherwise the exact one,
    searched from the bucket's (a tensor offset is bounded by the exact range: a narrower one
    would clamp offsets that fit)."""
    span = position_range(spec, tuple(sorted(length_buckets(sizes).items())), dtype)
    if offset is not None and span is not None and span[0] <= int(offset) \
            and int(offset) + sizes["Q_LEN"] - 1 <= span[1]:
        return span
    return position_range(spec, tuple(sorted(sizes.items())), dtype, span)


def _bounded(value: torch.Tensor, low: int, high: int, name: str, allowed: str,
             host_reads: bool | None = None) -> torch.Tensor:
    """``value`` (int64) with every entry in ``low .. high``: checked where the host may read it
    (``host_reads``; by default, on the CPU), clamped on the device elsewhere (see
    :func:`call_tensors`)."""
    if value.device.type == "cpu" if host_reads is None else host_reads:
        if value.numel():
            found_low, found_high = int(value.min()), int(value.max())
            if found_low < low or found_high > high:
                raise BindingError(f"{name} must lie in {allowed}; got {found_low}..{found_high}")
        return value
    return _clamped(value, low, high)


_clamped_kept = KeptByIdentity(_CLAMPED_KEPT)


def _clamped(value: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """``value.clamp(low, high)``, the same tensor again for the same unchanged ``value`` (see
    _CLAMPED_KEPT). Not kept inside a CUDA graph capture or the warm-up before one (the clamp
    must be recorded, and replays see new contents) nor for an inference tensor (its changes
    cannot be seen)."""
    seen = None if in_graph_memory(value.device) else identity(value)
    if seen is None:
        return value.clamp(low, high)

    def clamp():
        with torch.inference_mode(False):  # it serves calls in every mode, as _int_tensor does
            return value.clamp(low, high)
    return _clamped_kept.get((seen, low, high), value, clamp)


def _per_row(name: str, value, batch: int, device) -> torch.Tensor:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # a NumPy int is an int
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise BindingTypeError(f"{name} must be an int or an int tensor of shape [{batch}], "
                               f"got {type(value).__name__}")
    if isinstance(value, int):
        check_position(value, name, error=BindingError)
        if capturing(device):
            # made in the graph's memory pool, which nothing may keep: neither kept nor
            # remembered (a lookup it indexes is asserted on the device instead)
            return _int_tensor_made(value, batch, str(device))
        return _int_tensor(value, batch, str(device))
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise BindingError(f"{name} must hold ints, got dtype {value.dtype}")
    if value.dim() > 1 or (value.dim() == 1 and value.shape[0] not in (1, batch)):
        raise BindingError(f"{name} must be an int or an int tensor of shape [{batch}] (one per "
                           f"batch row) or [1], got shape {list(value.shape)}")
    if value.device != torch.device(device):
        raise BindingError(f"{name} is on {value.device}, but q is on {device}; move it with "
                           f".to('{device}')")
    return value.reshape(-1).to(torch.int64)


@functools.lru_cache(maxsize=_OFFSET_TENSORS_KEPT)
def _int_tensor(value: int, batch: int, device: str) -> torch.Tensor:
    made = _int_tensor_made(value, batch, device)
    remember_range(made, value, value)  # its lookups are then checked without a read
    return made


def _int_tensor_made(value: int, batch: int, device: str) -> torch.Tensor:
    # one entry per batch row, not one broadcast entry: a lookup then stays at index b, where a
    # single entry would be read at the constant index 0 (flexspec.workarounds:
    # flash-constant-index). Made outside inference mode, as it serves calls in every mode
    # (an inference tensor cannot be saved for a backward pass)
    with torch.inference_mode(False):
        return torch.full((batch,), value, dtype=torch.int64, device=device)

