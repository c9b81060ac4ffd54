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

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError


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


def checked_counts(new_tokens, batch: int, q_len: int) -> list:
    """``new_tokens`` as a list of ints, one per row, each in ``1..q_len``, or an error that
    says what is wrong."""
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
    """``(count, rows)`` for each count of new tokens, fewest first: the rows that run (or are
    appended) together."""
    return [(count, [row for row, n in enumerate(new_tokens) if n == count])
            for count in sorted(set(new_tokens))]


def batch_bindings(spec_tensors) -> dict:
    """The bindings indexed by the batch (declared ``[B, ...]``): name -> declared dimensions
    (a value given with fewer leaves its batch dimension out, and is broadcast)."""
    return {tensor.name: len(tensor.shape) for tensor in spec_tensors
            if tensor.shape and isinstance(tensor.shape[0], ir.Var)
            and tensor.shape[0].name == "B"}


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
                               lambda value: _rows_of(value, index, len(new_tokens)))
        span = (rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else None
        found.append(Part(index, count, slots.index_select(0, index.to(slots.device)),
                          _rows_of(q_offset, index, len(new_tokens)), picked, span))
    return Mixed(found, real)


def batch_rows_of(bindings: dict, by_batch: dict, cut) -> dict:
    """``bindings`` with those declared ``[B, ...]`` and given with their batch dimension
    (``by_batch``, :func:`batch_bindings`) passed through ``cut``; the others as they are."""
    return {name: cut(value) if isinstance(value, torch.Tensor)
            and value.dim() == by_batch.get(name) else value for name, value in bindings.items()}


def rows_between(value, start: int, stop: int, batch: int):
    """Rows ``start`` to ``stop`` of a per-row value (a tensor with a row per batch row), as a
    view; anything else (an int, a batch dimension of 1, broadcast) as it is."""
    return value[start:stop] if _per_row(value, batch) else value


def _rows_of(value, index: torch.Tensor, batch: int):
    """The rows ``index`` of a per-row value (a tensor with a row per batch row); anything else
    (an int, a batch dimension of 1, broadcast) as it is."""
    return value.index_select(0, index.to(value.device)) if _per_row(value, batch) else value


def _per_row(value, batch: int) -> bool:
    """Whether ``value`` has a row per batch row (of a batch of more than one)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch \
        and batch > 1


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
    split q, run them and put the outputs back, as :class:`~flexspec.runtime.paged_call.
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
