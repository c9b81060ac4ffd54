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
* ``held``: ``[slots]`` int64, the pages each slot holds (those its tokens fill, and those
  :meth:`PagedKVCache.reserve` gave it ahead of them);
* ``page_slot``, ``page_index``: ``[pages]`` int32, the slot and logical page each physical page
  holds (-1 where the page is free): four bytes a page each, against
  ``2 * kv_heads * page_size * head_dim`` elements of keys and values a page;
* the free pages, a stack ``[pages]`` and its height (a one-element tensor); a free page holds
  zeros;
* ``refused``: a device bool, set when an operation made with ``check=False`` was refused
  (:meth:`PagedKVCache.check` reads and clears it).

Memory other than the pool grows with the slots and the pages a slot may hold (the page
table), never with the pool times the batch. Masks, scores and bindings see logical positions:
a sequence's key ``i`` is position ``i``, wherever its page lies.

The cache is an allocator and its tables only: :meth:`PagedKVCache.tables` hands a read the
tables of some slots (:class:`~flexspec.runtime.contract.PageTables`), and reading them is the
runtime's (:mod:`flexspec.runtime.serving.reads`).
"""

from __future__ import annotations

import torch

from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime.contract import PageGeometry, PageTables
from flexspec.runtime.flexpages import pool_block_mask, pool_score_mod


def checked_counts(new_tokens, batch: int, q_len: int) -> list:
    """``new_tokens`` (a mixed batch's count of real tokens per row) as a list of ints, one per
    row, each in ``1..q_len``, or an error that says what is wrong."""
    if isinstance(new_tokens, torch.Tensor):
        if new_tokens.device.type != "cpu":
            raise BindingTypeError("new_tokens is read on the host: give it as a list of ints "
                                   "(or a CPU tensor), not a tensor on "
                                   f"{new_tokens.device.type}, whose read would wait for the "
                                   "device")
        new_tokens = new_tokens.tolist()
    if not isinstance(new_tokens, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in new_tokens):
        raise BindingTypeError(f"new_tokens must be a list of ints (the new tokens of each row "
                               f"of q), got {new_tokens!r}")
    if len(new_tokens) != batch:
        raise BindingError(f"new_tokens has {len(new_tokens)} entries, q has {batch} rows: "
                           "give one count per row")
    wrong = [n for n in new_tokens if not 1 <= n <= q_len]
    if wrong:
        raise BindingError(f"new_tokens must lie in 1..{q_len} (q's Q_LEN, the longest "
                           f"request's new tokens), got {wrong[0]}")
    return list(new_tokens)


def rows_by_count(new_tokens: list) -> list:
    """``(count, rows)`` for each count of new tokens, fewest first: the rows that are appended
    (or run) together."""
    return [(count, [row for row, n in enumerate(new_tokens) if n == count])
            for count in sorted(set(new_tokens))]


class PagedKVCache:
    """Keys and values of up to ``slots`` sequences in ``pages`` pages of ``page_size`` positions
    (see the module docstring); each sequence holds at most ``max_pages`` pages.

    An operation is all or nothing: one the pool cannot serve (more pages than are free,
    ``slots`` naming a slot twice, lengths past the capacity) changes nothing. With ``check``
    (the default), it raises a :class:`BindingError` at once (one host read); with
    ``check=False`` (inside a captured step) it raises nothing and :meth:`check` says so later.
    A page is zeroed when its slot gives it back, so what an earlier owner left there (a NaN)
    never reaches the positions past a new owner's length."""

    def __init__(self, *, pages: int, page_size: int, kv_heads: int, head_dim: int, slots: int,
                 max_pages: int, v_head_dim: int | None = None, dtype=torch.float32,
                 device="cpu"):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, value in (("pages", pages), ("page_size", page_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("slots", slots), ("max_pages", max_pages),
                            ("v_head_dim", v_head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BindingError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise BindingTypeError(f"PagedKVCache: dtype must be a floating torch.dtype "
                                   f"(torch.float32, torch.bfloat16...), got {dtype!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise BindingTypeError(f"PagedKVCache: device must name a torch device ('cpu', "
                                   f"'cuda:0'...), got {device!r}") from error
        self.page_size, self.max_pages, self.pages, self.slots = page_size, max_pages, pages, slots
        self.geometry = PageGeometry(page_size, pages, max_pages)
        # made outside inference mode: the cache serves calls in every mode, and an inference
        # tensor cannot be written in place outside it
        with torch.inference_mode(False):
            self.keys = torch.zeros(kv_heads, pages * page_size, head_dim, dtype=dtype,
                                    device=device)
            self.values = torch.zeros(kv_heads, pages * page_size, v_head_dim, dtype=dtype,
                                      device=device)
            self.page_table = torch.zeros(slots, max_pages, dtype=torch.int32, device=device)
            self.lengths = torch.zeros(slots, dtype=torch.int64, device=device)
            self.held = torch.zeros(slots, dtype=torch.int64, device=device)  # pages a slot holds
            self.page_slot = torch.full((pages,), -1, dtype=torch.int32, device=device)
            self.page_index = torch.full((pages,), -1, dtype=torch.int32, device=device)
            # the free pages, taken from the top (the end): page 0 is taken first
            self.free = torch.arange(pages - 1, -1, -1, dtype=torch.int32, device=device)
            self.free_count = torch.full((1,), pages, dtype=torch.int64, device=device)
            # set on the device when an operation made with check=False was refused
            self.refused = torch.zeros((), dtype=torch.bool, device=device)
        # what a read of the cache depends on besides its tables' values: a read made from one
        # cache runs over another of the same layout (a model's other layers)
        self.layout = (self.geometry, slots, tuple(self.keys.shape), tuple(self.values.shape),
                       dtype, device)

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
        taken back where a slot holds more); a later :meth:`append` writes into them. Tensor
        operations only; with ``check`` (the default), one host read says whether the pool
        could serve it: pass ``check=False`` inside a captured step, and call :meth:`check`
        outside it."""
        slots = self._slots(slots)
        lengths = self._lengths(lengths, slots)
        self._settle(self._take(slots, lengths, self.max_pages), check)

    def release(self, slots: torch.Tensor) -> None:
        """Give the pages of ``slots`` (distinct) back and empty them. Tensor operations only
        (where the host cannot tell that the slots are distinct, slots named twice release
        nothing, and :meth:`check` says so)."""
        slots = self._slots(slots)
        if not slots.numel():
            return
        ok = self._distinct(slots)
        held = torch.where(ok, self.held[slots], 0)
        first = torch.cumsum(held, 0) - held
        step = torch.arange(self.max_pages, device=self.device)
        giving = step < held.unsqueeze(1)
        pages = self.page_table[slots]
        self._zero(pages, giving)  # before they are free: a free page stays zero
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
        # tensors written, not scalars: a scalar written by index_put_ syncs
        for table in (self.held, self.lengths):
            table[slots] = torch.where(ok, 0, table[slots])
        self.refused |= ~ok

    def check(self) -> None:
        """A :class:`BindingError` if an operation made with ``check=False`` since the last check
        was refused (one host read); the flag is cleared."""
        if bool(self.refused):
            self.refused.zero_()
            raise BindingError(self._refusal())

    def _refusal(self) -> str:
        return (f"PagedKVCache: an operation was refused and changed nothing: it asked for more "
                f"pages than were free (the pool holds {self.pages} pages of {self.page_size} "
                "positions), named a slot twice, or went past a slot's capacity "
                f"({self.capacity} positions). Release finished sequences (or make the pool "
                "larger) and write the refused tokens again")

    def _settle(self, ok: torch.Tensor, check: bool) -> None:
        """Raise now if ``check`` and the operation was refused (``ok`` false), else remember
        a refusal for :meth:`check`."""
        if check:
            if not bool(ok):
                raise BindingError(self._refusal())
        else:
            self.refused |= ~ok

    def _take(self, slots: torch.Tensor, lengths: torch.Tensor, most: int) -> torch.Tensor:
        """Give ``slots`` pages for ``lengths`` positions each (at most ``most`` new pages a
        slot), all or none: whether they were given (a device bool). Tensor operations only."""
        page = self.page_size
        held = self.held[slots]
        needed = torch.maximum((lengths + page - 1) // page, held)
        extra = needed - held
        ok = (extra.sum() <= self.free_count[0]) & self._distinct(slots) \
            & (lengths <= self.capacity).all()
        extra = torch.where(ok, extra, 0)
        first = torch.cumsum(extra, 0) - extra  # where each slot's pages start on the stack
        total = extra.sum()
        step = torch.arange(min(most, self.max_pages), device=self.device)
        taking = step < extra.unsqueeze(1)                                   # [n, most]
        depth = self.free_count[0] - 1 - (first.unsqueeze(1) + step)         # stack positions
        taken = self.free[depth.clamp(min=0)]
        logical = (held.unsqueeze(1) + step).clamp(max=self.max_pages - 1)
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
        self.free_count -= total
        self.held[slots] = held + extra
        return ok

    def _zero(self, pages: torch.Tensor, giving: torch.Tensor) -> None:
        """Zero the ``pages`` where ``giving`` (pages given back), by tensor operations on a
        fixed number of positions: an entry that gives no page zeroes one that does, or a free
        page, or (when none is given and none is free) writes its own positions back."""
        page = self.page_size
        flat, flat_giving = pages.reshape(-1).long(), giving.reshape(-1)
        any_given = flat_giving.any()
        # gathered by an index tensor: indexing by a 0-d tensor would read it on the host
        first = flat.index_select(0, flat_giving.to(torch.int8).argmax().view(1)).squeeze(0)
        spare_free = self.free_count[0] > 0
        target = torch.where(flat_giving, flat, torch.where(
            any_given, first, torch.where(spare_free, self.free[0].long(), 0)))
        zeroing = any_given | spare_free
        positions = (target.unsqueeze(1) * page
                     + torch.arange(page, device=self.device)).reshape(-1)
        for pool in (self.keys, self.values):
            old = pool[:, positions]
            pool[:, positions] = torch.where(zeroing, torch.zeros_like(old), old)

    # ---- keys and values
    def append(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
               check: bool = True, new_tokens=None) -> None:
        """Write ``keys`` and ``values`` (``[n, kv_heads, T, D]``) after the last position of
        each of ``slots`` (distinct), reserving pages for them, all or nothing (see the class
        docstring). A mixed batch gives ``new_tokens`` (a list of ints, as ``attn.paged`` takes
        it): each row's first ``new_tokens[b]`` keys are written, the rest are padding."""
        slots = self._slots(slots)
        for name, given, pool in (("keys", keys, self.keys), ("values", values, self.values)):
            if not isinstance(given, torch.Tensor):
                raise BindingTypeError(f"PagedKVCache.append: {name} must be a torch.Tensor, "
                                       f"got {type(given).__name__}")
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
        counts = None if new_tokens is None else checked_counts(new_tokens, slots.shape[0],
                                                                count)
        if not slots.numel():
            return
        start = self.lengths[slots]
        added = count if counts is None else torch.tensor(counts, device=self.device)
        ok = self._take(slots, start + added, -(-count // self.page_size) + 1)
        self._settle(ok, check)
        groups = [(count, None)] if counts is None else rows_by_count(counts)
        for length, rows in groups:
            index = None if rows is None else torch.tensor(rows, device=self.device)
            self._write(slots, start, keys, values, length, index, None if check else ok)
        self.lengths[slots] = torch.where(ok, start + added, start)

    def _write(self, slots, start, keys, values, count: int, rows, ok) -> None:
        """Write the first ``count`` tokens of ``keys`` and ``values`` of the rows ``rows`` (all
        where None) after ``start``; where ``ok`` is false on the device, the positions keep
        what they hold."""
        if rows is not None:
            slots, start = slots.index_select(0, rows), start.index_select(0, rows)
            keys = keys.index_select(0, rows.to(keys.device))
            values = values.index_select(0, rows.to(values.device))
        positions = start.unsqueeze(1) + torch.arange(count, device=self.device)   # [n, T]
        where = self.physical(slots, positions.clamp(max=self.capacity - 1)).reshape(-1)
        for pool, given in ((self.keys, keys), (self.values, values)):
            new = given[:, :, :count].permute(1, 0, 2, 3).reshape(pool.shape[0], -1,
                                                                  pool.shape[2])
            if ok is not None:
                new = torch.where(ok, new, pool[:, where])
            pool[:, where] = new

    def physical(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pool index of each logical position (``[n, ...]``) of each of ``slots``
        (``[n]``)."""
        page = self.page_size
        rows = self.page_table[slots].long()
        index = (positions // page).reshape(positions.shape[0], -1)
        found = rows.gather(1, index).reshape(positions.shape)
        return found * page + positions % page

    def tables(self, slots) -> PageTables:
        """The page tables of ``slots`` (``[B]``: row ``b`` reads slot ``slots[b]``) as they are
        now, copied: what a read of them is made from. Tensor operations only."""
        slots = self._slots(slots)
        return PageTables(geometry=self.geometry, slots=slots, pages=self.page_table[slots],
                          lengths=self.lengths[slots], page_slot=self.page_slot.long(),
                          page_index=self.page_index.long())

    def gathered(self, slots: torch.Tensor) -> tuple:
        """``(keys, values)`` of ``slots`` laid out contiguously, ``[n, kv_heads, capacity, D]``
        (positions past a slot's length hold whatever their page holds): what a backend that
        cannot read pages runs on (a copy)."""
        tables = self.tables(slots)
        return tables.gather(self.keys), tables.gather(self.values)

    def block_mask(self, logical, slots: torch.Tensor):
        """FlexAttention's block mask over the pool of ``logical``, a block mask over the
        logical positions of ``slots`` (key blocks of the page over the capacity): see
        :func:`flexspec.runtime.flexpages.pool_block_mask`. It serves one call."""
        return pool_block_mask(logical, self.tables(slots))

    def score_mod(self, logical_score):
        """``logical_score`` as a ``score_mod`` over the pool, as the pages are now: see
        :func:`flexspec.runtime.flexpages.pool_score_mod`. It serves one call."""
        return pool_score_mod(logical_score, self.page_index.long(), self.page_size)

    # ---- checks
    def _slots(self, slots) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 \
                or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise BindingTypeError(f"slots must be a 1-D int tensor of slot numbers, got "
                                   f"{slots!r}")
        if slots.device != self.device:
            raise BindingError(f"slots are on {slots.device}, the cache on {self.device}")
        if slots.device.type == "cpu" and slots.numel():
            if int(slots.min()) < 0 or int(slots.max()) >= self.slots:
                raise BindingError(f"slots must lie in 0..{self.slots - 1}, got "
                                   f"{int(slots.min())}..{int(slots.max())}")
            if slots.unique().numel() != slots.numel():
                twice = [int(s) for s in slots.unique() if int((slots == s).sum()) > 1]
                raise BindingError(f"slots must be distinct: slot {twice[0]} is named twice")
        return slots.long()

    @staticmethod
    def _distinct(slots: torch.Tensor) -> torch.Tensor:
        """Whether ``slots`` names no slot twice, as a device bool (no host read)."""
        if slots.numel() < 2:
            return torch.ones((), dtype=torch.bool, device=slots.device)
        return (slots.sort().values.diff() != 0).all()

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
