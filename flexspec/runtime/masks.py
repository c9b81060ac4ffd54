"""Block masks for the runtime: which extents a mask needs, a small key standing for a mask at
given sizes, the bounded cache of built block masks one :class:`Attention` keeps, and the
handle a plan holds of it (:class:`MaskHandle`, what backends see)."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, noop_mask

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.kernels.block_tables import as_partial, from_tables, tables, tile_grid
from flexspec.kernels import fused_blocks
from flexspec.kernels.blocks import build_block_mask
from flexspec.kernels.lower import lower
from flexspec.limits import MAX_FUSED_TILES, check_block_mask
from flexspec.runtime.capture import capturing, in_graph_memory
from flexspec.runtime.identity import identity
from flexspec.runtime.progress import timed

# Devices where masks that read tensors are built by one compiled program each (fused_blocks):
# on the CPU a program's first compile (about 20 s on a 2-core machine) outweighs what it saves.
FUSED_DEVICES = frozenset({"cuda"})

# How block masks are built: interval analysis refined inside partial tiles (equal to
# create_block_mask), interval analysis alone, or torch's create_block_mask (S^2 evaluations).
BlockMaskMode = Literal["exact", "intervals", "dense"]
BLOCK_MASK_MODES: tuple[BlockMaskMode, ...] = ("exact", "intervals", "dense")
# The cache keeps at most this many block masks, holding at most this many bytes (tables and
# the binding tensors each entry keeps alive), least recently used out first.
BLOCK_MASK_CACHE_SIZE = 32
BLOCK_MASK_CACHE_BYTES = 256 * 1024**2
# New masks wait in a probation area this small until they are asked for a second time.
PROBATION_SIZE = 2
# Tokens kept for masks at given sizes, the oldest out first: a growing cache asks for a new
# one at every length, and a process that serves for days must not keep them all.
TOKENS_KEPT = 4096
# Tables of the masks that hide nothing or list every tile, kept per grid of tiles (see
# MaskCache._hiding_nothing and MaskCache.every_tile).
EVERY_KEY_GRIDS_KEPT = 64


@dataclass(frozen=True, slots=True)
class MaskKey:
    """A mask at given sizes and device, in one dialect of the lowering: a small int ``token``
    standing for them (so hot paths never hash the IR), its batch and head extents, the keys of
    the tensors it reads, the dialect of the ``mask_mod`` its block masks carry (the one
    the kernel reading them compiles inside partial tiles), whether its block masks list
    full tiles as partial ones, for a forward pass on FlexAttention's decoding kernel
    (:func:`flexspec.kernels.block_tables.as_partial`), and a ``mask_id`` standing for the
    mask at every size."""

    token: int
    batch: int
    heads: int
    reads: tuple
    dialect: str = "torch"
    partial: bool = False
    # the same mask at every size: what is learnt about its program holds for all of them
    mask_id: int = 0


@dataclass(frozen=True, eq=False)
class MaskHandle:
    """The block masks of one mask at one plan's sizes: what a plan holds of its Attention's
    cache (see flexspec.runtime.contract.PlanMasks)."""

    cache: "MaskCache"
    spec: ir.AttentionIR
    sizes: dict
    key: MaskKey
    device: torch.device | None = None

    @property
    def reads(self) -> tuple:
        return self.key.reads

    @property
    def batch(self) -> int:
        return self.key.batch

    @property
    def heads(self) -> int:
        return self.key.heads

    def get(self, values: dict, device, every_tile: bool = False) -> BlockMask:
        """The exact block mask for these values; with ``every_tile``, the mask listing every
        tile (:meth:`every_tile`) instead, outside a CUDA graph's memory once the exact mask's
        program has built it (so that a capture after this call does not compile)."""
        if every_tile and not in_graph_memory(device) and self.compiled_for_captures(device):
            return self.every_tile(values, device)
        return self.cache.get(self.spec, self.sizes, values, device, self.key)

    def every_tile(self, values: dict, device) -> BlockMask:
        """A block mask listing every tile, the mask evaluated in each (see
        :meth:`MaskCache.every_tile`)."""
        return self.cache.every_tile(self.spec, self.sizes, values, device, self.key)

    def compiled_for_captures(self, device) -> bool:
        """See :meth:`MaskCache.compiled_for_captures`."""
        return self.cache.compiled_for_captures(self.key, self.sizes, device)

    def partial_only(self) -> "MaskHandle":
        """The same masks with their full tiles listed as partial ones, kv side only (see
        :class:`MaskKey`), cached apart from these."""
        return self.cache.bind(self.spec, self.sizes, self.device, self.key.dialect,
                               partial=True)


def mask_extent(mask: ir.Expr, sizes: dict) -> tuple:
    """``(batch, heads, keys)``: the batch and head extents a mask needs (1 unless it reads ``b``
    or ``h``) and the keys of the tensors it reads."""
    reads_b, reads_h, keys = _mask_facts(mask)
    return sizes["B"] if reads_b else 1, sizes["H"] if reads_h else 1, keys


@functools.lru_cache(maxsize=1024)
def _mask_facts(mask: ir.Expr) -> tuple:
    free = ir.free_vars(mask)
    return "b" in free, "h" in free, ir.tensor_keys(mask)


class MaskCache:
    """The block masks of one Attention: built in ``mode`` with ``block_size`` blocks, cached
    (least recently used first out) by mask token and the identity of the tensors it reads."""

    def __init__(self, mode: BlockMaskMode, block_size: tuple):
        self.mode = mode
        self.block_size = block_size
        self._tokens: collections.OrderedDict = collections.OrderedDict()
        self._counter = itertools.count()  # a token is never given twice
        self._mask_ids: dict = {}  # (mask, extents, device, dialect) -> id, sizes left out
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        # a new mask waits here until it is asked for again, and only then enters the cache:
        # bindings that never repeat (fresh doc_ids every training step) pass through these
        # few entries instead of filling the cache
        self._probation: collections.OrderedDict = collections.OrderedDict()
        # calls from several threads share the cache: its bookkeeping is one step at a time (a
        # mask is built outside the lock; two threads may build the same one, harmlessly)
        self._lock = threading.Lock()
        self._untraceable: set = set()  # mask ids the fused program could not trace
        # (mask id, partial) of the masks the fused program has built: compiled for them
        self._built_once: set = set()
        # grid of tiles -> the tables of the mask that hides nothing (see _hiding_nothing), and
        # of the mask that lists every tile (see every_tile)
        self._every_key: collections.OrderedDict = collections.OrderedDict()

    def key(self, spec: ir.AttentionIR, sizes: dict, device, dialect: str = "torch",
            partial: bool = False) -> MaskKey:
        """The :class:`MaskKey` of ``spec``'s mask at ``sizes`` on ``device``, its block masks
        carrying the ``mask_mod`` of the lowering's ``dialect`` (and, with ``partial``, listing
        full tiles as partial ones)."""
        batch, heads, reads = mask_extent(spec.mask, sizes)
        full = (spec.mask, batch, heads, sizes["Q_LEN"], sizes["KV_LEN"], str(device), dialect,
                partial)
        found = self._tokens.get(full)
        if found is None:
            with self._lock:
                found = self._tokens.get(full)
                if found is None:
                    every_size = (spec.mask, batch, heads, str(device), dialect)
                    mask_id = self._mask_ids.setdefault(every_size, len(self._mask_ids))
                    found = self._tokens[full] = (next(self._counter), mask_id)
                    if len(self._tokens) > TOKENS_KEPT:
                        self._tokens.popitem(last=False)
        token, mask_id = found
        return MaskKey(token, batch, heads, tuple(sorted(reads)), dialect, partial, mask_id)

    def bind(self, spec: ir.AttentionIR, sizes: dict, device, dialect: str = "torch",
             partial: bool = False) -> MaskHandle:
        """The handle of ``spec``'s block masks at ``sizes`` a plan holds."""
        return MaskHandle(self, spec, sizes, self.key(spec, sizes, device, dialect, partial),
                          device)

    def _fused(self, key: MaskKey, sizes: dict, device) -> bool:
        """Whether to build with the compiled program (:mod:`flexspec.kernels.fused_blocks`):
        on the devices in :data:`FUSED_DEVICES`, for masks rebuilt whenever their tensors change
        (fresh ``doc_ids`` every training step, positions every decoding step), where the eager
        builder's launches and host synchronisations would cost more than the kernel, and for
        every mask in ``intervals`` mode. Masks that read no tensor are built once and refined."""
        return (device.type in FUSED_DEVICES and self.mode != "dense"
                and key.mask_id not in self._untraceable
                and (bool(key.reads) or self.mode == "intervals")
                and fused_blocks.fits(sizes, self.block_size, batch=key.batch, heads=key.heads))

    def get(self, spec: ir.AttentionIR, sizes: dict, values: dict, device,
            key: MaskKey | None = None) -> BlockMask:
        """The block mask of ``spec`` for these tensor values, from the cache or built."""
        key = key or self.key(spec, sizes, device)
        # Inside a CUDA graph capture (or the warm-up run before one, see capture.in_graph_memory)
        # a mask that reads tensors is built, never looked up: the graph replays its build with
        # whatever the tensors hold then (a cached mask would be replayed as it was at
        # capture). The build's tensors live in the graph's memory pool, so it is not kept
        # either. A mask that reads none is looked up (its build does not change), and one
        # built inside a capture is not kept.
        captured = bool(key.reads) and in_graph_memory(device)
        cache_key = (key.token,) + tuple(identity(values[name]) for name in key.reads)
        if None in cache_key:  # an inference tensor, which cannot be seen changing: built
            return self._build(spec, sizes, values, device, key, captured)
        with self._lock:
            cached = None if captured else self._cache.get(cache_key)
            if cached is not None:
                self._cache.move_to_end(cache_key)
                return cached[0]
            waiting = None if captured else self._probation.pop(cache_key, None)
            if waiting is not None:
                self._admit(cache_key, *waiting)
                return waiting[0]
        block_mask = self._build(spec, sizes, values, device, key, captured)
        if captured or capturing(device):
            return block_mask
        # an entry keeps the values alive, so their memory cannot be reused while it exists
        with self._lock:
            self._probation[cache_key] = (block_mask, values)
            if len(self._probation) > PROBATION_SIZE:
                self._probation.popitem(last=False)
        return block_mask

    def _build(self, spec: ir.AttentionIR, sizes: dict, values: dict, device, key: MaskKey,
               captured: bool) -> BlockMask:
        """The block mask of ``spec`` for these values, built (see :meth:`get`), outside
        inference mode: the cache serves calls of every mode, and an inference tensor cannot be
        saved for a backward pass."""
        with torch.inference_mode(False):
            block_mask = self._built(spec, sizes, values, device, key, captured)
            return as_partial(block_mask) if key.partial else block_mask

    def _built(self, spec: ir.AttentionIR, sizes: dict, values: dict, device, key: MaskKey,
               captured: bool) -> BlockMask:
        self._check_size(key, sizes)
        mask_mod, _ = lower(spec, dialect=key.dialect).make_mods(sizes, values)
        if spec.mask == ir.TRUE and self.mode != "dense":
            return self._hiding_nothing(spec, sizes, device, key, mask_mod)
        if self.mode == "dense":
            block_mask = create_block_mask(mask_mod or noop_mask, key.batch, key.heads,
                                           sizes["Q_LEN"], sizes["KV_LEN"], device=device,
                                           BLOCK_SIZE=self.block_size)
        elif self._fused(key, sizes, device):
            first = (key.mask_id, key.partial) not in self._built_once
            self._built_once.add((key.mask_id, key.partial))
            try:
                with timed(f"building the block-mask program of '{ir.to_text(spec.mask)}' "
                           f"(its first build compiles)") if first else contextlib.nullcontext():
                    block_mask = fused_blocks.fused_block_mask(
                        spec.mask, sizes, self.block_size, values, device, batch=key.batch,
                        heads=key.heads, mask_mod=mask_mod, partial=key.partial)
            except fused_blocks.Untraceable as error:
                if captured:
                    # compiling inside a capture can fail where it works outside (inductor
                    # runs kernels while it compiles): not a reason to give up the program
                    raise BindingError(self._compiled_in_capture(error)) from error
                # the eager builder runs every mask; this one will not be traced again
                self._untraceable.add(key.mask_id)
                return self._built(spec, sizes, values, device, key, captured)
        else:
            if captured:
                raise BindingError(self._not_capturable(key, sizes, device))
            block_mask = build_block_mask(spec.mask, sizes, self.block_size, values, device,
                                          batch=key.batch, heads=key.heads, mask_mod=mask_mod,
                                          exact=self.mode == "exact")
        return block_mask

    def _hiding_nothing(self, spec: ir.AttentionIR, sizes: dict, device, key: MaskKey,
                        mask_mod) -> BlockMask:
        """The block mask of a mask that hides nothing: what a decoded token that sees every
        key runs with, at a new length every step of a growing cache. Its tiles depend only on
        the grid (tile counts, and whether the last row and column of tiles run past the
        ends), so the eager builder (launches and host reads) runs once per grid, and each
        length gets a BlockMask of the kept tables."""
        bq, bk = self.block_size
        nq, nk = tile_grid(sizes, self.block_size)
        grid = (key.batch, key.heads, nq, nk, sizes["Q_LEN"] % bq != 0,
                sizes["KV_LEN"] % bk != 0, str(device), key.partial)

        def build():
            built = build_block_mask(spec.mask, sizes, self.block_size, {}, device,
                                     batch=key.batch, heads=key.heads,
                                     exact=self.mode == "exact")
            return tables(as_partial(built) if key.partial else built)
        return from_tables(self._grid_tables(grid, device, build), sizes, self.block_size,
                           mask_mod)

    def _grid_tables(self, grid: tuple, device, build) -> tuple:
        """The tables kept for ``grid`` (the masks whose tiles depend on their grid alone), or
        ``build()``'s, kept for the next call unless made in a CUDA graph's memory (its pool's
        tensors may not outlive the graph); at most :data:`EVERY_KEY_GRIDS_KEPT` grids."""
        with self._lock:
            found = self._every_key.get(grid)
        if found is None:
            found = build()
            if not in_graph_memory(device):
                with self._lock:
                    self._every_key[grid] = found
                    if len(self._every_key) > EVERY_KEY_GRIDS_KEPT:
                        self._every_key.popitem(last=False)
        return found

    def compiled_for_captures(self, key: MaskKey, sizes: dict, device) -> bool:
        """Whether a CUDA graph capture would build this mask without compiling: its program
        has built the mask (compiled for any length), or no program builds it (a capture cannot
        build it at all). A call that skips the exact mask (:meth:`every_tile`) builds it until
        then, so that a capture after an eager warm-up does not compile."""
        return ((key.mask_id, key.partial) in self._built_once
                or not self._fused(key, sizes, device))

    def every_tile(self, spec: ir.AttentionIR, sizes: dict, values: dict, device,
                   key: MaskKey) -> BlockMask:
        """A block mask of ``spec`` for these values that lists every tile of the grid as a
        partial one: the same attention as the exact mask, with the mask evaluated in every
        tile, so each key is read. Its tables depend on the grid alone and are kept per grid;
        only the ``mask_mod`` is this call's. They have the exact partial form's extents,
        dtypes and layout (``key.batch`` x ``key.heads`` rows, no full tiles, no q side), so a
        kernel compiled for one runs the other: a call warmed up eagerly with this mask and then
        captured in a CUDA graph, where the exact mask is built, does not compile again. What a
        decoding call whose bindings are new at every step runs with where reading its keys
        costs less than building its exact mask (see flexattention.lists_every_tile), and the
        logical mask of a small paged decoding read (flexpages.lists_every_page)."""
        nq, nk = tile_grid(sizes, self.block_size)
        rows = (key.batch, key.heads, nq)

        def build():
            counts = torch.full(rows, nk, dtype=torch.int32, device=device)
            columns = torch.arange(nk, dtype=torch.int32, device=device).expand(*rows, nk)
            return (counts, columns.contiguous(), None, None, None, None, None, None)
        found = self._grid_tables(("every tile", *rows, nk, str(device)), device, build)
        mask_mod, _ = lower(spec, dialect=key.dialect).make_mods(sizes, values)
        return from_tables(found, sizes, self.block_size, mask_mod)

    def _not_capturable(self, key: MaskKey, sizes: dict, device) -> str:
        """Why a mask that reads tensors cannot be built inside a CUDA graph capture: only the
        compiled program (fused_blocks) builds without reading the device from the host."""
        if device.type not in FUSED_DEVICES:
            why = f"the compiled block-mask program does not run on {device.type}"
        elif key.mask_id in self._untraceable:
            why = "torch.compile could not trace its block-mask program"
        else:
            nq, nk = tile_grid(sizes, self.block_size)
            why = (f"its grid of {key.batch * key.heads * nq * nk} tiles (B x H x query blocks "
                   f"x key blocks) is larger than the {MAX_FUSED_TILES} the compiled block-mask "
                   "program takes")
        return ("flexspec cannot build this block mask inside a CUDA graph capture: " + why +
                ", and the eager builder reads counts on the host. Run this step outside the "
                "graph, or capture a smaller one")

    @staticmethod
    def _compiled_in_capture(error: Exception) -> str:
        return ("flexspec could not compile this block mask's program inside a CUDA graph "
                f"capture ({error}): its first build for these batch and head extents came "
                "during the capture. Run the step once outside the graph before capturing it "
                "(a warm-up on a side stream, as torch.cuda.graphs asks), or build the mask "
                "once with Attention.block_mask(Q_LEN, KV_LEN, batch=..., device=..., "
                "<bindings>)")

    def _check_size(self, key: MaskKey, sizes: dict) -> None:
        nq, nk = tile_grid(sizes, self.block_size)
        check_block_mask(key.batch, key.heads, nq, nk,
                         f"Q_LEN = {sizes['Q_LEN']} and KV_LEN = {sizes['KV_LEN']} in blocks of "
                         f"{self.block_size[0]}x{self.block_size[1]}", error=BindingError)

    def _admit(self, cache_key: tuple, block_mask: BlockMask, values: dict) -> None:
        """Move a mask asked for twice into the cache, within the count and byte budgets."""
        size = _nbytes(block_mask, values)
        if size > BLOCK_MASK_CACHE_BYTES:
            return
        self._cache[cache_key] = (block_mask, values, size)
        self._bytes += size
        while len(self._cache) > BLOCK_MASK_CACHE_SIZE or self._bytes > BLOCK_MASK_CACHE_BYTES:
            self._bytes -= self._cache.popitem(last=False)[1][2]

    def cached_bytes(self) -> int:
        """The bytes the cached entries hold."""
        return self._bytes


def _nbytes(block_mask: BlockMask, values: dict) -> int:
    tensors = [t for t in tables(block_mask) if t is not None] + list(values.values())
    return sum(t.numel() * t.element_size() for t in tensors)

