"""Paged KV caches: the keys and values of many sequences in fixed-size pages of one pool, a
page table per sequence, and pages taken and given back by tensor operations alone (no value is
read on the host, so a CUDA graph can capture a step that grows its sequences).

A :class:`PagedKVCache` holds:

* ``keys``, ``values``: ``[kv_heads, pages * page_size, head_dim]``, each head's pages laid end
  to end, so that ``keys.unsqueeze(0)`` is a ``[1, Hkv, pages * page_size, D]`` cache every
  batch row can read. FlashInfer's HND layout, ``[pages, kv_heads, page_size, head_dim]``, is
  ``keys.view(kv_heads, pages, page_size, head_dim).transpose(0, 1)``; vLLM's
  ``[pages, page_size, kv_heads, head_dim]`` is ``.permute(1, 2, 0, 3)`` of the same view
  (both views, not copies);
* ``page_table``: ``[slots, max_pages]`` int32, the physical page of each logical page of each
  sequence (a *slot*); entries past a slot's pages are never read. FlashInfer's CSR form
  (``indptr``, ``indices``, ``last_page_len``) is the rows of the slots in a batch cut to their
  page counts, laid end to end;
* ``lengths``: ``[slots]`` int64, the tokens each slot holds (its next token's position);
* ``page_slot``, ``page_index``: ``[pages]`` int32, the slot and logical page each physical page
  holds (-1 where the page is free): four bytes a page each, against
  ``2 * kv_heads * page_size * head_dim`` elements of keys and values a page;
* the free pages, a stack ``[pages]`` and its height (a one-element tensor).

Memory other than the pool grows with the slots and the pages a slot may hold (the page
table), never with the pool times the batch. Masks, scores and bindings see logical positions:
a sequence's key ``i`` is position ``i``, wherever its page lies.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime.mixed import checked_counts, rows_by_count


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


class PagedKVCache:
    """Keys and values of up to ``slots`` sequences in ``pages`` pages of ``page_size`` positions
    (see the module docstring); each sequence holds at most ``max_pages`` pages."""

    def __init__(self, *, pages: int, page_size: int, kv_heads: int, head_dim: int, slots: int,
                 max_pages: int, v_head_dim: int | None = None, dtype=torch.float32,
                 device="cpu"):
        for name, value in (("pages", pages), ("page_size", page_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("slots", slots), ("max_pages", max_pages)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BindingError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        device = torch.device(device)
        self.page_size, self.max_pages, self.pages, self.slots = page_size, max_pages, pages, slots
        self.keys = torch.zeros(kv_heads, pages * page_size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(kv_heads, pages * page_size, v_head_dim, dtype=dtype,
                                  device=device)
        self.page_table = torch.zeros(slots, max_pages, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.int64, device=device)
        self.page_slot = torch.full((pages,), -1, dtype=torch.int32, device=device)
        self.page_index = torch.full((pages,), -1, dtype=torch.int32, device=device)
        # the free pages, taken from the top (the end): page 0 is taken first
        self.free = torch.arange(pages - 1, -1, -1, dtype=torch.int32, device=device)
        self.free_count = torch.full((1,), pages, dtype=torch.int64, device=device)
        # set on the device when a reservation asked for more pages than were free
        self.exhausted = torch.zeros((), dtype=torch.bool, device=device)

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def capacity(self) -> int:
        """The positions a slot may hold: ``max_pages * page_size``."""
        return self.max_pages * self.page_size

    # ---- pages
    def reserve(self, slots: torch.Tensor, lengths: torch.Tensor, *, check: bool = True) -> None:
        """Give each of ``slots`` (distinct) pages for ``lengths`` positions in all (no page is
        taken back where a slot holds more). Tensor operations only; with ``check`` (the
        default), one host read says whether the free pages sufficed: pass ``check=False``
        inside a captured step, and call :meth:`check` outside it."""
        slots = self._slots(slots)
        lengths = self._lengths(lengths, slots)
        page = self.page_size
        held = (self.lengths[slots] + page - 1) // page
        needed = (torch.maximum(lengths, self.lengths[slots]) + page - 1) // page
        extra = needed - held
        first = torch.cumsum(extra, 0) - extra  # where each slot's pages start on the stack
        total = extra.sum()
        self.exhausted |= total > self.free_count[0]
        step = torch.arange(self.max_pages, device=self.device)
        taking = step < extra.unsqueeze(1)                                   # [n, max_pages]
        depth = self.free_count[0] - 1 - (first.unsqueeze(1) + step)         # stack positions
        taking &= depth >= 0
        taken = self.free[depth.clamp(min=0)]
        logical = held.unsqueeze(1) + step
        # writes that do not take a page land in a spare column, dropped afterwards
        column = torch.where(taking, logical, self.max_pages)
        rows = torch.cat([self.page_table[slots],
                          torch.zeros_like(self.page_table[slots][:, :1])], dim=1)
        rows.scatter_(1, column, torch.where(taking, taken, 0))
        self.page_table[slots] = rows[:, :self.max_pages]
        target = torch.where(taking, taken.long(), self.pages)               # spare entry
        for table, value in ((self.page_slot, slots.unsqueeze(1).expand_as(taking)),
                             (self.page_index, logical)):
            spare = torch.cat([table, table[:1]])
            spare.scatter_(0, target.reshape(-1), value.reshape(-1).to(table.dtype))
            table.copy_(spare[:self.pages])
        self.free_count -= torch.minimum(total, self.free_count[0])
        if check:
            self.check()

    def release(self, slots: torch.Tensor) -> None:
        """Give the pages of ``slots`` (distinct) back and empty them. Tensor operations only."""
        slots = self._slots(slots)
        page = self.page_size
        held = (self.lengths[slots] + page - 1) // page
        first = torch.cumsum(held, 0) - held
        step = torch.arange(self.max_pages, device=self.device)
        giving = step < held.unsqueeze(1)
        pages = self.page_table[slots]
        depth = torch.where(giving, self.free_count[0] + first.unsqueeze(1) + step, self.pages)
        spare = torch.cat([self.free, self.free[:1]])
        spare.scatter_(0, depth.reshape(-1), pages.reshape(-1))
        self.free.copy_(spare[:self.pages])
        gone = torch.where(giving, pages.long(), self.pages).reshape(-1)
        for table in (self.page_slot, self.page_index):
            spare = torch.cat([table, table[:1]])
            spare.scatter_(0, gone, torch.full_like(gone, -1, dtype=table.dtype))
            table.copy_(spare[:self.pages])
        self.free_count += held.sum()
        self.lengths.index_fill_(0, slots, 0)  # a scalar written by index_put_ syncs

    def check(self) -> None:
        """A :class:`BindingError` if a reservation ran out of free pages (one host read)."""
        if bool(self.exhausted):
            raise BindingError(
                f"PagedKVCache: a reservation asked for more pages than were free (the pool "
                f"holds {self.pages} pages of {self.page_size} positions); release finished "
                "sequences first, or make the pool larger. The sequences reserved then are "
                "missing pages: release and write them again")

    # ---- keys and values
    def append(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
               check: bool = True, new_tokens=None) -> None:
        """Write ``keys`` and ``values`` (``[n, kv_heads, T, D]``) after the last position of
        each of ``slots`` (distinct), reserving pages for them. A mixed batch gives
        ``new_tokens`` (a list of ints, as ``attn.paged`` takes it): each row's first
        ``new_tokens[b]`` keys are written, the rest are padding."""
        slots = self._slots(slots)
        if new_tokens is not None:
            if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (keys, values)):
                raise BindingError("PagedKVCache.append: keys and values must be tensors "
                                   "[n slots, kv_heads, new tokens, head_dim]")
            counts = checked_counts(new_tokens, slots.shape[0], keys.shape[2])
            for count, rows in rows_by_count(counts):
                index = torch.tensor(rows, device=self.device)
                self.append(slots.index_select(0, index),
                            keys.index_select(0, index.to(keys.device))[:, :, :count],
                            values.index_select(0, index.to(values.device))[:, :, :count],
                            check=check)
            return
        for name, given, pool in (("keys", keys, self.keys), ("values", values, self.values)):
            if not isinstance(given, torch.Tensor):
                raise BindingTypeError(f"PagedKVCache.append: {name} must be a torch.Tensor")
            want = (slots.shape[0], pool.shape[0], given.shape[2] if given.dim() == 4 else -1,
                    pool.shape[2])
            if given.dim() != 4 or tuple(given.shape) != want or given.shape[2] < 1:
                raise BindingError(f"PagedKVCache.append: {name} must have shape [n slots, "
                                   f"kv_heads, new tokens, head_dim] = [{want[0]}, {want[1]}, "
                                   f"T, {want[3]}], got {list(given.shape)}")
            if given.device != self.device or given.dtype != pool.dtype:
                raise BindingError(f"PagedKVCache.append: {name} must be {pool.dtype} on "
                                   f"{self.device}, got {given.dtype} on {given.device}")
        if keys.shape[2] != values.shape[2]:
            raise BindingError("PagedKVCache.append: keys and values must add as many tokens")
        count = keys.shape[2]
        start = self.lengths[slots]
        self.reserve(slots, start + count, check=check)
        positions = start.unsqueeze(1) + torch.arange(count, device=self.device)   # [n, T]
        where = self.physical(slots, positions.clamp(max=self.capacity - 1))
        for pool, given in ((self.keys, keys), (self.values, values)):
            pool[:, where.reshape(-1)] = given.permute(1, 0, 2, 3).reshape(
                pool.shape[0], -1, pool.shape[2])
        self.lengths[slots] = start + count

    def physical(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pool index of each logical position (``[n, ...]``) of each of ``slots``
        (``[n]``)."""
        page = self.page_size
        rows = self.page_table[slots].long()
        index = (positions // page).reshape(positions.shape[0], -1)
        found = rows.gather(1, index).reshape(positions.shape)
        return found * page + positions % page

    def gathered(self, slots: torch.Tensor) -> tuple:
        """``(keys, values)`` of ``slots`` laid out contiguously, ``[n, kv_heads, capacity, D]``
        (positions past a slot's length hold whatever their page holds): what a backend that
        cannot read pages runs on (a copy)."""
        slots = self._slots(slots)
        positions = torch.arange(self.capacity, device=self.device).expand(slots.shape[0], -1)
        where = self.physical(slots, positions)
        return tuple(pool[:, where].permute(1, 0, 2, 3) for pool in (self.keys, self.values))

    def block_mask(self, logical: BlockMask, slots: torch.Tensor) -> BlockMask:
        """The block mask over the pool (``keys.unsqueeze(0)``, KV_LEN = ``pages * page_size``)
        of ``logical``, a block mask over the logical positions of ``slots`` (batch row ``b``
        is slot ``slots[b]``; KV_LEN the ``capacity``; key blocks of ``page_size``). Each row's
        key blocks become the pages that hold them; its mask_mod sees each pool position's
        logical position, and leaves out positions past the slot's length and pages the slot
        does not hold (the pages of a block past its pages are dropped from its rows). Tensor
        operations only: no value is read on the host. It serves one call: pages reserved,
        released or filled after it is made are not seen.

        For inference: it has no query-side tables (no backward). Its index tables are
        ``[B, H, rows, pages]`` views of ``[B, H, rows, max_pages]`` tables (the columns past a
        row's count are never read), so their memory grows with the pages a slot may hold,
        not with the pool."""
        slots = self._slots(slots)
        page = self.page_size
        if not isinstance(logical, BlockMask):
            raise BindingTypeError(f"PagedKVCache.block_mask: the logical mask must be a "
                                   f"BlockMask, got {type(logical).__name__}")
        rows, kv_blocks = logical.kv_indices.shape[-2:]
        if logical.BLOCK_SIZE[1] != page or kv_blocks != self.max_pages:
            raise BindingError(
                f"PagedKVCache.block_mask: the logical mask must have key blocks of the page "
                f"size ({page}) over the capacity ({self.capacity} positions, {self.max_pages} "
                f"blocks), got blocks of {logical.BLOCK_SIZE[1]} and {kv_blocks} key blocks: "
                f"build it with block_size=(query block, {page}) for KV_LEN = {self.capacity}")
        batch = slots.shape[0]
        if logical.kv_indices.shape[0] not in (1, batch):
            raise BindingError(f"PagedKVCache.block_mask: the logical mask has batch "
                               f"{logical.kv_indices.shape[0]}, the call {batch} slots")
        heads = logical.kv_indices.shape[1]
        held = (self.lengths[slots] + page - 1) // page                       # [B]
        table = self.page_table[slots]                                        # [B, max_pages]
        limit = held.view(batch, 1, 1, 1)

        def mapped(counts, indices):
            if counts is None:
                return None, None
            counts = counts.expand(batch, heads, rows)
            indices = indices.expand(batch, heads, rows, kv_blocks).long()
            # a row's blocks come first in increasing order: those of pages held stay first
            listed = torch.arange(kv_blocks, device=indices.device) < counts.unsqueeze(-1)
            kept = (listed & (indices < limit)).sum(-1, dtype=torch.int32)
            found = table.view(batch, 1, 1, kv_blocks).expand(-1, heads, rows, -1).gather(
                -1, indices.clamp(max=kv_blocks - 1))
            return kept, _widened(found.to(torch.int32), self.pages)

        counts, indices = mapped(logical.kv_num_blocks, logical.kv_indices)
        full_counts, full_indices = mapped(logical.full_kv_num_blocks, logical.full_kv_indices)
        logical_mask = logical.mask_mod
        position_of = self._position_of()
        # int64 copies (see _position_of); the mask serves one call, as the pages are now
        page_slot, lengths = self.page_slot.long(), self.lengths.clone()
        slot_of_row = slots

        def pool_mask(b, h, q_idx, kv_idx):
            where = kv_idx // page
            slot = slot_of_row[b]
            position = position_of(kv_idx)
            mine = (page_slot[where] == slot) & (position < lengths[slot])
            return mine & logical_mask(b, h, q_idx, position)
        return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices,
                                        BLOCK_SIZE=logical.BLOCK_SIZE, mask_mod=pool_mask,
                                        seq_lengths=(logical.seq_lengths[0],
                                                     self.pages * page),
                                        compute_q_blocks=False)

    def score_mod(self, logical_score):
        """``logical_score`` (a ``score_mod`` over logical positions) as a ``score_mod`` over
        the pool: each pool position is given to it as its logical position (0 for a free
        page, whose scores the mask leaves out). Like :meth:`block_mask`, it serves one call."""
        position_of = self._position_of()

        def pool_score(score, b, h, q_idx, kv_idx):
            return logical_score(score, b, h, q_idx, position_of(kv_idx))
        return pool_score

    def _position_of(self):
        """The function from pool positions to logical ones, as the pages are now (a free
        page's positions give 0: never a negative index into a binding). It reads an int64
        copy of ``page_index``: the CPU's compiled kernel fails to build mods that mix int32
        tables into int64 positions."""
        page_index, page = self.page_index.long(), self.page_size

        def position_of(kv_idx):
            return (page_index[kv_idx // page] * page + kv_idx % page).clamp(min=0)
        return position_of

    # ---- checks
    def _slots(self, slots) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 \
                or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise BindingTypeError(f"slots must be a 1-D int tensor of slot numbers, got "
                                   f"{slots!r}")
        if slots.device != self.device:
            raise BindingError(f"slots are on {slots.device}, the cache on {self.device}")
        if slots.device.type == "cpu" and slots.numel() and (
                int(slots.min()) < 0 or int(slots.max()) >= self.slots):
            raise BindingError(f"slots must lie in 0..{self.slots - 1}, got "
                               f"{int(slots.min())}..{int(slots.max())}")
        return slots.long()

    def _lengths(self, lengths, slots: torch.Tensor) -> torch.Tensor:
        if not isinstance(lengths, torch.Tensor) or lengths.shape != slots.shape \
                or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise BindingTypeError(f"lengths must be an int tensor with one entry per slot, "
                                   f"got {lengths!r}")
        if lengths.device.type == "cpu" and lengths.numel() and (
                int(lengths.min()) < 0 or int(lengths.max()) > self.capacity):
            raise BindingError(f"lengths must lie in 0..{self.capacity} (max_pages * "
                               f"page_size), got {int(lengths.min())}..{int(lengths.max())}")
        return lengths.long()
