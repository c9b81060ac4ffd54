"""The call path of one compiled spec: a plan per input signature (made on the first call,
cached), then a few cheap steps per call; calls whose rows provably see only a slice of the keys
(a decoded token under a sliding window) run on that slice; calls whose rows provably see every
key run on the spec without its mask; a backend that can never run a plan's calls (a failed
compile) has the signature planned anew without it. A decode call whose keys are too wide for
FlexAttention's decoding kernel runs as calls over runs of its batch rows.

Paged calls plan here too (:meth:`Calls.paged_plan`): over the pool of a paged KV cache, with
block masks whose key blocks are its pages, for a backend that reads pages in place
(:meth:`Calls.paged_launch` runs it); the serving room (:mod:`flexspec.runtime.serving`) makes
reads of them. ``block_mask`` and ``explain`` describe a call as it would run."""

from __future__ import annotations

import dataclasses

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime import order
from flexspec.runtime.backends import choose
from flexspec.runtime.bindings import batch_bindings, batch_rows_of, rows_between
from flexspec.runtime.capture import capturing
from flexspec.runtime.checks import check_qkv, checked_scale
from flexspec.runtime.contract import (BackendError, InputPlan, PageGeometry, PageTables, Plan,
                                       Replan)
from flexspec.runtime.explanation import Explanation, explain_plan
from flexspec.runtime.flexattention import wide_decode_chunks
from flexspec.runtime.identity import meta
from flexspec.runtime.masks import MaskCache
from flexspec.runtime.notices import warn_once
from flexspec.runtime.plan import PlanCache, call_key, failed, make_mask_plan, make_plan, run
from flexspec.runtime.positions import Placement
from flexspec.runtime.progress import log
from flexspec.runtime.step import NO_STEP, Step, launch_signature


class Calls:
    """The calls of one spec (see the module docstring): ``text`` names it in messages,
    ``asked`` is the backend asked for, ``block_size`` and ``mask_mode`` say how its block
    masks are built, ``options`` are its kernel options
    (:class:`~flexspec.runtime.tuning.KernelOptions`)."""

    def __init__(self, *, text: str, spec: ir.AttentionIR, asked: str, block_size: tuple,
                 mask_mode: str, options, placement: Placement | None = None,
                 unmasked: bool = True):
        self.text, self.ir, self.asked, self.block_size = text, spec, asked, block_size
        self.options = options
        self.masks = MaskCache(mask_mode, block_size)
        self.placement = placement or Placement(spec)
        self.plans = PlanCache()
        self.mask_plans = PlanCache()  # block_mask's
        self.last_plan: Plan | None = None  # the plan the last call took the whole path with
        self._paged: dict = {}  # block size -> the calls over pages of that size (over_pages)
        # the spec without its mask, for calls whose rows see every key: only for auto, a mask
        # that reads no tensor and a score that does not read positions
        self.unmasked: Calls | None = None
        if (unmasked and asked == "auto" and spec.has_mask
                and not any(isinstance(n, ir.Tensor) for n in ir.walk(spec.mask))
                and "q" not in ir.free_vars(spec.score)):
            plain = ir.AttentionIR(ir.TRUE, spec.score, spec.align)
            self.unmasked = Calls(text=text, spec=plain, asked=asked, block_size=block_size,
                                  mask_mode=mask_mode, options=options, unmasked=False)

    def forget_plans(self) -> None:
        """Plan every signature anew (the kernel options changed)."""
        self.plans = PlanCache()
        for other in (self.unmasked, *self._paged.values()):
            if other is not None:
                other.forget_plans()

    def unmasked_for(self, q, k, q_offset, kv_lengths) -> "Calls | None":
        """The calls of the spec without its mask, when this call's rows provably see every
        key (plain attention then runs on the fastest kernel for it and needs no block mask)."""
        if self.unmasked is not None and self.placement.sees_every_key(q, k, q_offset,
                                                                       kv_lengths):
            return self.unmasked
        return None

    # Inside torch.compile(model), dynamo must not trace the planning (dictionaries, the
    # lowering, interval analysis: it ran out of memory trying): the call runs as it does eagerly,
    # compiling its own kernel, and the model's graph breaks around it.
    @torch.compiler.disable
    def __call__(self, q, k, v, *, scale=None, bindings: dict, learnables: dict | None = None,
                 q_offset=None, kv_lengths=None, return_lse: bool = False, step=None):
        """Attention of ``q`` over ``k``, ``v`` (see ``Attention.__call__``)."""
        runs = self._decode_runs(q, k, v) if step is None else None
        if runs is not None:
            return self._in_runs(runs, q, k, v, scale, bindings, learnables, q_offset,
                                 kv_lengths, return_lse)
        return self._call(q, k, v, scale=scale, bindings=bindings, learnables=learnables,
                          q_offset=q_offset, kv_lengths=kv_lengths, return_lse=return_lse,
                          step=step)

    def _decode_runs(self, q, k, v) -> list | None:
        """The runs of batch rows a decode call over keys too wide for the decoding kernel runs
        as (:func:`~flexspec.runtime.flexattention.wide_decode_chunks`), on the backends that
        run FlexAttention; None for any other call."""
        return wide_decode_chunks(q, k, v) if self.asked in ("auto", "flex") else None

    def _in_runs(self, runs: list, q, k, v, scale, bindings: dict, learnables, q_offset,
                 kv_lengths, return_lse: bool):
        """A decode call whose keys are too wide for FlexAttention's decoding kernel, as a call
        per run of batch rows (``runs``) with the rows' own offsets, lengths and bindings
        (views, no copy), the outputs put together (flexspec.workarounds:
        flex-decoding-wide-indices)."""
        results = []
        for start, stop in runs:
            offset, lengths, rows = self._rows_of_call(start, stop, q.shape[0], q_offset,
                                                       kv_lengths, bindings)
            results.append(self._call(q[start:stop], k[start:stop], v[start:stop], scale=scale,
                                      bindings=rows, learnables=learnables, q_offset=offset,
                                      kv_lengths=lengths, return_lse=return_lse, step=None))
        if return_lse:
            return (torch.cat([out for out, _ in results]),
                    torch.cat([lse for _, lse in results]))
        return torch.cat(results)

    def _rows_of_call(self, start: int, stop: int, batch: int, q_offset, kv_lengths,
                      bindings: dict) -> tuple:
        """``(q_offset, kv_lengths, bindings)`` of batch rows ``start`` to ``stop`` of a call
        (views of the per-row tensors; the others as they are)."""
        rows = batch_rows_of(bindings, batch_bindings(self.ir.bindings()),
                             lambda value: rows_between(value, start, stop, batch))
        return (rows_between(q_offset, start, stop, batch),
                rows_between(kv_lengths, start, stop, batch), rows)

    def _call(self, q, k, v, *, scale=None, bindings: dict, learnables: dict | None = None,
              q_offset=None, kv_lengths=None, return_lse: bool = False, step=None):
        scale = checked_scale(scale)  # before the key: 0.5 and numpy's 0.5 are one signature
        signature = None
        if (step is not None and not bindings and not learnables and q_offset is None
                and kv_lengths is None):
            # a later layer of the step: the launch its first layer resolved, if any
            signature = launch_signature(q, k, v, scale, return_lse)
            if signature is not None and isinstance(step, Step):
                launch = step.launch(self, signature)
                if launch is not None:
                    return launch(q, k, v)
        if step is not None:
            q_offset, kv_lengths, bindings = self._from_step(step, q, q_offset, kv_lengths,
                                                             bindings)
        else:
            step = NO_STEP
        # the rows may see a slice of the keys only: the rest is not read
        sliced_k, sliced_v, q_offset, keys = self.placement.read_keys(q, k, v, q_offset,
                                                                      kv_lengths)
        calls = self.unmasked_for(q, sliced_k, q_offset, kv_lengths) or self
        if calls is not self:
            # the rows see every key: the spec runs without its mask, which reads no tensor,
            # and its score reads no position (the step's bindings go along, unread)
            q_offset = kv_lengths = None
        bindings = calls._placed(q, sliced_k, bindings, q_offset, kv_lengths, step)
        plan, key, made = calls._plan_for(q, sliced_k, sliced_v, scale, bindings, learnables,
                                          return_lse)
        if not made or not capturing(plan.device):  # a plan made in a capture: see _new_plan
            self.last_plan = plan
        if signature is not None:
            launch = calls._launch(plan, scale, bindings, step, keys)
            if launch is not None:
                step.keep_launch(self, signature, launch)
                return launch(q, k, v)
        out = calls._run(plan, key, q, sliced_k, sliced_v, scale, bindings, learnables,
                         return_lse, step)
        if signature is not None and made and key is not None:
            # the plan's first call (a growing cache's every step) has run its compile path:
            # the launch is resolved now, so the step's later layers need not take the whole
            # path to find it (the plan is the cache's: a failed compile replaced it there). A
            # plan met again has no launch now where it had none before the call
            plan = calls.plans.get(key)
            launch = None if plan is None else calls._launch(plan, scale, bindings, step, keys)
            if launch is not None:
                step.keep_launch(self, signature, launch)
        return out

    def _placed(self, q, k, bindings: dict, q_offset, kv_lengths, step) -> dict:
        """The call's bindings with the tensors that place its rows (made once per step)."""
        if step is NO_STEP:
            return self.placement.for_call(q, k, bindings, q_offset, kv_lengths)
        placed = step.shared(("placed", id(self.placement), tuple(q.shape), tuple(k.shape),
                              q.device), lambda: self.placement.for_call(
                                  q, k, {}, q_offset, kv_lengths))
        return {**bindings, **placed} if placed else bindings

    def _plan_for(self, q, k, v, scale, bindings, learnables, return_lse) -> tuple:
        """``(plan, key, made)``: the plan of this input signature, from the cache or made now
        (``made``; ``key`` None for arguments that cannot be hashed, whose plan is not kept)."""
        try:
            key = call_key(q, k, v, scale, bindings, learnables, return_lse)
            plan = self.plans.get(key)
        except TypeError:  # an unhashable argument: the checks of plan() say what is wrong
            key, plan = None, None
        if plan is not None:
            return plan, key, False
        return self._new_plan(key, q, k, v, scale, bindings, learnables, return_lse), key, True

    def _run(self, plan, key, q, k, v, scale, bindings, learnables, return_lse, step):
        while True:
            try:
                return run(plan, q, k, v, scale, bindings, step)
            except Replan as signal:  # lasting: this backend can never run the plan's calls
                failed(plan, signal)  # remembered, so that the next plan goes elsewhere
                gave_up = plan.backend.name
                plan = self._new_plan(key, q, k, v, scale, bindings, learnables, return_lse)
                warn_once(f"gave-up-{gave_up}-{hash(plan.spec)}",
                          f"flexspec: backend '{gave_up}' could not compile '{self.text}' "
                          f"({signal.reason}); running it on '{plan.choice.backend}' instead")

    @staticmethod
    def _launch(plan: Plan, scale, bindings: dict, step, keys):
        """The launch of ``plan``'s calls in ``step`` (a function of q, k, v with everything
        else resolved, the keys cut to ``keys``' slice), or None where its backend has none
        (then every layer takes the whole path)."""
        values = plan.values(bindings) if plan.needs_values or plan.lookups else None
        launch = plan.backend.launcher(plan, scale, bindings, values, step)
        if launch is None:
            return None
        if plan.lookups:  # once for the step: its layers read the same tensors
            plan.lookups.check(values)
        if keys is None:
            return launch
        start, end, _ = keys

        def sliced(q, k, v):
            return launch(q, k[:, :, start:end], v[:, :, start:end])
        return sliced

    @staticmethod
    def _from_step(step, q, q_offset, kv_lengths, bindings: dict) -> tuple:
        """A call's positions and bindings from its model step (a step's call gives neither
        positions nor a binding the step holds)."""
        if not isinstance(step, Step):
            raise BindingTypeError(f"step must be a flexspec.Step, got {type(step).__name__}")
        if step.slots is not None:
            raise BindingError("a step with slots is a paged step: give it to attn.paged(q, "
                               "cache, step=step)")
        if q_offset is not None or kv_lengths is not None:
            raise BindingError("a call with a step takes q_offset and kv_lengths from the step: "
                               "give them to flexspec.Step(...)")
        shared = step.bindings_for(q.shape[0], q.shape[2]) if isinstance(q, torch.Tensor) \
            and q.dim() == 4 else step.bindings
        twice = sorted(set(shared) & set(bindings))
        if twice:
            raise BindingError(f"{', '.join(twice)} given to the call and to its step: give them "
                               "once")
        return step.q_offset, step.kv_lengths, {**shared, **bindings}

    def _new_plan(self, key, q, k, v, scale, bindings, learnables, return_lse) -> Plan:
        plan = self.plan(q, k, v, scale, bindings, learnables, return_lse)
        log.debug("planned '%s' at %s on %s: %s (%s)", self.text, plan.sizes, plan.device,
                  plan.choice.backend, plan.choice.reason)
        if self.asked == "auto":
            for row in order.rows_for(plan.request):
                if row.backend == plan.choice.backend and row.notice is not None:
                    warn_once(f"notice-{row.backend}-{plan.request.device_type}",
                              row.notice.format(device=plan.request.device_type))
        # a plan made inside a CUDA graph capture holds tensors of the graph's memory pool (its
        # scale, built-in tables, block mask), which must not outlive the recording: it serves
        # this call alone (CUDA graph trees record a graph again, with no warm-up, at a later
        # generate(), where the plan may have been evicted since)
        if key is not None and not capturing(plan.device):
            self.plans.put(key, plan)
        return plan

    def plan(self, q, k, v, scale, bindings: dict, learnables=None, return_lse=False, *,
             pages: PageGeometry | None = None, vetoes: bool = True) -> Plan:
        """The plan of a call whose bindings are placed already (see Placement.for_call)."""
        return make_plan(text=self.text, asked=self.asked,
                         tensors=self.placement.tensors_for(bindings), masks=self.masks,
                         block_size=self.block_size, q=q, k=k, v=v, scale=scale,
                         bindings=bindings, learnables=learnables, return_lse=return_lse,
                         written=self.ir, options=self.options, pages=pages, vetoes=vetoes)

    # ---- paged calls

    def over_pages(self, geometry: PageGeometry) -> "Calls":
        """The calls of this spec over a pool of ``geometry``: its block masks with key blocks
        of the page (made on the first paged call with such pages)."""
        found = self._paged.get(geometry.block_size)
        if found is None:
            found = self._paged[geometry.block_size] = Calls(
                text=self.text, spec=self.ir, asked=self.asked, block_size=geometry.block_size,
                mask_mode=self.masks.mode, options=self.options, placement=self.placement,
                unmasked=False)
        return found

    def paged_plan(self, q, keys, values, pages: PageTables, *, scale, bindings: dict,
                   q_offset, return_lse: bool, vetoes: bool = True) -> tuple:
        """``(plan, bindings)`` of a call of ``q`` (``(B, Hq, Q_LEN, D)``, a row per slot) over
        the sequences ``pages`` of a pool (``keys``, ``values``: ``[Hkv, pages * page_size,
        D]``) read in place, the call's bindings with its rows placed: row ``b`` stands at
        ``q_offset`` (by default its length minus Q_LEN) and sees the first ``lengths[b]`` of
        its sequence's keys. A :class:`BackendError` where no backend reads these pages in
        place (``vetoes``: see :func:`~flexspec.runtime.backends.choose`), which the
        signature's plan cache remembers."""
        calls = self.over_pages(pages.geometry)
        scale = checked_scale(scale)
        # the sequences as a call's k and v at their capacity would be (no memory)
        shape = (pages.slots.shape[0], keys.shape[0], pages.geometry.capacity)
        k = keys.new_empty(1, 1, 1, 1).expand(*shape, keys.shape[-1])
        v = values.new_empty(1, 1, 1, 1).expand(*shape, values.shape[-1])
        check_qkv(q, k, v)
        if q_offset is None:
            q_offset = pages.lengths - q.shape[2]
        bindings = calls.placement.for_call(q, k, bindings, q_offset, pages.lengths)
        try:
            key = (call_key(q, k, v, scale, bindings, None, return_lse), pages.geometry, vetoes)
            found = calls.plans.get(key)
        except TypeError:  # an unhashable argument: the checks of plan() say what is wrong
            key, found = None, None
        if found is None:
            try:
                found = calls.plan(q, k, v, scale, bindings, None, return_lse,
                                   pages=pages.geometry, vetoes=vetoes)
            except BackendError as error:
                found = error
            if key is not None and not capturing(q.device):
                calls.plans.put(key, found)
        if isinstance(found, BackendError):
            raise found
        if not capturing(q.device):
            calls.last_plan = found
        return found, bindings

    @staticmethod
    def paged_launch(plan: Plan, scale, bindings: dict, pages: PageTables):
        """The launch of ``plan``'s reads over ``pages``: a function of ``(q, keys, values)``,
        the pools of any cache whose pages were taken by the operations that made ``pages``
        (the backend's launcher, or its ``run`` at each call where it has none)."""
        values = plan.values(bindings) if plan.needs_values or plan.lookups else None
        if plan.lookups:
            plan.lookups.check(values)
        launch = plan.backend.launcher(plan, scale, bindings, values, NO_STEP, pages=pages)
        if launch is not None:
            return launch

        def each_call(q, keys, pool_values):
            return run(plan, q, keys, pool_values, scale, bindings, NO_STEP, pages)
        return each_call

    # ---- descriptions

    def block_mask(self, sizes: dict, bindings: dict, device):
        """The BlockMask of this spec at ``sizes`` for ``bindings`` (placed already), from the
        plan of its signature (sizes, device, the bindings' names and :func:`meta`), kept:
        checking the bindings and specializing the IR on every call would cost a quarter of a
        fresh block mask's time on a GPU (docs/performance.md, `Attention.block_mask`'s own host
        path)."""
        key = (tuple(sizes.items()), device, torch.is_inference_mode_enabled(),
               tuple((name, meta(value)) for name, value in bindings.items()))
        plan: InputPlan = self.mask_plans.get(key)
        if plan is None:
            plan = make_mask_plan(tensors=self.placement.tensors_for(bindings), masks=self.masks,
                                  sizes=sizes, bindings=bindings, device=device)
            self.mask_plans.put(key, plan)
        values = plan.values(bindings)
        if plan.lookups:
            plan.lookups.check(values)
        return plan.masks.get(values, device)

    def explain(self, q, k, v, *, scale, q_offset, kv_lengths, return_lse: bool, bindings: dict,
                target: str | None, capability, facts: dict | None) -> Explanation:
        """What a call with these inputs would do (see ``Attention.explain``): a decode call
        whose keys are too wide for the decoding kernel, which runs as calls over runs of batch
        rows, is explained by its first run's call."""
        runs = self._decode_runs(q, k, v)
        if runs is not None:
            start, stop = runs[0]
            offset, lengths, rows = self._rows_of_call(start, stop, q.shape[0], q_offset,
                                                       kv_lengths, bindings)
            first = self.explain(q[start:stop], k[start:stop], v[start:stop], scale=scale,
                                 q_offset=offset, kv_lengths=lengths, return_lse=return_lse,
                                 bindings=rows, target=target, capability=capability,
                                 facts=facts)
            return dataclasses.replace(first, runs=(q.shape[0], len(runs), stop - start))
        # as a call does: only the keys its rows may see are read
        k, v, q_offset, keys = self.placement.read_keys(q, k, v, q_offset, kv_lengths)
        calls = self.unmasked_for(q, k, q_offset, kv_lengths) or self
        if calls is not self:  # the rows see every key: the call runs without the mask
            q_offset = kv_lengths = None
        bindings = calls.placement.for_call(q, k, bindings, q_offset, kv_lengths)
        plan = calls.plan(q, k, v, scale, bindings, None, return_lse)
        return self.explain_plan(plan, bindings, q, k, v, target=target,
                                 capability=capability, facts=facts, keys=keys)

    def explain_plan(self, plan: Plan, bindings: dict, q, k, v, *, target=None, capability=None,
                     facts=None, keys=None, pages: str | None = None) -> Explanation:
        """The :class:`Explanation` of a call planned as ``plan`` (on ``target``, where given:
        see ``Attention.explain``)."""
        values = plan.values(bindings)
        block_mask = plan.masks.get(values, q.device)
        choice = device = None
        if target is not None:
            request = dataclasses.replace(plan.request, device_type=target,
                                          capability=capability,
                                          facts=tuple(sorted((facts or {}).items())))
            choice = choose(self.asked, request, plan.spec)
            device = f"{target} (planned on {q.device})"
            plan = dataclasses.replace(plan, request=request)  # its kernel is the target's
        return explain_plan(plan, values, block_mask, self.text, q, k, v, choice=choice,
                            device=device, keys=keys, pages=pages,
                            options_source=self.options.source(plan.request))
