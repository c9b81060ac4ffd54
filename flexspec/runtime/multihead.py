"""``MultiheadAttention``: input and output projections around a spec, with
``torch.nn.MultiheadAttention``'s conventions where they fit.

Same as torch: ``embed_dim``, ``num_heads``, ``bias``, ``batch_first`` (default ``False``: inputs
are ``(L, N, E)``), ``key_padding_mask`` (``True`` marks padding), ``forward(query, key, value)``
returning ``(output, weights)``. Different: the pattern is a spec (``"causal"`` by default, not
an ``attn_mask``); ``num_kv_heads`` gives grouped-query attention; attention weights are never
computed (``need_weights`` defaults to ``False`` and ``True`` is an error), so ``weights`` is
``None``; ``q_offset`` places the queries (decoding with a cache the caller keeps); the spec's
learnable tables (``rel_bias``...) are parameters of the module; there is no dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from flexspec.errors import BindingError, SpecError
from flexspec.lang.api import parse, with_mask
from flexspec.runtime.attention import Attention
from flexspec.runtime.module import SpecAttention


class MultiheadAttention(nn.Module):
    """Projections of ``query``, ``key`` and ``value`` into heads, the spec's attention over them
    (a :class:`SpecAttention`, so its learnable tables train with the projections), and the
    output projection. See the module docstring for the conventions."""

    def __init__(self, embed_dim: int, num_heads: int, spec="causal", *,
                 num_kv_heads: int | None = None, bias: bool = True, batch_first: bool = False,
                 library=None, device=None, dtype=None, **compile_options):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads or num_heads % num_kv_heads:
            raise SpecError(f"embed_dim ({embed_dim}) must be a multiple of num_heads "
                            f"({num_heads}), and num_heads of num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        factory = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        # two compiled specs sharing one set of tables: with key padding, and without (a call
        # without a key_padding_mask then reads no padding tensor, which keeps it on the
        # fastest kernels, FLASH included)
        base = parse(spec, library=library)
        self.attention = SpecAttention(with_mask(base, "key_padding", library=library),
                                       num_heads=num_heads, library=library, device=device,
                                       dtype=dtype or torch.float32, **compile_options)
        self._unpadded = Attention(base, **compile_options)

    def forward(self, query, key=None, value=None, *, key_padding_mask=None,
                need_weights: bool = False, q_offset=None, **bindings):
        """``(output, None)``; ``key`` defaults to ``query`` (self-attention) and ``value`` to
        ``key``, as in ``torch.nn.MultiheadAttention``."""
        if need_weights:
            raise SpecError("flexspec does not compute attention weights: call with "
                            "need_weights=False (the default here)")
        key = query if key is None else key
        value = key if value is None else value
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 \
                    or tensor.shape[-1] != self.embed_dim:
                shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
                layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
                raise BindingError(f"{name} must be {layout} with E = {self.embed_dim}, got "
                                   f"{shape}")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[0] != batch or value.shape[:2] != key.shape[:2]:
            raise BindingError(f"query, key and value must share the batch size, and key and "
                               f"value the length: got query {list(query.shape)}, key "
                               f"{list(key.shape)}, value {list(value.shape)} (as (N, L, E))")
        q = self.q_proj(query).view(batch, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).view(batch, kv_len, self.num_kv_heads, self.head_dim) \
            .transpose(1, 2)
        if key_padding_mask is None:
            out = self._unpadded.call(q, k, v, bindings=bindings,
                                      learnables=self.attention.learnables(), q_offset=q_offset)
        else:
            out = self.attention(q, k, v, q_offset=q_offset,
                                 valid=self._valid(key_padding_mask, batch, kv_len), **bindings)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))
        return (out if self.batch_first else out.transpose(0, 1)), None

    @staticmethod
    def _valid(key_padding_mask, batch: int, kv_len: int) -> torch.Tensor:
        if not isinstance(key_padding_mask, torch.Tensor) \
                or tuple(key_padding_mask.shape) != (batch, kv_len):
            shape = list(key_padding_mask.shape) if isinstance(key_padding_mask, torch.Tensor) \
                else key_padding_mask
            raise BindingError(f"key_padding_mask must be ({batch}, {kv_len}) (True marks "
                               f"padding), got {shape}")
        if key_padding_mask.dtype != torch.bool:
            raise BindingError("key_padding_mask must be a bool tensor (True marks padding), got "
                               f"{key_padding_mask.dtype}")
        return ~key_padding_mask

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, batch_first={self.batch_first}")
