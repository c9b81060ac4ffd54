"""Which query blocks each rank of a context-parallel call computes: the work of each query
block read off the spec's block mask (the key tiles it visits, full or partial), and the
assignments that spread that work over the ranks, every rank taking as many blocks (so that
all shards have one size, as the collectives need).

``flexspec`` (:func:`balanced`) places the costliest blocks first, each on the least loaded
rank that has room, then swaps blocks between the busiest and the idlest rank while that
lowers the busiest one; it keeps the best of that and of the other assignments refined by the
same swaps. For comparison, the assignments torch's context parallelism offers,
at the same block granularity: none (contiguous shards), head-tail (the sequence in ``2W``
chunks, rank ``r`` taking chunks ``r`` and ``2W - 1 - r``), head-tail within each document, and
processing-time round robin (PTRR: blocks sorted by work, dealt to the ranks in a snake order).
"""

from __future__ import annotations

import heapq

import torch

BALANCERS = ("none", "head_tail", "per_document", "ptrr", "flexspec")


def block_work(block_mask) -> torch.Tensor:
    """The work of each query block of ``block_mask`` (a torch ``BlockMask``): the key tiles it
    visits, full and partial alike, summed over the batch and the heads. ``[query blocks]``
    int64."""
    counts = block_mask.kv_num_blocks.long()
    if block_mask.full_kv_num_blocks is not None:
        counts = counts + block_mask.full_kv_num_blocks.long()
    return counts.sum(dim=(0, 1))


def contiguous(blocks: int, ranks: int) -> list:
    """Rank ``r`` takes the ``r``-th run of ``blocks / ranks`` blocks."""
    share = _share(blocks, ranks)
    return [torch.arange(r * share, (r + 1) * share) for r in range(ranks)]


def head_tail(blocks: int, ranks: int) -> list:
    """The blocks in ``2 * ranks`` runs; rank ``r`` takes runs ``r`` and ``2 * ranks - 1 - r``."""
    run = _share(blocks, 2 * ranks)
    return [torch.cat([torch.arange(r * run, (r + 1) * run),
                       torch.arange((2 * ranks - 1 - r) * run, (2 * ranks - r) * run)])
            for r in range(ranks)]


def per_document(documents: list, ranks: int) -> list:
    """Head-tail within each document: ``documents`` are the block counts of consecutive
    documents, each a multiple of ``2 * ranks``."""
    taken = [[] for _ in range(ranks)]
    start = 0
    for length in documents:
        if length % (2 * ranks):
            raise ValueError(f"per-document head-tail needs every document's blocks to be a "
                             f"multiple of 2 x ranks = {2 * ranks}, got a document of {length}")
        for rank, own in enumerate(head_tail(length, ranks)):
            taken[rank].append(own + start)
        start += length
    return [torch.cat(own) for own in taken]


def ptrr(work: torch.Tensor, ranks: int) -> list:
    """Processing-time round robin: blocks sorted by work (ties in order), dealt in rows of
    ``ranks``, every other row reversed."""
    blocks = work.shape[0]
    _share(blocks, ranks)
    order = torch.sort(work, descending=True, stable=True).indices.view(-1, ranks)
    order[1::2] = order[1::2].flip(1)
    return [torch.sort(order[:, r]).values for r in range(ranks)]


def balanced(work: torch.Tensor, ranks: int) -> list:
    """flexspec's assignment (see the module docstring): every rank ``blocks / ranks`` blocks,
    the busiest rank's work as low as the greedy placement and the swaps make it. PTRR's and
    the fixed assignments, refined by the same swaps, are candidates too, so it is never
    busier than any of them."""
    blocks = work.shape[0]
    share = _share(blocks, ranks)
    values = work.tolist()
    order = sorted(range(blocks), key=lambda block: -values[block])
    taken = [[] for _ in range(ranks)]
    loads = [(0, rank) for rank in range(ranks)]  # a heap of the ranks with room
    for block in order:
        load, rank = heapq.heappop(loads)
        taken[rank].append(block)
        if len(taken[rank]) < share:
            heapq.heappush(loads, (load + values[block], rank))
    candidates = [taken, [own.tolist() for own in ptrr(work, ranks)],
                  [own.tolist() for own in contiguous(blocks, ranks)]]
    if blocks % (2 * ranks) == 0:
        candidates.append([own.tolist() for own in head_tail(blocks, ranks)])
    best = None
    for candidate in candidates:
        _swap(candidate, values)
        busiest = max(sum(values[b] for b in own) for own in candidate)
        if best is None or busiest < best[0]:
            best = (busiest, candidate)
    return [torch.tensor(sorted(own), dtype=torch.long) for own in best[1]]


def _swap(taken: list, values: list, rounds: int = 1000) -> None:
    """Swap a block of the busiest rank with a lighter one of the idlest while that lowers the
    larger of their two loads."""
    for _ in range(rounds):
        loads = [sum(values[b] for b in own) for own in taken]
        busiest = max(range(len(taken)), key=loads.__getitem__)
        idlest = min(range(len(taken)), key=loads.__getitem__)
        gap = loads[busiest] - loads[idlest]
        if gap <= 0:
            return
        # the pair whose difference is nearest half the gap, strictly between 0 and the gap
        light = sorted(taken[idlest], key=values.__getitem__)
        light_values = [values[b] for b in light]
        best = None
        for i, block in enumerate(taken[busiest]):
            want = values[block] - gap / 2
            j = _nearest(light_values, want)
            for k in (j - 1, j, j + 1):
                if 0 <= k < len(light):
                    moved = values[block] - light_values[k]
                    if 0 < moved < gap:
                        score = abs(moved - gap / 2)
                        if best is None or score < best[0]:
                            best = (score, i, k)
        if best is None:
            return
        _, i, k = best
        a, b = taken[busiest][i], light[k]
        taken[busiest][i] = b
        taken[idlest][taken[idlest].index(b)] = a


def _nearest(sorted_values: list, target: float) -> int:
    lo, hi = 0, len(sorted_values)
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_values[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def imbalance(work: torch.Tensor, assignment: list) -> float:
    """The busiest rank's work over the mean rank's."""
    loads = torch.stack([work[own].sum() for own in assignment]).double()
    return float(loads.max() / loads.mean())


def _share(blocks: int, parts: int) -> int:
    if blocks % parts:
        raise ValueError(f"{blocks} query blocks do not split into {parts} equal parts")
    return blocks // parts
