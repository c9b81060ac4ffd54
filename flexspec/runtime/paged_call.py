"""Attention over a paged KV cache read in place: one compiled FlexAttention call over the whole
pool (``keys.unsqueeze(0)``, every batch row reading it; a call per group of KV heads where the
pool is too wide for the decoding kernel), through a block mask mapped from the sequences'
logical positions to the pages that hold them and a ``score_mod`` that sees logical
positions (:meth:`PagedKVCache.block_mask <flexspec.runtime.paged.PagedKVCache.block_mask>`,
:meth:`~flexspec.runtime.paged.PagedKVCache.score_mod`). Nothing is copied; the call reads
the pages its sequences hold and no other.

The logical block mask and the mods come from a sibling of the spec compiled with key blocks of
the page size (:func:`pool_read`'s ``sibling``); a small decoding read lists every page its
slots hold instead of building the exact logical mask each time a read is made
(:func:`lists_every_page`). For inference only: the mapped mask has no query-side tables, so
there is no backward pass (``attn.paged(..., read="gather")`` has one).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError
from flexspec.ir.intervals import always
from flexspec.ir.overflow import position_ranges
from flexspec.kernels.block_tables import as_partial
from flexspec.kernels.generations import call_compiled
from flexspec.kernels.lower import lower
from flexspec.runtime import compiled
from flexspec.runtime.checks import check_qkv, checked_scale
from flexspec.runtime.contract import BackendError
from flexspec.runtime.flexattention import (DECODE_ROWS, DECODING_OPTIONS, every_tile_fits,
                                             wide_keys)
from flexspec.runtime.tuning import Tuned, checked_options, fastest, time_candidates

# The query block of the logical masks: FlexAttention's default.
QUERY_BLOCK = 128
# The least head dimension FlexAttention's GPU kernels take.
MIN_GPU_HEAD_DIM = 16
# The widest key tile FlexAttention's kernels take by default: a smaller page needs its own.
WIDEST_KEY_TILE = 128
# The mapped block mask has no query-side tables: no backward pass.
INFERENCE_ONLY = ("attn.paged: the pool is read in place for inference only (no backward "
                  "pass); use read='gather' to train through a paged cache")


def reads_in_place(q, cache, backend: str) -> bool:
    """Whether ``attn.paged`` reads the pool in place by default (``read="auto"``): on CUDA, for
    inference (no gradient to q), pages of a multiple of 16 positions (FlexAttention's
    smallest key tile), heads of at least 16 dimensions (its GPU kernels' least), on a
    backend that runs FlexAttention."""
    return (isinstance(q, torch.Tensor) and q.device.type == "cuda"
            and not (torch.is_grad_enabled() and q.requires_grad)
            and cache.page_size % 16 == 0 and backend in ("auto", "flex")
            and min(cache.keys.shape[-1], cache.values.shape[-1]) >= MIN_GPU_HEAD_DIM)


class PagedRead:
    """An in-place read of a paged cache prepared once (see :func:`pool_read`): the block mask
    mapped to the pages as they were when it was made, the mods, the compiled entry. Calling
    it, ``read(q)`` or ``read(q, cache)``, launches the kernel alone (a kernel per group of KV
    heads where the pool is too wide for one), so the layers of a model step share one
    preparation: ``cache`` may be any cache of the same geometry whose pages were taken by the
    same operations (one cache per layer, appended together)."""

    def __init__(self, kernel: "ReadKernel", groups: list, tail: tuple, cache, signature: tuple,
                 text: str, decoding: bool):
        self._kernel, self._groups, self._tail, self._cache = kernel, groups, tail, cache
        self._entry = kernel.entry()
        self._signature, self._text, self._decoding = signature, text, decoding
        self._warm = False
        self._returns_lse = tail[-1] is not None  # the entry's last argument: the lse request

    def __call__(self, q, cache=None):
        cache = self._cache if cache is None else cache
        if not isinstance(q, torch.Tensor) or _signature(q) != self._signature:
            raise BindingError(f"a PagedRead runs queries of the shape it was made for "
                               f"(shape, dtype, device {self._signature}), got "
                               f"{_signature(q) if isinstance(q, torch.Tensor) else q!r}: "
                               "make one per query shape")
        if torch.is_grad_enabled() and q.requires_grad:
            raise BindingError(INFERENCE_ONLY)
        if cache is not self._cache and _geometry(cache) != _geometry(self._cache):
            raise BindingError(f"a PagedRead reads caches of the geometry it was made for "
                               f"{_geometry(self._cache)}, got {_geometry(cache)}")
        outs = [self._run(group.arguments(q, cache) + self._tail, q)
                for group in self._groups]
        self._warm = True
        if len(outs) == 1:
            return outs[0]
        if self._returns_lse:
            return (torch.cat([out for out, _ in outs], dim=1),
                    torch.cat([lse for _, lse in outs], dim=1))
        return torch.cat(outs, dim=1)

    def tune(self, q, cache=None, *, candidates: list | None = None,
             repeats: int = 10) -> Tuned:
        """Time this read of ``q`` with each of ``candidates`` (kernel options; by default
        :func:`read_candidates`: key tiles that divide the page, pipeline stages) and with its
        own options, check each answer against the own options' answer, and keep the fastest
        for this read (its own unless one is faster by more than the timing's noise,
        :data:`flexspec.runtime.tuning.MARGIN`). The result's ``best`` is what to give
        ``flexspec.compile(spec, kernel_options=...)`` so that later reads run with it. A
        candidate whose key tile does not divide the page is left out and said so; each of the
        others compiles its kernel in a compiled entry of its own (seconds)."""
        started = time.perf_counter()
        entry, tail = self._entry, self._tail
        own = dict(tail[3] or {})
        result = Tuned(f"paged read of q {list(self._signature[0])}, {self._signature[1]}, "
                       f"pages of {self._kernel.page_size}", {})
        candidates = read_candidates(self._kernel.page_size, own) if candidates is None else [
            checked_options(options, "candidates") for options in candidates]
        refused = {}
        for options in candidates:
            try:
                given_options(options, self._kernel.page_size)
            except BindingError as error:
                refused[str(options)] = (options, str(error))

        def pin(options: dict) -> None:
            self._entry = self._kernel.entry(options) if options else entry
            self._tail = tail[:3] + ({**own, **options} or None,) + tail[4:]
            self._warm = False
        time_candidates(lambda: (self(q, cache),),
                        [{}] + [options for options in candidates if str(options) not in refused],
                        pin, result, repeats, q.device)
        for key, (options, why) in refused.items():
            result.times.append((options, None))
            result.failed[key] = why
        result.best = fastest(result.times)
        pin(result.best)
        result.seconds = time.perf_counter() - started
        return result

    def _run(self, args: tuple, q):
        if self._warm:
            out = call_compiled(self._entry, *args)
        else:
            if self._decoding:  # each group's views are new tensors
                compiled.mark_batch_static(*args[:3])
            try:
                out = compiled.run_compiled(self._entry, *args, static=self._kernel.static)
            except compiled.CompileLimitError:
                raise
            except Exception as err:  # noqa: BLE001 - inductor's errors have no stable type
                raise BackendError(
                    f"attn.paged: FlexAttention could not compile its read of the pool for "
                    f"'{self._text}' on {q.device.type} ({compiled.first_line(err)}); "
                    "read='gather' runs it on the sequences copied out of their pages") from err
        return compiled.split_lse(out) if self._returns_lse else out


def _signature(q) -> tuple:
    return tuple(q.shape), q.dtype, q.device


def _geometry(cache) -> tuple:
    """What a read of a cache depends on besides its tables' values."""
    if not hasattr(cache, "page_size"):
        return type(cache).__name__
    return (cache.pages, cache.page_size, cache.slots, cache.max_pages, tuple(cache.keys.shape),
            tuple(cache.values.shape), cache.keys.dtype, cache.device)


def pool_read(sibling, q, cache, slots, *, scale=None, q_offset=None, return_lse: bool = False,
              bindings: dict) -> PagedRead:
    """The :class:`PagedRead` of queries shaped like ``q`` over ``slots`` of ``cache``, as the
    pages are now (``sibling``: the spec compiled with ``block_size=(QUERY_BLOCK, page
    size)``)."""
    slots = cache._slots(slots)
    scale = checked_scale(scale)
    dim, v_dim = cache.keys.shape[-1], cache.values.shape[-1]
    batch = slots.shape[0]
    # q against the cache as a call's k and v of the slots' capacity would be (no memory)
    k_shape = (batch, cache.keys.shape[0], cache.capacity)
    keys = cache.keys.new_empty(1, 1, 1, 1).expand(*k_shape, dim)
    values = cache.values.new_empty(1, 1, 1, 1).expand(*k_shape, v_dim)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != batch:
        raise BindingError(f"attn.paged: q must be [B, Hq, Q_LEN, D] with a row per slot "
                           f"(B = {batch}), got "
                           f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    check_qkv(q, keys, values)
    if torch.is_grad_enabled() and q.requires_grad:
        raise BindingError(INFERENCE_ONLY)
    heads, q_len = q.shape[1], q.shape[2]
    lengths = cache.lengths[slots]
    if q_offset is None:
        q_offset = lengths - q_len
    kv_heads = cache.keys.shape[0]
    every_page = lists_every_page(q, sibling.ir.mask, cache.capacity,
                                  batch * kv_heads * cache.capacity, dim + v_dim,
                                  cache.keys.dtype.itemsize)
    logical, score_mod = sibling.logical_read(
        q_len, cache.capacity, batch=batch, heads=heads, device=q.device, q_offset=q_offset,
        kv_lengths=lengths, bindings=bindings, every_tile=every_page)
    parts = 1
    # the decoding kernel does not compile for a pool inductor indexes in int64
    # (flexspec.workarounds: flex-decoding-wide-indices): such a read runs as one call per
    # group of KV heads whose slice of the pool is narrower, where the mask is the same for
    # every head, else on the main kernel
    wide = wide_keys(kv_heads * cache.keys.shape[1], dim, v_dim)
    if wide and q_len < DECODE_ROWS and logical.kv_num_blocks.shape[1] == 1:
        parts = head_parts(kv_heads, cache.keys.shape[1], dim, v_dim) or 1
    decoding = q.device.type == "cuda" and q_len < DECODE_ROWS and (not wide or parts > 1)
    if decoding:
        # FlexAttention's decoding kernel splits a row's tiles among its splits by the pool's
        # length when any tile is listed full: the pages of a row would land in a few splits
        logical = as_partial(logical)
    block_mask = cache.block_mask(logical, slots)
    if score_mod is not None and "kv" in ir.free_vars(sibling.ir.score):
        score_mod = cache.score_mod(score_mod)
    options = dict(DECODING_OPTIONS) if decoding else {}
    if not decoding and q_len < DECODE_ROWS:
        options["FORCE_USE_FLEX_ATTENTION"] = True
    widest = max(page_tiles(cache.page_size), default=WIDEST_KEY_TILE)
    if widest < WIDEST_KEY_TILE:
        options["BLOCK_N"] = widest  # a key tile may not span two pages
    options.update(given_options(sibling.kernel_options, cache.page_size))
    # decoding reads compile apart from the main kernel's: once one entry had seen a chunk's
    # rows and batch, dynamo made them dynamic in the decoding graph too, and a decoded read
    # of a second cache ran 17x slower (docs/performance.md, nineteenth session)
    # the CPU's C++ kernel of a read does not compile with dynamic shapes
    # (flexspec.workarounds: cpu-dynamic-row-binding): there, one compile per shape
    kernel = ReadKernel(lower(sibling.ir), "paged decoding" if decoding else "paged",
                        cache.page_size, static=q.device.type == "cpu")
    tail = (block_mask, scale, heads != kv_heads, options or None,
            compiled.lse_request(return_lse))
    reads_h = score_mod is not None and "h" in ir.free_vars(sibling.ir.score)
    q_group, kv_group = heads // parts, kv_heads // parts
    groups = [HeadGroup(slice(p * q_group, (p + 1) * q_group) if parts > 1 else None,
                        slice(p * kv_group, (p + 1) * kv_group) if parts > 1 else None,
                        heads_from(score_mod, p * q_group, q.device)
                        if reads_h and parts > 1 else score_mod) for p in range(parts)]
    # the batch stays static where the first call compiles (PagedRead._run marks its views)
    if not kernel.static:
        compiled.mark_lengths_dynamic(kernel.entry(), *groups[0].arguments(q, cache)[:3],
                                      score_mod, block_mask)
    return PagedRead(kernel, groups, tail, cache, _signature(q), str(sibling.spec), decoding)


@dataclass(frozen=True)
class ReadKernel:
    """What a read's compiled entries are made from: the lowered spec, the entries' purpose
    (decoding reads compile apart from the others) and the page size; ``static``: whether they
    compile with static shapes, once per shape (:data:`compiled.STATIC_SETTINGS`)."""

    lowered: object
    purpose: str
    page_size: int
    static: bool = False

    def entry(self, options: dict | None = None):
        """The compiled entry of reads (``options``: a tuning candidate's, compiled in an
        entry of its own so that later reads never check its guards)."""
        purpose = f"{self.purpose} with {options}" if options else self.purpose
        return compiled.compiled_entry(self.lowered, purpose)


def read_candidates(page_size: int, own: dict) -> list:
    """The kernel options :meth:`PagedRead.tune` tries by default: each key tile that divides
    the page (:func:`page_tiles`), then pipeline stages, those the read runs with left out."""
    tiles = [size for size in page_tiles(page_size) if size != own.get("BLOCK_N")]
    return [{"BLOCK_N": size} for size in tiles] + [
        {"num_stages": stages} for stages in (2, 4) if stages != own.get("num_stages")]


def lists_every_page(q, mask: ir.Expr, capacity: int, positions: int, width: int,
                     itemsize: int) -> bool:
    """Whether a read lists every page its slots hold and lets the mask decide each key, rather
    than building the exact logical block mask (interval analysis, or the compiled mask
    program's launches) each time a read is made, which is every model step: for decoding
    reads on CUDA whose slots' keys and values, at the capacity (``positions`` rows over all
    batch rows and heads, ``width`` elements each), fit the rule of a contiguous decoding call
    (:func:`~flexspec.runtime.flexattention.every_tile_fits`), under a mask that lets a
    decoded row see every key its slot holds (:func:`last_row_sees_every_key`), so that
    listing them all reads no page the exact mask would skip (a window, other documents:
    a read made once serves every layer of a step, and those layers would read the extra
    pages). The pages a row does not hold are dropped when the mask is mapped
    (:meth:`PagedKVCache.block_mask <flexspec.runtime.paged.PagedKVCache.block_mask>`); a
    capture, and the first read of a spec, build the exact mask (``Attention.logical_read``)."""
    return (q.device.type == "cuda" and q.shape[2] < DECODE_ROWS
            and every_tile_fits(positions, width, itemsize)
            and last_row_sees_every_key(mask, capacity, q.shape[0], q.shape[1]))


@functools.lru_cache(maxsize=256)
def last_row_sees_every_key(mask: ir.Expr, capacity: int, batch: int, heads: int) -> bool:
    """Whether ``mask`` provably lets a query at the last position of a full slot (``capacity
    - 1``) see every key before it, in every batch row and head (interval analysis): true of
    ``causal``, of no mask, of a window of at least the capacity; false where it depends on
    bindings (documents)."""
    sizes = {"B": batch, "H": heads, "Q_LEN": 1, "KV_LEN": capacity}
    return always(mask, position_ranges(sizes, capacity - 1, capacity - 1))


def page_tiles(page_size: int) -> list:
    """The key tiles a read of pages of ``page_size`` positions may run with: FlexAttention's
    (powers of two from 16 to :data:`WIDEST_KEY_TILE`) that divide the page, narrowest first.
    Where the widest is not :data:`WIDEST_KEY_TILE` the read asks for it, since the kernels'
    default tile would span two pages (a page of 48 positions reads in tiles of 16)."""
    return [16 << shift for shift in range(4)
            if 16 << shift <= WIDEST_KEY_TILE and page_size % (16 << shift) == 0]


def given_options(options: dict | None, page_size: int) -> dict:
    """The kernel options given to ``flexspec.compile``, which a read in place runs with over
    its own, checked against the pages: a key tile (``BLOCK_N``) must be one of
    :func:`page_tiles`, since the next page may lie anywhere in the pool."""
    options = dict(options or {})
    tile = options.get("BLOCK_N")
    fits = page_tiles(page_size)
    if tile is not None and (isinstance(tile, bool) or tile not in fits):
        raise BindingError(f"attn.paged: kernel_options BLOCK_N={tile!r} is not a key tile "
                           f"that divides the cache's pages of {page_size} positions (a key "
                           "tile may not span two pages, and FlexAttention's are powers of two "
                           f"from 16 to 128): give one of {fits}, or leave BLOCK_N out (for "
                           "other calls that need it, compile the spec once more without it "
                           "for the paged reads)")
    return options


def head_parts(kv_heads: int, positions: int, dim: int, v_dim: int) -> int | None:
    """The fewest groups of KV heads (a divisor of ``kv_heads``) whose slices of a pool of
    ``positions`` are not indexed in int64 (:func:`wide_keys`), or None where one head's is."""
    for parts in range(2, kv_heads + 1):
        if kv_heads % parts == 0 and not wide_keys(kv_heads // parts * positions, dim, v_dim):
            return parts
    return None


def heads_from(score_mod, first: int, device):
    """``score_mod`` for a group of heads from ``first`` on: it is called with the group's own
    head numbers (0 ..). The offset is a tensor, so every group's call takes one graph."""
    offset = torch.tensor(first, device=device)

    def grouped_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h + offset, q_idx, kv_idx)
    return grouped_score


@dataclass(frozen=True)
class HeadGroup:
    """The query heads, KV heads (slices, or None for all) and score_mod of one call of a
    read."""

    q_heads: slice | None
    kv_heads: slice | None
    score_mod: object

    def arguments(self, q, cache) -> tuple:
        """q, keys and values of this group (the pool with a leading batch of one), and the
        score_mod."""
        keys, values = cache.keys, cache.values
        if self.kv_heads is not None:
            q, keys, values = q[:, self.q_heads], keys[self.kv_heads], values[self.kv_heads]
        return q, keys.unsqueeze(0), values.unsqueeze(0), self.score_mod


def check_pages(cache) -> None:
    """A :class:`BindingError` unless FlexAttention can read ``cache``'s pages in place."""
    if cache.page_size % 16:
        raise BindingError(f"attn.paged: the pool is read in place in key tiles of a multiple "
                           f"of 16 positions, and the cache's pages hold {cache.page_size}: "
                           "use pages of 16, 32, 64 or 128 positions, or read='gather'")


def checked_read(read) -> str:
    """``read`` of ``attn.paged``, checked."""
    if read not in ("auto", "in_place", "gather"):
        raise BindingTypeError(f"attn.paged: read must be 'auto', 'in_place' or 'gather', got "
                               f"{read!r}")
    return read

