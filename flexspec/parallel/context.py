"""Context parallelism: one spec's attention over a sequence whose query rows, keys and values
are sharded over the ranks of a ``torch.distributed`` process group.

Each rank holds the rows of its query blocks (blocks of 128 positions, chosen by a balancer of
:mod:`flexspec.parallel.balance` from the spec's block structure at the full length) of q, k
and v. A call gathers every rank's keys and values with torch's autograd-aware all-gather
(``torch.distributed._functional_collectives``: gradients flow back to each rank's shard),
puts them in sequence order, and runs one flexspec call over the local rows with each row read
at its absolute position (:meth:`~flexspec.runtime.attention.Attention.at_rows`), so each
rank's block mask covers its own rows only, however scattered its blocks are. The sequence is
padded inside to a multiple of ``ranks x 128``; padded keys are masked (``kv_lengths``) and
padded rows dropped by :meth:`ContextParallel.unshard`.

Bindings that decide the structure (``doc_ids``) are whole when the plan is made: they
choose the balance, and the keys of every rank read them. A rank may give its contiguous chunk
of them instead (:meth:`ContextParallel.from_chunks`), and of any input split that way
(:meth:`ContextParallel.shard_chunk`): the chunks are all-gathered first. The balance's work
per query block is measured by each rank for a share of the rows and gathered, so no rank
builds the block mask of the whole sequence.
"""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError, SpecError
from flexspec.ir.rewrites import ROW_POSITION
from flexspec.parallel import balance as balancers

BLOCK = 128


class ContextParallel:
    """The context-parallel plan of ``attn`` over ``seq_len`` positions on the ranks of
    ``group`` (the default group when None): ``shard`` a whole tensor to this rank's rows,
    call it on the shards of q, k and v, ``unshard`` the result (see the module docstring).
    ``balance`` is one of :data:`flexspec.parallel.balance.BALANCERS` ("per_document" needs
    ``documents``, the block count of each document in order); ``bindings`` are the spec's
    bindings over the whole (unpadded) sequence; ``batch``, the batch size the balance is
    measured at, defaults to the leading size of the bindings with one (1 without)."""

    def __init__(self, attn, seq_len: int, *, group=None, balance: str = "flexspec",
                 documents: list | None = None, batch: int | None = None, **bindings):
        dist = _distributed()
        if balance not in balancers.BALANCERS:
            raise BindingError(f"balance must be one of {', '.join(balancers.BALANCERS)}, "
                               f"got {balance!r}")
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise BindingError(f"seq_len must be a positive int, got {seq_len!r}")
        if attn._placement.default_offset:
            raise SpecError(f"'{attn.spec}' aligns its queries at the end of the keys, which a "
                            "shard of rows does not see: write it aligned at the start (causal "
                            "instead of causal_bottom_right) for context parallelism")
        # torch.distributed.new_group gives the processes outside the group a sentinel
        outside = group is dist.GroupMember.NON_GROUP_MEMBER
        if not outside and group is not None and not isinstance(group, dist.ProcessGroup):
            raise BindingTypeError(f"group must be a torch.distributed process group (or None "
                                   f"for the default one), got {type(group).__name__}")
        if outside or dist.get_rank(group) < 0:
            raise BindingError("this process is not a rank of the group given: make the plan "
                               "on the group's ranks only (torch.distributed.new_group(ranks) "
                               "names them)")
        self.attn, self.group, self.seq_len = attn, group, seq_len
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # head-tail cuts the blocks into 2 x ranks runs
        unit = self.ranks * BLOCK * (2 if balance == "head_tail" else 1)
        self.padded = -(-seq_len // unit) * unit
        sizes = _sizes_read(attn.ir)
        if "Q_LEN" in sizes or ("KV_LEN" in sizes and self.padded != seq_len):
            size = "Q_LEN" if "Q_LEN" in sizes else "KV_LEN"
            raise SpecError(f"'{attn.spec}' reads {size}, which inside a rank is not the "
                            f"sequence's ({seq_len}): "
                            + ("a rank runs its own rows only" if size == "Q_LEN" else
                               f"the sequence is padded to {self.padded} positions, a "
                               f"multiple of {unit}")
                            + ", so context parallelism would answer differently from one "
                              "process; run it in one process, or write the spec without it")
        self.bindings = {name: self._padded(value, -1) for name, value in bindings.items()}
        blocks = self.padded // BLOCK
        if balance == "none":
            assignment = balancers.contiguous(blocks, self.ranks)
        elif balance == "head_tail":
            assignment = balancers.head_tail(blocks, self.ranks)
        elif balance == "per_document":
            if documents is None or sum(documents) != blocks:
                raise BindingError(f"balance='per_document' needs documents: the block count "
                                   f"of each document, {blocks} blocks in all")
            assignment = balancers.per_document(documents, self.ranks)
        else:
            work = self._work(batch)
            assignment = (balancers.ptrr if balance == "ptrr" else balancers.balanced)(
                work, self.ranks)
        self.blocks = assignment[self.rank]
        # the gathered shards, rank after rank, put back in sequence order
        gathered = torch.cat(assignment)
        self._restore = _rows(torch.argsort(gathered))
        self.rows = _rows(self.blocks)
        self._tensors: dict = {}  # device tensors made once (see _kept)

    @classmethod
    def from_chunks(cls, attn, seq_len: int, *, group=None, balance: str = "flexspec",
                    documents: list | None = None, batch: int | None = None,
                    **chunks) -> "ContextParallel":
        """The plan made from each rank's contiguous chunk of each binding, as a data loader
        splits a sequence (see :func:`gather_chunks`: rank ``r`` holds positions ``r * c``
        onwards, ``c = ceil(seq_len / ranks)``, along the binding's last dimension): the
        chunks are all-gathered into the whole bindings, then the plan is made from those."""
        whole = {name: gather_chunks(chunk, seq_len, group, name) for name, chunk in
                 chunks.items()}
        return cls(attn, seq_len, group=group, balance=balance, documents=documents,
                   batch=batch, **whole)

    def shard_chunk(self, chunk, dim: int = 2):
        """This rank's rows (as :meth:`shard` gives them) from every rank's contiguous chunk
        of a tensor along ``dim`` (:func:`gather_chunks`; autograd flows back to each rank's
        chunk): for inputs a data loader split in order, such as the tokens."""
        return self.shard(gather_chunks(chunk, self.seq_len, self.group, "the chunk", dim), dim)

    def _work(self, batch: int | None) -> torch.Tensor:
        """The work of every query block (:func:`balance.block_work`), each rank measuring a
        contiguous share of the rows from the block mask of those rows alone, the shares
        all-gathered: no rank builds the whole sequence's block mask."""
        import torch.distributed as dist
        if self.bindings:
            device = next(iter(self.bindings.values())).device
        else:  # the collective's own device: NCCL gathers GPU tensors only
            device = torch.device("cuda" if dist.get_backend(self.group) == "nccl" else "cpu")
        if batch is None:
            batch = max((t.shape[0] for t in self.bindings.values() if t.dim() > 1), default=1)
        share = self.padded // self.ranks
        lengths = torch.full((batch,), self.seq_len, device=device)
        mask = self.attn.block_mask(share, self.padded, batch=batch, device=device,
                                    q_offset=self.rank * share, kv_lengths=lengths,
                                    **self.bindings)
        mine = balancers.block_work(mask)
        shares = [torch.empty_like(mine) for _ in range(self.ranks)]
        dist.all_gather(shares, mine.contiguous(), group=self.group)
        return torch.cat(shares).cpu()

    def _padded(self, tensor, dim: int):
        """``tensor`` padded along ``dim`` from ``seq_len`` to the padded length with its last
        entry (a binding: the padding continues the last document); other sizes pass."""
        if not isinstance(tensor, torch.Tensor):
            raise BindingTypeError(f"bindings of a context-parallel plan must be tensors, got "
                                   f"{type(tensor).__name__}")
        if tensor.shape[dim] != self.seq_len or self.padded == self.seq_len:
            return tensor
        last = tensor.narrow(dim, self.seq_len - 1, 1)
        shape = list(tensor.shape)
        shape[dim] = self.padded - self.seq_len
        return torch.cat([tensor, last.expand(shape)], dim=dim)

    def shard(self, tensor, dim: int = 2):
        """This rank's rows of ``tensor`` (the whole sequence along ``dim``: 2 for q, k, v of
        shape ``(B, H, S, D)``), zero-padded to the padded length first."""
        if not isinstance(tensor, torch.Tensor) or tensor.shape[dim] != self.seq_len:
            raise BindingError(f"shard takes a tensor of the whole sequence ({self.seq_len} "
                               f"positions) along dim {dim}, got {_described(tensor)}")
        tensor = _zero_padded(tensor, dim, self.padded)
        return tensor.index_select(dim, self.rows.to(tensor.device))

    def gather(self, shard, dim: int = 2):
        """The whole padded sequence along ``dim`` from every rank's ``shard``, in sequence
        order (autograd flows back to each rank's shard)."""
        dim = dim % shard.dim()
        laid = _rank_after_rank(shard, dim, self.group)
        return laid.index_select(dim, self._restore.to(shard.device))

    def unshard(self, shard, dim: int = 2):
        """The whole sequence (``seq_len`` positions, padding dropped) of every rank's
        ``shard`` of an output."""
        return self.gather(shard, dim).narrow(dim, 0, self.seq_len)

    def __call__(self, q, k, v, *, scale=None, return_lse: bool = False):
        """This rank's rows of the attention of the whole sequence: q, k and v are this rank's
        shards (:meth:`shard`), the output has q's rows (and with ``return_lse``, the
        log-sum-exp of each row too)."""
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 \
                    or tensor.shape[2] != self.rows.shape[0]:
                raise BindingError(f"{name} must be this rank's shard, (B, H, "
                                   f"{self.rows.shape[0]}, D) (ContextParallel.shard), got "
                                   f"{_described(tensor)}")
        keys, values = self.gather(k), self.gather(v)
        at_rows, batch, device = self.attn.at_rows(), q.shape[0], q.device
        placed = {}
        if self.padded != self.seq_len:
            placed["kv_lengths"] = self._kept(
                ("lengths", batch, device), lambda: torch.full((batch,), self.seq_len,
                                                               device=device))
        if ROW_POSITION.name in at_rows.bindings:  # a spec that reads no q takes none
            placed[ROW_POSITION.name] = self._kept(("positions", device),
                                                   lambda: self.rows.to(device))
        return at_rows(q, keys, values, scale=scale, return_lse=return_lse, **placed,
                       **self.bindings)

    def _kept(self, key: tuple, make) -> torch.Tensor:
        """The tensor kept under ``key`` (``seq_len`` per batch row, this rank's row positions;
        on a device), made once: the block-mask cache knows a binding by its identity."""
        kept = self._tensors.get(key)
        if kept is None:
            kept = self._tensors[key] = make()
        return kept


def gather_chunks(chunk, seq_len: int, group=None, name: str = "the chunk", dim: int = -1):
    """The whole sequence (``seq_len`` positions along ``dim``) from every rank's contiguous
    chunk of it: rank ``r`` of ``R`` holds positions ``r * c`` to ``min((r + 1) * c, seq_len)``,
    ``c = ceil(seq_len / R)`` (the last ranks fewer, or none). Gathered with torch's
    autograd-aware all-gather, so gradients flow back to each rank's chunk."""
    dist = _distributed()
    if not isinstance(chunk, torch.Tensor):
        raise BindingTypeError(f"{name} must be a tensor, got {type(chunk).__name__}")
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    size = -(-seq_len // ranks)
    first = min(rank * size, seq_len)
    held = min(size, seq_len - first)
    dim = dim % chunk.dim()
    if chunk.shape[dim] != held:
        raise BindingError(f"{name}: rank {rank} of {ranks} holds {held} of the {seq_len} "
                           f"positions along dim {dim}, from position {first} (chunks of "
                           f"{size} in rank order), got {chunk.shape[dim]}")
    return _rank_after_rank(_zero_padded(chunk, dim, size), dim, group).narrow(dim, 0, seq_len)


def _distributed():
    """``torch.distributed``, or an error where no process group is initialised."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise BindingError("context parallelism needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) on every rank")
    return dist


def _zero_padded(tensor, dim: int, size: int):
    """``tensor`` padded with zeros along ``dim`` to ``size``."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = list(tensor.shape)
    pad[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)


def _rank_after_rank(tensor, dim: int, group):
    """Every rank's ``tensor`` laid end to end along ``dim`` (``dim`` non-negative), rank after
    rank, by torch's autograd-aware all-gather."""
    import torch.distributed as dist
    # one new leading dimension: the collective gathers along dim 0 only
    parts = _all_gather(tensor.contiguous().unsqueeze(0), 0,
                        group if group is not None else dist.group.WORLD)
    return _ContiguousGradient.apply(parts).movedim(0, dim).flatten(dim, dim + 1)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: the gradient of the all-gather
    above comes back through ``movedim`` as a strided view, and NCCL's reduce-scatter (the
    all-gather's backward) takes contiguous tensors only."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        return gradient.contiguous()


def _described(value) -> str:
    """A tensor's shape, or anything else's repr, for messages."""
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else repr(value)


def _all_gather(tensor, dim: int, group):
    """torch's autograd-aware all-gather (all_gather_single_autograd in newer torch,
    all_gather_tensor_autograd in older)."""
    from torch.distributed import _functional_collectives as collectives
    gather = getattr(collectives, "all_gather_single_autograd", None) \
        or collectives.all_gather_tensor_autograd
    return gather(tensor, dim, group)


def _sizes_read(spec) -> set:
    """The sizes (``Q_LEN``, ``KV_LEN``...) a spec's mask and score read in their expressions
    (a binding declared ``[B, KV_LEN]`` is padded with the sequence, and read at the positions
    the rows stand at: its size is no value the spec computes with)."""
    return ir.direct_vars(spec.mask) | ir.direct_vars(spec.score)


def _rows(blocks: torch.Tensor) -> torch.Tensor:
    """The positions of ``blocks`` (block numbers), block after block."""
    return (blocks.view(-1, 1) * BLOCK + torch.arange(BLOCK)).reshape(-1)
