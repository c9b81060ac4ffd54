"""Absolute query positions and valid cache lengths: how a call's ``q_offset`` and ``kv_lengths``
enter the spec.

A spec's ``q`` is an absolute position: row ``i`` of a call stands at ``q_offset + i``. The
runtime turns both call arguments into tensors the IR reads like any binding, so new values are
new tensor contents, never new code (no recompilation):

* ``q_offset`` (an int, or an int tensor with one offset per batch row) becomes the tensor
  ``q_offset: int[B]``, and every ``q`` of the spec reads ``q + q_offset[b]`` (the rewrite is
  :func:`flexspec.ir.rewrites.placed`). Without it, the
  offset is 0, or ``KV_LEN - Q_LEN`` for a spec aligned at the end (``causal_bottom_right``);
* ``kv_lengths`` (an int tensor ``[B]``: how many keys of a preallocated cache are valid in each
  batch row) adds ``kv < kv_lengths[b]`` to the mask; an end-aligned spec then counts from each
  row's own end: ``q_offset = kv_lengths - Q_LEN``.

Both names are reserved: a spec's own bindings cannot take them (the checker says so).
This module makes and checks the tensors; the IR they enter is rewritten in ``ir.rewrites``.
"""

from __future__ import annotations

import functools

import torch

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.ir.intervals import Analyzer, ScalarOps
from flexspec.ir.rewrites import KV_LENGTHS, Q_OFFSET, default_offset, reads_positions
from flexspec.limits import check_position

# Ints given as q_offset are turned into tensors once per (value, device): the block-mask cache
# then sees the same tensor when the same offset comes again.
_OFFSET_TENSORS_KEPT = 256


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
    if q_offset is None and reads_positions(spec):
        q_offset = default_offset(spec.align, q_len, kv_len, added.get(KV_LENGTHS))
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
