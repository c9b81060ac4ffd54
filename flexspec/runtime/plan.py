"""Planning: everything about a call that depends only on its input signature (shapes, dtypes,
devices, strides, ``requires_grad``, grad mode, scale and binding names), decided once and kept
in a :class:`~flexspec.runtime.contract.Plan`.

:func:`make_plan` checks the inputs, specializes the IR to the bindings' shapes, proves tensor
lookups in range where it can, chooses the backend and lets it prepare what its calls reuse;
where the backend may hand calls back, it plans the fallback they run on too.
:func:`make_mask_plan` does the part of that a block mask needs (``Attention.block_mask``, which
training steps with fresh ``doc_ids`` call every step). :class:`Failures` remembers the
backends whose compile of a spec failed, so later plans of that spec go elsewhere.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading

import torch

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.ir import tensor_key
from flexspec.ir.overflow import (check_int_ranges, fits_int_ranges, largest, length_buckets,
                                  position_ranges)
from flexspec.limits import dense_fits
from flexspec.runtime.backends import REGISTRY, choose
from flexspec.runtime.bindings import Tensors
from flexspec.runtime.capture import capturing
from flexspec.runtime.checks import check_qkv, checked_scale
from flexspec.runtime.contract import (BackendError, Choice, InputPlan, PageGeometry, Plan,
                                       Replan, Request, Slot)
from flexspec.runtime.identity import meta
from flexspec.runtime.lookups import LookupCheck
from flexspec.runtime.masks import MaskCache
from flexspec.runtime.step import NO_STEP

PLAN_CACHE_SIZE = 64
# Failed compiles remembered, (backend, spec) pairs, the least recently failed out first.
FAILURES_KEPT = 256


def make_mask_plan(*, tensors: Tensors, masks: MaskCache, sizes: dict, bindings: dict,
                   device) -> InputPlan:
    """The :class:`InputPlan` of the mask alone (for ``Attention.block_mask``; with
    ``mask_only=False``, of the mask and the score, for the mods of a paged read): its bindings
    checked, its IR specialized to their shapes, its integer arithmetic checked at these sizes
    (positions as in :func:`check_ranges`) and its lookups proven in range where they can be."""
    values, spec = tensors.gather(sizes, bindings, device, mask_only=True)
    lookups = LookupCheck(spec, sizes, values)
    check_ranges(spec, sizes, "int64")
    slots = _slots(spec, bindings)
    return InputPlan(sizes=sizes, spec=spec, fixed=_fixed(values, slots), slots=slots,
                     masks=masks.bind(spec, sizes, device), lookups=lookups)


def _slots(spec: ir.AttentionIR, bindings: dict) -> tuple:
    """A :class:`Slot` per tensor of ``spec`` that the call passes by name: its bindings, and
    learnable tensors given by name."""
    # the same slots at every length (a declared rank does not depend on the sizes, whose
    # dimensions the bindings were checked against when they were gathered)
    return _named_slots(spec, tuple(bindings))


@functools.lru_cache(maxsize=256)
def _named_slots(spec: ir.AttentionIR, names: tuple) -> tuple:
    named = [t for t in spec.bindings() if t.name in names]
    named += [t for t in spec.tensors() if t.origin == "learnable" and t.name in names]
    return tuple(Slot(t.name, tensor_key(t), len(t.shape)) for t in named)


def _fixed(values: dict, slots: tuple) -> dict:
    """The values no slot replaces at each call."""
    passed = {slot.key for slot in slots}
    return {key: value for key, value in values.items() if key not in passed}


class PlanCache:
    """Plans by signature key, the least recently used out first beyond
    :data:`PLAN_CACHE_SIZE`. Calls from several threads share one: its bookkeeping is one step
    at a time (a plan is made outside the lock; two threads may make the same one, harmlessly)."""

    def __init__(self):
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        """The plan kept under ``key``, or None (a TypeError for an unhashable key)."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key, plan) -> None:
        with self._lock:
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)

    def values(self) -> list:
        """The plans kept, least recently used first."""
        with self._lock:
            return list(self._plans.values())


class Failures:
    """The backends that failed to compile a spec (backend name, specialized IR) -> what went
    wrong, at most :data:`FAILURES_KEPT` of them, shared by every Attention of the process."""

    def __init__(self, kept: int = FAILURES_KEPT):
        self._kept = kept
        self._failed: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, backend: str, spec: ir.AttentionIR, what: str) -> None:
        with self._lock:
            self._failed[(backend, spec)] = what
            self._failed.move_to_end((backend, spec))
            while len(self._failed) > self._kept:
                self._failed.popitem(last=False)

    def of(self, spec: ir.AttentionIR) -> tuple:
        """``(backend, what went wrong)`` for each backend that failed to compile ``spec``."""
        with self._lock:
            return tuple((name, what) for (name, failed), what in self._failed.items()
                         if failed == spec)

    def __len__(self) -> int:
        return len(self._failed)


FAILURES = Failures()


def check_ranges(spec: ir.AttentionIR, sizes: dict, dtype: str) -> None:
    """The spec's integer arithmetic must fit the kernel's int ``dtype`` at these sizes, or it
    would wrap around silently. Query positions are taken to lie in ``0 .. max(Q_LEN, KV_LEN)
    - 1``, where the default placements and a decoding step's ``q_offset`` put them (a plan
    serves every offset; the reference checks the positions of each call exactly). Checked once
    for the lengths' buckets (:func:`~flexspec.ir.overflow.length_buckets`: a growing cache
    checks once per doubling), at the exact lengths where the bucket does not pass."""
    widened = length_buckets(sizes)
    if not fits_int_ranges(spec, tuple(sorted(widened.items())), 0, _last_position(widened),
                           dtype):
        _check_ranges(spec, tuple(sorted(sizes.items())), dtype)


def _last_position(sizes: dict) -> int:
    """The last query position a plan serves: ``max(Q_LEN, KV_LEN) - 1``."""
    return max(largest(sizes["Q_LEN"]), largest(sizes["KV_LEN"])) - 1


@functools.lru_cache(maxsize=256)
def _check_ranges(spec: ir.AttentionIR, sizes: tuple, dtype: str) -> None:
    # remembered when it passes: Attention.block_mask checks on every call, and the answer
    # depends only on these arguments
    sizes = dict(sizes)
    last = _last_position(sizes)
    where = f"for Q_LEN={sizes['Q_LEN']}, KV_LEN={sizes['KV_LEN']}"
    check_int_ranges(spec, position_ranges(sizes, 0, last), dtype,
                     where + (" on a GPU" if dtype == "int32" else ""))


def call_key(q, k, v, scale, bindings: dict, learnables: dict | None,
             return_lse: bool = False) -> tuple:
    """The input signature a plan is cached under (a TypeError for unhashable arguments). The
    grad and inference modes are part of it: a plan keeps tensors made in its mode."""
    return (meta(q), meta(k), meta(v), scale, torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), bool(return_lse),
            tuple((name, meta(value)) for name, value in bindings.items()),
            None if learnables is None else
            tuple((name, id(value), meta(value)) for name, value in learnables.items()))


def make_plan(*, text: str, asked: str, tensors: Tensors, masks: MaskCache, block_size: tuple,
              q, k, v, scale, bindings: dict, learnables: dict | None,
              return_lse: bool = False, written: ir.AttentionIR | None = None,
              options=None, pages: PageGeometry | None = None, vetoes: bool = True) -> Plan:
    """Check a call's inputs and decide everything that depends only on their signature.
    ``written`` is the spec before its query positions were placed (see check_ranges);
    ``options`` the Attention's :class:`~flexspec.runtime.tuning.KernelOptions`; ``pages`` the
    pool's geometry where the keys are paged (``k`` and ``v`` then stand for the sequences at
    their capacity, ``(B, Hkv, capacity, D)``), for a backend that reads them in place;
    ``vetoes``: see :func:`~flexspec.runtime.backends.choose`."""
    float64 = asked != "auto" and REGISTRY[asked].float64
    sizes = check_qkv(q, k, v, allow_float64=float64).as_dict()
    scale = checked_scale(scale)
    if not isinstance(return_lse, bool):
        raise BindingError(f"return_lse must be True or False, got {return_lse!r}")
    device = q.device
    values, spec = tensors.gather(sizes, bindings, device, learnables)
    lookups = LookupCheck(spec, sizes, values)
    slots = _slots(spec, bindings)
    grad_on = torch.is_grad_enabled()
    if not grad_on:  # see InputPlan.detach
        values = {key: value.detach() for key, value in values.items()}
    score_keys = ir.tensor_keys(spec.score)
    table_grads = grad_on and any(values[key].requires_grad for key in score_keys)
    grads = table_grads or (grad_on and (q.requires_grad or k.requires_grad or v.requires_grad))
    facts = {}
    for backend in REGISTRY.values():
        facts.update(backend.facts(device))
    request = Request(
        device_type=device.type,
        capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        dtype=q.dtype, batch=sizes["B"], heads=sizes["H"], kv_heads=k.shape[1],
        q_len=sizes["Q_LEN"], kv_len=sizes["KV_LEN"], head_dim=q.shape[-1],
        v_head_dim=v.shape[-1], grads=grads, table_grads=table_grads,
        # a given scale reaches FlexAttention's kernels as a tensor the score reads (flex.py)
        score_tensors=bool(score_keys) or scale is not None, block_size=block_size,
        reference_fits=dense_fits(*q.shape[:3], k.shape[2]),
        lse=bool(return_lse), scale=scale, facts=tuple(sorted(facts.items())),
        failed=FAILURES.of(spec), pages=pages)
    chosen_options = () if options is None else options.for_request(request)
    if chosen_options:
        request = dataclasses.replace(request, kernel_options=chosen_options)
    choice = choose(asked, request, spec, vetoes=vetoes)
    check_ranges(written or spec, sizes, REGISTRY[choice.backend].index_dtype(device.type))
    draft = Plan(text=text, asked=asked, sizes=sizes, device=device, spec=spec, request=request,
                 choice=choice, backend=REGISTRY[choice.backend], fixed=_fixed(values, slots),
                 slots=slots, score_keys=score_keys, lookups=lookups,
                 masks=masks.bind(spec, sizes, device, REGISTRY[choice.backend].dialect),
                 gqa=k.shape[1] != q.shape[1], detach=not grad_on, scale=scale,
                 learnables=tuple(learnables.values()) if learnables else (),
                 written=written or spec)
    return _prepared(draft, values, masks)


def _prepared(plan: Plan, values: dict, masks: MaskCache) -> Plan:
    """``plan`` with what its backend prepared, and a fallback plan where the backend may hand
    calls back."""
    prepared = plan.backend.prepare(plan, values)
    fallback = None
    if prepared.hands_back is not None:
        fallback = _fallback(plan, values, masks, prepared.hands_back)
    return _with(plan, state=prepared.state, fallback=fallback,
                 needs_values=bool(plan.lookups) or prepared.needs_values)


def _with(plan: Plan, **changes) -> Plan:
    """``dataclasses.replace(plan, **changes)`` without re-running the frozen dataclass's
    ``__init__`` (Plan has no ``__post_init__``; a growing cache makes a plan every step)."""
    made = object.__new__(type(plan))
    made.__dict__.update(plan.__dict__)
    made.__dict__.update(changes)
    return made


def _fallback(plan: Plan, values: dict, masks: MaskCache, why: str):
    """The plan of the best other backend that can run ``plan``'s calls, prepared (and warmed,
    outside a capture), for the calls the backend hands back (``why``); a
    :class:`BackendError` saying why when no other backend can."""
    if not plan.choice.viable:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in plan.choice.rejected)
        return BackendError(f"backend '{plan.backend.name}' hands back {why}, and no other "
                            f"backend can run this call ({reasons})")
    name, because = plan.choice.viable[0]
    backend = REGISTRY[name]
    choice = Choice(name, f"{because} (for {why})", plan.choice.rejected,
                    plan.choice.viable[1:])
    fallback = _prepared(dataclasses.replace(
        plan, choice=choice, backend=backend, state=None, fallback=None,
        masks=masks.bind(plan.spec, plan.sizes, plan.device, backend.dialect)), values, masks)
    if not capturing(plan.device):
        # a capture after a warm-up may hand its calls to the fallback: what its first call
        # would build (a block-mask program's compile) is built now
        backend.warm(fallback, values)
    return fallback


def run(plan: Plan, q, k, v, scale, bindings: dict, step=NO_STEP, pages=None):
    """One call on ``plan`` (in the model step ``step``; ``pages``, the call's
    :class:`~flexspec.runtime.contract.PageTables`, where the plan is paged): its values
    gathered where read, lookups checked, the backend run; a call the backend hands back for
    this call alone runs on the plan's fallback. A lasting hand-back (:class:`Replan`)
    propagates to the caller, who plans anew (flexspec.runtime.calls)."""
    # gathering the values costs a dict and a view per binding: only where they are read
    values = plan.values(bindings) if plan.needs_values else None
    if plan.lookups:
        plan.lookups.check(values)
    try:
        if pages is not None:
            return plan.backend.run(plan, q, k, v, scale, bindings, values, step, pages=pages)
        return plan.backend.run(plan, q, k, v, scale, bindings, values, step)
    except Replan as signal:
        if signal.lasting:
            raise
        if isinstance(plan.fallback, BackendError):
            raise plan.fallback from None
        if plan.fallback is None:
            raise BackendError(f"backend '{plan.backend.name}' handed back a call it said it "
                               f"would run ({signal.reason}); please report it") from None
        return run(plan.fallback, q, k, v, scale, bindings, step, pages)


def failed(plan: Plan, signal: Replan) -> None:
    """Remember that ``plan``'s backend can never run its spec (``signal``); a
    :class:`BackendError` when that backend was asked for."""
    FAILURES.remember(plan.backend.name, plan.spec, signal.reason)
    if plan.asked != "auto":
        raise BackendError(f"backend '{plan.asked}' could not compile this spec: "
                           f"{signal.reason}. backend='auto' runs it on another backend") \
            from signal
