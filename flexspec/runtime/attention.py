"""The :class:`Attention` object ``flexspec.compile`` returns: a checked spec turned into
attention on real tensors, and the descriptions of it (``source``, ``block_mask``,
``dense_mask``, ``mods``, ``reference``, ``explain``).

It is a facade: calls go through the call path (:mod:`flexspec.runtime.calls`: a plan per input
signature, :mod:`flexspec.runtime.plan`), paged, mixed and jagged batches through the serving
room (:mod:`flexspec.runtime.serving`), which calls the same path.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.errors import BindingError, SpecError, did_you_mean
from flexspec.kernels.lower import lower
from flexspec.kernels.reference import dense_mask, reference_attention
from flexspec.lang.spec import Spec
from flexspec.runtime.backends import REGISTRY, BackendError, check_backend_name
from flexspec.runtime.bindings import implied_sizes, sizes_tensors_read
from flexspec.runtime.calls import Calls
from flexspec.runtime.checks import as_device, check_qkv, given_sizes
from flexspec.runtime.explanation import Explanation
from flexspec.runtime.lookups import check_lookups
from flexspec.runtime.masks import BLOCK_MASK_MODES, BlockMaskMode, mask_extent
from flexspec.runtime.serving import PagedKVCache, reads
from flexspec.runtime.serving.jagged import jagged_batch, jagged_call, packed_spec
from flexspec.runtime.tuning import KernelOptions, Tuned, answer_of, tune


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
        self._calls = Calls(text=str(spec), spec=spec.ir, asked=backend, block_size=sizes,
                            mask_mode=block_masks, options=self._options)
        self._placement = self._calls.placement
        self._packed: Calls | None = None  # the calls of jagged batches (see _jagged)
        self._rows: Attention | None = None  # the spec read row by row (see at_rows)

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
        return self._calls.block_mask(sizes, bindings, device)

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
        if jagged_batch(q, k, v, "reference"):
            raise BindingError("reference takes dense q, k, v: give each sequence of a jagged "
                               "batch alone, (1, H, length, D)")
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
        (:mod:`flexspec.runtime.serving.jagged`). With ``step`` (a :class:`flexspec.Step`),
        the positions and the bindings the step holds come from it, and what every layer of the
        step would derive from them is derived once (see :mod:`flexspec.runtime.step`)."""
        return self._call(q, k, v, bindings=bindings, scale=scale, q_offset=q_offset,
                          kv_lengths=kv_lengths, return_lse=return_lse, step=step)

    def _call(self, q, k, v, *, bindings: dict, learnables: dict | None = None, scale=None,
              q_offset=None, kv_lengths=None, return_lse: bool = False, step=None):
        """A call, with the bindings as a dict and the values of the spec's learnable tensors
        (by tensor key) from the module that owns them (``SpecAttention``)."""
        if jagged_batch(q, k, v):
            if q_offset is not None or kv_lengths is not None or step is not None:
                raise BindingError("a jagged batch places every sequence at its own start: "
                                   "it takes no q_offset, kv_lengths or step")
            return jagged_call(self._jagged(), q, k, v, scale=scale, return_lse=return_lse,
                               bindings=bindings, learnables=learnables)
        return self._calls(q, k, v, scale=scale, bindings=bindings, learnables=learnables,
                           q_offset=q_offset, kv_lengths=kv_lengths, return_lse=return_lse,
                           step=step)

    def _jagged(self) -> Calls:
        """The calls of this spec rewritten for jagged batches (made on the first one)."""
        if self._packed is None:
            packed = packed_spec(self.spec)
            self._packed = Calls(text=str(packed), spec=packed.ir, asked=self.backend,
                                 block_size=self.block_size, mask_mode=self.block_masks,
                                 options=self._options)
        return self._packed

    def at_rows(self) -> "Attention":
        """This spec with query row ``i`` at the position ``context_q_position[i]``, an int
        binding (:func:`flexspec.ir.rewrites.at_rows`); same backend and options; made once."""
        if self._placement.default_offset:
            raise SpecError(f"'{self.spec}' aligns its queries at the end of the keys: write it "
                            "aligned at the start (causal, not causal_bottom_right)")
        if self._rows is None:
            self._rows = Attention(Spec(self.spec.expr, ir.rewrites.at_rows(self.ir),
                                        self.spec.library), backend=self.backend,
                                   block_size=self.block_size, block_masks=self.block_masks,
                                   kernel_options=self.kernel_options, tuned=self.tuned)
        return self._rows

    def tune(self, q, k, v, *, backward: bool = False, candidates: list | None = None,
             repeats: int = 10, scale=None, q_offset=None, kv_lengths=None, **bindings) -> Tuned:
        """Time this call with each of ``candidates`` (kernel options; by default its backend's,
        :func:`flexspec.runtime.tuning.default_candidates` for FlexAttention) and flexspec's own
        options, check each answer against the own options' answer, and pin the fastest for the
        call's signature (:attr:`tuned`; flexspec's own unless one is faster by more than the
        timing's noise, :data:`flexspec.runtime.tuning.MARGIN`): later calls of that signature
        run with it. ``backward=True`` times the forward and the backward together (the
        gradients of q, k and v are part of the answer) and pins for calls that need
        gradients. Only the ``flex`` backend takes tuned options (FLASH's compile failures
        would be taken for the spec's). Each candidate compiles its kernels (seconds).

        A paged call is tuned as it is called: ``attn.tune(q, cache, slots)`` (see
        :meth:`paged`), which :meth:`PagedRead.tune
        <flexspec.runtime.serving.reads.PagedRead.tune>` does for a read made already."""
        if not isinstance(k, PagedKVCache) and jagged_batch(q, k, v, "tune"):
            raise BindingError("tune times dense q, k, v: give it one padded batch of the "
                               "shapes you run (a jagged batch runs laid end to end, as "
                               "(1, H, total, D))")
        if isinstance(k, PagedKVCache):
            read = self.paged_read(q, k, v, scale=scale, q_offset=q_offset, read="auto",
                                   **bindings)
            return read.tune(q, candidates=candidates, repeats=repeats)
        run = answer_of(lambda q, k, v: self(q, k, v, scale=scale, q_offset=q_offset,
                                             kv_lengths=kv_lengths, **bindings),
                        q, k, v, backward)
        run()
        plan = self._calls.last_plan

        def pin(options: dict) -> None:
            self._options.pin(plan.request, options)
            self._calls.forget_plans()
        return tune(plan, run, pin, candidates, repeats, q.device)

    def paged(self, q, cache, slots=None, *, scale=None, q_offset=None, return_lse: bool = False,
              read: str = "auto", new_tokens=None, step=None, **bindings):
        """Attention of ``q`` ``(B, Hq, Q_LEN, D)`` over the sequences ``slots`` (``[B]``, in
        any order) of a :class:`~flexspec.runtime.serving.cache.PagedKVCache`: row ``b`` of q
        reads the keys of slot ``slots[b]``, at logical positions ``0 .. length - 1`` (KV_LEN
        is the cache's ``capacity``, the valid lengths are the slots' lengths). ``q_offset``
        defaults to ``length - Q_LEN``: the rows are the newest tokens of their sequences,
        appended to the cache already. Bindings indexed by ``kv`` cover the capacity.

        ``read`` says how the pages are read: ``"in_place"`` by a backend that reads the pool
        where the pages lie (FlexAttention through a block mask mapped to the pages; inference
        only), ``"gather"`` from a copy of the sequences laid out contiguously (any backend, a
        backward pass), ``"auto"`` (the default) as ``auto``'s order for paged calls says: in
        place on CUDA where a backend can (no gradient, pages of a multiple of 16 positions,
        heads of 16 dimensions or more), else gathered.

        A mixed batch (prefill chunks and decoded tokens of many requests) gives
        ``new_tokens``, a list of each row's count of real queries (q padded to the longest):
        ``q_offset`` then defaults to ``length - new_tokens``, the rows of each count of new
        tokens run as a call of their own, unpadded (:mod:`flexspec.runtime.serving.mixed`),
        and the padding rows' outputs are zero.

        With ``step`` (a :class:`flexspec.Step` holding ``slots``, and ``new_tokens`` and
        ``q_offset`` where given), the step's first layer makes the read of the pages and every
        later layer runs it over its own cache (:mod:`flexspec.runtime.serving.reads`)."""
        return reads.paged(self._calls, q, cache, slots, scale=scale, q_offset=q_offset,
                           return_lse=return_lse, read=read, new_tokens=new_tokens, step=step,
                           bindings=bindings)

    def paged_read(self, q, cache, slots, *, scale=None, q_offset=None, return_lse: bool = False,
                   new_tokens=None, read: str = "in_place", **bindings):
        """The read :meth:`paged` makes, prepared once for queries shaped like ``q``:
        ``read(q)`` runs a call of that shape over the pages as they are now, and ``read(q,
        other)`` the same over another cache of that layout whose pages were taken by the same
        operations (a model's other layers). What the call derives from the page tables (the
        block mask, the mods) is made here, once per model step instead of once per layer (see
        :class:`~flexspec.runtime.serving.reads.PagedRead`; a :class:`flexspec.Step` given to
        :meth:`paged` keeps one for its layers). ``read`` is ``"in_place"`` by default (an
        error where no backend reads these pages in place); ``"auto"`` and ``"gather"`` as in
        :meth:`paged`. With ``new_tokens`` (a mixed batch, see :meth:`paged`), a
        :class:`~flexspec.runtime.serving.mixed.MixedRead` of its parts."""
        return reads.paged_read(self._calls, q, cache, slots, scale=scale, q_offset=q_offset,
                                return_lse=return_lse, read=read, new_tokens=new_tokens,
                                bindings=bindings)

    def explain(self, q, k, v, *, scale=None, q_offset=None, kv_lengths=None,
                return_lse: bool = False, target: str | None = None, capability=None,
                facts: dict | None = None, read: str = "auto", **bindings) -> Explanation:
        """What a call with these inputs would do: the canonical spec, the visible fraction of
        the score matrix, the work in FLOPs, the backend chosen and why (and why not the others).
        Only the shapes, dtypes and devices of ``q``, ``k``, ``v`` matter (and the values of the
        tensors the mask reads). A paged call is explained as it is called,
        ``attn.explain(q, cache, slots)``, with how its pages are read (``read``: as
        :meth:`paged` takes it).

        With ``target`` (a device type such as ``"cuda"``), the choice is the one a call on that
        device would make, planned from inputs on another (a laptop's CPU): ``capability`` is
        the target GPU's compute capability (``(9, 0)``: Hopper) and ``facts`` what is installed
        there, by the names backends read (``{"fa4.installed": True}``). A decode call whose
        keys are too wide for the decoding kernel, which runs as calls over runs of batch rows,
        is explained by its first run's call."""
        if not isinstance(k, PagedKVCache) and jagged_batch(q, k, v, "explain"):
            raise BindingError("explain takes dense q, k, v: a jagged batch runs laid end to "
                               "end, so explain that call, (1, H, total, D)")
        if isinstance(k, PagedKVCache):
            if target is not None:
                raise BindingError("a paged call is explained on the device of its cache: "
                                   "target= plans contiguous calls for another device")
            return self.paged_read(q, k, v, scale=scale, q_offset=q_offset,
                                   return_lse=return_lse, read=read, **bindings).explain(q)
        return self._calls.explain(q, k, v, scale=scale, q_offset=q_offset,
                                   kv_lengths=kv_lengths, return_lse=return_lse,
                                   bindings=bindings, target=target, capability=capability,
                                   facts=facts)
