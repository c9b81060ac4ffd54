"""Compiled ``flex_attention`` entry points, one per lowered spec, and the dynamo settings the
calls that may compile run under (static shapes, no graph breaks, an error at the recompile
limit)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import linecache

import torch
from torch.nn.attention.flex_attention import flex_attention

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch before return_aux
    AuxRequest = None

from flexspec.errors import SpecError
from flexspec.kernels import block_tables
from flexspec.kernels.generations import FAST_GUARDS, call_with_settings
from flexspec.kernels.lower import Lowered


class CompileLimitError(SpecError):
    """torch.compile reached its recompile limit for one spec (too many distinct shapes)."""


_entry_counter = itertools.count(1)


@functools.lru_cache(maxsize=256)
def compiled_entry(lowered: Lowered, purpose: str = "call"):
    """A compiled ``flex_attention`` call whose code object belongs to this spec alone, so each
    spec has its own dynamo cache and recompile budget (and each ``purpose`` of it: the reads
    of a paged cache compile apart from the plain calls). ``pinned`` lists the strides
    :func:`free_strides` finds, each stated to the compiler as a factor times a number; the
    numbers are read before the tensors, so that a number made dynamic becomes a graph input
    ahead of the strides that name it (flexspec.workarounds: inductor-symbol-order)."""
    text = ("def run(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, lse,\n"
            "        pinned=()):\n"
            "    for _, _, _, times in pinned:\n"
            "        torch._check(times >= 0)\n"
            "    tensors = (q, k, v)\n"
            "    for which, dim, factor, times in pinned:\n"
            "        torch._check(tensors[which].stride(dim) == factor * times)\n"
            "    if lse is None:\n"
            "        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,\n"
            "                              scale=scale, enable_gqa=enable_gqa,\n"
            "                              kernel_options=kernel_options)\n"
            "    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,\n"
            "                          scale=scale, enable_gqa=enable_gqa,\n"
            "                          kernel_options=kernel_options, **lse)\n")
    filename = f"<flexspec-entry-{next(_entry_counter)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"flex_attention": flex_attention, "torch": torch}
    exec(compile(text, filename, "exec"), namespace)
    # Neither dynamic=False nor fullgraph=True: both cost work around every call (see
    # docs/performance.md#why-the-backend-rules-are-what-they-are); run_compiled asks for the
    # same around the calls that compile instead
    return torch.compile(namespace["run"])


def lse_request(return_lse: bool) -> dict | None:
    """The keyword that asks ``flex_attention`` for the log-sum-exp too (``return_aux`` where
    torch has it, the older ``return_lse`` elsewhere), or ``None``."""
    if not return_lse:
        return None
    if AuxRequest is not None:
        return {"return_aux": AuxRequest(lse=True)}
    return {"return_lse": True}


def split_lse(result) -> tuple:
    """``(out, lse)`` from what ``flex_attention`` returned when asked for the log-sum-exp."""
    out, extra = result
    return out, getattr(extra, "lse", extra)


def free_strides(q, k, v) -> tuple:
    """``(tensor, dim, factor, times)`` for each stride of q, k and v that does not follow from
    the sizes and smaller strides (keys viewed in a longer cache, ``cache[:, :, :n]``: the head
    stride is the cache's), the stride being ``factor * times`` with ``factor`` 16 where it
    divides it. Once lengths are dynamic, dynamo gives such a stride a symbol of its own, which
    inductor cannot prove a multiple of 16, and the kernel loads unaligned, two to three times
    slower (flexspec.workarounds: dynamic-stride-alignment). The entry states the stride as
    ``factor * times`` instead: a constant while ``times`` stays the same (one cache), and a
    multiple of 16 once dynamo has seen it change and made ``times`` dynamic (a cache that grows
    by concatenation, read through a window). The rule is dynamo's stride inference."""
    pinned = []
    for which, tensor in enumerate((q, k, v)):
        sizes, strides = tensor.shape, tensor.stride()
        follows = set()
        for dim in sorted(range(len(strides)), key=lambda d: (strides[d], -d)):
            stride = strides[dim]
            inner = dim + 1 < len(strides) and stride == sizes[dim + 1] * strides[dim + 1]
            if not (stride in (0, 1) and not inner) and stride not in follows:
                factor = 16 if stride % 16 == 0 else 1
                pinned.append((which, dim, factor, stride // factor))
            follows.add(sizes[dim] * stride)
    return tuple(pinned)


# Dynamo settings for the calls that may compile: an error instead of a silent eager fallback at
# the recompile limit (flexspec.workarounds: dynamo-recompile-fallback), and guards on lengths
# checked in C++ (FAST_GUARDS). Shapes are static on an entry's first compile and dynamic in the
# lengths from its second on (see mark_lengths_dynamic): two compiles serve every length.
COMPILE_SETTINGS = {"fail_on_recompile_limit_hit": True, **FAST_GUARDS}
# The same with every shape static (a compile per shape), for the calls whose C++ kernel does
# not compile once shapes are dynamic (flexspec.workarounds: cpu-dynamic-row-binding).
STATIC_SETTINGS = {**COMPILE_SETTINGS, "automatic_dynamic_shapes": False}
# Entries that have compiled, with the (Q_LEN, KV_LEN) of their first compile.
_COMPILED: dict = {}


def mark_lengths_dynamic(entry, q, k, v, score_mod, block_mask) -> None:
    """Before an entry compiles for a second shape, ask dynamo to keep every length dimension
    symbolic: the sequence dimension of q, k and v, the block counts of the block mask, and the
    dimensions of captured tensors as long as Q_LEN or KV_LEN (``doc_ids``). Without it, dynamo
    makes a dimension dynamic only after seeing it change, which took three compiles (and eight
    ended in the recompile limit before)."""
    first = _COMPILED.get(entry)
    if first is None or first == (q.shape[2], k.shape[2]):
        return  # marking the same lengths again would itself be a new guard, so a recompile
    lengths = {q.shape[2], k.shape[2]}
    for tensor in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(tensor, 2)
    for table in () if block_mask is None else block_tables.tables(block_mask):
        if table is not None:
            for dim in range(2, table.dim()):
                torch._dynamo.maybe_mark_dynamic(table, dim)
    mods = (score_mod, None if block_mask is None else block_mask.mask_mod)
    for mod in mods:
        for cell in getattr(mod, "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if size in lengths and size > 1:
                        torch._dynamo.maybe_mark_dynamic(value, dim)


def mark_batch_static(*tensors) -> None:
    """Keep the batch and head dimensions of ``tensors`` static when an entry compiles: torch
    runs FlexAttention's decoding kernel only for static ones, and dynamo makes a dimension
    dynamic once it has seen it change (a second batch size), which sent every later decoding
    call to the main kernel (flexspec.workarounds: flex-decoding-dynamic-batch).

    A dimension whose stride does not follow from the inner sizes (the head stride of keys
    read through a window of a cache grown by concatenation) stays unmarked: dynamo keeps the
    stride of a dimension marked static a constant, guarded exactly, so such a decode compiled
    at every step until the recompile limit. The batch and heads of q, whose sizes torch's
    choice of kernel reads, are always marked."""
    for which, tensor in enumerate(tensors):
        sizes, strides = tensor.shape, tensor.stride()
        for dim in (0, 1):
            follows = strides[dim] == sizes[dim + 1] * strides[dim + 1]
            if which == 0 or follows or sizes[dim] == 1:
                torch._dynamo.mark_static(tensor, dim)


# torch.compile's graph-break switch as a context manager (torch >= 2.9); fullgraph=True's
# meaning without its per-call cost
_NO_GRAPH_BREAKS = getattr(torch._dynamo, "error_on_graph_break",
                           lambda _: contextlib.nullcontext())


def run_compiled(entry, *args, static: bool = False):
    """Run a compiled entry under :data:`COMPILE_SETTINGS` (:data:`STATIC_SETTINGS` with
    ``static``), with graph breaks made errors (as ``fullgraph=True`` would), turning torch's
    recompile limit into :class:`CompileLimitError` (by default dynamo would silently fall
    back to an unfused kernel that materialises the scores). Calls of a warm plan skip this:
    dynamo's guards depend only on what the plan's key holds, so they cannot recompile.

    dynamo's settings may be process-wide: compiling calls take a lock while they are changed
    (:func:`flexspec.kernels.generations.call_with_settings`; a thread's compile then waits for
    another's; later calls do not come here)."""
    try:
        with _NO_GRAPH_BREAKS(True):
            out = call_with_settings(STATIC_SETTINGS if static else COMPILE_SETTINGS, entry,
                                     *args)
        _COMPILED.setdefault(entry, (args[0].shape[2], args[1].shape[2]))
        return out
    except Exception as err:  # dynamo's own exception type moves between torch versions
        if "recompile" in type(err).__name__.lower() or "RecompileLimit" in str(err):
            raise CompileLimitError(
                f"torch.compile reached its recompile limit "
                f"({torch._dynamo.config.recompile_limit}) for this spec, because it ran with "
                "too many distinct shapes, dtypes or devices. Pad inputs to a few fixed lengths, "
                "or raise torch._dynamo.config.recompile_limit") from err
        raise


def first_line(err: Exception) -> str:
    """The gist of a compile error: its first lines that say something (inductor's start with
    "backend='inductor' raised:" and a banner), or the C++ compiler's first error where the
    generated code did not compile (the first lines are then a command)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip().strip("=")]
    lines = [line for line in lines if not line.endswith("raised:")]
    text = " ".join(lines[:2]) if lines else type(err).__name__
    compiler = [line.split(" error: ", 1)[1] for line in lines if " error: " in line]
    if "CppCompileError" in text and compiler:
        text = f"CppCompileError: {compiler[0]}"
    return text if len(text) <= 200 else text[:197] + "..."
