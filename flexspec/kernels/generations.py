"""Calls of flexspec's own compiled functions (its FlexAttention entry points and block-mask
programs) that leave CUDA graph trees' generation alone.

Every entry into a ``torch.compile``d function from eager code counts, for torch's CUDA graph
trees, as a new invocation of the user's compiled model (dynamo's ``GenerationTracker``). Inside
a model compiled with ``mode="reduce-overhead"``, flexspec's attention runs eagerly between the
model's graphs (a graph break); the first graph's outputs (the residual stream) are then read by
the next graph, which saw a new generation and had overwritten them (flexspec.workarounds:
compiled-call-new-generation)."""

from __future__ import annotations

from torch._dynamo.mutation_guard import GenerationTracker


def call_compiled(function, *args):
    """``function(*args)`` (a compiled function), with dynamo's generation as it was before."""
    generation = GenerationTracker.generation
    try:
        return function(*args)
    finally:
        GenerationTracker.generation = generation
