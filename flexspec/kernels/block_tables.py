"""BlockMask tables: torch's BlockMask built directly from tile classes (EMPTY, PARTIAL, FULL per
(q-block, kv-block) tile), and the classes read back from a BlockMask. :mod:`flexspec.kernels.blocks`
decides the classes; this module only writes and reads the format. At S = 1M the format is most
of the cost (four [8192, 8192] int32 tables, 268 MB each): the q-side tables come from the same
bool matrices as the kv-side ones where the masks' structure allows."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, noop_mask

EMPTY, PARTIAL, FULL = 0, 1, 2
# Above this fraction of True entries, ordered() lays rows out from their first True column
# instead of writing each True entry (nonzero): the measured crossover (docs/performance.md,
# "The block-mask builder's constants").
RUN_PATH_FRACTION = 1 / 32
# Matrices up to this many entries are ordered by one stable sort per row: a few kernels and no
# host synchronisation (the paths below read counts and nonzero entries on the host), which is
# what a mask rebuilt at every decoding step needs.
SORT_PATH_ENTRIES = 1 << 16


# Devices where a table written entry by entry (the rank path) leaves the filler after each
# row's count unwritten. On the CPU a sparse table is mostly filler, and unwritten its pages are
# never touched (at S = 1M, writing the filler of a causal mask's two partial-tile tables took
# about 0.25 s of 0.95). FlexAttention's Triton and CPU kernels read a row only up to its count;
# FLASH's reading was not checked on a GPU, and there writing the filler costs little.
UNWRITTEN_FILLER_DEVICES = frozenset({"cpu"})


# row_counts adds a bool row's bytes eight at a time, as int64 words whose bytes are 0 or 1: a
# sum of at most 127 words keeps every byte below 128, so no byte carries into the next and the
# word stays below 2**63.
_WORDS_PER_SUM = 127


def _words(dense: torch.Tensor):
    """The rows of a bool tensor read as int64 words of eight entries (``[rows, n / 8]``, a
    view), or None where they cannot be (not contiguous, a row length that is not a multiple of
    8, a storage offset that is not, no entries)."""
    n = dense.shape[-1]
    if not (dense.dtype == torch.bool and dense.is_contiguous() and n % 8 == 0
            and dense.storage_offset() % 8 == 0 and dense.numel()):
        return None
    return dense.view(torch.uint8).reshape(-1, n).view(torch.int64)


def row_counts(dense: torch.Tensor) -> torch.Tensor:
    """The number of True entries in each row of a bool tensor: int32, ``dense.shape[:-1]``.

    torch's bool-to-int32 row sum is compute-bound on the CPU (about 0.2 s for an [8192, 8192]
    matrix, one per index table at S = 1M); reading the bytes as int64 words and adding the
    words' bytes at the end does the same count in a thirtieth of the time. Tensors whose rows
    cannot be read as words (:func:`_words`) take torch's sum."""
    words = _words(dense)
    if words is None:
        return dense.sum(-1, dtype=torch.int32)
    width = words.shape[1]
    whole = width - width % _WORDS_PER_SUM
    parts = []
    if whole:
        parts.append(words[:, :whole].unflatten(1, (-1, _WORDS_PER_SUM)).sum(-1))
    if whole < width:
        parts.append(words[:, whole:].sum(-1, keepdim=True))
    # every byte of these sums is a partial count: their bytes add up to the row's count
    sums = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    return sums.view(torch.uint8).sum(-1, dtype=torch.int32).reshape(dense.shape[:-1])


def tile_grid(sizes: dict, block: tuple) -> tuple:
    """``(NQ, NK)``: the q-block rows and kv-block columns of a mask at ``sizes`` in blocks of
    ``block`` (the last row and column may run past the end). Written without negation, so a
    traced length (``torch.compile``'s symbolic ints) gives the same expression."""
    return ((sizes["Q_LEN"] + block[0] - 1) // block[0],
            (sizes["KV_LEN"] + block[1] - 1) // block[1])


def ordered(dense: torch.Tensor):
    """``(count, indices)`` per row of a bool matrix: ``count`` True entries, whose columns come
    first in ``indices``, in increasing order. The entries after them are filler in no promised
    order: other valid column numbers, or, in tables written at each True entry's rank on the
    devices in :data:`UNWRITTEN_FILLER_DEVICES`, whatever the memory held. FlexAttention (its
    Triton and CPU kernels, ``to_dense``) reads only the first ``count`` of each row, and
    leaving the rest unsorted saves a sort or a full permutation over all NQ x NK entries (at
    S = 1M, 67M of them per table).

    Rows whose True entries form one run (``first .. first + count - 1``, as in causal, window
    and document masks) get ``(column + first) % NK``, copied from the rows of a strided view of
    ``arange(2 NK) % NK`` (a modulo over every entry cost three times as much); a row is one run
    when its last True entry is ``count - 1`` after its first. The other rows write each True
    entry at its rank (``nonzero``), which is cheaper when there are few of them. Small matrices
    (:data:`SORT_PATH_ENTRIES`) are sorted instead, without a host synchronisation.
    """
    if dense.numel() <= SORT_PATH_ENTRIES:
        return sorted_rows(dense)
    return _ordered(dense, by_column=False)[0]


def _ordered(dense: torch.Tensor, by_column: bool):
    """:func:`ordered`'s run and rank paths: ``(rows, columns)``, where ``rows`` is
    ``ordered(dense)`` and, with ``by_column``, ``columns`` is ``ordered(dense.mT)`` wherever it
    comes without a transposed copy of ``dense`` (else None):

    * on the rank path, from the same True entries, stably sorted by column and each written at
      its rank in its column;
    * on the run path, when every non-empty row is one run and the runs' first and last columns
      never decrease down the rows, with no run on both sides of an empty row: then column
      ``c``'s True rows are one run too, from the first row whose run ends at or after ``c`` to
      the last one whose run starts at or before it, and are laid out like a row's."""
    n_rows, n_cols = dense.shape[-2:]
    count = row_counts(dense)
    columns = torch.arange(n_cols, dtype=torch.int32, device=dense.device)
    flat = dense.reshape(-1, n_cols)
    counts = count.reshape(-1)
    total = int(counts.sum())
    by_columns = None
    if total > RUN_PATH_FRACTION * flat.numel() and n_cols > 1:
        first, last = _ends(flat)
        indices = _laid_out(n_cols, first)
        several = ((last - first + 1 != counts) & (counts > 0)).nonzero().reshape(-1)
        if several.numel():  # rows of several runs
            indices[several] = _ordered_by_rank(flat[several], counts[several], columns)
        elif by_column:
            by_columns = _column_runs(first, last, counts, dense.shape)
    else:
        rows, cols = _nonzero(flat)
        indices = _ranked(rows, cols, counts, columns)
        if by_column:
            # the same entries, grouped by (batch and head, column) and in row order inside
            key = rows // n_rows * n_cols + cols
            key, order = torch.sort(key, stable=True)
            column_counts = torch.bincount(key, minlength=flat.shape[0] // n_rows * n_cols)
            row_numbers = torch.arange(n_rows, dtype=torch.int32, device=dense.device)
            by_columns = (column_counts.to(torch.int32).reshape(*dense.shape[:-2], n_cols),
                          _ranked(key, rows[order] % n_rows, column_counts, row_numbers
                                  ).reshape(*dense.shape[:-2], n_cols, n_rows))
    return (count.contiguous(), indices.reshape(dense.shape)), by_columns


def _laid_out(n: int, first: torch.Tensor) -> torch.Tensor:
    """``[len(first), n]`` int32, row ``i`` holding ``(first[i] + column) % n`` (``first`` in
    ``0 .. n``): the rows of a strided view of ``arange(2 n) % n`` (``[n + 1, n]``, no copy)
    at ``first``."""
    rotations = (torch.arange(2 * n, dtype=torch.int32, device=first.device) % n).unfold(0, n, 1)
    return rotations.index_select(0, first)


def _ends(flat: torch.Tensor):
    """The first and last True column of each row of a 2-D bool matrix (for an empty row, any
    valid columns). Where its rows read as int64 words (:func:`_words`), the first and last
    nonzero word of each row, then the True bytes inside those two: a pass over words instead of
    an ``argmax`` over every byte and another over a flipped copy (19 ms against 80 ms at
    [8192, 8192])."""
    words = _words(flat)
    if words is None:
        as_bytes = flat.view(torch.uint8)
        return as_bytes.argmax(-1), (flat.shape[-1] - 1) - as_bytes.flip(-1).argmax(-1)
    nonzero = (words != 0).view(torch.uint8)
    first_word = nonzero.argmax(-1)
    last_word = (words.shape[1] - 1) - nonzero.flip(-1).argmax(-1)
    rows = torch.arange(words.shape[0], device=flat.device)
    first_bytes = words[rows, first_word].view(torch.uint8).reshape(-1, 8)
    last_bytes = words[rows, last_word].view(torch.uint8).reshape(-1, 8)
    return (first_word * 8 + first_bytes.argmax(-1),
            last_word * 8 + (7 - last_bytes.flip(-1).argmax(-1)))


def _nonzero(flat: torch.Tensor):
    """``flat.nonzero(as_tuple=True)`` of a 2-D bool matrix. Where its rows read as int64 words
    (:func:`_words`), the nonzero words first, then the True bytes inside them: few words are
    nonzero in the sparse matrices that take the rank path (8 ms against 36 ms at
    [8192, 8192] with one True entry per row)."""
    words = _words(flat)
    if words is None:
        return flat.nonzero(as_tuple=True)
    words = words.reshape(-1)
    at = words.nonzero().reshape(-1)
    word, byte = words[at].view(torch.uint8).reshape(-1, 8).nonzero(as_tuple=True)
    entry = at[word] * 8 + byte
    return entry // flat.shape[1], entry % flat.shape[1]


def _column_runs(first, last, counts, shape):
    """``ordered(dense.mT)`` from the runs of ``dense``'s rows (every non-empty row one run,
    ``first .. last``), or None where a column's True rows are not one run (see
    :func:`_ordered`)."""
    *outer, n_rows, n_cols = shape
    first, last = first.reshape(-1, n_rows), last.reshape(-1, n_rows)
    filled = counts.reshape(-1, n_rows) > 0
    # an empty row takes the next run's first column and the previous run's last: then both
    # never decrease, and a column lies in both runs around an empty row when start <= end
    start = torch.where(filled, first, n_cols).flip(-1).cummin(-1).values.flip(-1)
    end = torch.where(filled, last, -1).cummax(-1).values
    if not torch.where(filled, (start == first) & (end == last), start > end).all():
        return None
    column = torch.arange(n_cols, device=first.device).expand(first.shape[0], n_cols)
    low = torch.searchsorted(end, column.contiguous())  # the first row ending at or after c
    high = torch.searchsorted(start, column.contiguous(), right=True)  # past the last starting
    # a column no run reaches has low = n_rows, the spare last row of the rotations
    indices = _laid_out(n_rows, low.reshape(-1))
    return ((high - low).clamp(min=0).to(torch.int32).reshape(*outer, n_cols),
            indices.reshape(*outer, n_cols, n_rows))


def sorted_rows(dense: torch.Tensor):
    """:func:`ordered`'s ``(count, indices)`` with every column in order, the True ones first:
    a stable partition of each row, each column written at its rank among the True (or, after
    them, the False) columns by one scan and one scatter, with no host synchronisation. (A
    stable sort per row gives the same tables, but on CUDA it is a library sort of several
    launches and allocations, which a compiled program cannot fuse.)"""
    flags = dense.to(torch.int32)
    before = flags.cumsum(-1, dtype=torch.int32) - flags  # the True columns left of each one
    count = before[..., -1] + flags[..., -1]
    column = torch.arange(dense.shape[-1], device=dense.device, dtype=torch.int32)
    rank = torch.where(dense, before, count.unsqueeze(-1) + column - before)
    indices = torch.empty_like(flags).scatter_(-1, rank.long(), column.expand_as(flags))
    return count.contiguous(), indices


def _ordered_by_rank(flat: torch.Tensor, counts: torch.Tensor, columns: torch.Tensor):
    """:func:`ordered`'s indices for 2-D ``flat``, writing every True entry at its rank."""
    return _ranked(*_nonzero(flat), counts, columns)


def _ranked(rows, values, counts, columns):
    """``[len(counts), len(columns)]`` int32: row ``i`` lists the ``values`` of its ``counts[i]``
    entries (``rows``, grouped by row in increasing order) first, then ``columns``' tail, left
    unwritten on the devices in :data:`UNWRITTEN_FILLER_DEVICES`."""
    if columns.device.type in UNWRITTEN_FILLER_DEVICES:
        indices = torch.empty((counts.shape[0], columns.shape[0]), dtype=torch.int32,
                              device=columns.device)
    else:
        indices = columns.expand(counts.shape[0], columns.shape[0]).contiguous()
    if rows.numel():
        counts = counts.long()
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(rows.numel(), device=rows.device) - starts[rows]
        indices[rows, rank] = values.to(torch.int32)
    return indices


def index_tables(classes: torch.Tensor, order=ordered) -> tuple:
    """The eight BlockMask index tables of tile classes, in :func:`tables`' order: each of the
    partial and full tiles listed per q-block row (kv side) and per kv-block column (q side),
    each list laid out by ``order`` (:func:`ordered` or :func:`sorted_rows`).

    With :func:`ordered` above :data:`SORT_PATH_ENTRIES`, the q-side tables come from the
    kv-side bool matrices where they can (:func:`_ordered`); the others are read from one
    transposed copy of the classes, made only for them."""
    if order is ordered and classes.numel() > SORT_PATH_ENTRIES:
        by_kv = None
        sides = []
        for value in (PARTIAL, FULL):
            rows, columns = _ordered(classes == value, by_column=True)
            if columns is None:
                if by_kv is None:
                    by_kv = classes.mT.contiguous()
                columns = ordered(by_kv == value)
            sides.append((rows, columns))
        (kv_num, kv_idx), (q_num, q_idx) = sides[0]
        (full_kv_num, full_kv_idx), (full_q_num, full_q_idx) = sides[1]
        return kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx
    kv_num, kv_idx = order(classes == PARTIAL)
    full_kv_num, full_kv_idx = order(classes == FULL)
    # one contiguous transposed copy of the int8 classes is cheaper than walking two
    # transposed bool views
    by_kv = classes.transpose(-2, -1).contiguous()
    q_num, q_idx = order(by_kv == PARTIAL)
    full_q_num, full_q_idx = order(by_kv == FULL)
    return kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx


def from_tables(index: tuple, sizes: dict, block: tuple, mask_mod=None) -> BlockMask:
    """A torch BlockMask from :func:`index_tables`' eight tables."""
    return BlockMask((sizes["Q_LEN"], sizes["KV_LEN"]), *index,
                     BLOCK_SIZE=tuple(block), mask_mod=mask_mod or noop_mask)


def to_block_mask(classes: torch.Tensor, sizes: dict, block: tuple, mask_mod=None) -> BlockMask:
    """A torch BlockMask from tile classes, with the q-side tables built directly."""
    return from_tables(index_tables(classes), sizes, block, mask_mod)


def tables(block_mask: BlockMask) -> tuple:
    """Every index table a BlockMask holds (``None`` where it has none)."""
    return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
            block_mask.full_q_num_blocks, block_mask.full_q_indices)


def tile_classes(block_mask: BlockMask) -> torch.Tensor:
    """The tile classes (EMPTY, PARTIAL, FULL as int8, ``[B, H, NQ, NK]``) a BlockMask's kv-side
    tables hold: the inverse of :func:`to_block_mask`."""
    kv_num = block_mask.kv_num_blocks
    nk = block_mask.kv_indices.shape[-1]
    classes = torch.full((*kv_num.shape, nk), EMPTY, dtype=torch.int8, device=kv_num.device)
    for num, indices, value in ((kv_num, block_mask.kv_indices, PARTIAL),
                                (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)):
        if num is None:
            continue
        # only the first `num` entries of a row are blocks; the rest is filler (see ordered)
        listed = (torch.arange(nk, device=num.device) < num.unsqueeze(-1)).nonzero(as_tuple=True)
        classes[listed[:-1] + (indices[listed].long(),)] = value
    return classes


def as_partial(block_mask: BlockMask) -> BlockMask:
    """``block_mask`` with its full tiles listed as partial ones, for the forward pass only (no
    q-side tables): the same attention, the mask evaluated in every listed tile.

    FlexAttention's decoding kernel splits a row's keys among its splits by the row's listed
    tiles only when the block mask has no full tiles; with full ones it splits all of KV_LEN,
    so a window at the end of a long cache lands in one split and the others idle (torch's own
    TODO in its flex_decode template). Each row lists its tiles in increasing order, the filler
    after them the last column, as :func:`ordered` lists a row."""
    full_num = block_mask.full_kv_num_blocks
    if full_num is None:
        return block_mask
    partial_num, partial = block_mask.kv_num_blocks, block_mask.kv_indices
    columns = partial.shape[-1]
    slot = torch.arange(columns, device=partial.device)
    count = partial_num + full_num
    from_full = (slot - partial_num.unsqueeze(-1)).clamp(0, columns - 1)
    merged = torch.where(slot < partial_num.unsqueeze(-1), partial,
                         block_mask.full_kv_indices.gather(-1, from_full.long()))
    # entries past a row's count sort last, then read as the last column
    merged = torch.where(slot < count.unsqueeze(-1), merged, columns)
    merged = merged.sort(-1).values.clamp(max=columns - 1)
    return BlockMask(block_mask.seq_lengths, count.to(torch.int32), merged.to(torch.int32),
                     None, None, None, None, None, None, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                     mask_mod=block_mask.mask_mod)
