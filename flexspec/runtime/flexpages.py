"""FlexAttention over a paged pool: how the ``flex`` backend reads a paged plan's keys and values
in place (:attr:`Request.pages <flexspec.runtime.contract.Request.pages>`).

One compiled FlexAttention call reads the whole pool (``keys.unsqueeze(0)``: every call row
reads one batch row of ``[1, Hkv, pages * page_size, D]``), through a block mask mapped from the
sequences' logical positions to the pages that hold them (:func:`pool_block_mask`) and a
``score_mod`` that sees each key's logical position (:func:`pool_score_mod`). Nothing is copied,
and a row reads the pages its slot holds and no other. The plan's block masks are its logical
ones, with key blocks of the page (``PageGeometry.block_size``), so that a key block maps to one
page; a key tile never spans two pages (:func:`page_tiles`). A pool too wide for the decoding
kernel is read a group of KV heads at a time (:func:`head_parts`), and a small decoding read
lists every page its slots hold rather than building the exact logical mask each step
(:func:`lists_every_page`).

:func:`prepare` and :func:`launcher` are the ``flex`` backend's for a paged plan: the lowered
spec, the compiled entry, the decoding rule (:func:`flexspec.runtime.flexattention.decodes`) and
the kernel options given or tuned are those of every FlexAttention call. For inference only: the
mapped mask has no query-side tables, so there is no backward pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError
from flexspec.ir.intervals import always
from flexspec.ir.overflow import position_ranges
from flexspec.kernels.replay import Replay
from flexspec.runtime import compiled
from flexspec.runtime.contract import BackendError, PageTables, Plan, Prepared
from flexspec.runtime.flexattention import (DECODE_ROWS, decodes, every_tile_fits,
                                             kernel_parts, wide_keys)
from flexspec.runtime.progress import timed

# The least head dimension FlexAttention's GPU kernels take.
MIN_GPU_HEAD_DIM = 16
# The widest key tile FlexAttention's kernels take by default: a smaller page needs its own.
WIDEST_KEY_TILE = 128
# The mapped block mask has no query-side tables: no backward pass.
INFERENCE_ONLY = ("the pool is read in place for inference only (no backward pass); use "
                  "read='gather' to train through a paged cache")


def why_not(request) -> str | None:
    """Why FlexAttention cannot read ``request``'s paged pool in place, or ``None``."""
    if request.grads:
        return INFERENCE_ONLY
    page = request.pages.page_size
    if page % 16:
        return (f"the pool is read in place in key tiles of a multiple of 16 positions, and its "
                f"pages hold {page}: use pages of 16, 32, 64 or 128 positions, or "
                "read='gather'")
    if request.device_type != "cpu" and min(request.head_dim, request.v_head_dim) < \
            MIN_GPU_HEAD_DIM:
        return (f"FlexAttention's GPU kernels take heads of at least {MIN_GPU_HEAD_DIM} "
                "dimensions")
    return None


def auto_veto(request) -> str | None:
    """Why ``auto`` copies a paged call's sequences out rather than reading them in place."""
    if request.device_type != "cuda":
        return (f"on {request.device_type}, copying the sequences out of their pages costs less "
                "than compiling the pool's read (read='in_place' reads in place)")
    return None


# ---- the pool's block mask and score_mod


def _widened(table: torch.Tensor, width: int) -> torch.Tensor:
    """``table`` (``[..., n]``, contiguous) seen as ``[..., width]`` with ``width >= n``: each
    row runs on into the rows after it, and the last into ``width - n`` spare entries. The
    kernels read a row only up to its count; the shape is what they check against the keys'
    length (a table as wide as the pool, written out, would grow with the pool times the
    batch)."""
    n = table.shape[-1]
    if width <= n:
        return table
    flat = torch.cat([table.reshape(-1), table.new_zeros(width - n)])
    return flat.as_strided((*table.shape[:-1], width), table.stride())


def pool_block_mask(logical: BlockMask, tables: PageTables) -> BlockMask:
    """The block mask over the pool (KV_LEN ``pages * page_size``) of ``logical``, a block mask
    over the logical positions of ``tables``' rows (KV_LEN the capacity, key blocks of the
    page). Each row's key blocks become the pages that hold them; its mask_mod sees each pool
    position's logical position, and leaves out positions past the row's length and pages its
    slot does not hold (the pages of a block past its pages are dropped from its rows). Tensor
    operations only: no value is read on the host.

    For inference: it has no query-side tables (no backward). Its index tables are
    ``[B, H, rows, pages]`` views of ``[B, H, rows, max_pages]`` tables (the columns past a
    row's count are never read), so their memory grows with the pages a slot may hold, not with
    the pool."""
    geometry = tables.geometry
    page = geometry.page_size
    if not isinstance(logical, BlockMask):
        raise BindingTypeError(f"the logical mask must be a BlockMask, got "
                               f"{type(logical).__name__}")
    rows, kv_blocks = logical.kv_indices.shape[-2:]
    if logical.BLOCK_SIZE[1] != page or kv_blocks != geometry.max_pages:
        raise BindingError(
            f"the logical mask must have key blocks of the page size ({page}) over the capacity "
            f"({geometry.capacity} positions, {geometry.max_pages} blocks), got blocks of "
            f"{logical.BLOCK_SIZE[1]} and {kv_blocks} key blocks: build it with "
            f"block_size=(query block, {page}) for KV_LEN = {geometry.capacity}")
    batch = tables.slots.shape[0]
    if logical.kv_indices.shape[0] not in (1, batch):
        raise BindingError(f"the logical mask has batch {logical.kv_indices.shape[0]}, the call "
                           f"{batch} slots")
    heads = logical.kv_indices.shape[1]
    held = (tables.lengths + page - 1) // page                            # [B]
    limit = held.view(batch, 1, 1, 1)

    def mapped(counts, indices):
        if counts is None:
            return None, None
        counts = counts.expand(batch, heads, rows)
        indices = indices.expand(batch, heads, rows, kv_blocks).long()
        # a row's blocks come first in increasing order: those of pages held stay first
        listed = torch.arange(kv_blocks, device=indices.device) < counts.unsqueeze(-1)
        kept = (listed & (indices < limit)).sum(-1, dtype=torch.int32)
        found = tables.pages.view(batch, 1, 1, kv_blocks).expand(-1, heads, rows, -1).gather(
            -1, indices.clamp(max=kv_blocks - 1))
        return kept, _widened(found.to(torch.int32), geometry.pages)

    counts, indices = mapped(logical.kv_num_blocks, logical.kv_indices)
    full_counts, full_indices = mapped(logical.full_kv_num_blocks, logical.full_kv_indices)
    logical_mask = logical.mask_mod
    position_of = _position_of(tables.page_index, page)
    page_slot, lengths, slots = tables.page_slot, tables.lengths, tables.slots

    def pool_mask(b, h, q_idx, kv_idx):
        position = position_of(kv_idx)
        mine = (page_slot[kv_idx // page] == slots[b]) & (position < lengths[b])
        return mine & logical_mask(b, h, q_idx, position)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices,
                                    BLOCK_SIZE=logical.BLOCK_SIZE, mask_mod=pool_mask,
                                    seq_lengths=(logical.seq_lengths[0], geometry.positions),
                                    compute_q_blocks=False)


def pool_score_mod(logical_score, page_index: torch.Tensor, page_size: int):
    """``logical_score`` (a ``score_mod`` over logical positions) as a ``score_mod`` over the
    pool: each pool position is given to it as its logical position (0 for a free page, whose
    scores the mask leaves out). ``page_index``: the logical page of each pool page, int64."""
    position_of = _position_of(page_index, page_size)

    def pool_score(score, b, h, q_idx, kv_idx):
        return logical_score(score, b, h, q_idx, position_of(kv_idx))
    return pool_score


def _position_of(page_index: torch.Tensor, page: int):
    """The function from pool positions to logical ones (a free page's positions give 0: never
    a negative index into a binding). ``page_index`` is int64: the CPU's compiled kernel fails
    to build mods that mix int32 tables into int64 positions."""
    def position_of(kv_idx):
        return (page_index[kv_idx // page] * page + kv_idx % page).clamp(min=0)
    return position_of


# ---- tiles, head groups, every page


def page_tiles(page_size: int) -> list:
    """The key tiles a read of pages of ``page_size`` positions may run with: FlexAttention's
    (powers of two from 16 to :data:`WIDEST_KEY_TILE`) that divide the page, narrowest first.
    Where the widest is not :data:`WIDEST_KEY_TILE` the read asks for it, since the kernels'
    default tile would span two pages (a page of 48 positions reads in tiles of 16)."""
    return [16 << shift for shift in range(4)
            if 16 << shift <= WIDEST_KEY_TILE and page_size % (16 << shift) == 0]


def given_options(options: dict | None, page_size: int) -> dict:
    """Kernel options given to ``flexspec.compile`` or tuned, which a read in place runs with
    over its own, checked against the pages: a key tile (``BLOCK_N``) must be one of
    :func:`page_tiles`, since the next page may lie anywhere in the pool."""
    options = dict(options or {})
    tile = options.get("BLOCK_N")
    fits = page_tiles(page_size)
    if tile is not None and (isinstance(tile, bool) or tile not in fits):
        raise BindingError(f"kernel_options BLOCK_N={tile!r} is not a key tile that divides the "
                           f"cache's pages of {page_size} positions (a key tile may not span two "
                           "pages, and FlexAttention's are powers of two from 16 to 128): give "
                           f"one of {fits}, or leave BLOCK_N out (for other calls that need it, "
                           "compile the spec once more without it for the paged reads)")
    return options


def read_candidates(page_size: int, own: dict) -> list:
    """The kernel options a paged read's tune tries by default: each key tile that divides the
    page (:func:`page_tiles`), then pipeline stages, those the read runs with left out."""
    tiles = [size for size in page_tiles(page_size) if size != own.get("BLOCK_N")]
    return [{"BLOCK_N": size} for size in tiles] + [
        {"num_stages": stages} for stages in (2, 4) if stages != own.get("num_stages")]


def lists_every_page(request, mask: ir.Expr) -> bool:
    """Whether a paged read lists every page its slots hold and lets the mask decide each key,
    rather than building the exact logical block mask (interval analysis, or the compiled mask
    program's launches) each time a read is made, which is every model step: for decoding
    reads on CUDA whose slots' keys and values, at the capacity, fit the rule of a contiguous
    decoding call (:func:`~flexspec.runtime.flexattention.every_tile_fits`), under a mask that
    lets a decoded row see every key its slot holds (:func:`last_row_sees_every_key`), so that
    listing them all reads no page the exact mask would skip (a window, other documents: a read
    made once serves every layer of a step, and those layers would read the extra pages). The
    pages a row does not hold are dropped when the mask is mapped (:func:`pool_block_mask`); a
    capture, and the first read of a spec, build the exact mask."""
    return (request.device_type == "cuda" and request.q_len < DECODE_ROWS
            and every_tile_fits(request.batch * request.kv_heads * request.kv_len,
                                request.head_dim + request.v_head_dim, request.dtype.itemsize)
            and last_row_sees_every_key(mask, request.kv_len, request.batch, request.heads))


@functools.lru_cache(maxsize=256)
def last_row_sees_every_key(mask: ir.Expr, capacity: int, batch: int, heads: int) -> bool:
    """Whether ``mask`` provably lets a query at the last position of a full slot (``capacity
    - 1``) see every key before it, in every batch row and head (interval analysis): true of
    ``causal``, of no mask, of a window of at least the capacity; false where it depends on
    bindings (documents)."""
    sizes = {"B": batch, "H": heads, "Q_LEN": 1, "KV_LEN": capacity}
    return always(mask, position_ranges(sizes, capacity - 1, capacity - 1))


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


# ---- the backend's prepare and launcher for a paged plan


@dataclass(eq=False)
class PagedCall:
    """What a paged FlexAttention plan keeps between reads (the ``flex`` backend's ``state``)."""

    kernel: object                    # flexattention.KernelParts: lowered spec, options, entry
    masks: object                     # the plan's logical PlanMasks, in the kernel's form
    every_page: bool                  # lists every page outside a capture (lists_every_page)
    parts: int                        # groups of KV heads read one call each (head_parts)
    static: bool                      # compiles with static shapes (the CPU's kernel)
    score_mod: object = None          # the logical score_mod where it reads no binding
    score_varies: bool = True
    score_reads_kv: bool = False
    score_reads_h: bool = False


def prepare(plan: Plan, values: dict) -> Prepared:
    """The state of a paged plan: its kernel (compiled once per plan, in an entry of its own
    for decoding reads), its logical block masks, and whether its reads list every page."""
    request = plan.request
    geometry = request.pages
    parts, wide = 1, wide_keys(request.key_positions, request.head_dim, request.v_head_dim)
    # the decoding kernel does not compile for a pool inductor indexes in int64
    # (flexspec.workarounds: flex-decoding-wide-indices): such a read runs as one call per
    # group of KV heads whose slice of the pool is narrower, where the mask is the same for
    # every head, else on the main kernel
    if wide and request.q_len < DECODE_ROWS and plan.masks.heads == 1:
        parts = head_parts(request.kv_heads, geometry.positions, request.head_dim,
                           request.v_head_dim) or 1
    decoding = decodes(plan, parts)
    options = {}
    if not decoding and request.q_len < DECODE_ROWS:
        options["FORCE_USE_FLEX_ATTENTION"] = True
    widest = max(page_tiles(geometry.page_size), default=WIDEST_KEY_TILE)
    if widest < WIDEST_KEY_TILE:
        options["BLOCK_N"] = widest  # a key tile may not span two pages
    given = given_options(dict(request.kernel_options), geometry.page_size)
    # decoding reads compile apart from the others: once one entry had seen a chunk's rows and
    # batch, dynamo made them dynamic in the decoding graph too, and a decoded read of a
    # second cache ran 17x slower (docs/performance.md, nineteenth session)
    kernel = kernel_parts(plan, values, options, decoding,
                          "paged decoding" if decoding else "paged", given)
    masks = plan.masks.partial_only() if decoding else plan.masks
    free = ir.free_vars(plan.spec.score)
    call = PagedCall(kernel=kernel, masks=masks, parts=parts,
                     every_page=lists_every_page(request, plan.written.mask),
                     # the CPU's C++ kernel of a read does not compile with dynamic shapes
                     # (flexspec.workarounds: cpu-dynamic-row-binding): one compile per shape
                     static=request.device_type == "cpu",
                     score_reads_kv="kv" in free, score_reads_h="h" in free)
    score_keys = plan.score_keys
    if not (score_keys & {slot.key for slot in plan.slots}) and not any(
            values[key].dtype == torch.float64 for key in score_keys):
        call.score_mod = kernel.score_mod(plan, values)
        call.score_varies = False
    return Prepared(state=call, needs_values=True)


def kernel(plan: Plan) -> str:
    """Which kernel reads a paged plan's pool, and how (what ``explain`` reports)."""
    call: PagedCall = plan.state
    how = ("FlexAttention's decoding kernel" if call.kernel.decoding
           else "FlexAttention's main kernel")
    how += (f" over the pool in place, key tiles within pages of {plan.request.pages.page_size} "
            "positions")
    if call.parts > 1:
        how += (f", one call per group of {plan.request.kv_heads // call.parts} KV heads (the "
                "pool holds 2**31 elements or more; flexspec.workarounds: "
                "flex-decoding-wide-indices)")
    if call.every_page:
        how += (", every page a row's slot holds listed (no exact mask built at each step; "
                "a decoded row sees every key it holds)")
    return how


def launcher(plan: Plan, values: dict, pages: PageTables):
    """The launch of a paged plan's reads over ``pages`` (see :func:`prepare`): a function of
    ``(q, keys, values)``, the pools of any cache whose pages were taken by the operations that
    made ``pages``, that runs the kernel alone."""
    call: PagedCall = plan.state
    kernel = call.kernel
    logical = call.masks.get(values, plan.device, every_tile=call.every_page)
    block_mask = pool_block_mask(logical, pages)
    score_mod = call.score_mod if not call.score_varies else kernel.score_mod(plan, values)
    if score_mod is not None and call.score_reads_kv:
        score_mod = pool_score_mod(score_mod, pages.page_index, pages.geometry.page_size)
    request, parts = plan.request, call.parts
    heads, kv_heads = request.heads // parts, request.kv_heads // parts
    scores = [heads_from(score_mod, part * heads, plan.device)
              if call.score_reads_h and parts > 1 and score_mod is not None else score_mod
              for part in range(parts)]
    options, lse, gqa = kernel.options, kernel.lse, plan.gqa
    replays: list = [None] * parts  # the code each group's first call ran, for later layers

    def run(part: int, q, keys, values):
        if parts > 1:
            q = q[:, part * heads:(part + 1) * heads]
            keys = keys[part * kv_heads:(part + 1) * kv_heads]
            values = values[part * kv_heads:(part + 1) * kv_heads]
        args = (q, keys.unsqueeze(0), values.unsqueeze(0), scores[part], block_mask, None, gqa,
                options, lse)
        replay = replays[part]
        out = replay.run(args) if replay is not None else None
        if out is None:
            out, replays[part] = _kept_call(call, plan, args)
        return compiled.split_lse(out) if lse is not None else out

    def launch(q, keys, values):
        if parts == 1:
            return run(0, q, keys, values)
        outs = [run(part, q, keys, values) for part in range(parts)]
        if lse is not None:
            return (torch.cat([out for out, _ in outs], dim=1),
                    torch.cat([found for _, found in outs], dim=1))
        return torch.cat(outs, dim=1)
    return launch


def _kept_call(call: PagedCall, plan: Plan, args: tuple) -> tuple:
    """``(output, replay)`` of a launch's first call of a group of heads (or one its replay
    refused): the cached code dynamo's guards accept, kept for the step's later layers
    (kernels.replay), else a call through dynamo under flexspec's compile settings, which
    compiles the kernel where new (a compile that fails is a :class:`BackendError` that says
    how to read the pages otherwise)."""
    entry = call.kernel.entry
    found = Replay.of(entry, args)
    if found is not None:
        return found.function(*args), found
    if call.kernel.decoding:  # each group's views are new tensors
        compiled.mark_batch_static(*args[:3])
    if not call.static:
        compiled.mark_lengths_dynamic(entry, *args[:5])
    sizes = plan.sizes
    try:
        with timed(f"a read of '{plan.text}' over a paged pool at B={sizes['B']} "
                   f"H={sizes['H']} Q_LEN={sizes['Q_LEN']}, which compiles its kernel where "
                   "new"):
            out = compiled.run_compiled(entry, *args, static=call.static)
    except compiled.CompileLimitError:
        raise
    except Exception as err:  # noqa: BLE001 - inductor's errors have no stable type
        raise BackendError(
            f"FlexAttention could not compile its read of the pool for '{plan.text}' on "
            f"{plan.device.type} ({compiled.first_line(err)}); read='gather' runs it on the "
            "sequences copied out of their pages") from err
    return out, Replay.of(entry, args)
