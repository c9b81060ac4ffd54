"""Whether a call runs inside a CUDA graph capture, where it may not read the device from the
host and its results are replayed later with new inputs, or inside the warm-up run before one;
and a way out of the memory pool that torch.compile's CUDA graph trees allocate from while they
warm a graph up."""

from __future__ import annotations

import contextlib
import sys
import threading

import torch


def capturing(device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now (a captured call may
    not read the device from the host, and its results are replayed with new inputs)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Whether this thread runs inside outside_graph_pool during a warm-up: the one way flexspec is
# entered while CUDA graph trees warm a graph up (the transformers operator); anything else
# inside a compiled graph breaks it and runs outside the trees. A flag, so that the calls that
# ask (several per attention call) pay no look at the trees.
_thread = threading.local()


def in_graph_memory(device) -> bool:
    """Whether this call's tensors belong to a CUDA graph: it is being captured, or it runs in
    the warm-up that torch.compile's CUDA graph trees record next, entered through
    :func:`outside_graph_pool`. Every replay gives those tensors new contents, so nothing may
    be kept by them or looked up by them (a warm-up may still read the device from the host:
    see :func:`capturing`)."""
    return capturing(device) or getattr(_thread, "warming", False)


def warming_pool(device):
    """The memory pool this thread allocates from because torch.compile's CUDA graph trees
    (``mode="reduce-overhead"``) are running a graph's warm-up on ``device``, or ``None``.

    The warm-up runs the graph once, not captured, with every allocation in the pool the graph
    will be recorded into; the trees then refuse any tensor of that pool that outlives the run
    and is not one of its outputs. What flexspec keeps from a call (plans, block masks) must
    therefore be made outside it (:func:`outside_graph_pool`; flexspec.workarounds:
    cudagraph-trees-warm-up-pool)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return None  # nothing imported the trees: no warm-up can be running
    index = _index(device)
    try:
        manager = trees.get_manager(index, create_if_none_exists=False)
        warming = (manager is not None and manager.in_warmup
                   and torch.cuda.current_stream(index) == manager.stream)
        return manager.cuda_graphs_thread_pool if warming else None
    except (AttributeError, TypeError):  # the trees changed: no warm-up is recognised
        return None


@contextlib.contextmanager
def outside_graph_pool(device):
    """Allocations inside go to the caching allocator's ordinary pools even during a CUDA graph
    trees warm-up (see :func:`warming_pool`), and :func:`in_graph_memory` is true there;
    elsewhere this does nothing. Yields whether a warm-up is running. The warm-up's pool is
    given back as it was on the way out (its use count is unchanged)."""
    pool = warming_pool(device)
    if pool is None:
        yield False
        return
    index = _index(device)
    torch._C._cuda_endAllocateToPool(index, pool)
    was = getattr(_thread, "warming", False)
    _thread.warming = True
    try:
        yield True
    finally:
        _thread.warming = was
        # beginning again counts one more user of the pool; releasing takes it back off
        torch._C._cuda_beginAllocateCurrentThreadToPool(index, pool)
        torch._C._cuda_releasePool(index, pool)


def _index(device) -> int:
    """The index of a CUDA ``device``, the current one where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()
