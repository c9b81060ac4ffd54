"""Mixed batches over a paged KV cache: prefill chunks and decoded tokens of many requests in one
``attn.paged`` call, run as calls of their own kind.

``q`` is padded to the longest request's new tokens (``[B, Hq, Q_LEN, D]``) and ``new_tokens``
says, on the host, how many of each row's queries are real. Padded into one call, a decoded
token would cost a whole query tile (a 128-row block over all its keys, on the main kernel
rather than the decoding one), and a short chunk's padding rows would stand past the tokens its
sequence holds (past the capacity, for a full one). So the rows with the same count of new
tokens run together, unpadded: the decoded tokens as a batch of ``Q_LEN`` 1 (FlexAttention's
decoding kernel on CUDA), each chunk length as a batch of its own, and the outputs are put
back in the rows of q, the padding rows zero. Each part is an ordinary paged call (in place or
gathered): a mixed batch costs the sum of its parts, plus a copy of q and of the output. The
split builds small index tensors from ``new_tokens`` on every call: make a step's read
(``attn.paged_read(..., new_tokens=...)``) outside a captured CUDA graph and run it inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexspec.errors import BindingError
from flexspec.runtime.bindings import batch_rows_of, rows_at
from flexspec.runtime.serving.cache import rows_by_count


@dataclass(frozen=True)
class Part:
    """The rows of a mixed batch that run together: their indices in the batch (on the
    queries' device), how many query rows they keep (``q_len``), and their slots, offsets and
    bindings; ``span`` is ``(start, stop)`` where the rows are consecutive, which are then
    read and written through views of q and of the output rather than gathered and scattered
    by index kernels (docs/performance.md, thirty-third session: a sixth of a small mixed
    read's time)."""

    rows: torch.Tensor
    q_len: int
    slots: torch.Tensor
    q_offset: object
    bindings: dict
    span: tuple | None = None

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        if self.span is not None:
            return q[self.span[0]:self.span[1], :, :self.q_len]
        # cut the rows first: the decoded tokens' part copies one row of each, not q's length
        return q[:, :, :self.q_len].index_select(0, self.rows)

    def write(self, target: torch.Tensor, value: torch.Tensor) -> None:
        """Put this part's ``value`` (its outputs or log-sum-exps) in its rows of
        ``target``."""
        if self.span is not None:
            target[self.span[0]:self.span[1], :, :self.q_len] = value
        else:
            target[self.rows, :, :self.q_len] = value


@dataclass(frozen=True)
class Mixed:
    """A mixed batch split into its :class:`Part` s, and which query rows are real (``[B,
    Q_LEN]`` bool on q's device: row ``b``'s first ``new_tokens[b]``)."""

    parts: list
    real: torch.Tensor


def split(q, slots, new_tokens: list, q_offset, bindings: dict, by_batch: dict) -> Mixed:
    """A mixed batch's parts: the rows of each count of new tokens together, fewest first (the
    decoded tokens, one each, on the decoding kernel)."""
    device = q.device
    # q_offset left to each part's call, whose default (length - its Q_LEN) is length - count
    real = torch.arange(q.shape[2], device=device) < torch.tensor(new_tokens,
                                                                  device=device)[:, None]
    found = []
    for count, rows in rows_by_count(new_tokens):
        index = torch.tensor(rows, device=device)
        picked = batch_rows_of(bindings, by_batch,
                               lambda value: rows_at(value, index, len(new_tokens)))
        span = (rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else None
        found.append(Part(index, count, slots.index_select(0, index.to(slots.device)),
                          rows_at(q_offset, index, len(new_tokens)), picked, span))
    return Mixed(found, real)


def assemble(q: torch.Tensor, mixed: Mixed, results: list, return_lse: bool):
    """The outputs of the parts put back in the rows of q (``[B, Hq, Q_LEN, Dv]``, zero in the
    padding rows; with ``return_lse``, the log-sum-exp too, ``-inf`` there)."""
    outs = [result[0] if return_lse else result for result in results]
    batch, heads, q_len = q.shape[:3]
    out = outs[0].new_zeros(batch, heads, q_len, outs[0].shape[-1])
    lse = None
    if return_lse:
        lse = results[0][1].new_zeros(batch, heads, q_len)
    for part, part_out, result in zip(mixed.parts, outs, results):
        part.write(out, part_out)
        if return_lse:
            part.write(lse, result[1])
    if return_lse:
        return out, lse.masked_fill(~mixed.real[:, None, :], float("-inf"))
    return out


class MixedRead:
    """A mixed batch's in-place read made once per model step (``attn.paged_read(...,
    new_tokens=...)``): the reads of its parts, made once; ``read(q)`` and ``read(q, cache)``
    split q, run them and put the outputs back, as :class:`~flexspec.runtime.serving.reads.
    PagedRead` does for one part."""

    def __init__(self, mixed: Mixed, reads: list, return_lse: bool):
        self._mixed, self._reads, self._return_lse = mixed, reads, return_lse

    def __call__(self, q, cache=None):
        real = self._mixed.real
        if not isinstance(q, torch.Tensor) or q.dim() != 4 \
                or (q.shape[0], q.shape[2]) != tuple(real.shape):
            raise BindingError(f"a MixedRead runs queries [B, Hq, Q_LEN, D] of the shape it was "
                               f"made for, got "
                               f"{list(q.shape) if isinstance(q, torch.Tensor) else q!r}")
        results = [read(part.queries(q), cache)
                   for part, read in zip(self._mixed.parts, self._reads)]
        return assemble(q, self._mixed, results, self._return_lse)
