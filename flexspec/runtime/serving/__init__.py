"""Serving: many sequences at once, between the ``Attention`` facade and the engine (the call path
of :mod:`flexspec.runtime.calls`), which it calls and never the facade.

* :mod:`.cache`: :class:`PagedKVCache`, the pool of pages, its page tables and the pages taken
  and given back (an allocator: reading it is not its job);
* :mod:`.reads`: reads of a paged cache (:class:`PagedRead`, made once per model step and run
  by every layer; in place where a backend reads pages, else gathered), and ``explain`` and
  ``tune`` of them;
* :mod:`.mixed`: mixed batches of prefill chunks and decoded tokens, each count of new tokens
  read as a part of its own;
* :mod:`.jagged`: jagged batches (nested tensors), laid end to end and run as one call.
"""

from flexspec.runtime.serving.cache import PagedKVCache
from flexspec.runtime.serving.mixed import MixedRead
from flexspec.runtime.serving.reads import PagedRead

__all__ = ["MixedRead", "PagedKVCache", "PagedRead"]
