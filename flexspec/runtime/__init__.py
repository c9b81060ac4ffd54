"""Running specs on real tensors: backends and their choice, plans, block-mask caches, the
:class:`Attention` object ``flexspec.compile`` returns and the ``SpecAttention`` module."""
