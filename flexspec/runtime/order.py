"""``auto``'s order: the one table that says which backends ``auto`` tries, best first, per layout
of the keys, device and mode (forward, or with gradients), each row with the reason ``auto``
takes that backend when it is the first that can run a call, and where the measurement behind
it is written down.

A row's ``layout`` is ``"contiguous"`` (keys and values as tensors) or ``"paged"`` (read in
place from the pages of a pool); its ``devices`` name device types (``"*"``: a device no other
row of that layout names); ``mode`` is ``"forward"``, ``"backward"`` or ``"any"``. The rows of a
call's layout, device and mode, in table order, are the order. ``auto`` takes the first backend
whose ``why_not`` and ``auto_veto`` say nothing; a row with a ``notice`` warns once when
``auto`` takes it (it is a slow path). A paged call that no row's backend reads in place is
copied out of its pages and runs as a contiguous call (its rows then decide).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexspec.runtime.contract import Request

_RULES = "docs/performance.md#why-the-backend-rules-are-what-they-are"
_PAGED = ("docs/performance.md#paged-decode-read-in-place-seventeenth-session-"
          "2026-12-04")


@dataclass(frozen=True)
class Row:
    """One place in ``auto``'s order (see the module docstring)."""

    devices: tuple
    mode: str
    backend: str
    reason: str
    measured: str = _RULES
    notice: str | None = None  # warned once (with {device}) when auto takes this row
    layout: str = "contiguous"


ORDER: tuple[Row, ...] = (
    # CUDA: FA4's own kernels, FA4 through FlexAttention, cuDNN SDPA, FlexAttention's Triton
    Row(("cuda",), "any", "fa4",
        "FA4's own kernels ran this structure (causal, windows, documents as variable-length "
        "sequences) faster than any block-sparse kernel, and need no block mask"),
    Row(("cuda",), "any", "flash",
        "FlashAttention-4 was the fastest kernel measured on Hopper for every spec at this "
        "size, forward and backward"),
    Row(("cuda",), "any", "sdpa",
        "plain full or causal attention: cuDNN SDPA beat FlexAttention's Triton kernel for it"),
    Row(("cuda",), "any", "flex",
        "FlexAttention runs every spec; its block mask skips the empty tiles"),
    # CPU and MPS: FlexAttention has no backward pass there
    Row(("cpu", "mps"), "forward", "sdpa",
        "plain full or causal attention: SDPA beat compiled FlexAttention for it on {device}"),
    Row(("cpu", "mps"), "forward", "flex",
        "FlexAttention runs every spec; its block mask skips the empty tiles"),
    Row(("cpu", "mps"), "forward", "reference",
        "sequences shorter than one block (128 positions) run densely: the compiled CPU kernel "
        "is wrong for them (flexspec.workarounds: cpu-short-sequences)"),
    Row(("cpu", "mps"), "backward", "sdpa", "SDPA has a backward pass on {device}"),
    Row(("cpu", "mps"), "backward", "reference",
        "FlexAttention has no backward pass on {device}; the dense reference has (slower, "
        "memory grows with Q_LEN * KV_LEN)",
        notice="flexspec: FlexAttention has no backward pass on {device}; inputs that require "
               "gradients run on the dense reference path instead (slower, memory grows with "
               "Q_LEN * KV_LEN)"),
    Row(("cpu", "mps"), "backward", "flex",
        "FlexAttention runs every spec; its block mask skips the empty tiles"),
    # every other device (XPU...): SDPA where it applies, FlexAttention, the dense reference
    Row(("*",), "any", "sdpa",
        "plain full or causal attention: SDPA beat compiled FlexAttention for it on {device}"),
    Row(("*",), "any", "flex", "FlexAttention runs every spec; its block mask skips the empty tiles"),
    Row(("*",), "any", "reference",
        "the dense reference runs every spec where the kernels cannot"),
    # paged keys and values read in place (inference only: flex refuses calls with gradients,
    # whose mapped block mask would have no backward); a call no row takes is gathered into
    # contiguous keys first
    Row(("cuda",), "any", "flex",
        "FlexAttention reads the pool in place through a block mask mapped to the pages: "
        "nothing is copied, and at or under 1.1x the contiguous call in most rows measured",
        measured=_PAGED, layout="paged"),
    Row(("*",), "any", "flex",
        "FlexAttention reads the pool in place through a block mask mapped to the pages",
        measured=_PAGED, layout="paged"),
)


def rows_for(request: Request, order: tuple | None = None) -> list[Row]:
    """The rows of ``request``'s layout, device and mode, best first (of :data:`ORDER` by
    default)."""
    order = [row for row in (ORDER if order is None else order)
             if row.layout == request.layout]
    device = request.device_type
    named = any(device in row.devices for row in order)
    return [row for row in order
            if (device in row.devices if named else "*" in row.devices)
            and row.mode in ("any", request.mode)]


def reason(row: Row, request: Request) -> str:
    """The row's reason for this call's device."""
    return row.reason.format(device=request.device_type)


def backend_names(order: tuple | None = None) -> list[str]:
    """Every backend the table (:data:`ORDER` by default) names, in the order of first
    appearance (the order the registry lists backends in)."""
    return list(dict.fromkeys(row.backend for row in (ORDER if order is None else order)))
