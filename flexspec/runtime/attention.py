"""The :class:`Attention` object ``flexspec.compile`` returns: a checked spec turned into
attention on real tensors, and the descriptions of it (``source``, ``block_mask``,
``dense_mask``, ``mods``, ``reference``, ``explain``).

It is a facade: calls go through the call path (:mod:`flexspec.runtime.calls`: a plan per input
signature, :mod:`flexspec.runtime.plan`), queries are placed by the spec's
:class:`~flexspec.runtime.positions.Placement`, block masks come from its
:class:`~flexspec.runtime.masks.BlockMasks`.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError, SpecError, did_you_mean
from flexspec.kernels.lower import lower
from flexspec.kernels.reference import dense_mask, reference_attention
from flexspec.lang.spec import Spec
from flexspec.runtime.backends import REGISTRY, BackendError, check_backend_name, choose
from flexspec.runtime.bindings import implied_sizes, sizes_tensors_read
from flexspec.runtime.calls import Calls
from flexspec.runtime.checks import as_device, check_qkv, given_sizes
from flexspec.runtime.contract import InputPlan
from flexspec.runtime.explanation import Explanation, explain_plan
from flexspec.runtime.flexattention import own_tensors, wide_decode_chunks
from flexspec.runtime.identity import meta
from flexspec.runtime.jagged import is_jagged, jagged_call, packed_spec
from flexspec.runtime.tuning import (KernelOptions, Tuned, answer_of, checked_options,
                                     default_candidates, fastest, signature, time_candidates)
from flexspec.runtime.lookups import check_lookups
from flexspec.runtime import mixed
from flexspec.runtime.masks import BLOCK_MASK_MODES, BlockMaskMode, BlockMasks, mask_extent
from flexspec.runtime.mixed import MixedRead
from flexspec.runtime.paged_call import (QUERY_BLOCK, PagedRead, check_pages, checked_read,
                                         pool_read, reads_in_place)
from flexspec.runtime.plan import PlanCache, make_mask_plan
from flexspec.runtime.positions import Placement


class Attention:
    """A compiled spec. Call it like ``attn(q, k, v, doc_ids=ids)``; see the module docstring."""

    def __init__(self, spec: Spec, *, backend: str = "auto", block_size=128,
                 block_masks: BlockMaskMode = "exact", kernel_options: dict | None = None,
                 tuned: dict | None = None):
        check_backend_name(backend)
        refusal = REGISTRY[backend].cannot_run(spec.ir) if backend != "auto" else None
        if refusal is not None:
            raise BackendError(f"backend '{backend}' cannot run '{spec}': {refusal}. "
                               "backend='auto' chooses one that can")
        if block_masks not in BLOCK_MASK_MODES:
            raise SpecError(f"unknown block_masks mode '{block_masks}'."
                            f"{did_you_mean(block_masks, BLOCK_MASK_MODES)} Modes: "
                            f"{', '.join(BLOCK_MASK_MODES)}")
        sizes = block_size if isinstance(block_size, tuple) else (block_size, block_size)
        if len(sizes) != 2 or not all(isinstance(s, int) and s > 0 and s % 16 == 0 for s in sizes):
            raise SpecError(f"block_size must be a positive multiple of 16 or a pair of them, got "
                            f"{block_size!r}")
        self.spec = spec
        self.ir = spec.ir
        self.backend = backend
        self.block_size = sizes
        self.block_masks = block_masks
        self._options = KernelOptions(kernel_options, tuned)
        self.kernel_options = self._options.given
        self._placement = Placement(spec.ir)
        self._masks = BlockMasks(block_masks, sizes)
        self._calls = Calls(text=str(spec), spec=spec.ir, asked=backend, block_size=sizes,
                            masks=self._masks, placement=self._placement, options=self._options)
        self._mask_plans = PlanCache()  # block_mask's
        self._packed: Attention | None = None  # the spec for jagged batches (see _jagged)
        self._rows: Attention | None = None  # the spec read row by row (see at_rows)
        self._paged: dict = {}  # page size -> the spec with key blocks of it (see paged)

    # ---- copies: the spec and the options travel; plans and caches are made anew (they hold
    # tensors, compiled entries and locks, and a copy may land on another process or device)
    def __getstate__(self) -> dict:
        return {"spec": self.spec, "backend": self.backend, "block_size": self.block_size,
                "block_masks": self.block_masks, "kernel_options": self.kernel_options,
                "tuned": self.tuned}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"], backend=state["backend"], block_size=state["block_size"],
                      block_masks=state["block_masks"],
                      kernel_options=state.get("kernel_options"), tuned=state.get("tuned"))

    @property
    def tuned(self) -> dict:
        """The kernel options :meth:`tune` pinned, by call signature: a dict JSON keeps, which
        ``flexspec.compile(spec, tuned=...)`` takes again."""
        return self._options.tuned

    # ---- descriptions
    def __repr__(self) -> str:
        """The call that compiles it again (``flexspec.compile(flexspec.parse('causal'),
        backend='auto')``, with the library its names resolved in and options not left at their
        defaults)."""
        options = f"backend={self.backend!r}"
        if self.block_size != (128, 128):
            options += f", block_size={self.block_size!r}"
        if self.block_masks != "exact":
            options += f", block_masks={self.block_masks!r}"
        if self.kernel_options:
            options += f", kernel_options={self.kernel_options!r}"
        return f"flexspec.compile({self.spec!r}, {options})"

    @property
    def bindings(self) -> list[str]:
        return self.spec.bindings

    def source(self) -> str:
        """Readable Python source of the generated ``mask_mod`` and ``score_mod``."""
        return lower(self.ir).source()

    def _tensors(self, sizes: dict, bindings: dict, device, mask_only: bool = False) -> tuple:
        """Checked tensor values (keyed by tensor_key) and the IR specialized to their shapes,
        its lookups checked on them; ``bindings`` may hold the position tensors of
        :meth:`Placement.bindings <flexspec.runtime.positions.Placement.bindings>`."""
        values, spec = self._placement.tensors_for(bindings).gather(sizes, bindings, device,
                                                                    mask_only=mask_only)
        check_lookups(spec, sizes, values)
        return values, spec

    def block_mask(self, q_len: int, kv_len: int, *, batch: int | None = None,
                   heads: int | None = None, device="cpu", q_offset=None, kv_lengths=None,
                   **bindings) -> BlockMask:
        """The BlockMask for these sizes. Batch and head dimensions are 1 unless the mask depends
        on ``b`` or ``h``. A spec without a mask gets an all-full block mask (the compiled CPU
        kernel needs one: flexspec.workarounds, cpu-mask-free-block-mask)."""
        sizes = given_sizes(q_len, kv_len, batch, heads).as_dict()
        device = as_device(device)
        bindings = self._placement.bindings(bindings, q_offset, kv_lengths, sizes, device)
        plan = self._mask_plan(sizes, bindings, device)
        values = plan.values(bindings)
        if plan.lookups:
            plan.lookups.check(values)
        return plan.masks.get(values, device)

    def _mask_plan(self, sizes: dict, bindings: dict, device,
                   mask_only: bool = True) -> InputPlan:
        """The :class:`InputPlan` of :meth:`block_mask` for this signature (sizes, device, the
        bindings' names and :func:`meta`), from the cache or made: checking the bindings and
        specializing the IR on every call would cost a quarter of a fresh block mask's time on
        a GPU (docs/performance.md, `Attention.block_mask`'s own host path). With
        ``mask_only=False``, the plan of the score's tensors too (:meth:`logical_read`)."""
        key = (tuple(sizes.items()), device, torch.is_inference_mode_enabled(), mask_only,
               tuple((name, meta(value)) for name, value in bindings.items()))
        plan = self._mask_plans.get(key)
        if plan is None:
            plan = make_mask_plan(tensors=self._placement.tensors_for(bindings),
                                  masks=self._masks, sizes=sizes, bindings=bindings,
                                  device=device, mask_only=mask_only)
            self._mask_plans.put(key, plan)
        return plan

    def logical_read(self, q_len: int, kv_len: int, *, batch: int, heads: int, device,
                     q_offset, kv_lengths, bindings: dict, every_tile: bool = False) -> tuple:
        """``(block_mask, score_mod)`` at these sizes from one plan (a paged read maps both to
        the pages): what :meth:`block_mask` and :meth:`mods` give, the ``bindings`` placed,
        gathered and checked once (a float64 table read as float32, as the kernel computes
        scores); ``every_tile``: see :meth:`~flexspec.runtime.masks.BoundMasks.get`."""
        sizes = given_sizes(q_len, kv_len, batch, heads).as_dict()
        device = as_device(device)
        bindings = self._placement.bindings(bindings, q_offset, kv_lengths, sizes, device)
        plan = self._mask_plan(sizes, bindings, device, mask_only=False)
        values = plan.values(bindings)
        if plan.lookups:
            plan.lookups.check(values)
        block_mask = plan.masks.get(values, device, every_tile=every_tile)
        kernel_values = {key: value.float() if value.dtype == torch.float64 else value
                         for key, value in values.items()}
        return block_mask, lower(plan.spec).make_mods(sizes, own_tensors(kernel_values))[1]

    def dense_mask(self, q_len: int, kv_len: int, *, batch: int | None = None,
                   heads: int | None = None, device="cpu", q_offset=None, kv_lengths=None,
                   **bindings) -> torch.Tensor:
        """The mask from the reference semantics: bool ``[B or 1, H or 1, Q_LEN, KV_LEN]``
        (``B`` when the mask depends on the batch row, per-row ``q_offset`` or ``kv_lengths``
        included)."""
        sizes = given_sizes(q_len, kv_len, batch, heads).as_dict()
        device = as_device(device)
        offset, lengths = self._placement.for_reference(q_offset, kv_lengths, sizes, device)
        values, spec = self._tensors(sizes, bindings, device, mask_only=True)
        batch_extent, head_extent, _ = mask_extent(spec.mask, sizes)
        per_row = any(t is not None and t.numel() > 1 for t in (offset, lengths))
        # the reference reads the sizes B and H off the extents it is given: a mask that reads
        # them (`B / 2 < Q_LEN`) gets the whole extent, or it would see B = 1
        sizes_read = ir.direct_vars(spec.mask)
        rows = sizes["B"] if per_row or "B" in sizes_read else batch_extent
        heads = sizes["H"] if "H" in sizes_read else head_extent
        return dense_mask(spec, rows, heads, q_len, kv_len, values, device,
                          q_offset=offset, kv_lengths=lengths)

    def mods(self, *, q_len: int | None = None, kv_len: int | None = None,
             batch: int | None = None, heads: int | None = None, device=None, q_offset=None,
             kv_lengths=None, **bindings) -> tuple:
        """``(mask_mod, score_mod)`` for raw ``flex_attention`` (``None`` for a missing half).

        Sizes the generated code or the bindings' shapes need must be known: pass them, or let
        them be read off the bindings (``doc_ids`` of shape ``[2, 4096]`` gives B=2,
        KV_LEN=4096). ``device`` defaults to the bindings' device.
        """
        needed = set(lower(self.ir).size_names) | sizes_tensors_read(self.ir)
        if q_offset is not None or kv_lengths is not None or self._placement.default_offset:
            needed |= {"Q_LEN", "KV_LEN"}  # where the queries stand depends on both
        given = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
        implied, found = implied_sizes(self.ir, given, bindings, needed)
        sizes = given_sizes(implied["Q_LEN"], implied["KV_LEN"], implied["B"],
                            implied["H"]).as_dict()
        device = as_device(device or found or "cpu")
        bindings = self._placement.bindings(bindings, q_offset, kv_lengths, sizes, device)
        values, spec = self._tensors(sizes, bindings, device)
        return lower(spec).make_mods(sizes, values)

    # ---- attention
    def reference(self, q, k, v, *, scale=None, rows=None, q_offset=None, kv_lengths=None,
                  return_lse: bool = False, **bindings):
        """The dense float64 reference result (in q's dtype); with ``rows`` (row numbers of q),
        only those rows of it, to check long sequences at a fraction of the memory. The
        arguments mean what they mean in a call."""
        sizes = check_qkv(q, k, v, allow_float64=True).as_dict()
        offset, lengths = self._placement.for_reference(q_offset, kv_lengths, sizes, q.device)
        values, spec = self._tensors(sizes, bindings, q.device)
        return reference_attention(spec, q, k, v, scale=scale, tensors=values, rows=rows,
                                   q_offset=offset, kv_lengths=lengths, return_lse=return_lse)

    def __call__(self, q, k, v, *, scale=None, q_offset=None, kv_lengths=None,
                 return_lse: bool = False, step=None, **bindings):
        """Attention of ``q`` ``(B, Hq, Q_LEN, D)`` over ``k``, ``v`` ``(B, Hkv, KV_LEN, D)``.

        ``q_offset`` (an int, or an int tensor ``[B]``) places query row ``i`` at absolute
        position ``q_offset + i`` (decoding, chunked prefill); ``kv_lengths`` (an int tensor
        ``[B]``) says how many keys of a preallocated cache are valid per batch row. With
        ``return_lse``, returns ``(out, lse)``: the natural-log sum of ``exp`` of the scores over
        the visible keys, ``(B, Hq, Q_LEN)`` float32, ``-inf`` for a row that sees no key.
        Bindings are passed by name (``doc_ids=ids``). q, k and v may be nested tensors of the
        jagged layout, ``(B, H, j, D)``: each sequence then runs alone, with no padding
        (:mod:`flexspec.runtime.jagged`). With ``step`` (a :class:`flexspec.Step`),
        the positions and the bindings the step holds come from it, and what every layer of the
        step would derive from them is derived once (see :mod:`flexspec.runtime.step`)."""
        if is_jagged(q):
            if q_offset is not None or kv_lengths is not None or step is not None:
                raise BindingError("a jagged batch places every sequence at its own start: "
                                   "it takes no q_offset, kv_lengths or step")
            return jagged_call(self._jagged(), q, k, v, scale=scale, return_lse=return_lse,
                               bindings=bindings)
        chunks = self._decode_runs(q, k, v) if step is None else None
        if chunks is not None:
            return self._in_runs_of_rows(chunks, q, k, v, scale, q_offset, kv_lengths,
                                         return_lse, bindings)
        return self._calls(q, k, v, scale=scale, bindings=bindings, q_offset=q_offset,
                           kv_lengths=kv_lengths, return_lse=return_lse, step=step)

    def _in_runs_of_rows(self, chunks: list, q, k, v, scale, q_offset, kv_lengths,
                         return_lse: bool, bindings: dict):
        """A decode call whose keys are too wide for FlexAttention's decoding kernel, as a call
        per run of batch rows (``chunks``, :func:`~flexspec.runtime.flexattention.
        wide_decode_chunks`) with the rows' own offsets, lengths and bindings (views, no copy),
        the outputs put together (flexspec.workarounds: flex-decoding-wide-indices)."""
        results = []
        for start, stop in chunks:
            offset, lengths, rows = self._rows_of_call(start, stop, q.shape[0], q_offset,
                                                       kv_lengths, bindings)
            results.append(self._calls(q[start:stop], k[start:stop], v[start:stop], scale=scale,
                                       bindings=rows, q_offset=offset, kv_lengths=lengths,
                                       return_lse=return_lse, step=None))
        if return_lse:
            return (torch.cat([out for out, _ in results]),
                    torch.cat([lse for _, lse in results]))
        return torch.cat(results)

    def _decode_runs(self, q, k, v) -> list | None:
        """The runs of batch rows a decode call over keys too wide for the decoding kernel
        runs as (:func:`~flexspec.runtime.flexattention.wide_decode_chunks`), on the backends
        that run FlexAttention; None for any other call."""
        return wide_decode_chunks(q, k, v) if self.backend in ("auto", "flex") else None

    def _rows_of_call(self, start: int, stop: int, batch: int, q_offset, kv_lengths,
                      bindings: dict) -> tuple:
        """``(q_offset, kv_lengths, bindings)`` of batch rows ``start`` to ``stop`` of a call
        (views of the per-row tensors; the others as they are)."""
        rows = mixed.batch_rows_of(bindings, mixed.batch_bindings(self.ir.bindings()),
                                   lambda value: mixed.rows_between(value, start, stop, batch))
        return (mixed.rows_between(q_offset, start, stop, batch),
                mixed.rows_between(kv_lengths, start, stop, batch), rows)

    def _jagged(self) -> "Attention":
        """This spec rewritten for jagged batches (made on the first jagged call)."""
        if self._packed is None:
            self._packed = self._like(packed_spec(self.spec))
        return self._packed

    def at_rows(self) -> "Attention":
        """This spec with query row ``i`` at the position ``context_q_position[i]``, an int
        binding (:func:`flexspec.ir.rewrites.at_rows`); same backend and options; made once."""
        if self._placement.default_offset:
            raise SpecError(f"'{self.spec}' aligns its queries at the end of the keys: write it "
                            "aligned at the start (causal, not causal_bottom_right)")
        if self._rows is None:
            self._rows = self._like(Spec(self.spec.expr, ir.rewrites.at_rows(self.ir),
                                         self.spec.library))
        return self._rows

    def _like(self, spec: Spec) -> "Attention":
        """``spec`` on this one's backend, block size, block masks and kernel options."""
        return Attention(spec, backend=self.backend, block_size=self.block_size,
                         block_masks=self.block_masks, kernel_options=self.kernel_options,
                         tuned=self.tuned)

    def tune(self, q, k, v, *, backward: bool = False, candidates: list | None = None,
             repeats: int = 10, scale=None, q_offset=None, kv_lengths=None, **bindings) -> Tuned:
        """Time this call with each of ``candidates`` (kernel options; by default
        :func:`flexspec.runtime.tuning.default_candidates`) and flexspec's own options, check
        each answer against the own options' answer, and pin the fastest for the call's
        signature (:attr:`tuned`; flexspec's own unless one is faster by more than the timing's
        noise, :data:`flexspec.runtime.tuning.MARGIN`): later calls of that signature run with
        it. ``backward=True`` times the forward and the backward together (the gradients of q,
        k and v are part of the answer) and pins for calls that need gradients. Only the
        ``flex`` backend takes tuned options (FLASH's compile failures would be taken for the
        spec's). Each candidate compiles its kernels (seconds)."""
        started = time.perf_counter()
        if is_jagged(q):
            raise BindingError("tune times dense q, k, v: give it one padded batch of the "
                               "shapes you run (a jagged batch runs laid end to end, as "
                               "(1, H, total, D))")
        run = answer_of(lambda q, k, v: self(q, k, v, scale=scale, q_offset=q_offset,
                                             kv_lengths=kv_lengths, **bindings),
                        q, k, v, backward)
        run()
        plan = self._calls.last_plan
        key = signature(plan.request)
        if plan.choice.backend != "flex":
            return Tuned(key, {}, failed={"all": f"this call runs on backend "
                                                 f"'{plan.choice.backend}', which takes no "
                                                 "tuned kernel options"},
                         seconds=time.perf_counter() - started)
        candidates = default_candidates(plan.request) if candidates is None else [
            checked_options(options, "candidates") for options in candidates]
        result = Tuned(key, {})

        def pin(options: dict) -> None:
            self._options.tuned[key] = options
            self._calls.forget_plans()
        # each candidate compiles in an entry of its own (FlexAttentionBackend.prepare)
        time_candidates(run, [{}] + candidates, pin, result, repeats, q.device)
        pin(fastest(result.times))
        result.best = self._options.tuned[key]
        result.seconds = time.perf_counter() - started
        return result

    def call(self, q, k, v, *, bindings: dict, learnables: dict | None = None, scale=None,
             q_offset=None, kv_lengths=None, return_lse: bool = False, step=None):
        """A call as :meth:`__call__` makes it, with the bindings as a dict and the values of
        the spec's learnable tensors (by tensor key) from the module that owns them
        (``SpecAttention``)."""
        if is_jagged(q):
            if q_offset is not None or kv_lengths is not None or step is not None:
                raise BindingError("a jagged batch places every sequence at its own start: "
                                   "it takes no q_offset, kv_lengths or step")
            return jagged_call(self._jagged(), q, k, v, scale=scale, return_lse=return_lse,
                               bindings=bindings, learnables=learnables)
        return self._calls(q, k, v, scale=scale, bindings=bindings, learnables=learnables,
                           q_offset=q_offset, kv_lengths=kv_lengths, return_lse=return_lse,
                           step=step)

    def paged(self, q, cache, slots, *, scale=None, q_offset=None, return_lse: bool = False,
              read: str = "auto", new_tokens=None, **bindings):
        """Attention of ``q`` ``(B, Hq, Q_LEN, D)`` over the sequences ``slots`` (``[B]``, in
        any order) of a :class:`~flexspec.runtime.paged.PagedKVCache`: row ``b`` of q reads the
        keys of slot ``slots[b]``, at logical positions ``0 .. length - 1`` (KV_LEN is the
        cache's ``capacity``, the valid lengths are the slots' lengths). ``q_offset`` defaults
        to ``length - Q_LEN``: the rows are the newest tokens of their sequences, appended to
        the cache already. Bindings indexed by ``kv`` cover the capacity.

        ``read`` says how the pages are read: ``"in_place"`` through a block mask mapped to the
        pages (:mod:`flexspec.runtime.paged_call`; inference only), ``"gather"`` from a copy of
        the sequences laid out contiguously (any backend, a backward pass), ``"auto"`` (the
        default) in place where :func:`~flexspec.runtime.paged_call.reads_in_place` says so
        (CUDA, no gradient, pages of a multiple of 16 positions, heads of 16 dimensions or more,
        the ``auto`` or ``flex`` backend), else gathered.

        A mixed batch (prefill chunks and decoded tokens of many requests) gives
        ``new_tokens``, a list of each row's count of real queries (q padded to the longest):
        ``q_offset`` then defaults to ``length - new_tokens``, the rows of each count of new
        tokens run as a call of their own, unpadded (:mod:`flexspec.runtime.mixed`), and the
        padding rows' outputs are zero."""
        from flexspec.runtime.paged import PagedKVCache
        if not isinstance(cache, PagedKVCache):
            raise BindingTypeError(f"cache must be a flexspec.PagedKVCache, got "
                                   f"{type(cache).__name__}")
        read = checked_read(read)
        if new_tokens is not None:
            split = self._mixed(q, cache, slots, new_tokens, q_offset, bindings)
            results = [self.paged(part.queries(q), cache, part.slots, scale=scale,
                                  q_offset=part.q_offset, return_lse=return_lse, read=read,
                                  **part.bindings) for part in split.parts]
            return mixed.assemble(q, split, results, return_lse)
        if read == "auto":
            read = "in_place" if reads_in_place(q, cache, self.backend) else "gather"
        if read == "in_place":
            return self.paged_read(q, cache, slots, scale=scale, q_offset=q_offset,
                                   return_lse=return_lse, **bindings)(q)
        keys, values = cache.gathered(slots)
        lengths = cache.lengths[slots.long()]
        if q_offset is None and isinstance(q, torch.Tensor) and q.dim() == 4:
            q_offset = lengths - q.shape[2]
        return self._calls(q, keys, values, scale=scale, bindings=bindings, q_offset=q_offset,
                           kv_lengths=lengths, return_lse=return_lse)

    def paged_read(self, q, cache, slots, *, scale=None, q_offset=None, return_lse: bool = False,
                   new_tokens=None, **bindings) -> PagedRead | MixedRead:
        """The in-place read :meth:`paged` makes (``read="in_place"``), prepared once for
        queries shaped like ``q``: ``read(q)`` runs a call of that shape over the pages as
        they are now, and ``read(q, other)`` the same over another cache of that geometry whose
        pages were taken by the same operations (a model's other layers). What the call derives
        from the page tables (the block mask, the mods) is made here, once per model step
        instead of once per layer (see :class:`~flexspec.runtime.paged_call.PagedRead`).
        With ``new_tokens`` (a mixed batch, see :meth:`paged`), a
        :class:`~flexspec.runtime.mixed.MixedRead` of its parts."""
        from flexspec.runtime.paged import PagedKVCache
        if not isinstance(cache, PagedKVCache):
            raise BindingTypeError(f"cache must be a flexspec.PagedKVCache, got "
                                   f"{type(cache).__name__}")
        check_pages(cache)
        if new_tokens is not None:
            split = self._mixed(q, cache, slots, new_tokens, q_offset, bindings)
            reads = [self.paged_read(part.queries(q), cache, part.slots, scale=scale,
                                     q_offset=part.q_offset, return_lse=return_lse,
                                     **part.bindings) for part in split.parts]
            return MixedRead(split, reads, return_lse)
        return pool_read(self._paged_sibling(cache.page_size), q, cache, slots, scale=scale,
                         q_offset=q_offset, return_lse=return_lse, bindings=bindings)

    def _mixed(self, q, cache, slots, new_tokens, q_offset, bindings: dict) -> mixed.Mixed:
        """The parts a mixed batch runs as (:func:`flexspec.runtime.mixed.split`)."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise BindingError(f"attn.paged: q must be [B, Hq, Q_LEN, D], got "
                               f"{list(q.shape) if isinstance(q, torch.Tensor) else q!r}")
        counts = mixed.checked_counts(new_tokens, q.shape[0], q.shape[2])
        return mixed.split(q, cache._slots(slots), counts, q_offset, bindings,
                           mixed.batch_bindings(self.ir.bindings()))

    def _paged_sibling(self, page_size: int) -> "Attention":
        """This spec with key blocks of ``page_size`` (made on the first in-place read of a
        cache of such pages): its block masks and mods are the logical ones the pool's read
        maps."""
        sibling = self._paged.get(page_size)
        if sibling is None:
            sibling = Attention(self.spec, backend="auto", block_size=(QUERY_BLOCK, page_size),
                                block_masks=self.block_masks, kernel_options=self.kernel_options)
            self._paged[page_size] = sibling
        return sibling

    def explain(self, q, k, v, *, scale=None, q_offset=None, kv_lengths=None,
                return_lse: bool = False, target: str | None = None, capability=None,
                facts: dict | None = None, **bindings) -> Explanation:
        """What a call with these inputs would do: the canonical spec, the visible fraction of
        the score matrix, the work in FLOPs, the backend chosen and why (and why not the others).
        Only the shapes, dtypes and devices of ``q``, ``k``, ``v`` matter (and the values of the
        tensors the mask reads).

        With ``target`` (a device type such as ``"cuda"``), the choice is the one a call on that
        device would make, planned from inputs on another (a laptop's CPU): ``capability`` is
        the target GPU's compute capability (``(9, 0)``: Hopper) and ``facts`` what is installed
        there, by the names backends read (``{"fa4.installed": True}``). A decode call whose
        keys are too wide for the decoding kernel, which runs as calls over runs of batch rows,
        is explained by its first run's call."""
        chunks = self._decode_runs(q, k, v)
        if chunks is not None:
            start, stop = chunks[0]
            offset, lengths, rows = self._rows_of_call(start, stop, q.shape[0], q_offset,
                                                       kv_lengths, bindings)
            first = self.explain(q[start:stop], k[start:stop], v[start:stop], scale=scale,
                                 q_offset=offset, kv_lengths=lengths, return_lse=return_lse,
                                 target=target, capability=capability, facts=facts, **rows)
            return dataclasses.replace(first, runs=(q.shape[0], len(chunks), stop - start))
        # as a call does: only the keys its rows may see are read
        k, v, q_offset, keys = self._calls.placement.read_keys(q, k, v, q_offset, kv_lengths)
        calls = self._calls.unmasked_for(q, k, q_offset, kv_lengths) or self._calls
        if calls is not self._calls:  # the rows see every key: the call runs without the mask
            q_offset = kv_lengths = None
        bindings = calls.placement.for_call(q, k, bindings, q_offset, kv_lengths)
        plan = calls.plan(q, k, v, scale, bindings, None, return_lse)
        values = plan.values(bindings)
        block_mask = plan.masks.get(values, q.device)
        choice = device = None
        if target is not None:
            request = dataclasses.replace(plan.request, device_type=target, capability=capability,
                                          facts=tuple(sorted((facts or {}).items())))
            choice = choose(self.backend, request, plan.spec)
            device = f"{target} (planned on {q.device})"
            plan = dataclasses.replace(plan, request=request)  # its kernel is the target's
        return explain_plan(plan, values, block_mask, str(self.spec), q, k, v, choice=choice,
                            device=device, keys=keys,
                            options_source=self._options.source(plan.request))
