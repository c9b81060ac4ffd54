"""Absolute query positions and valid cache lengths: how a call's ``q_offset`` and ``kv_lengths``
enter the spec.

A spec's ``q`` is an absolute position: row ``i`` of a call stands at ``q_offset + i``. The
runtime turns both call arguments into tensors the IR reads like any binding, so new values are
new tensor contents, never new code (no recompilation):

* ``q_offset`` (an int, or an int tensor with one offset per batch row) becomes the tensor
  ``q_offset: int[B]``, and every ``q`` of the spec reads ``q + q_offset[b]``. Without it, the
  offset is 0, or ``KV_LEN - Q_LEN`` for a spec aligned at the end (``causal_bottom_right``);
* ``kv_lengths`` (an int tensor ``[B]``: how many keys of a preallocated cache are valid in each
  batch row) adds ``kv < kv_lengths[b]`` to the mask; an end-aligned spec then counts from each
  row's own end: ``q_offset = kv_lengths - Q_LEN``.

Both names are reserved: a spec's own bindings cannot take them (the checker says so).
"""

from __future__ import annotations

import functools

import torch

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.ir.intervals import Analyzer, ScalarOps
from flexspec.limits import check_position

Q_OFFSET = "q_offset"
KV_LENGTHS = "kv_lengths"
_PER_ROW = (ir.Var("B"),)
OFFSET_TENSOR = ir.Tensor(Q_OFFSET, _PER_ROW, "int")
LENGTHS_TENSOR = ir.Tensor(KV_LENGTHS, _PER_ROW, "int")
# Ints given as q_offset are turned into tensors once per (value, device): the block-mask cache
# then sees the same tensor when the same offset comes again.
_OFFSET_TENSORS_KEPT = 256


@functools.lru_cache(maxsize=256)
def positioned(spec: ir.AttentionIR, offset: bool, lengths: bool) -> ir.AttentionIR:
    """``spec`` with ``q`` read as ``q + q_offset[b]`` (with ``offset``) and the mask limited to
    ``kv < kv_lengths[b]`` (with ``lengths``)."""
    mask, score = spec.mask, spec.score
    if offset:
        position = ir.Binary("+", ir.Var("q"), ir.Lookup(OFFSET_TENSOR, (ir.Var("b"),)))
        mask, score = (ir.substitute(mask, {"q": position}) if "q" in ir.free_vars(mask) else mask,
                       ir.substitute(score, {"q": position}) if "q" in ir.free_vars(score)
                       else score)
    if lengths:
        valid = ir.Binary("<", ir.Var("kv"), ir.Lookup(LENGTHS_TENSOR, (ir.Var("b"),)))
        mask = valid if mask == ir.TRUE else ir.And((mask, valid))
    # with the offset written into the IR, its q is the row number: aligned at the start (an
    # end-aligned IR would be shifted a second time by whoever places its rows, the reference)
    return ir.AttentionIR(mask, score, "start" if offset else spec.align)


def reads_positions(spec: ir.AttentionIR) -> bool:
    """Whether the spec reads ``q`` at all (else an offset changes nothing)."""
    return "q" in ir.free_vars(spec.mask) | ir.free_vars(spec.score)


def sees_every_key(spec: ir.AttentionIR, offset: int, batch: int, heads: int, q_len: int,
                   kv_len: int) -> bool:
    """Whether the mask provably holds for every query row (at positions ``offset ..
    offset + Q_LEN - 1``) and every key: a single decoded token under ``causal`` sees the whole
    cache, so that call is plain attention over all keys."""
    ranges = {"b": (0, batch - 1), "h": (0, heads - 1), "q": (offset, offset + q_len - 1),
              "kv": (0, kv_len - 1), "B": (batch, batch), "H": (heads, heads),
              "Q_LEN": (q_len, q_len), "KV_LEN": (kv_len, kv_len)}
    return bool(Analyzer(ScalarOps, ranges).boolean(spec.mask)[0])


def call_tensors(spec: ir.AttentionIR, q_offset, kv_lengths, batch: int, q_len: int,
                 kv_len: int, device) -> dict:
    """The tensors ``q_offset`` and ``kv_lengths`` a call adds to its bindings (either may be
    absent), checked: ints and int tensors of shape ``[B]`` or ``[1]`` on q's device, offsets
    that keep ``q + q_offset`` an int64, lengths within ``0..KV_LEN``."""
    added = {}
    if kv_lengths is not None:
        lengths = _per_row(KV_LENGTHS, kv_lengths, batch, device)
        if lengths.device.type == "cpu" or not torch.cuda.is_available():
            # the check reads the values; on a GPU it would cost a host synchronisation per step
            low, high = int(lengths.min()), int(lengths.max())
            if low < 0 or high > kv_len:
                raise BindingError(f"kv_lengths must lie in 0..{kv_len} (the keys given), got "
                                   f"{low}..{high}")
        added[KV_LENGTHS] = lengths
    if q_offset is None and spec.align == "end" and reads_positions(spec):
        if kv_lengths is not None:
            q_offset = added[KV_LENGTHS] - q_len
        else:
            q_offset = kv_len - q_len
    if q_offset is not None and reads_positions(spec):
        added[Q_OFFSET] = _per_row(Q_OFFSET, q_offset, batch, device)
    elif q_offset is not None:
        _per_row(Q_OFFSET, q_offset, batch, device)  # checked, then not needed
    return added


def _per_row(name: str, value, batch: int, device) -> torch.Tensor:
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise BindingError(f"{name} must be an int or an int tensor of shape [{batch}], got "
                           f"{type(value).__name__}")
    if isinstance(value, int):
        check_position(value, name, error=BindingError)
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
    # one entry per batch row, not one broadcast entry: a lookup then stays at index b, where a
    # single entry would be read at the constant index 0, which FLASH's code generator
    # (CuTeDSL) cannot compile
    return torch.full((batch,), value, dtype=torch.int64, device=device)
