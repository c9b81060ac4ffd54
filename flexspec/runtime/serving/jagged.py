"""Attention over jagged batches: q, k and v as torch nested tensors with a ragged sequence
dimension (``layout=torch.jagged``, shaped ``(B, H, j, D)`` as SDPA takes them), run without
padding to the longest sequence and never across sequences.

The sequences are laid end to end in one row (the nested tensors' own values, no copy where
they are contiguous) and the spec runs there rewritten by
:func:`flexspec.ir.rewrites.packed`: its positions, batch row and lengths are each sequence's
own, read from small per-row tensors made on the device from the nested tensors' offsets, and
its mask keeps every query in its own sequence (the block mask then skips the tiles between
sequences). Forward and backward go through the packed call, on any backend.
"""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError
from flexspec.ir import rewrites
from flexspec.lang.spec import Spec


def is_jagged(value) -> bool:
    """Whether ``value`` is a nested tensor of the jagged layout."""
    return isinstance(value, torch.Tensor) and value.is_nested \
        and value.layout == torch.jagged


def jagged_batch(q, k, v, what: str = "a call") -> bool:
    """Whether q, k and v are a jagged batch (all nested tensors of the jagged layout); a
    :class:`BindingError` that says what to give where they mix layouts or a nested tensor is
    strided. ``what`` names the entry point in the message."""
    nested = [isinstance(t, torch.Tensor) and t.is_nested for t in (q, k, v)]
    if not any(nested):
        return False
    for name, tensor in zip("qkv", (q, k, v)):
        if isinstance(tensor, torch.Tensor) and tensor.is_nested \
                and tensor.layout != torch.jagged:
            raise BindingError(f"{name} is a nested tensor of the strided layout: {what} takes "
                               "nested tensors of the jagged layout (torch.nested.nested_tensor"
                               "(..., layout=torch.jagged))")
    if not all(nested):
        dense = [name for name, found in zip("qkv", nested) if not found]
        jagged = [name for name, found in zip("qkv", nested) if found]
        raise BindingTypeError(f"{dense[0]} must be a nested tensor of layout torch.jagged like "
                               f"{' and '.join(jagged)}, or q, k and v all dense tensors")
    return True


def why_not_packed(spec: ir.AttentionIR) -> str | None:
    """Why a spec cannot run over a jagged batch, or ``None``."""
    for tensor in spec.tensors():
        if tensor.origin == "binding":
            return (f"it reads the binding '{tensor.name}', whose rows and positions a jagged "
                    "batch does not have: pad the batch, or pass the sequences laid end to end "
                    "with documents (`& doc`)")
        if {"Q_LEN", "KV_LEN"} & ir.free_vars(tensor):
            return (f"its tensor '{tensor.name}' is sized by the sequence lengths, which differ "
                    "between the sequences of a jagged batch")
    if "B" in ir.direct_vars(spec.mask) | ir.direct_vars(spec.score):
        return "it reads the batch size B, which a jagged batch laid end to end does not keep"
    return None


def packed_spec(spec: Spec) -> Spec:
    """``spec`` with its IR rewritten for a jagged batch laid end to end (its text unchanged,
    for messages)."""
    why = why_not_packed(spec.ir)
    if why is not None:
        raise BindingError(f"'{spec}' cannot run over a jagged batch: {why}")
    return Spec(spec.expr, rewrites.packed(spec.ir), spec.library)


def _parts(name: str, value) -> tuple:
    """``(values (total, H, D), offsets [B + 1])`` of a jagged ``(B, H, j, D)`` tensor."""
    if not is_jagged(value):
        raise BindingTypeError(f"{name} must be a nested tensor of layout torch.jagged like q, "
                               f"got {type(value).__name__}")
    if value.dim() != 4 or getattr(value, "_ragged_idx", 2) != 2:
        raise BindingError(f"{name} must be a jagged tensor of shape (B, H, j, D), the ragged "
                           f"sequence dimension third (nested.transpose(1, 2) of a (B, j, H, D) "
                           f"one), got shape {tuple(value.shape)}")
    return value.transpose(1, 2).values(), value.offsets()


def jagged_call(calls, q, k, v, *, scale, return_lse: bool, bindings: dict,
                learnables: dict | None = None):
    """Attention of jagged ``q``, ``k``, ``v`` (see the module docstring) through ``calls``, the
    call path (:class:`~flexspec.runtime.calls.Calls`) of the spec rewritten by
    :func:`packed_spec`: a jagged ``(B, H, j, Dv)`` output (and the log-sum-exp, ``(B, H, j)``
    jagged, with ``return_lse``). ``learnables`` are a module's tables (``SpecAttention``), by
    tensor key."""
    if bindings:
        raise BindingError(f"a jagged batch takes no bindings; got {', '.join(sorted(bindings))}")
    (q_rows, q_starts), (k_rows, k_starts), (v_rows, v_starts) = (
        _parts(name, value) for name, value in (("q", q), ("k", k), ("v", v)))
    if q_starts.shape != k_starts.shape:
        raise BindingError(f"q holds {q_starts.shape[0] - 1} sequences, k "
                           f"{k_starts.shape[0] - 1}: they must hold as many")
    # offsets on the CPU are compared; on a GPU only the totals (a comparison is a host read)
    same = k_rows.shape[0] == v_rows.shape[0] and (
        k_starts is v_starts or k_starts.device.type != "cpu"
        or (k_starts.shape == v_starts.shape and torch.equal(k_starts, v_starts)))
    if not same:
        raise BindingError("k and v must hold sequences of the same lengths")
    read = {tensor.name for tensor in calls.ir.bindings()}
    tables = {name: table for name, table in sequence_tables(
        q_starts, k_starts, q_rows.shape[0], k_rows.shape[0]).items() if name in read}
    out = calls(q_rows.transpose(0, 1).unsqueeze(0), k_rows.transpose(0, 1).unsqueeze(0),
                v_rows.transpose(0, 1).unsqueeze(0), bindings=tables, scale=scale,
                return_lse=return_lse, learnables=learnables)
    lse = None
    if return_lse:
        out, lse = out
    result = torch.nested.nested_tensor_from_jagged(out[0].transpose(0, 1).contiguous(),
                                                    offsets=q_starts).transpose(1, 2)
    if not return_lse:
        return result
    return result, torch.nested.nested_tensor_from_jagged(
        lse[0].transpose(0, 1).contiguous(), offsets=q_starts).transpose(1, 2)


def sequence_tables(q_starts: torch.Tensor, kv_starts: torch.Tensor, q_total: int,
                    kv_total: int) -> dict:
    """The per-row tensors :func:`flexspec.ir.rewrites.packed` reads, made on the device from
    the offsets (no host read: the totals come from the tensors' shapes)."""
    q_starts, kv_starts = q_starts.long(), kv_starts.long()
    sequences = torch.arange(q_starts.shape[0] - 1, device=q_starts.device)
    q_lengths, kv_lengths = q_starts.diff(), kv_starts.diff()
    q_sequence = torch.repeat_interleave(sequences, q_lengths, output_size=q_total)
    kv_sequence = torch.repeat_interleave(sequences, kv_lengths, output_size=kv_total)
    q_rows = torch.arange(q_total, device=q_starts.device)
    kv_rows = torch.arange(kv_total, device=kv_starts.device)
    return {rewrites.Q_SEQUENCE.name: q_sequence,
            rewrites.Q_POSITION.name: q_rows - q_starts[q_sequence],
            rewrites.Q_LENGTH.name: q_lengths[q_sequence],
            rewrites.KV_LENGTH.name: kv_lengths[q_sequence],
            rewrites.KV_SEQUENCE.name: kv_sequence,
            rewrites.KV_POSITION.name: kv_rows - kv_starts[kv_sequence]}
