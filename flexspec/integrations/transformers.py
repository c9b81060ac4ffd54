"""flexspec as an attention implementation of Hugging Face transformers.

:func:`register` adds an attention function and its mask function to transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` under one name; a model built or loaded with
``attn_implementation=name`` (or switched with ``model.set_attn_implementation(name)``) then runs
every attention layer through flexspec. What a layer asks for becomes part of its spec:

* the spec given to :func:`register` (``"causal"`` by default: a decoder);
* the 2-D ``attention_mask`` (left or right padding): ``& key_padding`` with the padding of the
  whole cache;
* the layer's ``sliding_window`` (transformers counts the query itself: a window of W sees W
  keys, ``sliding_window(W - 1)`` in flexspec), per layer, so models that mix full and sliding
  layers (Qwen2, Gemma-2) get a spec per kind of layer;
* the layer's ``softcap`` (Gemma-2's ``attn_logit_softcapping``): ``+ softcap(c)``;
* ``scaling``: the call's ``scale``;
* the KV cache: the queries stand at the cache's query offset (``q_offset``), keys at the
  cache's key offset (a sliding cache that dropped old keys shifts both, which is exact for
  masks and scores that read ``q - kv`` only);
* GQA: key and value heads as the model gives them;
* packed sequences: without an ``attention_mask`` and a cache (``use_cache=False``),
  ``position_ids`` that restart (``0 1 2 0 1``) mark documents, as transformers finds them:
  ``& doc`` with those ids (a model given ``doc_ids`` by name uses them instead);
* attention sinks (gpt-oss's ``s_aux``: one more logit per head, on no value), merged through
  the log-sum-exp (training needs a backend whose log-sum-exp has a gradient: the reference
  path's has; otherwise a clear error);
* bindings passed to the model by name (``model(ids, doc_ids=...)``) reach every layer.

Inside ``torch.compile(model.forward)`` (with or without ``mode="reduce-overhead"``) the mask
function is traced with the model and an inference call of a layer is one operator
(``flexspec::transformers_attention``) in the model's graph, so a decode step is one graph
with no break (under ``mode="reduce-overhead"``, the operator is captured in the step's CUDA
graph; a call whose offsets are ints that move every step, which ``generate()`` did not
prepare, runs between the replays instead). A call that needs a gradient, the spec's own bindings
or packed documents runs outside the graph instead (a graph break per layer).

What flexspec cannot do raises :class:`flexspec.SpecError` with the reason: attention dropout in
training, attention weights (``output_attentions``).

transformers is an optional dependency: ``pip install 'flexspec[transformers]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field

import torch

import flexspec
from flexspec.errors import SpecError
from flexspec.lang.api import with_mask, with_score
from flexspec.runtime.capture import outside_graph_pool


@dataclass(frozen=True)
class HandedMask:
    """What the mask function hands to the attention function: where the queries and keys stand,
    and which keys are padding (``valid``: bool ``[B, KV_LEN]``, ``None`` when none is). Every
    layer of a forward (of one kind: full or sliding) gets the same one, so it keeps the
    forward's :class:`flexspec.Step`: positions, padding and packed documents are derived once,
    not once per layer."""

    q_offset: object        # int, or an int tensor (a static cache)
    kv_offset: int
    valid: torch.Tensor | None
    given_mask: bool = False  # the model got a 2-D attention_mask (then packing is not looked for)
    # q_offset - kv_offset as a 0-d device tensor, made where the placement was prepared outside
    # any graph (generate() prepares a static cache's step before the compiled forward): inside
    # the graph the operator reads it instead of the cache's int counter (see _Layers.attention)
    prepared_offset: torch.Tensor | None = field(default=None, compare=False)
    _steps: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    # generate() prepares the mask of a step before the model's forward, which prepares it
    # again from what generate() made: transformers reads `ndim` to tell a 2-D mask it must
    # move from one it has prepared (a placement is never 2-D)
    ndim = 4

    def step(self, kwargs: dict, batch: int):
        """The forward's step: the queries at ``q_offset - kv_offset`` (a sliding cache that
        dropped old keys shifts both), the padding as ``valid``, and documents packed by
        restarting ``position_ids`` as ``doc_ids``, found as transformers finds them: without a
        mask and without a cache (then both give the same logits), unless the model was given
        ``doc_ids`` by name."""
        positions = kwargs.get("position_ids")
        key = (id(positions), bool(kwargs.get("use_cache")), "doc_ids" in kwargs, batch)
        found = self._steps.get(key)
        if found is None:
            q_offset, bindings = self.placed()
            if self.may_pack(kwargs) and "doc_ids" not in kwargs:
                packed = packed_documents(positions, batch)
                if packed is not None:
                    bindings["doc_ids"] = packed
            found = self._steps[key] = flexspec.Step(q_offset=q_offset, **bindings)
        return found

    def placed(self) -> tuple:
        """``(q_offset, bindings)`` of a call at this placement: the queries at ``q_offset -
        kv_offset`` (a sliding cache that dropped old keys shifts both), the padding as
        ``valid``."""
        q_offset = self.q_offset - self.kv_offset if self.kv_offset else self.q_offset
        return q_offset, ({} if self.valid is None else {"valid": self.valid})

    def may_pack(self, kwargs: dict) -> bool:
        """Whether the forward's ``position_ids`` may mark packed documents, as transformers
        looks for them: without a mask, without a cache, at the start of the sequence."""
        return (not self.given_mask and kwargs.get("position_ids") is not None
                and not kwargs.get("use_cache") and isinstance(self.q_offset, int)
                and self.q_offset == 0)


def register(name: str = "flexspec", spec: str = "causal", library=None,
             **compile_options) -> str:
    """Register flexspec with transformers under ``name`` (see the module docstring) and return
    the name. ``spec`` is the model's own pattern, ``library`` an ``.attn`` library it may use;
    ``compile_options`` go to :func:`flexspec.compile` (``backend``, ``block_size``...)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise SpecError("flexspec.integrations.transformers needs transformers: "
                        "pip install 'flexspec[transformers]'") from err
    if not isinstance(name, str) or not name:
        raise SpecError(f"the attention implementation's name must be a non-empty str, got "
                        f"{name!r}")
    base = flexspec.parse(spec, library=library) if isinstance(spec, str) else spec
    layers = _Layers(base, library, compile_options, name)
    _REGISTERED[name] = layers
    AttentionInterface.register(name, layers.attention)
    AttentionMaskInterface.register(name, placement)
    return name


def _inside_graph() -> bool:
    """Whether torch.compile is tracing this call (the model's forward, compiled)."""
    return torch.compiler.is_compiling()


def placement(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
              mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs
              ) -> HandedMask:
    """transformers' mask function for flexspec: instead of a mask, where the call's queries and
    keys stand and which keys are padding. The mask itself comes from the spec. A placement
    given as the attention mask (generate() prepared it for this step) is kept, at this call's
    offsets. Inside torch.compile it is traced with the model (no graph break): it reads nothing
    on the host there."""
    if isinstance(attention_mask, HandedMask):
        if attention_mask.valid is not None and attention_mask.valid.shape[-1] != kv_length:
            raise SpecError(f"the prepared placement covers {attention_mask.valid.shape[-1]} "
                            f"keys, this call {kv_length}: please report it")
        return dataclasses.replace(attention_mask, q_offset=q_offset, kv_offset=kv_offset)
    if attention_mask is None:
        return HandedMask(q_offset, kv_offset, None, False)
    if attention_mask.dim() != 2:
        raise SpecError("flexspec takes the 2-D attention_mask (1 for a token, 0 for "
                        f"padding), got one of shape {list(attention_mask.shape)}")
    traced, prepared = _inside_graph(), None
    if not traced and isinstance(q_offset, int):
        # a fill, not a copy from the host: nothing waits for it
        prepared = torch.full((), q_offset - kv_offset, dtype=torch.long,
                              device=attention_mask.device)
    mask = attention_mask.bool()
    # no padding: a host read, as transformers makes one too (inside a graph, which must not
    # read, the padding stays, all valid)
    if not traced and bool(mask.all()):
        return HandedMask(q_offset, kv_offset, None, True, prepared)
    missing = kv_length + kv_offset - mask.shape[-1]
    if missing > 0:  # a static cache longer than the tokens seen: its tail is empty
        mask = torch.nn.functional.pad(mask, (0, missing))
    return HandedMask(q_offset, kv_offset, mask[:, kv_offset:kv_offset + kv_length], True,
                     prepared)


def packed_documents(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """Document ids of sequences packed in one row, found as transformers finds them: a new
    document starts wherever the position does not follow the previous one (``0 1 2 0 1`` is
    two documents). ``None`` when every row holds one sequence."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    position_ids = position_ids.expand(batch, -1)
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    documents = (position_ids - previous != 1).cumsum(-1)
    return documents if bool((documents[:, -1] > 0).any()) else None


class _Layers:
    """The compiled specs of one registration, one per kind of layer (window, softcap,
    padding), and the attention function transformers calls."""

    def __init__(self, base, library, options: dict, name: str | None = None):
        self.base, self.library, self.options, self.name = base, library, options, name
        self._compiled: dict = {}
        self._lock = threading.Lock()

    def spec_for(self, sliding_window, softcap, padded: bool, packed: bool = False):
        """The spec of a kind of layer call: the registered one with the layer's masks and
        softcap joined to it."""
        masks = ["doc"] if packed else []
        if sliding_window is not None:
            if int(sliding_window) < 1:
                raise SpecError(f"sliding_window must be at least 1, got {sliding_window}")
            masks.append(f"sliding_window({int(sliding_window) - 1})")
        if padded:
            masks.append("key_padding")
        spec = self.base
        # the joined masks and softcap are transformers' own, the registry's patterns: parsed
        # without the library, whose patterns of the same names would change them (the library
        # still resolves the registered spec's own names, which with_mask checks)
        if masks:
            spec = with_mask(spec, flexspec.parse(" & ".join(masks)), library=self.library)
        if softcap:
            spec = with_score(spec, flexspec.parse(f"softcap({float(softcap)!r})"),
                              library=self.library)
        return spec

    def attention_for(self, sliding_window, softcap, padded: bool, packed: bool):
        """The compiled spec of a kind of layer call, made on its first call (every later call
        of every layer finds it without parsing anything)."""
        kind = (sliding_window, softcap, padded, packed)
        with self._lock:
            attn = self._compiled.get(kind)
            if attn is None:
                attn = self._compiled[kind] = flexspec.compile(self.spec_for(*kind),
                                                               **self.options)
        return attn

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  sliding_window=None, softcap=None, s_aux=None, **kwargs):
        """transformers' attention function: ``[B, S, H, D]`` out of ``[B, H, S, D]`` q, k, v."""
        if dropout:
            raise SpecError("flexspec has no attention dropout: set the config's "
                            "attention_dropout to 0.0 (or run the model in eval mode)")
        if kwargs.get("output_attentions"):
            raise SpecError("flexspec does not return attention weights (output_attentions): "
                            "use attn_implementation='eager' for them")
        if attention_mask is not None and not isinstance(attention_mask, HandedMask):
            raise SpecError("the attention mask did not come from flexspec's mask function: "
                            "register() both with transformers (it does) and build the model "
                            "with attn_implementation set to the registered name")
        if _inside_graph() and self._operator_runs(
                attention_mask, kwargs, query, key, value, s_aux):
            where = attention_mask
            tensor_offset, int_offset, kv_offset = None, where.q_offset, where.kv_offset
            if isinstance(where.q_offset, torch.Tensor):
                tensor_offset, int_offset = where.q_offset, 0
            elif where.prepared_offset is not None:
                # the same offsets (generate() prepared them for this step), as a tensor: the
                # graph takes no int of the cache's counter, which moves every step
                tensor_offset, int_offset, kv_offset = where.prepared_offset, 0, 0
            # CUDA graph trees record a graph again for every value of an int it takes, and an
            # int offset other than 0 is a cache's counter (a sliding cache's: it moves every
            # step; dynamo shows it as an int, so only its value tells): such a call runs
            # between replays
            moving = int_offset != 0 or kv_offset != 0
            operator = (torch.ops.flexspec.transformers_attention_between_graphs if moving
                        else torch.ops.flexspec.transformers_attention)
            return operator(
                self.name, -1 if sliding_window is None else int(sliding_window),
                float(softcap or 0.0), query, key, value, scaling,
                tensor_offset, int_offset, kv_offset, where.valid, s_aux), None
        return self.eager_attention(query, key, value, attention_mask, scaling, sliding_window,
                                    softcap, s_aux, kwargs)

    def _operator_runs(self, where, kwargs, query, key, value, s_aux) -> bool:
        """Whether a call inside torch.compile runs as the operator: an inference call (the
        operator has no gradient) that needs nothing a forward finds or is given by name
        (packed documents, the spec's own bindings); every other call breaks the graph."""
        if not isinstance(where, HandedMask) or self.name is None:
            return False
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (query, key, value, s_aux)):
            return False
        if any(name in kwargs for name in self.base.bindings) or "doc_ids" in kwargs:
            return False
        return not where.may_pack(kwargs)

    # not traced: dynamo would guard on what a step keeps (by id) and recompile every decode
    # step; a call inside torch.compile that is not the operator breaks the graph around it
    @torch.compiler.disable
    def eager_attention(self, query, key, value, attention_mask, scaling, sliding_window,
                        softcap, s_aux, kwargs: dict, shared: bool = True) -> tuple:
        """The attention of one layer call, outside any graph: the forward's step is shared
        with its other layers (see HandedMask.step), unless ``shared`` is False (the operator's
        call, whose placement is its own)."""
        where = attention_mask or HandedMask(0, 0, None)
        if shared:
            step = where.step(kwargs, query.shape[0])
            placed, step_bindings = {"step": step}, step.bindings
        else:
            # the operator's placement serves this call alone: a step would keep for nothing
            q_offset, step_bindings = where.placed()
            placed = {"q_offset": q_offset, **step_bindings}
        attn = self.attention_for(sliding_window, softcap, where.valid is not None,
                                  "doc_ids" in step_bindings and "doc_ids" not in kwargs)
        bindings = {name: kwargs[name] for name in attn.bindings
                    if name in kwargs and name not in step_bindings}
        if s_aux is None:
            out = attn(query, key, value, scale=scaling, **placed, **bindings)
        else:
            # a sink is one more logit per head in every row's softmax, on no value: it scales
            # the row's output by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)
            out, lse = attn(query, key, value, scale=scaling, return_lse=True, **placed,
                            **bindings)
            # the log-sum-exp depends on q and k alone: a call whose values alone learn (LoRA
            # on the value projection) needs no gradient of it
            if lse.grad_fn is None and torch.is_grad_enabled() and any(
                    t.requires_grad for t in (query, key)):
                raise SpecError("attention sinks (s_aux) run through the log-sum-exp, which "
                                "this backend returns without a gradient: use sinks for "
                                "inference (torch.no_grad()), or train where the backend "
                                "differentiates it (the reference path does)")
            sink = s_aux.reshape(1, -1, 1).to(lse.dtype)
            out = out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
        return out.transpose(1, 2).contiguous(), None


# ---- the attention call inside torch.compile ---------------------------------------------------

_REGISTERED: dict[str, _Layers] = {}  # registered name -> its layers (the operator finds them)


# Inside torch.compile(model.forward), an inference call is one opaque operator in the model's
# graph. A graph break around each layer's call instead compiles each layer's frame apart
# (transformers' layer index is a static int: past dynamo's recompile limit for deep models,
# after which the forward runs eagerly), and under mode="reduce-overhead" its resumed frames
# read outputs that a later replay had overwritten. The operator runs the call eagerly, on
# flexspec's own compiled kernels; it has no gradient, so a call that needs one breaks the
# graph (see _Layers._operator_runs). Each call has its own placement, so it shares no step.
# Under mode="reduce-overhead" it is captured with the rest of the step: CUDA graph trees refuse
# tensors of their memory pool that outlive the recording and are not outputs, so the warm-up
# run before the recording makes what the calls keep (plans, block masks) outside that pool
# (flexspec.workarounds: cudagraph-trees-warm-up-pool). A call whose offsets move every step
# takes the variant that runs between the replays (see _Layers.attention).
def _attend(name: str, sliding_window: int, softcap: float, query: torch.Tensor,
            key: torch.Tensor, value: torch.Tensor, scaling: float | None,
            tensor_offset: torch.Tensor | None, q_offset: int, kv_offset: int,
            valid: torch.Tensor | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """The operators' call: the registered layers' attention for these arguments."""
    layers = _REGISTERED[name]
    with outside_graph_pool(query.device), _one_dispatch_state():
        tensor_offset, valid, s_aux = (_ordinary(t) for t in (tensor_offset, valid, s_aux))
        where = HandedMask(q_offset if tensor_offset is None else tensor_offset, kv_offset,
                          valid, True)
        out = layers.eager_attention(query, key, value, where, scaling,
                                     None if sliding_window < 0 else sliding_window,
                                     softcap or None, s_aux, {}, shared=False)[0]
    return _ordinary(out)


# written out rather than read off _attend's annotations, which a wrapped _attend (mutation
# testing's) does not carry
_SCHEMA = ("(str name, SymInt sliding_window, float softcap, Tensor query, Tensor key, "
           "Tensor value, float? scaling, Tensor? tensor_offset, SymInt q_offset, "
           "SymInt kv_offset, Tensor? valid, Tensor? s_aux) -> Tensor")
_attention_operator = torch.library.custom_op(
    "flexspec::transformers_attention", _attend, mutates_args=(), schema=_SCHEMA)
# the same call, run between the replays of CUDA graph trees instead of captured
_uncaptured_operator = torch.library.custom_op(
    "flexspec::transformers_attention_between_graphs", _attend, mutates_args=(),
    tags=(torch._C.Tag.cudagraph_unsafe,), schema=_SCHEMA)


# CUDA graph trees run a graph's warm-up and its recording in different dispatch states (one
# under inference mode, one below the operator's autograd kernel), and the graph's own tensors
# are inference tensors in one and ordinary ones in the other. Dynamo guards on the dispatch
# keys a tensor shows, so a kernel compiled in the warm-up would compile again in the
# recording, where nothing may compile. The operator therefore always runs in one state
# (flexspec.workarounds: cudagraph-trees-dispatch-state), in which q, k and v show the same
# keys whatever their kind, and copies its small tensors (offsets, padding, sinks), which
# flexspec also reads outside inference mode, to ordinary ones.
_IN_PLACE_OR_VIEW = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def _one_dispatch_state():
    """Inference mode with the ADInplaceOrView key excluded: a tensor's dispatch keys are then
    its backend's alone, for ordinary and inference tensors alike."""
    with torch.inference_mode(), torch._C._ExcludeDispatchKeyGuard(_IN_PLACE_OR_VIEW):
        yield


def _ordinary(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor``, or a copy of it that is not an inference tensor where it is one."""
    if tensor is None or not tensor.is_inference():
        return tensor
    with torch.inference_mode(False):
        return tensor.clone()


def _attended_shape(name, sliding_window, softcap, query, key, value, scaling, tensor_offset,
                    q_offset, kv_offset, valid, s_aux):
    batch, _, length, _ = query.shape
    return query.new_empty(batch, length, query.shape[1], value.shape[-1])


_attention_operator.register_fake(_attended_shape)
_uncaptured_operator.register_fake(_attended_shape)
