"""The FlexAttention call that the ``flex`` and ``flash`` backends both make: the lowered spec,
its compiled entry point, the block mask and ``score_mod`` kept where they read no binding, and
a call that fetches the block mask of its bindings and launches. The two backends differ in
their kernel options, the lowering's dialect, their rules, and what a failed first compile
means (:meth:`FlexAttentionBackend.compile_failed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexspec import ir
from flexspec.ir import rewrites, tensor_key
from flexspec.kernels.generations import call_compiled, call_kept
from flexspec.kernels.lower import Lowered, lower
from flexspec.runtime import compiled
from flexspec.runtime.capture import in_graph_memory
from flexspec.runtime.identity import version
from flexspec.runtime.progress import timed
from flexspec.kernels.replay import Replay
from flexspec.runtime.step import NO_STEP
from flexspec.runtime.contract import Backend, Plan, Prepared
from flexspec.errors import BindingError

try:
    from torch.nn.attention.flex_attention import FlexKernelOptions
except ImportError:  # torch before FlexKernelOptions was public
    FlexKernelOptions = dict


@dataclass(frozen=True, eq=False)
class KernelParts:
    """What every compiled FlexAttention call of a plan is made of (:func:`kernel_parts`): the
    lowered spec (a given scale made a tensor the score reads), its compiled entry, the kernel
    options, whether it runs on the decoding kernel, and the log-sum-exp request."""

    lowered: Lowered
    entry: object                            # compiled.compiled_entry(lowered, purpose)
    options: FlexKernelOptions | None
    decoding: bool                           # runs on the decoding kernel (see decodes)
    lse: dict | None                         # compiled.lse_request(return_lse)
    scale_values: dict                       # the scale as a tensor (rewrites.scaled)

    def score_mod(self, plan: Plan, values: dict):
        """The ``score_mod`` of a call with these tensor values: float64 tables read as float32
        copies (the kernel computes scores in float32), each tensor a view of its own
        (:func:`own_tensors`)."""
        kernel_values = {key: value.float() if value.dtype == torch.float64 else value
                         for key, value in values.items()}
        return self.lowered.make_mods(plan.sizes, own_tensors(
            {**kernel_values, **self.scale_values}))[1]


def kernel_parts(plan: Plan, values: dict, options: dict | None, decoding: bool, purpose: str,
                 given: dict | None = None, dialect: str = "torch") -> KernelParts:
    """The :class:`KernelParts` of ``plan``'s calls: flexspec's ``options`` for them, over
    :data:`DECODING_OPTIONS` where they run on the decoding kernel, under those ``given``
    (given to compile or tuned for the call: the request's by default). Calls with options of
    their own compile in an entry of their own: tune's candidates would otherwise leave their
    graphs in the default entry, whose every later call would then check their guards too
    (host time, docs/performance.md "Tuning kernel options")."""
    spec, scale_values = plan.spec, {}
    if plan.scale is not None:
        # the kernel keeps its default 1/sqrt(D) and the score is multiplied by a tensor: a
        # new scale is a new value, not a new kernel
        spec = rewrites.scaled(plan.spec)
        ratio = float(plan.scale) * math.sqrt(plan.request.head_dim)
        scale_values = {rewrites.SCALE: torch.full((plan.sizes["B"],), ratio,
                                                   dtype=torch.float32, device=plan.device)}
    lowered = lower(spec, dialect=dialect)
    if decoding:
        options = {**DECODING_OPTIONS, **(options or {})}
    given = dict(plan.request.kernel_options) if given is None else given
    if given:
        options, purpose = {**(options or {}), **given}, f"{purpose} with {given}"
    return KernelParts(lowered=lowered, entry=compiled.compiled_entry(lowered, purpose),
                       options=options or None, decoding=decoding,
                       lse=compiled.lse_request(plan.request.lse), scale_values=scale_values)


@dataclass(eq=False)
class FlexCall:
    """What a FlexAttention plan keeps between calls (its backend's ``state``)."""

    kernel: KernelParts
    masks: object = None                     # the plan's PlanMasks, in the kernel's form
    every_tile: bool = False                 # lists every tile outside a capture (see below)
    mask_bindings: tuple = ()                # names of the bindings the mask reads
    # the learnable tables the mask reads (a module's parameters, changed in place by an
    # optimizer step): their block mask is rebuilt when one changes
    mask_tables: tuple = ()
    block_mask: BlockMask | None = None      # the block mask when the mask reads neither
    # ((tensor, version) of the mask's bindings, versions of its tables, block mask) of the
    # last call: one tuple, replaced whole, so that concurrent calls never pair one call's
    # bindings with another's mask
    last: tuple | None = None
    score_varies: bool = True                # the score_mod captures this call's bindings
    score_mod: object = None
    # (values, versions of its float64 ones, score_mod) of the last call whose score_mod
    # captured its bindings: one tuple, replaced whole (see last)
    last_score: tuple | None = None
    warm: bool = False                       # the compiled entry has run once for this plan
    pinned: tuple = ()                       # compiled.free_strides of the plan's q, k, v
    # the compiled code of an earlier call of the plan (its first, where it was a layer of a
    # model step): what later calls with that call's score, block mask and options replay
    # (kernels.replay); whether it served a call since it was kept; whether to keep trying
    replay: Replay | None = None
    replay_served: bool = False
    replays: bool = True

    @property
    def mask_varies(self) -> bool:
        """Whether the block mask may differ between calls (it reads a binding or a table)."""
        return bool(self.mask_bindings or self.mask_tables)

    def seen(self, bindings: dict) -> tuple:
        """What :meth:`last_block_mask` compares: the mask's bindings with their versions, and
        its tables' versions."""
        return (tuple((bindings[name], version(bindings[name])) for name in self.mask_bindings),
                tuple(version(table) for table in self.mask_tables))

    def last_block_mask(self, bindings: dict) -> BlockMask | None:
        """The previous call's block mask when the mask's bindings are the very tensors of that
        call and they and its tables are unchanged in place since (same object, same version
        counter): the cache lookup (storage identity, hashing) is then skipped. ``None``
        otherwise."""
        last = self.last  # read once: another thread may replace it meanwhile
        if last is None:
            return None
        for name, (value, seen) in zip(self.mask_bindings, last[0]):
            given = bindings[name]
            if given is not value or seen is None or version(given) != seen:
                return None  # another tensor, an inference tensor, or changed in place
        for table, seen in zip(self.mask_tables, last[1]):
            if seen is None or version(table) != seen:
                return None
        return last[2]

    def block_mask_for(self, plan: Plan, bindings: dict, values, device) -> BlockMask:
        """The block mask of a call whose mask reads its bindings: the last call's for the very
        same tensors; else one listing every tile where the plan does (:func:`lists_every_tile`)
        and the exact mask's program has compiled (a capture after this eager call would
        otherwise compile it, which a capture cannot); else the exact one, from the cache or
        built. Inside a CUDA graph capture (or the warm-up before one) the exact mask is built,
        so that replays rebuild it from what the bindings hold then (a kept mask would be
        replayed as it was)."""
        captured = in_graph_memory(device)
        block_mask = None if captured else self.last_block_mask(bindings)
        if block_mask is None:
            seen = self.seen(bindings)
            values = values or plan.values(bindings)
            block_mask = self.masks.get(values, device, every_tile=self.every_tile)
            if not captured:
                self.last = (*seen, block_mask)
        return block_mask


# FlexAttention runs calls of fewer query rows than this with its decoding kernel (split-KV)
DECODE_ROWS = 128


def needs_block_mask(plan: Plan) -> bool:
    """Whether a plan whose mask reads no binding keeps a block mask: always but for a
    mask-free spec on CUDA, which runs faster without one, unless its few rows run on the
    decoding kernel (flexspec.workarounds: flex-decoding-one-block). The CPU kernel needs one
    (flexspec.workarounds: cpu-mask-free-block-mask)."""
    request = plan.request
    return (plan.spec.mask != ir.Const(True) or request.device_type != "cuda"
            or request.q_len < DECODE_ROWS)


# Kernel options of calls on FlexAttention's decoding kernel: three pipeline stages, where
# torch's default on Hopper is one (docs/performance.md, "FlexAttention's decoding kernel,
# tuned").
DECODING_OPTIONS: FlexKernelOptions = {"num_stages": 3}


def decodes(plan: Plan, parts: int = 1) -> bool:
    """Whether FlexAttention runs ``plan``'s calls on its decoding kernel (split-KV) with no
    backward pass: fewer than :data:`DECODE_ROWS` rows on CUDA, no gradients, a power-of-two
    number of query heads per key head, block masks with one head (or, without grouped heads,
    as many as q), and keys narrow enough (:func:`wide_indices`; a paged pool read in ``parts``
    groups of KV heads counts a group's): torch's rule (``flex_decoding._use_flex_decoding``),
    with the batch and head dimensions kept static (:func:`compiled.mark_batch_static`)."""
    request = plan.request
    group = request.heads // request.kv_heads
    mask_heads = plan.masks.heads == 1 or (not plan.gqa and plan.masks.heads == request.heads)
    return (request.device_type == "cuda" and request.q_len < DECODE_ROWS
            and not request.grads and group & (group - 1) == 0 and mask_heads
            and not wide_indices(request, parts))


# A decoding call whose keys and values hold at most this many bytes lists every tile of its
# block mask outside a CUDA graph capture: reading every key costs at most these bytes at the
# device's bandwidth, less than the host time of building the exact mask at every step
# (docs/performance.md, thirtieth session).
EVERY_TILE_BYTES = 256 * 1024**2


def lists_every_tile(request) -> bool:
    """Whether a decoding call whose mask reads its bindings runs with a block mask listing
    every tile (:meth:`masks.MaskCache.every_tile`) instead of its exact one, outside CUDA graph
    captures: where its keys and values are at most :data:`EVERY_TILE_BYTES`. Its bindings are
    new at almost every step of a decode (a position that moves), so the exact mask would be
    built each time; inside a capture its build runs on the device and is kept exact."""
    return every_tile_fits(request.batch * request.kv_heads * request.kv_len,
                           request.head_dim + request.v_head_dim, request.dtype.itemsize)


def every_tile_fits(positions: int, width: int, itemsize: int) -> bool:
    """Whether reading the keys and values of ``positions`` rows over all batch rows and heads
    (``width`` elements each, key and value together) costs at most :data:`EVERY_TILE_BYTES`:
    the rule of :func:`lists_every_tile`, which a paged read's every-page mask follows too
    (:func:`flexspec.runtime.flexpages.lists_every_page`)."""
    return positions * width * itemsize <= EVERY_TILE_BYTES


# Tensors of this many elements or more are indexed in int64 by inductor's kernels.
WIDE_INDEX_ELEMENTS = 2**31


def wide_indices(request, parts: int = 1) -> bool:
    """Whether the keys or values a call gives the kernel (a paged pool read in ``parts``
    groups of KV heads: a group's slice) hold so many elements that inductor indexes them in
    int64, where FlexAttention's decoding kernel does not compile (flexspec.workarounds:
    flex-decoding-wide-indices)."""
    return wide_keys(request.key_positions // parts, request.head_dim, request.v_head_dim)


def wide_keys(positions: int, head_dim: int, v_head_dim: int) -> bool:
    """:func:`wide_indices` for keys and values of ``positions`` rows over all batch rows and
    heads."""
    return positions * max(head_dim, v_head_dim) >= WIDE_INDEX_ELEMENTS


def wide_decode_chunks(q, k, v) -> list | None:
    """``(start, stop)`` of the runs of batch rows a decode call (fewer than
    :data:`DECODE_ROWS` rows, no gradients) runs as, one call each, where its keys are so wide
    that the decoding kernel does not compile for them (:func:`wide_indices`) and a run's are
    narrower (runs of equal length, the last one shorter where they do not divide the batch);
    None for any other call."""
    # cheap tests first: every call asks
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4 \
            or v.dim() != 4 or k.numel() * max(k.shape[3], v.shape[3]) < \
            WIDE_INDEX_ELEMENTS * k.shape[3]:
        return None
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[2] >= DECODE_ROWS \
            or q.shape[0] != k.shape[0] or q.shape[0] < 2:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    batch, width = q.shape[0], k.shape[1] * k.shape[2] * max(k.shape[3], v.shape[3])
    rows = (WIDE_INDEX_ELEMENTS - 1) // width  # the most rows whose keys are narrow
    if rows < 1:
        return None
    parts = -(-batch // rows)
    size = -(-batch // parts)
    return [(start, min(start + size, batch)) for start in range(0, batch, size)]


def varying_score(call: FlexCall, plan: Plan, values: dict):
    """The score_mod of a call whose score reads its bindings: the last call's when its values
    are the very same tensors (the closure reads them at launch, so changes in place count;
    a decoded token at a repeated offset finds its position tensors again) and its float64
    tables, which it reads as float32 copies, are unchanged in place since; else a new one."""
    last = call.last_score  # read once: another thread may replace it meanwhile
    if last is not None and last[0].keys() == values.keys() and all(
            values[key] is seen for key, seen in last[0].items()) and all(
            seen is not None and version(values[key]) == seen for key, seen in last[1].items()):
        return last[2]
    # the kernel reads float64 tables as float32 copies: a change in place makes a new one
    copied = {key: version(value) for key, value in values.items()
              if value.dtype == torch.float64}
    score_mod = call.kernel.score_mod(plan, values)
    if not in_graph_memory(plan.device):  # a graph's tensors: new contents at every replay
        call.last_score = (dict(values), copied, score_mod)
    return score_mod


def own_tensors(values: dict) -> dict:
    """``values`` with each tensor a view of its own, for a ``score_mod``: dynamo guards on
    which tensors the score_mod and the block mask's mask_mod share, and a block mask kept from
    an earlier call shares none with a score_mod made for a later one, so a first call whose
    two mods read the very same tensors compiled a graph that every later call failed (a
    recompile of a warm plan, which on a GPU also left FlexAttention's decoding kernel).
    With views of their own they never share one. A tensor that requires gradients (a
    learnable table in training) stays itself: it is the very same object at every call, so
    its sharing never changes, and its gradient is FlexAttention's to compute as it always
    did."""
    return {key: value if value.requires_grad else value.view(value.shape)
            for key, value in values.items()}


def warm_call(call: FlexCall, args: tuple):
    """A warm plan's call: the code dynamo compiled, replayed where the arguments agree with the
    call it was kept from (kernels.replay), else the compiled entry, whose code is then kept for
    the next call; unless the code kept last never served a call (arguments new at every call,
    such as block masks built from fresh bindings), after which the plan stops keeping any.
    A call in a CUDA graph's memory keeps nothing: the code it would keep holds its block mask
    and score, the graph's tensors."""
    replay = call.replay
    if replay is not None:
        out = replay.run(args)
        if out is not None:
            call.replay_served = True
            return out
    entry = call.kernel.entry
    if in_graph_memory(args[0].device):
        return call_compiled(entry, *args)
    if call.replays and (replay is None or call.replay_served):
        out, call.replay = call_kept(entry, *args)
        call.replay_served = False
        call.replays = call.replay is not None  # None: this torch has no replays
        return out
    if call.replays:  # the code kept last never served a call
        call.replay, call.replays = None, False
    return call_compiled(entry, *args)


class FlexAttentionBackend(Backend):
    """A backend that calls ``flex_attention`` compiled: subclasses give the kernel options,
    the rules and what a failed first compile means."""

    # its calls of few rows run on FlexAttention's decoding kernel (see decodes)
    decoding: bool = False

    def kernel_options(self, request) -> FlexKernelOptions | None:
        """The kernel options of a compiled FlexAttention call for ``request``."""
        return None

    def compile_failed(self, plan: Plan, err: Exception):
        """What the first call of ``plan`` does when torch.compile raised ``err``: raise."""
        raise err

    def prepare(self, plan: Plan, values: dict) -> Prepared:
        decoding = self.decoding and decodes(plan)
        kernel = kernel_parts(plan, values, self.kernel_options(plan.request), decoding, "call",
                              dialect=self.dialect)
        # the decoding kernel splits a row's tiles evenly among its splits only when none is
        # listed full (flexspec.workarounds: flex-decoding-full-blocks)
        masks = plan.masks.partial_only() if decoding else plan.masks
        call = FlexCall(kernel=kernel, masks=masks)
        slot_keys = {slot.key for slot in plan.slots}
        call.mask_bindings = tuple(slot.name for slot in plan.slots
                                   if slot.key in masks.reads)
        learnable = {tensor_key(t) for t in plan.spec.tensors() if t.origin == "learnable"}
        call.mask_tables = tuple(values[key] for key in masks.reads
                                 if key in learnable and key not in slot_keys)
        if not call.mask_varies and needs_block_mask(plan):
            call.block_mask = masks.get(values, plan.device)
        call.every_tile = decoding and call.mask_varies and lists_every_tile(plan.request)
        score_keys = plan.score_keys
        float64 = any(values[key].dtype == torch.float64 for key in score_keys)
        if not (score_keys & {slot.key for slot in plan.slots}) and not float64:
            call.score_mod = kernel.score_mod(plan, values)
            call.score_varies = False
        return Prepared(state=call, needs_values=call.score_varies)

    def warm(self, plan: Plan, values: dict) -> None:
        call: FlexCall = plan.state
        if call.mask_varies:
            try:
                call.masks.get(values, plan.device)
            except BindingError:
                # a mask too large to build: the plan this one stands in for needs none, and a
                # capture, which would need it, gets the same error then
                pass

    def launcher(self, plan: Plan, scale, bindings, values, step):
        call: FlexCall = plan.state
        if not call.warm:
            return None  # its first call compiles, and a failed compile hands it back
        block_mask = call.block_mask if not call.mask_varies else call.block_mask_for(
            plan, bindings, values, plan.device)
        score_mod = call.score_mod if not call.score_varies else varying_score(call, plan, values)
        kernel = call.kernel
        entry, options, lse, gqa, detach, pinned = (kernel.entry, kernel.options, kernel.lse,
                                                    plan.gqa, plan.detach, call.pinned)
        # the compiled code the later layers replay (kernels.replay): the plan's first call's,
        # where its score and block mask are this launch's, else this launch's first call's
        replay, resolved = call.replay, False

        def launch(q, k, v):
            nonlocal replay, resolved
            if detach and (q.requires_grad or k.requires_grad or v.requires_grad):
                q, k, v = q.detach(), k.detach(), v.detach()
            args = (q, k, v, score_mod, block_mask, None, gqa, options, lse, pinned)
            out = replay.run(args) if replay is not None else None
            if out is not None:
                call.replay_served = True
            elif resolved:
                out = call_compiled(entry, *args)
            else:
                (out, replay), resolved = call_kept(entry, *args), True
            return compiled.split_lse(out) if lse is not None else out
        return launch

    def run(self, plan: Plan, q, k, v, scale, bindings, values, step=None):
        call: FlexCall = plan.state
        block_mask = call.block_mask if not call.mask_varies else call.block_mask_for(
            plan, bindings, values, q.device)
        score_mod = call.score_mod if not call.score_varies else varying_score(call, plan, values)
        if plan.detach:
            q, k, v = q.detach(), k.detach(), v.detach()
        if not call.warm:  # the plan's key holds the strides: the same for all its calls
            call.pinned = compiled.free_strides(q, k, v)
        # a given scale is in the score_mod (see kernel_parts): the kernel keeps its default
        kernel = call.kernel
        args = (q, k, v, score_mod, block_mask, None, plan.gqa, kernel.options, kernel.lse,
                call.pinned)
        if call.warm:
            # a warm plan cannot recompile (see compiled.run_compiled): no watch needed
            out = warm_call(call, args)
        else:
            try:
                compiled.mark_lengths_dynamic(kernel.entry, *args[:5])
                if kernel.decoding:
                    compiled.mark_batch_static(q, k, v)
                sizes = plan.sizes
                # in a step, the code that runs this call is kept for the next layer, which
                # launches it (kernels.replay): found before the call where no compile is
                # needed, so that its guards are checked once
                stepping = step is not None and step is not NO_STEP
                found = Replay.of(kernel.entry, args) if stepping else None
                with timed(f"first call of '{plan.text}' on backend '{self.name}' at "
                           f"B={sizes['B']} H={sizes['H']} Q_LEN={sizes['Q_LEN']} "
                           f"KV_LEN={sizes['KV_LEN']}, which compiles its kernel where new"):
                    out = (found.function(*args) if found is not None
                           else compiled.run_compiled(kernel.entry, *args))
            except compiled.CompileLimitError:
                raise
            except Exception as err:  # noqa: BLE001 - inductor's errors have no stable type
                return self.compile_failed(plan, err)
            if stepping and not in_graph_memory(q.device):  # see warm_call
                call.replay = found or Replay.of(kernel.entry, args)
            call.warm = True
        return compiled.split_lse(out) if kernel.lse is not None else out
