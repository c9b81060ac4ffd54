"""What ``Attention.explain`` reports: the canonical spec, the call's sizes, how much of the score
matrix is visible, the work in FLOPs, the backend chosen with its reason, and for a paged call
how its pages are read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexspec import ir
from flexspec.kernels.block_tables import tile_classes, tile_grid
from flexspec.kernels.blocks import count_visible
from flexspec.runtime.backends import REGISTRY
from flexspec.runtime.contract import Choice

# Forward+backward work in forwards: the backward does 2.5 forwards' matrix products (five
# against two), as FlashAttention counts it.
FORWARD_AND_BACKWARD = 3.5


def attention_flops(pairs: float, head_dim: int, v_head_dim: int, *, backward: bool) -> float:
    """FLOPs of attention over ``pairs`` visible (query, key) pairs: 2*D for q.k and 2*Dv for
    p.v per pair forward; the backward does 2.5 times the forward's work (five products against
    two), as FlashAttention counts it."""
    forward = 2.0 * pairs * (head_dim + v_head_dim)
    return forward * FORWARD_AND_BACKWARD if backward else forward


@dataclass(frozen=True)
class Explanation:
    """What ``Attention.explain`` reports (see the module docstring)."""

    spec: str
    mask: str             # the canonical IR the backends are chosen from
    score: str
    sizes: dict
    head_dim: int
    dtype: torch.dtype
    device: str
    density: float        # visible (q, kv) pairs / all pairs
    tile_density: float   # tiles a block-sparse kernel computes / all tiles
    block_size: tuple
    flops: float          # forward FLOPs of the visible pairs
    grads: bool
    choice: Choice
    dense: bool = False   # the chosen backend computes every pair (the dense reference)
    keys: tuple | None = None  # (start, end, cache length): the call reads only keys start:end
    kernel: str | None = None  # which of the backend's kernels runs the call, and why
    options: str | None = None  # the kernel options given or tuned, and where they come from
    runs: tuple | None = None  # (batch rows, calls, rows a call): a wide decode call's runs
    pages: str | None = None  # a paged call: how its pages are read (in place, or copied out)

    def __str__(self) -> str:
        s = self.sizes
        kv_heads = s.get("KV_HEADS", s["H"])
        heads = f"H={s['H']}" + (f" (KV heads {kv_heads})" if kv_heads != s["H"] else "")
        lines = [
            f"spec:     {self.spec}",
            f"mask:     {self.mask}",
            f"score:    {self.score}",
            f"call:     B={s['B']} {heads} Q_LEN={s['Q_LEN']} KV_LEN={s['KV_LEN']} "
            f"D={self.head_dim} {str(self.dtype).replace('torch.', '')} on {self.device}"
            + (", with gradients" if self.grads else ""),
            *([f"runs:     the call's {self.runs[0]} batch rows run as {self.runs[1]} calls of "
               f"up to {self.runs[2]} rows (keys of 2**31 elements or more: the decoding kernel "
               "compiles for narrower ones); the lines here are the first call's"]
              if self.runs else []),
            *([f"pages:    {self.pages}"] if self.pages else []),
            *([f"keys:     only {self.keys[0]}:{self.keys[1]} of the {self.keys[2]} keys are read "
               "(the rows see no other key)"] if self.keys else []),
            f"density:  {self.density:.2%} of (q, kv) pairs visible; "
            + ("every pair computed (the chosen backend is dense)" if self.dense else
               f"{self.tile_density:.2%} of {self.block_size[0]}x{self.block_size[1]} tiles "
               "computed"),
            f"work:     {_flops_text(self.flops)} forward"
            + (f", {_flops_text(self.flops * FORWARD_AND_BACKWARD)} forward+backward"
               if self.grads else ""),
            f"backend:  {self.choice.backend}: {self.choice.reason}",
            *([f"kernel:   {self.kernel}"] if self.kernel else []),
            *([f"options:  {self.options}"] if self.options else []),
        ]
        for name, reason in self.choice.rejected:
            lines.append(f"  not {name}: {reason}")
        return "\n".join(lines)


def _flops_text(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def explain_plan(plan, values: dict, block_mask, text: str, q, k, v, *, choice=None,
                 device: str | None = None, keys: tuple | None = None,
                 options_source: str | None = None, pages: str | None = None) -> Explanation:
    """The explanation of a planned call, given its tensor values and its block mask.

    The visible pairs are the area of the block mask's full tiles plus the pairs counted cell by
    cell inside its partial ones (its tables say which tiles are partial, not how full). A dense
    backend (the reference) computes every pair: its work counts them all. ``choice`` and
    ``device`` replace the plan's where the call is explained for another device; ``keys`` says
    which keys of the cache a call reads, where it reads only some; ``options_source`` where
    the call's kernel options come from (given to compile, tuned); ``pages`` how a paged call
    reads its pages."""
    choice = plan.choice if choice is None else choice
    kernel = REGISTRY[choice.backend].kernel(plan)
    sizes, spec, mask = plan.sizes, plan.spec, plan.masks
    block_size = plan.request.block_size
    visible = count_visible(spec.mask, sizes, block_size, values, q.device,
                            batch=mask.batch, heads=mask.heads,
                            classes=tile_classes(block_mask))
    tiles = int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())
    pairs = visible * (sizes["B"] // mask.batch) * (sizes["H"] // mask.heads)
    dense = REGISTRY[choice.backend].dense
    if dense:
        pairs = sizes["B"] * sizes["H"] * sizes["Q_LEN"] * sizes["KV_LEN"]
    # the fractions are of the call as given: all of its keys, also those it does not read
    given = sizes if keys is None else {**sizes, "KV_LEN": keys[2]}
    nq, nk = tile_grid(given, block_size)
    return Explanation(
        spec=text, mask=ir.to_text(spec.mask), score=ir.to_text(spec.score),
        sizes={**given, "KV_HEADS": k.shape[1]}, head_dim=q.shape[-1], dtype=q.dtype,
        device=str(q.device) if device is None else device,
        density=visible / (mask.batch * mask.heads * given["Q_LEN"] * given["KV_LEN"]),
        tile_density=tiles / (mask.batch * mask.heads * nq * nk), block_size=block_size,
        flops=attention_flops(pairs, q.shape[-1], v.shape[-1], backward=False),
        grads=plan.request.grads, choice=choice, dense=dense, keys=keys, kernel=kernel,
        pages=pages,
        options=(f"{dict(plan.request.kernel_options)} ({options_source})"
                 if plan.request.kernel_options and options_source else None))
