"""Running specs on real tensors: the backends and their choice (:mod:`.backends`), a call's
inputs (:mod:`.inputs`), block masks (:mod:`.masks`), plans (:mod:`.plan`), compiled entry points
(:mod:`.compiled`), the :class:`Attention` facade ``flexspec.compile`` returns
(:mod:`.attention`), its ``explain`` report (:mod:`.explanation`), the ``SpecAttention``
module (:mod:`.module`) and ``MultiheadAttention`` with projections (:mod:`.multihead`)."""

from flexspec.runtime.attention import Attention
from flexspec.runtime.backends import BackendError
from flexspec.runtime.compiled import CompileLimitError
from flexspec.runtime.module import SpecAttention
from flexspec.runtime.multihead import MultiheadAttention

__all__ = ["Attention", "BackendError", "CompileLimitError", "MultiheadAttention", "SpecAttention"]
