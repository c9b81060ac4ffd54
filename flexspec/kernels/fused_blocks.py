"""Block masks built by one compiled program per mask: the interval classes of every tile
(:func:`flexspec.kernels.blocks.tile_rows`), the ragged-edge rule and the eight BlockMask tables,
traced once by ``torch.compile`` with dynamic lengths.

The eager builder (:mod:`flexspec.kernels.blocks`) launches a few kernels per IR node, reads
counts on the host (``nonzero``) to refine partial tiles, and chooses its table layout by size. On
a GPU that is launch- and synchronisation-bound: milliseconds for a mask whose arithmetic takes
microseconds. Here the same interval rules are fused by inductor into a few kernels, the tables are
laid out by a stable partition of each row (:func:`flexspec.kernels.block_tables.sorted_rows`), and
nothing is read on the host, so a mask whose bindings change every step (fresh ``doc_ids``, decoding
positions) costs a few launches and can be captured in a CUDA graph.

The classes are the intervals' alone (sound, not refined): a tile the analysis cannot decide
stays PARTIAL, which is still exact for attention (the kernel applies ``mask_mod`` inside partial
tiles) and, for the masks training and decoding rebuild (documents in contiguous runs, windows,
causal, positions), is what refinement finds anyway.

One program serves a (mask, block size, batch and head extents, device); lengths and tensor
shapes are symbolic, so new lengths do not recompile (torch specialises a length of 1, which
decoding's Q_LEN = 1 gets as a second program). A call at new lengths runs the code dynamo's
guards accept without the rest of dynamo's call path, and calls that repeat their shapes and
lengths run the code kept for them with no guards (:mod:`flexspec.kernels.replay`).
"""

from __future__ import annotations

import functools
import itertools
import types

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.kernels.block_tables import (EMPTY, FULL, PARTIAL, from_tables, index_tables,
                                           sorted_rows, tile_grid)
from flexspec.kernels.blocks import tile_rows
from flexspec.kernels.generations import FAST_GUARDS, call_with_settings
from flexspec.kernels.replay import ExactReplays
from flexspec.limits import MAX_FUSED_TILES

# The torch.compile backend of the programs ("eager" traces the same graph, dynamic lengths
# included, without generating code: what the CPU tests use to check many masks quickly).
COMPILER = "inductor"


def fits(sizes: dict, block: tuple, *, batch: int, heads: int) -> bool:
    """Whether a grid is small enough for the fused program
    (:data:`flexspec.limits.MAX_FUSED_TILES`); larger ones go to the eager builder."""
    nq, nk = tile_grid(sizes, block)
    return batch * heads * nq * nk <= MAX_FUSED_TILES


def fused_block_mask(mask: ir.Expr, sizes: dict, block: tuple, tensors: dict, device, *,
                     batch: int, heads: int, mask_mod=None, compiler: str = COMPILER,
                     partial: bool = False) -> BlockMask:
    """The BlockMask of ``mask`` (an IR boolean specialized to the tensors' shapes) from the
    intervals alone, built by the mask's program, compiled with the torch.compile backend
    ``compiler`` (see the module docstring). With ``partial``, the forward-only form of
    :func:`flexspec.kernels.block_tables.as_partial` (full tiles listed as partial ones, kv side
    only), made inside the program rather than by a dozen launches after it."""
    program = _program(mask, tuple(block), batch, heads, str(device), compiler, partial)
    read, named = _inputs(mask)
    reads = {key: tensors[key] for key in read}
    lengths = {name: int(sizes[name]) for name in ir.SIZE_VARS}
    if partial:
        reads, lengths["KV_LEN"] = _whole_tiles(mask, reads, lengths["KV_LEN"], block[1])
    # B and H where the mask does not name them are the program's own extents: a call with 16
    # heads and Attention.block_mask with 1 would otherwise be two signatures, the second a
    # recompile (which inside a CUDA graph capture fails)
    lengths.update((name, extent) for name, extent in (("B", batch), ("H", heads))
                   if name not in named)
    return from_tables(program(reads, lengths), sizes, block, mask_mod)


def _whole_tiles(mask: ir.Expr, reads: dict, kv_len: int, kv_block: int) -> tuple:
    """``(reads, KV_LEN)`` the partial form's program builds with: KV_LEN rounded up to whole
    tiles, and the tensors declared ``KV_LEN`` long padded to it, where ``mask`` reads KV_LEN
    only as such tensors' length (else as given). The padding repeats a tensor's last entry:
    zeros would widen the range of values of a tile, and rows that read the tensor by q (in a
    tile past Q_LEN) would list tiles they never see. The partial form lists no full tile, and a
    tile is left out only where no key of it (those past KV_LEN included) is visible, so the
    tiles listed are those of the keys that exist, or at most the last one more, whose keys
    past the end the kernel never reads. A decoding step's lengths then repeat for a tile's
    worth of steps, and so does its program's signature: those calls replay it with no guard
    evaluation (:class:`flexspec.kernels.replay.ExactReplays`)."""
    whole = -(-kv_len // kv_block) * kv_block
    dims = _kv_dims(mask)
    if whole == kv_len or dims is None:
        return reads, kv_len
    padded = dict(reads)
    for key, (rank, tensor_dims) in dims:
        value = padded[key]
        if not tensor_dims:
            continue
        if value.dim() != rank:  # not laid out as declared: built as given
            return reads, kv_len
        for dim in tensor_dims:
            if value.shape[dim] == kv_len:  # a dimension of size 1 broadcasts: left alone
                extra = list(value.shape)
                extra[dim] = whole - kv_len
                value = torch.cat([value, value.narrow(dim, kv_len - 1, 1).expand(extra)], dim)
        padded[key] = value
    return padded, whole


@functools.lru_cache(maxsize=None)
def _kv_dims(mask: ir.Expr) -> tuple | None:
    """For each tensor ``mask`` reads, ``(key, (its declared rank, the dimensions declared
    KV_LEN long))``; ``None`` where the mask reads KV_LEN otherwise (itself, or in another
    dimension's declaration)."""
    if "KV_LEN" in ir.direct_vars(mask):
        return None
    found = {}
    for node in ir.walk(mask):
        if isinstance(node, ir.Tensor):
            dims = []
            for dim, declared in enumerate(node.shape):
                if declared == ir.Var("KV_LEN"):
                    dims.append(dim)
                elif "KV_LEN" in ir.free_vars(declared):
                    return None
            found[ir.tensor_key(node)] = (len(node.shape), tuple(dims))
    return tuple(sorted(found.items()))


class Untraceable(Exception):
    """The mask's program could not be traced or compiled (torch's message is the cause): the
    caller builds with the eager builder instead."""


@functools.lru_cache(maxsize=None)
def _inputs(mask: ir.Expr) -> tuple:
    """The keys of the tensors ``mask`` reads (sorted) and the sizes it names."""
    return tuple(sorted(ir.tensor_keys(mask))), ir.free_vars(mask) & set(ir.SIZE_VARS)


@functools.lru_cache(maxsize=256)
def _program(mask: ir.Expr, block: tuple, batch: int, heads: int, device: str, compiler: str,
             partial: bool = False):
    device = torch.device(device)

    def build(tensors: dict, sizes: dict) -> tuple:
        nq, nk = tile_grid(sizes, block)
        classes = tile_rows(mask, sizes, block, tensors, device, batch=batch, heads=heads,
                            start=0, stop=nq, nk=nk)
        if partial:  # every visible tile listed as partial, in increasing order (as_partial)
            return (*sorted_rows(classes != EMPTY), None, None, None, None, None, None)
        # like create_block_mask, a tile that runs past the end of the sequence is never FULL
        q_end = (torch.arange(nq, device=device) + 1) * block[0]
        kv_end = (torch.arange(nk, device=device) + 1) * block[1]
        ragged = (q_end > sizes["Q_LEN"]).reshape(-1, 1) | (kv_end > sizes["KV_LEN"])
        classes = torch.where(ragged & (classes == FULL), PARTIAL, classes).to(torch.int8)
        return index_tables(classes, order=sorted_rows)

    # dynamo keeps compiled code per code object, guarded on the closure: every mask sharing
    # build's code would count as a recompile of one function (8 at most), so each program
    # gets a code object of its own. Dynamo also compiles one frame at a time (its own lock),
    # so threads may share a program.
    own = build.__code__.replace(co_name=f"flexspec_block_mask_{next(_programs)}")
    build = types.FunctionType(own, build.__globals__, own.co_name, None, build.__closure__)
    compiled = torch.compile(build, backend=compiler, dynamic=True, fullgraph=True)
    # calls that repeat their shapes and lengths (a static cache's steps, a training step's
    # fresh bindings) run the code of the first such call with no guard evaluation
    replays = ExactReplays(compiled)

    def run(tensors: dict, sizes: dict) -> tuple:
        try:
            # a mask has no gradient; and dynamo guards on the grad mode, so a program called
            # with and without it would compile twice. Any call may compile (a new
            # specialisation), and its guards are then built under FAST_GUARDS, unless another
            # thread is compiling (a step's mask does not wait seconds for its lock)
            with torch.no_grad():
                return replays.call((tensors, sizes), tuple(sizes.values()),
                                    lambda: call_with_settings(FAST_GUARDS, compiled, tensors,
                                                               sizes, wait=False))
        except Exception as error:  # noqa: BLE001 - narrowed below
            if not compile_error(error):
                raise
            raise Untraceable(str(error).split("\n")[0]) from error

    return run


def compile_error(error: Exception) -> bool:
    """Whether ``error`` comes from tracing or compiling (dynamo, inductor), not from running."""
    # imported here: torch._inductor is heavy, and only a failed compile needs it
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError
    return isinstance(error, (TorchDynamoException, InductorError))


_programs = itertools.count(1)
