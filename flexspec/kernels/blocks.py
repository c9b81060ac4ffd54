"""Block masks from the spec's structure: interval analysis per tile, exact refinement inside
partial tiles; the BlockMask is then written by :mod:`flexspec.kernels.block_tables`.

``create_block_mask`` evaluates the mask on all Q_LEN x KV_LEN positions. Here every
(q-block, kv-block) tile is classified at once from the mask's formula: each IR node gets bounds
over the tile's index ranges (:mod:`flexspec.ir.intervals`, vectorised with torch over all tiles), so
a tile is EMPTY (no visible pair), FULL (all visible) or PARTIAL. By default the mask is then
evaluated element by element inside the PARTIAL tiles only, which gives exactly the partial and
full blocks that ``create_block_mask`` finds, at a cost that grows with the number of partial
tiles rather than with Q_LEN * KV_LEN. Like ``create_block_mask``, a tile that runs past the end
of the sequence is never FULL (its padding counts as masked).

Large grids are classified coarse to fine (super-tiles first, then the tiles inside the
partial ones). Tensor lookups (``doc_ids[b, q]``) are bounded by the tensor's minimum and maximum
over the tile's index range: computed per block in one pass when the index is ``q`` or ``kv``
itself, and with a sparse table (range-minimum queries) for other index expressions. The
BlockMask index tables list each row's blocks exactly as ``create_block_mask`` does (see
:func:`flexspec.kernels.block_tables.ordered`).
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.ir import tensor_key
from flexspec.ir.intervals import INF, Analyzer
from flexspec.kernels.block_tables import EMPTY, FULL, PARTIAL, tile_grid, to_block_mask
from flexspec.kernels.evaluate import evaluate

# Tiles classified per step: bounds intermediates are float64 tensors of this many elements.
TILES_PER_CHUNK = 1 << 22
# Cells evaluated per step when refining partial tiles.
CELLS_PER_CHUNK = 1 << 23
# Tile grids larger than this are classified coarse to fine (see classify), with super-tiles
# making a grid of about COARSE_SIDE x COARSE_SIDE.
HIERARCHY_TILES = 1 << 20
COARSE_SIDE = 256
# Side of the sub-tiles whose intervals decide most partial tiles before any cell is evaluated.
SUBTILE = 16
# Rows per tile evaluated in the second search for one visible and one hidden pair.
SAMPLED_ROWS = 16


class TorchOps:
    """:mod:`flexspec.ir.intervals` operations on torch tensors (one element per tile)."""

    def __init__(self, device, lookup):
        self.device = device
        self._lookup = lookup

    def const(self, value):
        if isinstance(value, torch.Tensor):
            return value
        dtype = torch.bool if isinstance(value, bool) else torch.float64
        # a fill on the device: torch.tensor(value, device="cuda") would copy from the host and
        # wait for the queue, once per constant of the formula
        return torch.full((), value, dtype=dtype, device=self.device)

    minimum = staticmethod(torch.minimum)
    maximum = staticmethod(torch.maximum)
    where = staticmethod(torch.where)
    logical_not = staticmethod(torch.logical_not)
    floor = staticmethod(torch.floor)
    ceil = staticmethod(torch.ceil)

    @staticmethod
    def all(*values):
        result = values[0]
        for value in values[1:]:
            result = result & value
        return result

    @staticmethod
    def any(*values):
        result = values[0]
        for value in values[1:]:
            result = result | value
        return result

    @staticmethod
    def fix_nan(value, replacement):
        return torch.where(torch.isnan(value), torch.full_like(value, replacement), value)

    @staticmethod
    def apply(fn, value):
        return fn.torch_fn(torch)(value)

    def lookup(self, node, index_bounds):
        return self._lookup(node, index_bounds)


# ---------------------------------------------------------------------------------------------
# Tensor lookups


def _block_reduce(values: torch.Tensor, dim: int, block: int):
    """Per-block (min, max) of ``values`` along ``dim`` (the last block may be short)."""
    values = values.movedim(dim, -1)
    length = values.shape[-1]
    blocks = -(-length // block)
    pad = blocks * block - length
    low = torch.nn.functional.pad(values, (0, pad), value=INF).reshape(*values.shape[:-1], blocks, block)
    high = torch.nn.functional.pad(values, (0, pad), value=-INF).reshape(*values.shape[:-1], blocks, block)
    return low.amin(-1).movedim(-1, dim), high.amax(-1).movedim(-1, dim)


class _SparseTable:
    """Range minimum and maximum queries along the last dimension in O(1) after O(n log n)."""

    def __init__(self, values: torch.Tensor):
        self.length = values.shape[-1]
        levels = max(1, math.floor(math.log2(self.length)) + 1)
        low, high = [values], [values]
        for k in range(1, levels):
            step = 1 << (k - 1)
            prev_low, prev_high = low[-1], high[-1]
            nxt_low = torch.minimum(prev_low[..., :-step], prev_low[..., step:])
            nxt_high = torch.maximum(prev_high[..., :-step], prev_high[..., step:])
            pad = self.length - nxt_low.shape[-1]
            low.append(torch.nn.functional.pad(nxt_low, (0, pad), value=INF))
            high.append(torch.nn.functional.pad(nxt_high, (0, pad), value=-INF))
        self.low = torch.stack(low)     # [levels, ..., n]
        self.high = torch.stack(high)

    def query(self, prefix: tuple, lo: torch.Tensor, hi: torch.Tensor):
        """min and max over [lo, hi] (int64 tensors, inclusive) of the rows picked by ``prefix``
        (index tensors for the leading dimensions)."""
        span = (hi - lo + 1).clamp_min(1)
        k = torch.floor(torch.log2(span.double())).long()
        right = (hi - (1 << k) + 1).clamp_min(0)
        low = torch.minimum(self.low[(k,) + prefix + (lo,)], self.low[(k,) + prefix + (right,)])
        high = torch.maximum(self.high[(k,) + prefix + (lo,)], self.high[(k,) + prefix + (right,)])
        return low, high


class _Lookups:
    """Bounds of tensor lookups over tiles, with per-tensor caches."""

    def __init__(self, tensors: dict, block: tuple, tile_index: dict):
        self.tensors = tensors
        self.block = block            # (q block, kv block)
        self.tile_index = tile_index  # "q"/"kv" -> int64 tile numbers, broadcastable
        self._reduced: dict = {}
        self._tables: dict = {}

    def __call__(self, node: ir.Lookup, index_bounds):
        if not isinstance(node.tensor, ir.Tensor):
            return None
        key = tensor_key(node.tensor)
        value = self.tensors[key]
        value = value.reshape((1,) * (len(node.index) - value.dim()) + tuple(value.shape))
        value = value.to(torch.float64)
        ranged = [d for d, expr in enumerate(node.index) if ir.free_vars(expr) & {"q", "kv"}]
        exact = []
        for d, (lo, _) in enumerate(index_bounds):
            size = value.shape[d]
            index = lo.long().clamp(0, size - 1) if size > 1 else torch.zeros_like(lo.long())
            # a 0-d index tensor would be read as a Python int (a host read; no graph)
            exact.append(index.reshape(1) if index.dim() == 0 else index)
        if not ranged:
            found = value[tuple(exact)]
            return found, found
        if len(ranged) > 1:
            return value.min(), value.max()
        dim = ranged[0]
        if value.shape[dim] == 1:
            found = value[tuple(exact)]
            return found, found
        expr = node.index[dim]
        if isinstance(expr, ir.Var) and expr.name in ("q", "kv"):
            block = self.block[0] if expr.name == "q" else self.block[1]
            cache = (key, dim, block)
            if cache not in self._reduced:
                self._reduced[cache] = _block_reduce(value, dim, block)
            low, high = self._reduced[cache]
            picks = list(exact)
            # sub-tiles past the end of the sequence are discarded by the caller
            picks[dim] = self.tile_index[expr.name].clamp(max=low.shape[dim] - 1)
            return low[tuple(picks)], high[tuple(picks)]
        cache = (key, dim)
        if cache not in self._tables:
            self._tables[cache] = _SparseTable(value.movedim(dim, -1).contiguous())
        size = value.shape[dim]
        lo, hi = index_bounds[dim]
        lo = lo.clamp(0, size - 1).long()
        hi = hi.clamp(0, size - 1).long()
        prefix = tuple(e for d, e in enumerate(exact) if d != dim)
        return self._tables[cache].query(prefix, lo, hi)


# ---------------------------------------------------------------------------------------------
# Classification


def classify(mask: ir.Expr, sizes: dict, block: tuple, tensors: dict, device, *,
             batch: int, heads: int) -> torch.Tensor:
    """Tile classes (EMPTY, PARTIAL, FULL as int8) of shape ``[batch, heads, NQ, NK]`` from the
    interval analysis alone (sound, not exact). ``batch``/``heads`` are 1 unless the mask reads
    ``b``/``h``.

    A grid of more than :data:`HIERARCHY_TILES` tiles is classified coarse to fine: super-tiles
    of ``factor x factor`` tiles first (a grid of about :data:`COARSE_SIDE` squared), then only
    the tiles inside PARTIAL super-tiles. A FULL or EMPTY super-tile makes all its tiles so
    (soundness carries over: a tile's index ranges lie inside its super-tile's). At S = 1M
    (8192 x 8192 tiles) a causal mask then classifies 256 super-tiles' worth of tiles, not 67M.
    """
    nq, nk = tile_grid(sizes, block)
    if nq * nk <= HIERARCHY_TILES:
        return _classify_grid(mask, sizes, block, tensors, device, batch=batch, heads=heads)
    factor = -(-max(nq, nk) // COARSE_SIDE)
    coarse = _classify_grid(mask, sizes, (block[0] * factor, block[1] * factor), tensors,
                            device, batch=batch, heads=heads)
    cq, ck = coarse.shape[-2:]
    fine = coarse.reshape(batch, heads, cq, 1, ck, 1) \
        .expand(batch, heads, cq, factor, ck, factor).contiguous()
    by_super_tile = fine.permute(0, 1, 2, 4, 3, 5)  # a view: [b, h, cq, ck, factor, factor]
    coords = (coarse == PARTIAL).nonzero()
    per_chunk = max(1, TILES_PER_CHUNK // factor ** 2)
    for start in range(0, coords.shape[0], per_chunk):
        part = coords[start:start + per_chunk]
        must, may, _ = _tiles_inside(part, (factor, factor), block, mask, sizes, tensors, device)
        by_super_tile[part[:, 0], part[:, 1], part[:, 2], part[:, 3]] = _classes(must, may)
    return fine.reshape(batch, heads, cq * factor, ck * factor)[:, :, :nq, :nk].contiguous()


def _classes(must: torch.Tensor, may: torch.Tensor) -> torch.Tensor:
    """Tile classes from the intervals' booleans: FULL where the mask must hold, EMPTY where it
    cannot, PARTIAL elsewhere."""
    # torch.where rather than masked assignments, which would synchronise with the host
    return torch.where(~may, EMPTY, torch.where(must, FULL, PARTIAL)).to(torch.int8)


def _classify_grid(mask: ir.Expr, sizes: dict, block: tuple, tensors: dict, device, *,
                   batch: int, heads: int) -> torch.Tensor:
    """:func:`classify` over the whole tile grid at once (in chunks of rows)."""
    nq, nk = tile_grid(sizes, block)
    out = torch.empty(batch, heads, nq, nk, dtype=torch.int8, device=device)
    rows = max(1, TILES_PER_CHUNK // max(1, batch * heads * nk))
    for start in range(0, nq, rows):
        stop = min(nq, start + rows)
        out[:, :, start:stop] = tile_rows(mask, sizes, block, tensors, device, batch=batch,
                                          heads=heads, start=start, stop=stop, nk=nk)
    return out


def tile_rows(mask: ir.Expr, sizes: dict, block: tuple, tensors: dict, device, *, batch: int,
              heads: int, start, stop, nk) -> torch.Tensor:
    """The interval classes of the tiles in q-block rows ``start:stop`` (all ``nk`` kv-blocks),
    ``[batch, heads, stop - start, nk]``. Branch-free in the sizes, so that
    :mod:`flexspec.kernels.fused_blocks` traces it once for every length."""
    q_block, kv_block = block
    q_lo = torch.arange(start, stop, device=device, dtype=torch.float64) * q_block
    q_hi = torch.clamp(q_lo + (q_block - 1), max=sizes["Q_LEN"] - 1)
    kv_lo = torch.arange(nk, device=device, dtype=torch.float64) * kv_block
    kv_hi = torch.clamp(kv_lo + (kv_block - 1), max=sizes["KV_LEN"] - 1)
    b = torch.arange(batch, device=device, dtype=torch.float64).reshape(batch, 1, 1, 1)
    h = torch.arange(heads, device=device, dtype=torch.float64).reshape(1, heads, 1, 1)
    ranges = {
        "b": (b, b), "h": (h, h),
        "q": (q_lo.reshape(1, 1, -1, 1), q_hi.reshape(1, 1, -1, 1)),
        "kv": (kv_lo.reshape(1, 1, 1, -1), kv_hi.reshape(1, 1, 1, -1)),
    }
    ranges.update((name, (sizes[name], sizes[name])) for name in ir.SIZE_VARS)
    q_tiles = torch.arange(start, stop, device=device).reshape(1, 1, -1, 1)
    kv_tiles = torch.arange(nk, device=device).reshape(1, 1, 1, -1)
    lookups = _Lookups(tensors, block, {"q": q_tiles, "kv": kv_tiles})
    must, may = Analyzer(TorchOps(device, lookups), ranges).boolean(mask)
    shape = (batch, heads, stop - start, nk)
    return _classes(must.expand(shape), may.expand(shape))


def _without_ragged_full(classes: torch.Tensor, sizes: dict, block: tuple, device) -> torch.Tensor:
    """A copy of ``classes`` where a FULL tile that runs past the end of the sequence is
    PARTIAL: like create_block_mask, which counts the padding as masked. Only the last tile row
    and column can run past the end, so only they are touched."""
    classes = classes.clone()
    # torch.where, not a masked assignment: no nonzero, so no host synchronisation
    if sizes["Q_LEN"] % block[0]:
        last = classes[..., -1, :]
        last.copy_(torch.where(last == FULL, PARTIAL, last))
    if sizes["KV_LEN"] % block[1]:
        last = classes[..., :, -1]
        last.copy_(torch.where(last == FULL, PARTIAL, last))
    return classes


def _tiles_inside(coords: torch.Tensor, factors: tuple, block: tuple, mask: ir.Expr,
                  sizes: dict, tensors: dict, device) -> tuple:
    """Interval bounds of the ``block``-sized tiles inside coarse tiles: ``coords`` rows are
    (b, h, coarse q, coarse kv), each coarse tile holding ``factors`` = (fq, fk) tiles. Returns
    bool ``(must, may, valid)`` of shape ``[len(coords), fq, fk]``; ``valid`` marks the tiles
    that start inside the sequence (the others are padding of the last coarse tile)."""
    (fq, fk), (q_block, kv_block) = factors, block
    b, h, qi, ki = (coords[:, i].reshape(-1, 1, 1) for i in range(4))
    q_tiles = qi * fq + torch.arange(fq, device=device).reshape(1, fq, 1)
    kv_tiles = ki * fk + torch.arange(fk, device=device).reshape(1, 1, fk)
    q_lo, kv_lo = (q_tiles * q_block).double(), (kv_tiles * kv_block).double()
    q_hi = torch.clamp(q_lo + q_block - 1, max=sizes["Q_LEN"] - 1)
    kv_hi = torch.clamp(kv_lo + kv_block - 1, max=sizes["KV_LEN"] - 1)
    ranges = {"b": (b.double(), b.double()), "h": (h.double(), h.double()),
              "q": (q_lo, q_hi), "kv": (kv_lo, kv_hi)}
    ranges.update((name, (float(sizes[name]), float(sizes[name]))) for name in ir.SIZE_VARS)
    lookups = _Lookups(tensors, block, {"q": q_tiles, "kv": kv_tiles})
    must, may = Analyzer(TorchOps(device, lookups), ranges).boolean(mask)
    shape = (coords.shape[0], fq, fk)
    valid = (q_lo < sizes["Q_LEN"]) & (kv_lo < sizes["KV_LEN"])
    return must.expand(shape) & valid, may.expand(shape) & valid, valid.expand(shape)


def _subtile_classes(coords: torch.Tensor, mask: ir.Expr, sizes: dict, block: tuple,
                     tensors: dict, device) -> torch.Tensor:
    """Decide PARTIAL tiles from their sub-tiles' intervals where possible: a tile with one FULL
    and one EMPTY sub-tile (padding counts as EMPTY) is PARTIAL for sure; all sub-tiles EMPTY
    makes it EMPTY; all FULL (and no padding) makes it FULL. Returns the class per tile, or -1
    where the sub-tiles do not decide."""
    (q_block, kv_block), sub = block, SUBTILE
    nsq, nsk = q_block // sub, kv_block // sub
    must, may, valid = _tiles_inside(coords, (nsq, nsk), (sub, sub), mask, sizes, tensors,
                                     device)
    q_end = (coords[:, 2] + 1) * q_block
    kv_end = (coords[:, 3] + 1) * kv_block
    full_tile = (q_end <= sizes["Q_LEN"]) & (kv_end <= sizes["KV_LEN"])
    has_true = must.flatten(1).any(1)
    has_false = (~may & valid).flatten(1).any(1) | ~full_tile
    result = torch.full((coords.shape[0],), -1, dtype=torch.int8, device=device)
    result[has_true & has_false] = PARTIAL
    result[~may.flatten(1).any(1)] = EMPTY
    result[must.flatten(1).all(1) & full_tile] = FULL
    return result


def refine(classes: torch.Tensor, mask: ir.Expr, sizes: dict, block: tuple, tensors: dict,
           device) -> torch.Tensor:
    """Exact classes for the tiles the intervals left PARTIAL: first from the intervals of their
    16 x 16 sub-tiles, then, for the tiles still undecided, by evaluating the mask on every cell
    (a tile running past the end of the sequence is never FULL, as in ``create_block_mask``)."""
    classes = _without_ragged_full(classes, sizes, block, device)
    coords = (classes == PARTIAL).nonzero()
    if coords.numel() == 0:
        return classes
    if block[0] % SUBTILE == 0 and block[1] % SUBTILE == 0:  # sub-tiles must tile the block
        decided = _subtile_classes(coords, mask, sizes, block, tensors, device)
        known = decided >= 0
        done = coords[known]
        classes[done[:, 0], done[:, 1], done[:, 2], done[:, 3]] = decided[known]
        coords = coords[~known]
    # Cells of a few rows per tile usually show one visible and one hidden pair (a PARTIAL tile
    # proven): first the tile's first and last rows, then every sixteenth row; only the tiles
    # still without both witnesses are evaluated in full.
    q_block = block[0]
    for rows in (sorted({0, q_block - 1}), range(0, q_block, max(1, q_block // SAMPLED_ROWS))):
        if coords.numel() == 0:
            return classes
        visible, valid = _count_cells(coords, torch.tensor(list(rows), device=device), mask,
                                      sizes, block, tensors, device)
        proven = (visible > 0) & (visible < valid)
        done = coords[proven]
        classes[done[:, 0], done[:, 1], done[:, 2], done[:, 3]] = PARTIAL
        coords = coords[~proven]
    visible, valid = _count_cells(coords, torch.arange(q_block, device=device), mask, sizes,
                                  block, tensors, device)
    new = torch.full_like(visible, PARTIAL, dtype=torch.int8)
    new[visible == 0] = EMPTY
    new[visible == block[0] * block[1]] = FULL
    classes[coords[:, 0], coords[:, 1], coords[:, 2], coords[:, 3]] = new
    return classes


def _count_cells(coords: torch.Tensor, rows: torch.Tensor, mask: ir.Expr, sizes: dict,
                 block: tuple, tensors: dict, device):
    """(visible pairs, pairs inside the sequence) per tile, over the given rows of each tile."""
    q_block, kv_block = block
    q_offsets = rows.reshape(1, -1, 1)
    kv_offsets = torch.arange(kv_block, device=device).reshape(1, 1, kv_block)
    visible = torch.zeros(coords.shape[0], dtype=torch.int64, device=device)
    valid_count = torch.zeros_like(visible)
    per_chunk = max(1, CELLS_PER_CHUNK // (rows.numel() * kv_block))
    for start in range(0, coords.shape[0], per_chunk):
        part = coords[start:start + per_chunk]
        b, h, qi, ki = (part[:, i].reshape(-1, 1, 1) for i in range(4))
        q = qi * q_block + q_offsets
        kv = ki * kv_block + kv_offsets
        valid = (q < sizes["Q_LEN"]) & (kv < sizes["KV_LEN"])
        grid = {"b": b, "h": h, "q": q.clamp(max=sizes["Q_LEN"] - 1),
                "kv": kv.clamp(max=sizes["KV_LEN"] - 1)}
        grid.update((name, sizes[name]) for name in ir.SIZE_VARS)
        shape = (part.shape[0], rows.numel(), kv_block)
        cells = evaluate(mask, grid, tensors).expand(shape) & valid
        visible[start:start + per_chunk] = cells.sum(dim=(1, 2))
        valid_count[start:start + per_chunk] = valid.expand(shape).sum(dim=(1, 2))
    return visible, valid_count


def build_block_mask(mask: ir.Expr, sizes: dict, block: tuple, tensors: dict, device, *,
                     batch: int, heads: int, mask_mod=None, exact: bool = True) -> BlockMask:
    """The BlockMask of ``mask`` (an IR boolean, specialized to the tensors' shapes).

    ``exact=False`` skips the refinement: every tile the intervals cannot decide stays PARTIAL
    (still correct for attention, since the kernel applies ``mask_mod`` inside partial tiles).
    """
    classes = classify(mask, sizes, block, tensors, device, batch=batch, heads=heads)
    if exact:
        classes = refine(classes, mask, sizes, block, tensors, device)
    else:
        classes = _without_ragged_full(classes, sizes, block, device)
    return to_block_mask(classes, sizes, block, mask_mod)


def count_visible(mask: ir.Expr, sizes: dict, block: tuple, tensors: dict, device, *,
                  batch: int, heads: int, classes: torch.Tensor | None = None) -> int:
    """The number of visible (q, kv) pairs over ``batch`` x ``heads`` (the mask's extents),
    exactly: the area of FULL tiles plus a cell-by-cell count inside PARTIAL ones. ``classes``
    (sound tile classes such as :func:`tile_classes` of the block mask) saves classifying the
    tiles again."""
    if classes is None:
        classes = classify(mask, sizes, block, tensors, device, batch=batch, heads=heads)
    q_rows = torch.clamp(sizes["Q_LEN"] - torch.arange(0, sizes["Q_LEN"], block[0],
                                                      device=device), max=block[0])
    kv_cols = torch.clamp(sizes["KV_LEN"] - torch.arange(0, sizes["KV_LEN"], block[1],
                                                        device=device), max=block[1])
    area = q_rows.reshape(-1, 1) * kv_cols.reshape(1, -1)
    total = int((area * (classes == FULL)).sum())
    coords = (classes == PARTIAL).nonzero()
    if coords.numel():
        visible, _ = _count_cells(coords, torch.arange(block[0], device=device), mask, sizes,
                                  block, tensors, device)
        total += int(visible.sum())
    return total
