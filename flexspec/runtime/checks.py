"""The checks of a call's q, k, v, its scale and the sizes a user gives: the sizes of a call, or
a :class:`BindingError` that says what is wrong and how to fix it."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime.notices import warn_once

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Sizes(NamedTuple):
    """The sizes a spec's IR reads."""

    B: int
    H: int
    Q_LEN: int
    KV_LEN: int

    def as_dict(self) -> dict:
        """The sizes as the kernels take them (``{"B": ..., "H": ..., ...}``)."""
        return self._asdict()


def check_qkv(q, k, v, *, allow_float64: bool = False) -> Sizes:
    """The sizes of a call, or a :class:`BindingError` saying what is wrong with q, k or v."""
    dtypes = FLOAT_DTYPES + ((torch.float64,) if allow_float64 else ())
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise BindingTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise BindingError(f"{name} must have 4 dimensions (B, H, S, D), got shape "
                               f"{list(t.shape)}")
        if t.dtype == torch.float64 and not allow_float64:
            raise BindingError(f"{name} has dtype torch.float64, which only the reference "
                               "backend runs (compile(..., backend='reference'), or "
                               ".reference(q, k, v)); the kernels take float32, float16 or "
                               "bfloat16")
        if t.dtype not in dtypes:
            allowed = "float32, float16, bfloat16" + (", float64" if allow_float64 else "")
            raise BindingError(f"{name} has dtype {t.dtype}; use {allowed}")
    if not (q.dtype == k.dtype == v.dtype):
        raise BindingError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise BindingError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        # block masks, lookup checks and tables read values, which meta tensors do not hold
        raise BindingError("q, k and v are on the meta device, which holds shapes but no values; "
                           "flexspec reads values (block masks, checks of indices, tables), so "
                           "run it on a real device (the output's shape is [B, Hq, Q_LEN, Dv])")
    batch, heads, q_len, dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise BindingError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != dim:
        raise BindingError(f"q and k must have the same head dimension, got {dim} and {k.shape[3]}")
    if v.shape[1:3] != k.shape[1:3]:
        raise BindingError(f"k {list(k.shape)} and v {list(v.shape)} must have the same heads "
                           "and length")
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise BindingError(f"{heads} query heads must be a multiple of {kv_heads} key/value heads"
                           + _layout_hint(q, k))
    if kv_heads > LIKELY_HEADS and kv_heads > k.shape[2]:
        warn_once(f"layout-{tuple(k.shape)}",
                  f"flexspec: k has shape {list(k.shape)}, read as (B, H, S, D): "
                  f"{kv_heads} heads of {k.shape[2]} positions. If it is (B, S, H, D), as "
                  "projections give before their transpose, pass q.transpose(1, 2), "
                  "k.transpose(1, 2) and v.transpose(1, 2) (views: no copy)")
    if q_len == 0 or k.shape[2] == 0:
        raise BindingError("q and k must have at least one position")
    if dim == 0 or v.shape[3] == 0:
        raise BindingError(f"the head dimension must be at least 1, got q/k {dim} and v "
                           f"{v.shape[3]}")
    return Sizes(batch, heads, q_len, k.shape[2])


# More heads than any model has: a dimension this long is more likely the sequence (see
# check_qkv's hint).
LIKELY_HEADS = 256


def _layout_hint(q, k) -> str:
    """A hint for inputs that look like (B, S, H, D) where (B, H, S, D) is read."""
    if q.shape[2] < q.shape[1] or k.shape[2] < k.shape[1]:
        return ("; q and k have more heads than positions: if they are (B, S, H, D), pass "
                "q.transpose(1, 2), k.transpose(1, 2) and v.transpose(1, 2)")
    return ""


def checked_scale(scale) -> float | None:
    """A call's ``scale`` as a Python float (NumPy numbers are numbers too), or ``None``; a
    :class:`BindingError` unless it is a finite number or ``None``."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) \
            or isinstance(scale, torch.Tensor) or not math.isfinite(scale):
        raise BindingError(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)


def given_sizes(q_len, kv_len, batch, heads) -> Sizes:
    """Sizes given by the user (``block_mask(q_len, kv_len, batch=...)``), checked."""
    sizes = Sizes(1 if batch is None else batch, 1 if heads is None else heads, q_len, kv_len)
    for name, value in zip(Sizes._fields, sizes):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BindingError(f"{name} must be a positive int, got {value!r}")
    return sizes


def as_device(device) -> torch.device:
    """A device as tensors report it ("cuda" becomes "cuda:0"), so comparisons are exact."""
    try:
        return torch.empty(0, device=device).device
    except Exception as err:  # RuntimeError, TypeError, or AssertionError from a torch built
        # without that device
        raise BindingError(f"cannot use device {device!r}: {err}") from None
