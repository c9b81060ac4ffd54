"""The :class:`Attention` object ``flexspec.compile`` returns: a checked spec turned into
attention on real tensors, and the descriptions of it (``source``, ``block_mask``,
``dense_mask``, ``mods``, ``reference``, ``explain``).

The first call with a new input signature builds a plan (:mod:`flexspec.runtime.plan`): checks,
the specialized IR, the backend (:mod:`flexspec.runtime.backends`) and what that backend reuses.
Later calls with that signature gather their bindings where needed, check value-dependent
lookups and hand over to the backend's ``run``.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.errors import BindingError, SpecError, did_you_mean
from flexspec.ir import rewrites
from flexspec.kernels.lower import lower
from flexspec.kernels.reference import dense_mask, reference_attention
from flexspec.lang.spec import Spec
from flexspec.runtime.backends import REGISTRY, BackendError, BackendName, check_backend_name
from flexspec.runtime.explanation import Explanation, explain_plan
from flexspec.runtime.inputs import Tensors, as_device, check_qkv, given_sizes, meta
from flexspec.runtime.masks import BLOCK_MASK_MODES, BlockMaskMode, BlockMasks
from flexspec.runtime.notices import warn_once
from flexspec.runtime import positions
from flexspec.runtime.plan import (PLAN_CACHE_SIZE, InputPlan, Plan, PlanCache, call_key,
                                   make_mask_plan, make_plan)


class Attention:
    """A compiled spec. Call it like ``attn(q, k, v, doc_ids=ids)``; see the module docstring."""

    def __init__(self, spec: Spec, *, backend: BackendName = "auto", block_size=128,
                 block_masks: BlockMaskMode = "exact"):
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
        # a Tensors per way the call places its queries: (q_offset read, kv_lengths read)
        self._inputs = {(False, False): Tensors(spec.ir)}
        self._default_offset = spec.ir.align == "end" and rewrites.reads_positions(spec.ir)
        self._masks = BlockMasks(block_masks, sizes)
        self._plans = PlanCache()  # the calls'
        self._mask_plans = PlanCache()  # block_mask's
        # the spec without its mask, for calls whose rows see every key (see _unmasked_for)
        self._unmaskable = None
        self._sees_every_key: dict = {}
        if (backend == "auto" and spec.ir.has_mask and not any(
                isinstance(n, ir.Tensor) for n in ir.walk(spec.ir.mask))
                and "q" not in ir.free_vars(spec.ir.score)):
            self._unmaskable = Attention(
                Spec(spec.expr, ir.AttentionIR(ir.TRUE, spec.ir.score, spec.ir.align)),
                backend=backend, block_size=block_size, block_masks=block_masks)

    # ---- descriptions
    def __repr__(self) -> str:
        return f"Attention({str(self.spec)!r}, backend={self.backend!r})"

    @property
    def bindings(self) -> list[str]:
        return self.spec.bindings

    def source(self) -> str:
        """Readable Python source of the generated ``mask_mod`` and ``score_mod``."""
        return lower(self.ir).source()

    def _tensors(self, sizes: dict, bindings: dict, device, learnables=None,
                 mask_only: bool = False) -> tuple:
        """Checked tensor values (keyed by tensor_key) and the IR specialized to their shapes
        (see :meth:`flexspec.runtime.inputs.Tensors.gather`); ``bindings`` may hold the
        ``q_offset`` and ``kv_lengths`` tensors of :meth:`_positions`."""
        return self._inputs_for(bindings).gather(sizes, bindings, device, learnables, mask_only)

    def _inputs_for(self, bindings: dict) -> Tensors:
        variant = (rewrites.Q_OFFSET in bindings, rewrites.KV_LENGTHS in bindings)
        inputs = self._inputs.get(variant)
        if inputs is None:
            inputs = self._inputs[variant] = Tensors(rewrites.placed(self.ir, *variant))
        return inputs

    def _positions(self, bindings: dict, q_offset, kv_lengths, batch: int, q_len: int,
                   kv_len: int, device) -> dict:
        """``bindings`` with the tensors that place the queries (see
        :mod:`flexspec.runtime.positions`), when the call or the spec's alignment asks for them."""
        if q_offset is None and kv_lengths is None and not self._default_offset:
            return bindings
        added = positions.call_tensors(self.ir, q_offset, kv_lengths, batch, q_len, kv_len,
                                       as_device(device))
        return {**bindings, **added} if added else bindings

    def _reference_positions(self, q_offset, kv_lengths, batch: int, q_len: int, kv_len: int,
                             device) -> tuple:
        """``(q_offset, kv_lengths)`` of a call, checked as a call checks them, for the
        reference (which places the queries of an end-aligned spec itself)."""
        checked = positions.call_tensors(self.ir, q_offset, kv_lengths, batch, q_len, kv_len,
                                         as_device(device))
        return (checked.get(rewrites.Q_OFFSET) if q_offset is not None else None,
                checked.get(rewrites.KV_LENGTHS))

    def block_mask(self, q_len: int, kv_len: int, *, batch: int | None = None,
                   heads: int | None = None, device="cpu", q_offset=None, kv_lengths=None,
                   **bindings) -> BlockMask:
        """The BlockMask for these sizes. Batch and head dimensions are 1 unless the mask depends
        on ``b`` or ``h``. A spec without a mask gets an all-full block mask: torch 2.13's
        compiled CPU kernel gave wrong results (NaN, or differing run to run) with
        ``block_mask=None`` and a score_mod, so flexspec always passes one."""
        sizes = given_sizes(q_len, kv_len, batch, heads).as_dict()
        device = as_device(device)
        bindings = self._positions(bindings, q_offset, kv_lengths, sizes["B"], q_len, kv_len,
                                   device)
        plan = self._mask_plan(sizes, bindings, device)
        values = plan.values(bindings)
        if plan.unproven:
            plan.check_lookups(values)
        return self._masks.get(plan.spec, sizes, values, device, plan.mask)

    def _mask_plan(self, sizes: dict, bindings: dict, device) -> InputPlan:
        """The :class:`InputPlan` of :meth:`block_mask` for this signature (sizes, device, the
        bindings' names and :func:`meta`), from the cache or made: checking the bindings and
        specializing the IR on every call cost 0.15-0.5 ms, a quarter of a fresh block mask's
        time on an H200 (docs/performance.md)."""
        key = (tuple(sizes.items()), device,
               tuple((name, meta(value)) for name, value in bindings.items()))
        plan = self._mask_plans.get(key)
        if plan is None:
            plan = make_mask_plan(tensors=self._inputs_for(bindings), masks=self._masks,
                                  sizes=sizes, bindings=bindings, device=device)
            self._mask_plans.put(key, plan)
        return plan

    def dense_mask(self, q_len: int, kv_len: int, *, batch: int | None = None,
                   heads: int | None = None, device="cpu", q_offset=None, kv_lengths=None,
                   **bindings) -> torch.Tensor:
        """The mask from the reference semantics: bool ``[B or 1, H or 1, Q_LEN, KV_LEN]``
        (``B`` when the mask depends on the batch row, per-row ``q_offset`` or ``kv_lengths``
        included)."""
        sizes = given_sizes(q_len, kv_len, batch, heads).as_dict()
        device = as_device(device)
        offset, lengths = self._reference_positions(q_offset, kv_lengths, sizes["B"], q_len,
                                                    kv_len, device)
        values, spec = self._tensors(sizes, bindings, device, mask_only=True)
        key = self._masks.key(spec, sizes, device)
        per_row = any(t is not None and t.numel() > 1 for t in (offset, lengths))
        # the reference reads the sizes B and H off the extents it is given: a mask that reads
        # them (`B / 2 < Q_LEN`) gets the whole extent, or it would see B = 1
        sizes_read = _read_outside_tensors(spec.mask)
        rows = sizes["B"] if per_row or "B" in sizes_read else key.batch
        heads = sizes["H"] if "H" in sizes_read else key.heads
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
        given = {"B": batch, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
        for tensor in self.ir.tensors():
            value = bindings.get(tensor.name)
            if not isinstance(value, torch.Tensor):
                continue
            dims = tuple(tensor.shape)[len(tensor.shape) - value.dim():] if value.dim() else ()
            for expr, size in zip(dims, value.shape):
                if isinstance(expr, ir.Var) and given.get(expr.name) is None and size > 1:
                    given[expr.name] = size
            if device is None:
                device = value.device
        needed = set(lower(self.ir).size_names)
        for tensor in self.ir.tensors():
            sizes_used = ir.free_vars(tensor) & set(ir.SIZE_VARS)
            # a binding broadcasts over B and H; computed and learnable tensors need their sizes
            needed |= sizes_used - {"B", "H"} if tensor.origin == "binding" else sizes_used
        if q_offset is not None or kv_lengths is not None or self._default_offset:
            needed |= {"Q_LEN", "KV_LEN"}  # where the queries stand depends on both
        missing = sorted(n for n in needed if given[n] is None)
        if missing:
            names = {"B": "batch", "H": "heads", "Q_LEN": "q_len", "KV_LEN": "kv_len"}
            raise BindingError("this spec needs " + ", ".join(missing) + "; pass "
                               + ", ".join(f"{names[n]}=..." for n in missing))
        sizes = given_sizes(*(given[n] or 1 for n in ("Q_LEN", "KV_LEN", "B", "H"))).as_dict()
        device = as_device(device or "cpu")
        bindings = self._positions(bindings, q_offset, kv_lengths, sizes["B"], sizes["Q_LEN"],
                                   sizes["KV_LEN"], device)
        values, spec = self._tensors(sizes, bindings, device)
        return lower(spec).make_mods(sizes, values)

    # ---- attention
    def reference(self, q, k, v, *, scale=None, rows=None, q_offset=None, kv_lengths=None,
                  return_lse: bool = False, **bindings):
        """The dense float64 reference result (in q's dtype); with ``rows`` (row numbers of q),
        only those rows of it, to check long sequences at a fraction of the memory. The
        arguments mean what they mean in a call."""
        sizes = check_qkv(q, k, v, allow_float64=True).as_dict()
        offset, lengths = self._reference_positions(q_offset, kv_lengths, sizes["B"],
                                                    sizes["Q_LEN"], sizes["KV_LEN"], q.device)
        values, spec = self._tensors(sizes, bindings, q.device)
        return reference_attention(spec, q, k, v, scale=scale, tensors=values, rows=rows,
                                   q_offset=offset, kv_lengths=lengths, return_lse=return_lse)

    def __call__(self, q, k, v, *, scale=None, q_offset=None, kv_lengths=None,
                 return_lse: bool = False, **bindings):
        """Attention of ``q`` ``(B, Hq, Q_LEN, D)`` over ``k``, ``v`` ``(B, Hkv, KV_LEN, D)``.

        ``q_offset`` (an int, or an int tensor ``[B]``) places query row ``i`` at absolute
        position ``q_offset + i`` (decoding, chunked prefill); ``kv_lengths`` (an int tensor
        ``[B]``) says how many keys of a preallocated cache are valid per batch row. With
        ``return_lse``, returns ``(out, lse)``: the natural-log sum of ``exp`` of the scores over
        the visible keys, ``(B, Hq, Q_LEN)`` float32, ``-inf`` for a row that sees no key.
        Bindings are passed by name (``doc_ids=ids``)."""
        return self._call(q, k, v, scale, bindings, None, q_offset, kv_lengths, return_lse)

    def explain(self, q, k, v, *, scale=None, q_offset=None, kv_lengths=None,
                return_lse: bool = False, **bindings) -> Explanation:
        """What a call with these inputs would do: the canonical spec, the visible fraction of
        the score matrix, the work in FLOPs, the backend chosen and why (and why not the others).
        Only the shapes, dtypes and devices of ``q``, ``k``, ``v`` matter (and the values of the
        tensors the mask reads)."""
        unmasked = self._unmasked_for(q, k, q_offset, kv_lengths)
        if unmasked is not None:  # the rows see every key: the call runs without the mask
            return unmasked.explain(q, k, v, scale=scale, return_lse=return_lse, **bindings)
        bindings = self._placed(q, k, bindings, q_offset, kv_lengths)
        plan = self._plan(q, k, v, scale, bindings, None, return_lse)
        values = plan.values(bindings)
        block_mask = self._masks.get(plan.spec, plan.sizes, values, q.device, plan.mask)
        return explain_plan(plan, values, block_mask, str(self.spec), q, k, v)

    # ---- the call path: a plan per input signature, then a few cheap steps per call
    def _placed(self, q, k, bindings, q_offset, kv_lengths) -> dict:
        """:meth:`_positions` for a call, sized by q and k (checked first when they are not
        what a call takes, so the error names them)."""
        if type(q_offset) is int and q_offset == 0 and not self._default_offset:
            # where the queries stand anyway (transformers' integration passes it on every
            # call): the spec runs as written, so forms such as fa4's documents still apply
            q_offset = None
        if q_offset is None and kv_lengths is None and not self._default_offset:
            return bindings
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and q.dim() == k.dim() == 4):
            check_qkv(q, k, k)
        return self._positions(bindings, q_offset, kv_lengths, q.shape[0], q.shape[2],
                               k.shape[2], q.device)

    # Inside torch.compile(model), dynamo must not trace the planning (dictionaries, the
    # lowering, interval analysis: it ran out of memory trying): the call runs as it does eagerly,
    # compiling its own kernel, and the model's graph breaks around it.
    @torch.compiler.disable
    def _call(self, q, k, v, scale, bindings, learnables, q_offset=None, kv_lengths=None,
              return_lse=False):
        unmasked = self._unmasked_for(q, k, q_offset, kv_lengths)
        if unmasked is not None:
            return unmasked._call(q, k, v, scale, bindings, learnables, None, None, return_lse)
        bindings = self._placed(q, k, bindings, q_offset, kv_lengths)
        try:
            key = call_key(q, k, v, scale, bindings, learnables, return_lse)
            plan = self._plans.get(key)
        except TypeError:  # an unhashable argument: the checks of _plan say what is wrong
            key, plan = None, None
        if plan is None:
            plan = self._plan(q, k, v, scale, bindings, learnables, return_lse)
            if plan.choice.backend == "reference" and plan.request.grads \
                    and self.backend == "auto":
                device = q.device.type
                warn_once(f"no-backward-{device}",
                          f"flexspec: FlexAttention has no backward pass on {device}; inputs "
                          "that require gradients run on the dense reference path instead "
                          "(slower, memory grows with Q_LEN * KV_LEN)")
            if key is not None:
                self._plans.put(key, plan)
        # gathering the values costs a dict and a view per binding: only where they are read
        values = plan.values(bindings) if plan.needs_values else None
        if plan.unproven:
            plan.check_lookups(values)
        return plan.backend.run(plan, q, k, v, scale, bindings, values)

    def _unmasked_for(self, q, k, q_offset, kv_lengths) -> "Attention | None":
        """This spec without its mask, for a call whose rows provably see every key (a decoded
        token under ``causal``): plain attention runs on the fastest kernel for it (SDPA) and
        needs no block mask. Only for ``auto``, a mask that reads no tensor, a score that does
        not read positions, and positions the host knows (an int ``q_offset``)."""
        if (self._unmaskable is None or kv_lengths is not None
                or not (q_offset is None or (isinstance(q_offset, int)
                                             and not isinstance(q_offset, bool)))
                or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                        and q.dim() == k.dim() == 4)):
            return None
        batch, heads, q_len, kv_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if q_offset is None:
            q_offset = kv_len - q_len if self._default_offset else 0
        key = (q_offset, batch, heads, q_len, kv_len)
        sees = self._sees_every_key.get(key)
        if sees is None:
            if len(self._sees_every_key) > PLAN_CACHE_SIZE:
                self._sees_every_key.clear()
            sees = self._sees_every_key[key] = positions.sees_every_key(
                self.ir, q_offset, batch, heads, q_len, kv_len)
        return self._unmaskable if sees else None

    def _plan(self, q, k, v, scale, bindings, learnables, return_lse=False) -> Plan:
        return make_plan(text=str(self.spec), asked=self.backend,
                         tensors=self._inputs_for(bindings), masks=self._masks,
                         block_size=self.block_size, q=q, k=k, v=v, scale=scale,
                         bindings=bindings, learnables=learnables, return_lse=return_lse,
                         written=self.ir)


def _read_outside_tensors(expr: ir.Expr) -> set:
    """The variables ``expr`` reads itself, not through a tensor's declared shape (a
    ``doc_ids[b, q]`` of shape ``[B, KV_LEN]`` does not read the size ``B``)."""
    found, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ir.Var):
            found.add(node.name)
        elif not isinstance(node, ir.Tensor):
            stack.extend(ir.children(node))
    return found
