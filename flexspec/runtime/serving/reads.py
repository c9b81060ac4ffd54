"""Reads of a paged KV cache (:class:`~flexspec.runtime.serving.cache.PagedKVCache`): what
``attn.paged`` and ``attn.paged_read`` do, and ``explain`` and ``tune`` of a paged call.

A read is made from the cache's page tables as they are (:meth:`PagedKVCache.tables`) and the
shape of the queries, through the engine's call path (:meth:`Calls.paged_plan
<flexspec.runtime.calls.Calls.paged_plan>`): a backend that reads pages in place runs over the
pool (``auto``'s order for paged calls, :mod:`flexspec.runtime.order`), or, where none can or
``read="gather"`` asks, the sequences are copied out of their pages into contiguous keys and
values and run as an ordinary call. The read is made once per model step and run by every layer:
``read(q, cache)`` for q of its shape over any cache whose pages were taken by the same
operations (one cache per layer). A call given a :class:`~flexspec.runtime.step.Step` keeps the
read there, so that the step's first layer makes it and the others run it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime.bindings import batch_bindings
from flexspec.runtime.checks import checked_scale
from flexspec.runtime.contract import BackendError
from flexspec.runtime.explanation import Explanation
from flexspec.runtime.flexpages import INFERENCE_ONLY
from flexspec.runtime.serving import mixed
from flexspec.runtime.serving.cache import PagedKVCache, checked_counts
from flexspec.runtime.step import Step
from flexspec.runtime.tuning import Tuned, answer_of, tune

# How attn.paged reads the pages: as auto's order says (in place where a backend reads them,
# else gathered), in place, or gathered (copied out into contiguous keys and values).
READ_MODES = ("auto", "in_place", "gather")


@dataclass(frozen=True, eq=False)
class ReadArguments:
    """What a paged call asked for, but its queries and its cache: the slots its rows read,
    and its scale, offsets, log-sum-exp request, bindings and ``read`` mode."""

    slots: torch.Tensor
    scale: object
    q_offset: object
    return_lse: bool
    bindings: dict
    mode: str


class PagedRead:
    """A paged call prepared once (``attn.paged_read``): ``read(q)`` runs it for queries shaped
    like the ones it was made for, over the pages as they were when it was made, and ``read(q,
    cache)`` the same over another cache of that layout whose pages were taken by the same
    operations (a model's other layers). What the call derives from the page tables (block
    masks mapped to the pages, the mods, the plan) is made once, so a model step's layers only
    launch the kernel. ``explain()`` says how it runs; ``tune(q)`` times kernel options for it."""

    def __init__(self, calls, q, cache, arguments: ReadArguments):
        self._calls, self._cache, self._arguments = calls, cache, arguments
        self._queries = (q.shape, q.dtype, q.device)
        self._make(q)

    def _make(self, q) -> None:
        """Plan the read for queries like ``q`` over the cache's pages as they are now."""
        calls, cache, arguments = self._calls, self._cache, self._arguments
        self._tables = tables = cache.tables(arguments.slots)
        self._plan, self._bindings, self._gathered = None, None, None
        if arguments.mode != "gather":
            try:
                self._plan, self._bindings = calls.paged_plan(
                    q, cache.keys, cache.values, tables, scale=arguments.scale,
                    bindings=arguments.bindings, q_offset=arguments.q_offset,
                    return_lse=arguments.return_lse, vetoes=arguments.mode == "auto")
            except BackendError as error:
                if arguments.mode == "in_place":
                    raise BindingError(f"read='in_place': {error}") from None
                self._gathered = str(error)
        else:
            self._gathered = "read='gather' was asked for"
        if self._plan is not None:
            self._launch = calls.paged_launch(self._plan, arguments.scale, self._bindings,
                                              tables)
        else:
            self._launch = self._gathered_call(q.shape[2])

    def _gathered_call(self, q_len: int):
        """The read as an ordinary call of the sequences copied out of their pages, in a
        :class:`Step` of its own: the layers after the first only launch its kernel."""
        calls, tables, arguments = self._calls, self._tables, self._arguments
        q_offset = tables.lengths - q_len if arguments.q_offset is None else arguments.q_offset
        step = Step(q_offset=q_offset, kv_lengths=tables.lengths)
        step.bindings = arguments.bindings  # any names: Step's keywords are not theirs

        def gathered(q, keys, values):
            return calls(q, tables.gather(keys), tables.gather(values), scale=arguments.scale,
                         bindings={}, return_lse=arguments.return_lse, step=step)
        return gathered

    def __call__(self, q, cache=None):
        cache = self._cache if cache is None else cache
        if not isinstance(q, torch.Tensor) or (q.shape, q.dtype, q.device) != self._queries:
            raise BindingError(f"a PagedRead runs queries of the shape it was made for (shape, "
                               f"dtype, device {self._queries}), got "
                               f"{_described(q)}: make one per query shape")
        if self._plan is not None and q.requires_grad and torch.is_grad_enabled():
            raise BindingError(INFERENCE_ONLY)
        if cache is not self._cache and getattr(cache, "layout", None) != self._cache.layout:
            raise BindingError(f"a PagedRead reads caches of the layout it was made for "
                               f"{self._cache.layout}, got "
                               f"{getattr(cache, 'layout', type(cache).__name__)}")
        return self._launch(q, cache.keys, cache.values)

    def explain(self, q=None) -> Explanation:
        """What a run of this read does (see ``Attention.explain``): its backend, its kernel,
        and how it reads the pages (``q``: the queries, where their values matter; only their
        shape, dtype and device do otherwise)."""
        q = _like(self._queries) if q is None else q
        tables, keys, values = self._tables, self._cache.keys, self._cache.values
        if self._plan is None:
            arguments = self._arguments
            found = self._calls.explain(
                q, tables.gather(keys), tables.gather(values), scale=arguments.scale,
                q_offset=(tables.lengths - q.shape[2] if arguments.q_offset is None
                          else arguments.q_offset),
                kv_lengths=tables.lengths, return_lse=arguments.return_lse,
                bindings=arguments.bindings, target=None, capability=None, facts=None)
            return dataclasses.replace(found, pages=f"copied out of their pages into contiguous "
                                                    f"keys and values ({self._gathered})")
        geometry = tables.geometry
        shape = (tables.slots.shape[0], keys.shape[0], geometry.capacity)
        k = keys.new_empty(1, 1, 1, 1).expand(*shape, keys.shape[-1])
        v = values.new_empty(1, 1, 1, 1).expand(*shape, values.shape[-1])
        return self._calls.explain_plan(
            self._plan, self._bindings, q, k, v,
            pages=f"read in place from a pool of {geometry.pages} pages of "
                  f"{geometry.page_size} positions (a row reads the pages its slot holds, up to "
                  f"{geometry.max_pages})")

    def tune(self, q, cache=None, *, candidates: list | None = None,
             repeats: int = 10) -> Tuned:
        """Time this read of ``q`` with each of ``candidates`` (kernel options; by default its
        backend's: for FlexAttention over the pool, key tiles that divide the page and pipeline
        stages) and with flexspec's own options, check each answer against the own options'
        answer, and keep the fastest for this read and every later read of its signature
        (``Attention.tuned``; flexspec's own unless one is faster by more than the timing's
        noise, :data:`flexspec.runtime.tuning.MARGIN`). The result's ``best`` is what to give
        ``flexspec.compile(spec, kernel_options=...)`` to read with it in another process. A
        candidate the pages refuse (a key tile that does not divide the page) is a row that
        says why; each of the others compiles its kernel in a compiled entry of its own."""
        cache = self._cache if cache is None else cache
        run = answer_of(lambda q, k, v: self(q, cache), q, q, q, backward=False)
        run()
        plan = self._plan or self._calls.last_plan

        def pin(options: dict) -> None:
            self._calls.options.pin(plan.request, options)
            self._calls.forget_plans()
            self._make(q)
        return tune(plan, run, pin, candidates, repeats, q.device)


def _described(q) -> str:
    return (f"{tuple(q.shape)}, {q.dtype}, {q.device}" if isinstance(q, torch.Tensor)
            else type(q).__name__)


def _like(queries: tuple) -> torch.Tensor:
    """A tensor of no memory with the shape, dtype and device of a read's queries (what
    ``explain`` reads of them)."""
    shape, dtype, device = queries
    return torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(*shape)


def checked_read_mode(read) -> str:
    """``read`` of ``attn.paged``, checked."""
    if read not in READ_MODES:
        raise BindingTypeError(f"read must be 'auto', 'in_place' or 'gather', got {read!r}")
    return read


def checked_cache(cache) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise BindingTypeError(f"cache must be a flexspec.PagedKVCache, got "
                               f"{type(cache).__name__}")
    return cache


def paged_read(calls, q, cache, slots, *, scale=None, q_offset=None, return_lse: bool = False,
               read: str = "in_place", new_tokens=None, bindings: dict):
    """The :class:`PagedRead` of queries shaped like ``q`` over ``slots`` of ``cache`` (see
    ``Attention.paged_read``); with ``new_tokens``, a :class:`~flexspec.runtime.serving.mixed.
    MixedRead` of its parts."""
    checked_cache(cache)
    read = checked_read_mode(read)
    slots = cache._slots(slots)
    if not slots.numel():
        raise BindingError("slots is empty: a paged call reads at least one slot")
    if isinstance(q, torch.Tensor) and q.is_nested:
        raise BindingError("q is a nested tensor: a paged call takes dense q [B, Hq, Q_LEN, D] "
                           "with a row per slot (for rows of different lengths, pad q to the "
                           "longest and give new_tokens)")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != slots.shape[0]:
        raise BindingError(f"q must be [B, Hq, Q_LEN, D] with a row per slot (B = "
                           f"{slots.shape[0]}), got "
                           f"{list(q.shape) if isinstance(q, torch.Tensor) else _described(q)}")
    if new_tokens is not None:
        counts = checked_counts(new_tokens, q.shape[0], q.shape[2])
        split = mixed.split(q, slots, counts, q_offset, bindings,
                            batch_bindings(calls.ir.bindings()))
        reads = [paged_read(calls, part.queries(q), cache, part.slots, scale=scale,
                            q_offset=part.q_offset, return_lse=return_lse, read=read,
                            bindings=part.bindings) for part in split.parts]
        return mixed.MixedRead(split, reads, return_lse)
    return PagedRead(calls, q, cache, ReadArguments(slots, scale, q_offset, return_lse,
                                                    bindings, read))


def paged(calls, q, cache, slots, *, scale=None, q_offset=None, return_lse: bool = False,
          read: str = "auto", new_tokens=None, step=None, bindings: dict):
    """``attn.paged``: the read of this call, made and run; with a ``step``, the read the
    step's first layer made (every later layer only runs it)."""
    if step is None:
        return paged_read(calls, q, cache, slots, scale=scale, q_offset=q_offset,
                          return_lse=return_lse, read=read, new_tokens=new_tokens,
                          bindings=bindings)(q)
    if not isinstance(step, Step):
        raise BindingTypeError(f"step must be a flexspec.Step, got {type(step).__name__}")
    if slots is not None or new_tokens is not None or q_offset is not None:
        raise BindingError("a paged call with a step takes slots, new_tokens and q_offset from "
                           "the step: give them to flexspec.Step(...)")
    if step.slots is None:
        raise BindingError("a paged call's step names the slots its rows read: "
                           "flexspec.Step(slots=...)")
    twice = sorted(set(step.bindings) & set(bindings))
    if twice:
        raise BindingError(f"{', '.join(twice)} given to the call and to its step: give them "
                           "once")
    if bindings:  # the layer's own bindings: a read of its own
        return paged_read(calls, q, cache, step.slots, scale=scale, q_offset=step.q_offset,
                          return_lse=return_lse, read=read, new_tokens=step.new_tokens,
                          bindings={**step.bindings, **bindings})(q)
    if scale is not None:
        scale = checked_scale(scale)  # 0.5 and numpy's 0.5 are one read
    if not isinstance(cache, PagedKVCache):
        checked_cache(cache)
    # the calls themselves in the key: the step keeps them alive, so no id is reused
    key = ("paged read", calls, q.shape, q.dtype, q.device, q.requires_grad,
           torch.is_grad_enabled(), cache.layout, scale, return_lse, read)
    made = step.shared(key, lambda: paged_read(
        calls, q, cache, step.slots, scale=scale, q_offset=step.q_offset,
        return_lse=return_lse, read=read, new_tokens=step.new_tokens, bindings=step.bindings))
    return made(q, cache)
