"""Running specs on real tensors.

Bottom to top: a call's inputs (:mod:`.checks` of q, k, v and sizes; :mod:`.bindings`, the
tensors a spec reads; :mod:`.lookups`, their index checks; :mod:`.identity` and
:mod:`.capture`, what caches see), the contract between the runtime and its backends
(:mod:`.contract`), ``auto``'s order (:mod:`.order`), what both FA4 paths need (:mod:`.fa4`),
the FlexAttention call two backends make (:mod:`.flexattention`), compiled entry points
(:mod:`.compiled`), the backends and their choice (:mod:`.backends`), block masks
(:mod:`.masks`), query positions (:mod:`.positions`), plans (:mod:`.plan`), the call path
(:mod:`.calls`), ``explain``'s report (:mod:`.explanation`), the :class:`Attention` facade
``flexspec.compile`` returns (:mod:`.attention`), the ``SpecAttention`` module (:mod:`.module`),
``MultiheadAttention`` with projections (:mod:`.multihead`); between the facade and the call
path, serving (:mod:`.serving`: paged KV caches and their reads, mixed and jagged batches), and
beside the FlexAttention call, its read of a paged pool (:mod:`.flexpages`)."""

from flexspec.runtime.attention import Attention
from flexspec.runtime.contract import BackendError
from flexspec.runtime.compiled import CompileLimitError
from flexspec.runtime.module import SpecAttention
from flexspec.runtime.multihead import KVCache, MultiheadAttention
from flexspec.runtime.serving import PagedKVCache
from flexspec.runtime.step import Step

__all__ = ["Attention", "BackendError", "CompileLimitError", "KVCache", "MultiheadAttention",
           "PagedKVCache", "SpecAttention", "Step"]
