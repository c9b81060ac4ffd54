"""The eager reference: what a spec's attention means, computed densely in float64.

The spec's mask and scores are evaluated on index grids by :mod:`flexspec.kernels.evaluate`
(the semantics of expressions) and attention is computed the textbook way, so every fast path
(the FlexAttention lowering, block masks, other backends) is tested against it. It has two
roles: the test oracle, and the ``reference`` backend of last resort (inputs in float64, CPU
backward passes, short CPU sequences). It must never import the lowering nor call
FlexAttention, or those tests would compare the code with itself.

Attention: logits ``q @ k^T * scale`` go through the score pipeline at every position, masked
positions become ``-inf``, then softmax, then the weighted sum of the values the row sees (a
value a row does not see, NaN or not, never reaches it). A query row with no finite logit
returns zeros (never NaN), as FlexAttention does.
"""

from __future__ import annotations

import math

import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.ir.overflow import (check_int_ranges, fits_int_ranges, length_buckets,
                                  position_ranges)
from flexspec.ir.rewrites import default_offset
from flexspec.kernels.evaluate import FLOAT as _FLOAT, INT as _INT
from flexspec.kernels.evaluate import as_bool, evaluate, index_grid, query_offsets
from flexspec.limits import MAX_DENSE_ARRAY_BYTES, check_dense

# The largest dense [B, H, Q_LEN, KV_LEN] float64 array the reference builds (its share of
# flexspec.limits.MEMORY_BUDGET), under the name the reference's callers know.
MAX_BYTES = MAX_DENSE_ARRAY_BYTES


def placement(spec: ir.AttentionIR, q_offset, kv_lengths, q_len: int, kv_len: int):
    """Where row 0 of a call stands: ``q_offset`` when given, else the spec's default
    (:func:`flexspec.ir.rewrites.default_offset`: 0 at the start, the last row on the last valid
    key at the end)."""
    if q_offset is not None:
        return q_offset
    if kv_lengths is not None:
        kv_lengths = torch.as_tensor(kv_lengths).to(_INT).reshape(-1)
    return default_offset(spec.align, q_len, kv_len, kv_lengths)


def check_ranges(spec: ir.AttentionIR, batch: int, heads: int, q_len: int, kv_len: int,
                 q_offset=None) -> None:
    """The spec's integer arithmetic must stay inside int64 at these sizes, with row 0 at
    ``q_offset`` (an int, an int tensor, or None): torch would wrap around silently."""
    low = high = 0
    if isinstance(q_offset, torch.Tensor) and q_offset.numel():
        low, high = int(q_offset.min()), int(q_offset.max())
    elif isinstance(q_offset, int):
        low = high = q_offset
    sizes = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
    last = high + q_len - 1
    widened = tuple(sorted(length_buckets(sizes).items()))
    # a decode that grows by one key a step checks once per doubling of its length and of its
    # query positions
    if fits_int_ranges(spec, widened, min(low, 0), 1 << max(last, 1).bit_length(), "int64"):
        return
    check_int_ranges(spec, position_ranges(sizes, low, last), "int64",
                     f"for B={batch}, H={heads}, Q_LEN={q_len}, KV_LEN={kv_len}"
                     + (f" and query positions from {low}" if low or high else ""))


def dense_mask(spec: ir.AttentionIR, batch: int, heads: int, q_len: int, kv_len: int,
               tensors: dict | None = None, device="cpu", *,
               max_bytes: int | None = None, q_offset=None, kv_lengths=None) -> torch.Tensor:
    """The mask as a bool tensor ``[batch, heads, q_len, kv_len]``: True where ``q`` sees ``kv``
    (row ``i`` standing at position ``q_offset + i``; keys from ``kv_lengths[b]`` on hidden)."""
    check_dense(batch, heads, q_len, kv_len, max_bytes)
    q_offset = placement(spec, q_offset, kv_lengths, q_len, kv_len)
    grid = index_grid(batch, heads, q_len, kv_len, device, q_offset)
    check_ranges(spec, batch, heads, q_len, kv_len, q_offset)
    mask = _mask_on(spec, grid, tensors, kv_lengths)
    return mask.expand(batch, heads, q_len, kv_len).contiguous()


def dense_scores(spec: ir.AttentionIR, logits: torch.Tensor, tensors: dict | None = None, *,
                 max_bytes: int | None = None, q_offset=None) -> torch.Tensor:
    """The score pipeline applied to float64 ``logits [B, H, Q_LEN, KV_LEN]`` (no masking)."""
    batch, heads, q_len, kv_len = logits.shape
    check_dense(batch, heads, q_len, kv_len, max_bytes)
    q_offset = placement(spec, q_offset, None, q_len, kv_len)
    grid = index_grid(batch, heads, q_len, kv_len, logits.device, q_offset)
    check_ranges(spec, batch, heads, q_len, kv_len, q_offset)
    return _scores_on(spec, grid, logits, tensors).expand(batch, heads, q_len, kv_len)


def _mask_on(spec: ir.AttentionIR, grid: dict, tensors: dict | None,
             kv_lengths=None) -> torch.Tensor:
    """The mask evaluated on an index grid (broadcastable bool); with ``kv_lengths`` (valid keys
    per batch row, ``[B]`` or ``[1]``), keys from ``kv_lengths[b]`` on are hidden too."""
    mask = as_bool(evaluate(spec.mask, grid, tensors or {}), spec.mask)
    if kv_lengths is None:
        return mask
    lengths = torch.as_tensor(kv_lengths, device=grid["kv"].device).to(_INT).reshape(-1, 1, 1, 1)
    return mask & (grid["kv"] < lengths)


def _scores_on(spec: ir.AttentionIR, grid: dict, logits: torch.Tensor,
               tensors: dict | None) -> torch.Tensor:
    """The score pipeline evaluated on an index grid whose ``score`` is ``logits`` (float64,
    broadcastable)."""
    grid = {**grid, ir.SCORE_VAR: logits.to(_FLOAT)}
    scores = evaluate(spec.score, grid, tensors or {})
    if scores.dtype == torch.bool:
        raise SpecError(f"the score pipeline '{ir.to_text(spec.score)}' is not numeric")
    return scores.to(_FLOAT)


def reference_attention(spec: ir.AttentionIR, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        *, scale: float | None = None, tensors: dict | None = None,
                        max_bytes: int | None = None, rows: torch.Tensor | None = None,
                        q_offset=None, kv_lengths=None, return_lse: bool = False):
    """Attention as the spec defines it, computed densely in float64, returned in ``q.dtype``.

    ``q`` is ``(B, Hq, Q_LEN, D)``, ``k`` and ``v`` are ``(B, Hkv, KV_LEN, D)`` (``v`` may have its
    own last dimension). With ``Hq`` a multiple of ``Hkv`` (grouped-query attention), query head
    ``h`` reads kv head ``h // (Hq // Hkv)``; the ``h`` and ``H`` the spec sees are the query
    head and ``Hq``. ``scale`` defaults to ``1 / sqrt(D)``.

    Row ``i`` of ``q`` stands at absolute position ``q_offset + i`` (``q_offset``: an int, or
    one per batch row as an int tensor ``[B]``; 0 when ``None``): ``q`` in the spec is that
    position. With ``kv_lengths`` (an int tensor ``[B]``), only the first ``kv_lengths[b]`` keys
    of batch row ``b`` are visible (a preallocated cache). ``rows`` (row numbers of ``q``) computes only those rows of the output,
    ``(B, Hq, len(rows), Dv)``: the same semantics at a fraction of the memory, to check long
    sequences.

    With ``return_lse``, returns ``(out, lse)``: ``lse`` is the natural logarithm of the sum of
    ``exp`` of the final scores over the visible keys, ``(B, Hq, rows)``, ``-inf`` for a row that
    sees no key; float32 (float64 when ``q`` is float64).
    """
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != dim:
        raise SpecError(f"q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} do not "
                        "fit together")
    if heads % kv_heads:
        raise SpecError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    q_offset = placement(spec, q_offset, kv_lengths, q_len, kv_len)
    grid = index_grid(batch, heads, q_len, kv_len, q.device, q_offset)
    check_ranges(spec, batch, heads, q_len, kv_len, q_offset)
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=_INT, device=q.device).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= q_len):
            raise SpecError(f"rows must lie in 0..{q_len - 1}")
        grid["q"] = rows.reshape(1, 1, -1, 1) + (0 if q_offset is None else
                                                 query_offsets(q_offset, batch, q.device))
        q = q[:, :, rows]
    n_rows = q.shape[2]
    check_dense(batch, heads, n_rows, kv_len, max_bytes)
    # query head h reads kv head h // group: the group's query rows are stacked on its kv head
    # (q as (B, Hkv, group * rows, D)), so keys and values are never copied per query head
    group = heads // kv_heads
    q64 = q.to(_FLOAT).reshape(batch, kv_heads, group * n_rows, dim)
    k64, v64 = k.to(_FLOAT), v.to(_FLOAT)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    shape = (batch, heads, n_rows, kv_len)

    logits = torch.matmul(q64, k64.transpose(-2, -1)).reshape(shape) * scale
    scores = _scores_on(spec, grid, logits, tensors).expand(shape)
    scores = torch.where(_mask_on(spec, grid, tensors, kv_lengths).expand(shape), scores,
                         -math.inf)

    # Softmax by hand so a row without any finite logit gives zeros instead of NaN.
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total > 0, total, 1.0)
    out = _weighted_values(weights.reshape(batch, kv_heads, group * n_rows, kv_len), v64)
    out = out.reshape(batch, heads, n_rows, v.shape[-1]).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.where(total > 0, torch.log(total) + row_max, -math.inf).squeeze(-1)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``weights @ values``, where a key of weight 0 contributes nothing, as in the sum the
    attention is: a matrix product would give ``0 * NaN = NaN`` and spread a non-finite value to
    every row of the head, also those that do not see it. A row that reads a NaN (or +inf and
    -inf in one column) gets NaN there, one that reads only +inf or only -inf gets it."""
    finite = torch.isfinite(values)
    out = torch.matmul(weights, torch.where(finite, values, 0.0))
    if bool(finite.all()):
        return out
    reads = (weights > 0).to(values.dtype)

    def read(where: torch.Tensor) -> torch.Tensor:
        return torch.matmul(reads, where.to(values.dtype)) > 0
    nan, plus, minus = read(values.isnan()), read(values == math.inf), read(values == -math.inf)
    out = torch.where(plus, math.inf, out)
    out = torch.where(minus, -math.inf, out)
    return torch.where(nan | (plus & minus), math.nan, out)
