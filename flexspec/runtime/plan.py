"""Planning: everything about a call that depends only on its input signature (shapes, dtypes,
devices, strides, ``requires_grad``, grad mode, scale and binding names), decided once and kept
in a :class:`Plan`.

:func:`make_plan` checks the inputs, specializes the IR to the bindings' shapes, proves tensor
lookups in range where it can, chooses the backend and lets it prepare what its calls reuse.
:func:`make_mask_plan` does the part of that a block mask needs (``Attention.block_mask``, which
training steps with fresh ``doc_ids`` call every step).
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flexspec import ir
from flexspec.errors import BindingError
from flexspec.ir import tensor_key
from flexspec.ir.overflow import check_int_ranges, position_ranges
from flexspec.ir.specialize import declared_shape
from flexspec.kernels.lower import lower
from flexspec.kernels.tensors import add_leading_dims
from flexspec.limits import dense_fits
from flexspec.runtime.backends import REGISTRY, Backend, Choice, Request, choose
from flexspec.runtime.inputs import (Tensors, check_lookups, check_qkv, check_scale, contiguous,
                                     identity, meta, shapes_key, unproven_lookups)
from flexspec.runtime.masks import BlockMasks, MaskKey

PLAN_CACHE_SIZE = 64


class Slot(NamedTuple):
    """A tensor given by name at each call: its name, tensor key and declared dimensions."""

    name: str
    key: str
    ndim: int


@dataclass(eq=False, kw_only=True)
class InputPlan:
    """What the tensors of calls with one input signature need, decided once: the IR
    specialized to the bindings' shapes, the values that do not change between calls, a slot
    per tensor passed by name, the key of the block mask, and the lookups to check by value.
    :meth:`Attention.block_mask <flexspec.runtime.attention.Attention.block_mask>` keeps one per
    signature; a :class:`Plan` is one with the backend's choices added."""

    sizes: dict
    spec: ir.AttentionIR            # specialized to the bindings' shapes
    fixed: dict                     # tensor values that do not change between calls
    slots: tuple                    # a Slot per tensor passed by name
    mask: MaskKey
    unproven: tuple                 # lookups whose indices are checked by value
    # Under no_grad, run on detached tensors: FlexAttention refuses inputs that require
    # gradients where it has no backward, and FLASH captured tables that do, even though
    # nothing is recorded under no_grad
    detach: bool = False
    checked: tuple = ()             # identity of the values whose lookups were last checked

    def values(self, bindings: dict) -> dict:
        """The tensor values of one call: the plan's fixed ones and this call's bindings."""
        if not self.slots:
            return self.fixed
        values = dict(self.fixed)
        for name, key, ndim in self.slots:
            value = contiguous(bindings[name])
            value = value if value.dim() == ndim else add_leading_dims(value, ndim)
            values[key] = value.detach() if self.detach else value
        return values

    def check_lookups(self, values: dict) -> None:
        """The lookups interval analysis could not prove in range, checked on these values
        unless they are the very ones checked last."""
        found = self.lookup_identity(values)
        if found != self.checked:
            check_lookups(self.spec, self.sizes, values, self.unproven)
            self.checked = found

    def lookup_identity(self, values: dict) -> tuple:
        return tuple(identity(values[tensor_key(t)]) for t, _, _ in self.unproven)


@dataclass(eq=False, kw_only=True)
class Plan(InputPlan):
    """Everything about a call that depends only on its input signature (see the module
    docstring); ``prepared`` is what the chosen backend keeps (see Backend.prepare)."""

    text: str                       # the spec as the user wrote it, for messages
    asked: str                      # the backend asked for ("auto", "flex", ...)
    device: torch.device
    request: Request
    choice: Choice
    backend: Backend
    score_keys: frozenset           # keys of the tensors the score reads
    gqa: bool
    scale: float | None = None      # the call's scale (None: 1 / sqrt(D))
    needs_values: bool = False      # calls gather their tensor values (see Plan.values)
    prepared: object = None


def make_mask_plan(*, tensors: Tensors, masks: BlockMasks, sizes: dict, bindings: dict,
                   device) -> InputPlan:
    """The :class:`InputPlan` of the mask alone (for ``Attention.block_mask``): its bindings
    checked, its IR specialized to their shapes, its integer arithmetic checked at these sizes
    (positions as in :func:`check_ranges`) and its lookups proven in range where they can be."""
    values, spec = tensors.gather(sizes, bindings, device, mask_only=True)
    check_ranges(spec, sizes, "int64")
    slots = _slots(spec, sizes, bindings)
    plan = InputPlan(sizes=sizes, spec=spec, fixed=_fixed(values, slots), slots=slots,
                     mask=masks.key(spec, sizes, device),
                     unproven=unproven_lookups(spec, tuple(sorted(sizes.items())),
                                               shapes_key(values)))
    plan.checked = plan.lookup_identity(values)
    return plan


def _slots(spec: ir.AttentionIR, sizes: dict, bindings: dict) -> tuple:
    """A :class:`Slot` per tensor of ``spec`` that the call passes by name: its bindings, and
    learnable tensors given by name."""
    named = [t for t in spec.bindings() if t.name in bindings]
    named += [t for t in spec.tensors() if t.origin == "learnable" and t.name in bindings]
    return tuple(Slot(t.name, tensor_key(t), len(declared_shape(t, sizes))) for t in named)


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


def check_ranges(spec: ir.AttentionIR, sizes: dict, dtype: str) -> None:
    """The spec's integer arithmetic must fit the kernel's int ``dtype`` at these sizes, or it
    would wrap around silently. Query positions are taken to lie in ``0 .. max(Q_LEN, KV_LEN)
    - 1``, where the default placements and a decoding step's ``q_offset`` put them (a plan
    serves every offset; the reference checks the positions of each call exactly)."""
    _check_ranges(spec, tuple(sorted(sizes.items())), dtype)


@functools.lru_cache(maxsize=256)
def _check_ranges(spec: ir.AttentionIR, sizes: tuple, dtype: str) -> None:
    # remembered when it passes: Attention.block_mask checks on every call (0.1-0.35 ms of
    # interval analysis each time), and the answer depends only on these arguments
    sizes = dict(sizes)
    last = max(sizes["Q_LEN"], sizes["KV_LEN"]) - 1
    where = f"for Q_LEN={sizes['Q_LEN']}, KV_LEN={sizes['KV_LEN']}"
    check_int_ranges(spec, position_ranges(sizes, 0, last), dtype,
                     where + (" on a GPU" if dtype == "int32" else ""))


def call_key(q, k, v, scale, bindings: dict, learnables: dict | None,
             return_lse: bool = False) -> tuple:
    """The input signature a plan is cached under (a TypeError for unhashable arguments)."""
    return (meta(q), meta(k), meta(v), scale, torch.is_grad_enabled(), bool(return_lse),
            tuple((name, meta(value)) for name, value in bindings.items()),
            None if learnables is None else
            tuple((name, id(value), meta(value)) for name, value in learnables.items()))


def make_plan(*, text: str, asked: str, tensors: Tensors, masks: BlockMasks, block_size: tuple,
              q, k, v, scale, bindings: dict, learnables: dict | None,
              return_lse: bool = False, written: ir.AttentionIR | None = None) -> Plan:
    """Check a call's inputs and decide everything that depends only on their signature.
    ``written`` is the spec before its query positions were placed (see check_ranges)."""
    sizes = check_qkv(q, k, v, allow_float64=asked == "reference").as_dict()
    check_scale(scale)
    if not isinstance(return_lse, bool):
        raise BindingError(f"return_lse must be True or False, got {return_lse!r}")
    device = q.device
    values, spec = tensors.gather(sizes, bindings, device, learnables)
    slots = _slots(spec, sizes, bindings)
    grad_on = torch.is_grad_enabled()
    if not grad_on:  # see Plan.detach
        values = {key: value.detach() for key, value in values.items()}
    score_keys = ir.tensor_keys(spec.score)
    table_grads = grad_on and any(values[key].requires_grad for key in score_keys)
    grads = table_grads or (grad_on and (q.requires_grad or k.requires_grad or v.requires_grad))
    lowered = lower(spec)
    facts = {}
    for backend in REGISTRY.values():
        facts.update(backend.facts(device, lowered))
    request = Request(
        device_type=device.type,
        capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        dtype=q.dtype, batch=sizes["B"], heads=sizes["H"], kv_heads=k.shape[1],
        q_len=sizes["Q_LEN"], kv_len=sizes["KV_LEN"], head_dim=q.shape[-1],
        v_head_dim=v.shape[-1], grads=grads, table_grads=table_grads,
        # a given scale reaches FlexAttention's kernels as a tensor the score reads (flex.py)
        score_tensors=bool(score_keys) or scale is not None, block_size=block_size,
        reference_fits=dense_fits(*q.shape[:3], k.shape[2]),
        lse=bool(return_lse), scale=scale, **facts)
    if q.dtype == torch.float64 and asked == "reference":
        choice = Choice("reference", "backend='reference' was asked for")
    else:
        choice = choose(asked, request, spec)
    check_ranges(written or spec, sizes, REGISTRY[choice.backend].index_dtype(device.type))
    unproven = unproven_lookups(spec, tuple(sorted(sizes.items())), shapes_key(values))
    plan = Plan(text=text, asked=asked, sizes=sizes, device=device, spec=spec, request=request,
                choice=choice, backend=REGISTRY[choice.backend],
                fixed=_fixed(values, slots), slots=slots, score_keys=score_keys,
                mask=masks.key(spec, sizes, device, REGISTRY[choice.backend].cute),
                unproven=unproven,
                gqa=k.shape[1] != q.shape[1], detach=not grad_on, scale=scale,
                needs_values=bool(unproven))
    plan.checked = plan.lookup_identity(values)
    plan.backend.prepare(plan, values, masks)
    return plan
