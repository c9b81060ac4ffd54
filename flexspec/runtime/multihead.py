"""``MultiheadAttention``: input and output projections around a spec, with
``torch.nn.MultiheadAttention``'s conventions where they fit, and :class:`KVCache`, the keys and
values a decoding layer keeps between steps.

Same as torch: ``embed_dim``, ``num_heads``, ``bias``, ``batch_first`` (default ``False``: inputs
are ``(L, N, E)``), ``kdim`` and ``vdim``, ``key_padding_mask`` (``True`` marks padding),
``forward(query, key, value)`` returning ``(output, weights)``, ``key`` defaulting to ``query``
and ``value`` to ``key``. Different: the pattern is a spec (``"causal"`` by default; torch's
third argument, ``dropout``, is flexspec's ``spec``), not an ``attn_mask``; ``is_causal=True``
is accepted where the spec is causal; ``num_kv_heads`` gives grouped-query attention; attention
weights are never computed (``need_weights`` defaults to ``False`` and ``True`` is an error), so
``weights`` is ``None``; ``q_offset`` places the queries, and a :class:`KVCache` passed as
``cache`` keeps the projected keys and values of earlier calls, so that a decoding step projects
only its new tokens; the spec's learnable tables (``rel_bias``...) are parameters of the module;
there is no dropout (``dropout`` must be 0), and neither ``add_bias_kv`` nor ``add_zero_attn``.
Every difference is a :class:`~flexspec.SpecError` that says what to do instead.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from flexspec.errors import BindingError, SpecError, SpecTypeError
from flexspec.ir.forms import is_causal_mask
from flexspec.lang.api import parse, with_mask
from flexspec.runtime.attention import Attention
from flexspec.runtime.module import SpecAttention


class KVCache:
    """The projected keys and values a :class:`MultiheadAttention` has seen, ``(N, Hkv, L, D)``
    each, appended by every call that is given it (``layer(x, cache=cache)``): a decoding step
    projects only its new tokens, and its queries stand after the cached ones."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """How many positions the cache holds."""
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """The cache's keys and values with ``k`` and ``v`` after them (kept)."""
        self.k, self.v = self.joined(k, v)
        return self.k, self.v

    def joined(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """The cache's keys and values with ``k`` and ``v`` after them, not kept (a layer keeps
        them once its call has run: a refused call leaves the cache as it was)."""
        if self.k is None:
            return k, v
        if self.k.shape[:2] != k.shape[:2] or self.k.shape[3] != k.shape[3]:
            raise BindingError(f"this cache holds keys of shape {list(self.k.shape)} (N, Hkv, L, "
                               f"D); the call's keys are {list(k.shape)}: use one cache per "
                               "layer and batch")
        if (self.k.dtype, self.k.device) != (k.dtype, k.device):
            raise BindingError(f"this cache holds {self.k.dtype} keys on {self.k.device}; the "
                               f"call's are {k.dtype} on {k.device} (under autocast, the "
                               "projections' dtype changes with it): call the layer in one "
                               "dtype, or use a cache per dtype")
        return torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)


class MultiheadAttention(nn.Module):
    """Projections of ``query``, ``key`` and ``value`` into heads, the spec's attention over them
    (a :class:`SpecAttention`, so its learnable tables train with the projections), and the
    output projection. See the module docstring for the conventions."""

    def __init__(self, embed_dim: int, num_heads: int, spec="causal", *,
                 num_kv_heads: int | None = None, bias: bool = True, batch_first: bool = False,
                 kdim: int | None = None, vdim: int | None = None, dropout: float = 0.0,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, library=None,
                 device=None, dtype=None, backend: str = "auto", block_size=128,
                 block_masks: str = "exact"):
        super().__init__()
        if isinstance(spec, numbers.Real) and not isinstance(spec, bool):
            raise SpecTypeError(
                f"the third argument of flexspec.MultiheadAttention is the spec (default "
                f"'causal'), not dropout as in torch.nn.MultiheadAttention (got {spec!r}): pass "
                "the pattern as text, e.g. MultiheadAttention(512, 8, 'causal & window(128)'); "
                "flexspec has no attention dropout")
        if dropout:
            raise SpecError(f"flexspec has no attention dropout (dropout={dropout!r}): use "
                            "dropout=0.0, and an nn.Dropout on the layer's output if the model "
                            "needs one")
        if add_bias_kv or add_zero_attn:
            raise SpecError("flexspec.MultiheadAttention has no add_bias_kv or add_zero_attn: a "
                            "key every query sees is a spec's mask (e.g. 'causal | sink(1)')")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kdim, vdim = embed_dim if kdim is None else kdim, embed_dim if vdim is None else vdim
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("kdim", kdim), ("vdim", vdim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads or num_heads % num_kv_heads:
            raise SpecError(f"embed_dim ({embed_dim}) must be a multiple of num_heads "
                            f"({num_heads}), and num_heads of num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.kdim, self.vdim = kdim, vdim
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        factory = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        # two compiled specs sharing one set of tables: with key padding, and without (a call
        # without a key_padding_mask then reads no padding tensor, which keeps it on the
        # fastest kernels, FLASH included)
        options = {"backend": backend, "block_size": block_size, "block_masks": block_masks}
        base = parse(spec, library=library)
        self.attention = SpecAttention(with_mask(base, "key_padding", library=library),
                                       num_heads=num_heads, library=library, device=device,
                                       dtype=dtype or torch.float32, **options)
        self._unpadded = Attention(base, **options)

    def forward(self, query, key=None, value=None, *, key_padding_mask=None,
                need_weights: bool = False, attn_mask=None, is_causal: bool = False,
                q_offset=None, cache: KVCache | None = None, **bindings):
        """``(output, None)``; ``key`` defaults to ``query`` (self-attention) and ``value`` to
        ``key``, as in ``torch.nn.MultiheadAttention``. With ``cache``, the new keys and values
        join the cached ones and the queries stand after them (unless ``q_offset`` says
        otherwise); a ``key_padding_mask`` then covers every cached position too."""
        self._refuse_torch_only(need_weights, attn_mask, is_causal)
        key = query if key is None else key
        value = key if value is None else value
        for name, tensor, dim in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                  ("value", value, self.vdim)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[-1] != dim:
                shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
                layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
                raise BindingError(f"{name} must be {layout} with E = {dim}, got {shape}")
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
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise SpecTypeError(f"cache must be a flexspec.KVCache, got "
                                    f"{type(cache).__name__}")
            seen = cache.length
            k, v = cache.joined(k, v)
            q_offset = seen if q_offset is None else q_offset
        if key_padding_mask is None:
            out = self._unpadded._call(q, k, v, bindings=bindings,
                                      learnables=self.attention.learnables(), q_offset=q_offset)
        else:
            out = self.attention(q, k, v, q_offset=q_offset,
                                 valid=self._valid(key_padding_mask, batch, k.shape[2]),
                                 **bindings)
        if cache is not None:  # the call ran: its keys and values are kept
            cache.k, cache.v = k, v
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _refuse_torch_only(self, need_weights, attn_mask, is_causal) -> None:
        """torch's arguments this layer takes another way, each refused with that way."""
        if need_weights:
            raise SpecError("flexspec does not compute attention weights: call with "
                            "need_weights=False (the default here)")
        if attn_mask is not None:
            raise SpecError("flexspec.MultiheadAttention takes its pattern as a spec, not an "
                            "attn_mask: build the layer with it, e.g. MultiheadAttention(E, H, "
                            "'causal & window(128)'), or give a mask that changes per call as "
                            "a binding of a spec that reads one (docs/howto.md, bindings)")
        if is_causal and not is_causal_mask(self._unpadded.ir):
            raise SpecError(f"is_causal=True, but this layer's spec is "
                            f"'{self._unpadded.spec}', which is not causal: the spec alone says "
                            "which keys a query sees")

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
