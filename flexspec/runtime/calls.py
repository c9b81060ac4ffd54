"""The call path of one compiled spec: a plan per input signature (made on the first call,
cached), then a few cheap steps per call; calls whose rows provably see only a slice of the keys
(a decoded token under a sliding window) run on that slice; calls whose rows provably see every
key run on the spec without its mask; a backend that can never run a plan's calls (a failed
compile) has the signature planned anew without it."""

from __future__ import annotations

import torch

from flexspec import ir
from flexspec.errors import BindingError, BindingTypeError
from flexspec.runtime import order
from flexspec.runtime.capture import capturing
from flexspec.runtime.checks import checked_scale
from flexspec.runtime.contract import Plan, Replan
from flexspec.runtime.masks import BlockMasks
from flexspec.runtime.notices import warn_once
from flexspec.runtime.plan import PlanCache, call_key, failed, make_plan, run
from flexspec.runtime.positions import Placement
from flexspec.runtime.progress import log
from flexspec.runtime.step import NO_STEP, Step, launch_signature


class Calls:
    """The calls of one spec (see the module docstring): ``text`` names it in messages,
    ``asked`` is the backend asked for."""

    def __init__(self, *, text: str, spec: ir.AttentionIR, asked: str, block_size: tuple,
                 masks: BlockMasks, placement: Placement, options=None):
        self.text, self.ir, self.asked, self.block_size = text, spec, asked, block_size
        self.masks, self.placement, self.options = masks, placement, options
        self.plans = PlanCache()
        self.last_plan: Plan | None = None  # the plan the last call took the whole path with
        # the spec without its mask, for calls whose rows see every key: only for auto, a mask
        # that reads no tensor and a score that does not read positions
        self.unmasked: Calls | None = None
        if (asked == "auto" and spec.has_mask
                and not any(isinstance(n, ir.Tensor) for n in ir.walk(spec.mask))
                and "q" not in ir.free_vars(spec.score)):
            plain = ir.AttentionIR(ir.TRUE, spec.score, spec.align)
            self.unmasked = Calls(text=text, spec=plain, asked=asked, block_size=block_size,
                                  masks=BlockMasks(masks.mode, block_size),
                                  placement=Placement(plain), options=options)

    def forget_plans(self) -> None:
        """Plan every signature anew (the kernel options changed)."""
        self.plans = PlanCache()
        if self.unmasked is not None:
            self.unmasked.forget_plans()

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

    def plan(self, q, k, v, scale, bindings: dict, learnables=None, return_lse=False) -> Plan:
        """The plan of a call whose bindings are placed already (see Placement.for_call)."""
        return make_plan(text=self.text, asked=self.asked,
                         tensors=self.placement.tensors_for(bindings), masks=self.masks,
                         block_size=self.block_size, q=q, k=k, v=v, scale=scale,
                         bindings=bindings, learnables=learnables, return_lse=return_lse,
                         written=self.ir, options=self.options)
