"""``SpecAttention``: an ``nn.Module`` that owns a spec's learnable tensors as parameters and
runs the spec's :class:`~flexspec.runtime.attention.Attention` with them."""

from __future__ import annotations

import torch
from torch import nn

from flexspec import ir
from flexspec.errors import BindingError, SpecError
from flexspec.ir import tensor_key
from flexspec.kernels.tensors import init_learnable
from flexspec.lang.api import parse
from flexspec.runtime.attention import Attention


class SpecAttention(nn.Module):
    """An ``nn.Module`` that owns a spec's learnable tensors (``rel_bias``, ``t5_bias``...) as
    ``nn.Parameter``s. ``num_heads`` fixes the ``H`` their shapes use."""

    def __init__(self, spec, *, num_heads: int, library=None, backend: str = "auto",
                 block_size=128, block_masks: str = "exact", device=None, dtype=torch.float32):
        super().__init__()
        self.attention = Attention(parse(spec, library=library), backend=backend,
                                   block_size=block_size, block_masks=block_masks)
        self.num_heads = num_heads
        self.tables = nn.ParameterDict()
        self._keys: dict[str, str] = {}
        for tensor in self.attention.ir.tensors():
            if tensor.origin != "learnable":
                continue
            if ir.free_vars(tensor) - {"H"}:
                raise SpecError(f"learnable tensor '{tensor.name}' has a shape that depends on "
                                f"{sorted(ir.free_vars(tensor) - {'H'})}; only H is known when "
                                "the module is built")
            sizes = {"H": num_heads, "B": 1, "Q_LEN": 1, "KV_LEN": 1}
            value = init_learnable(tensor, sizes, device or "cpu").to(dtype)
            self.tables[tensor.name] = nn.Parameter(value)
            self._keys[tensor_key(tensor)] = tensor.name

    def forward(self, q, k, v, *, scale=None, q_offset=None, kv_lengths=None,
                return_lse: bool = False, step=None, **bindings):
        """Attention as :meth:`flexspec.runtime.attention.Attention.__call__` computes it, with
        this module's tables."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != self.num_heads:
            found = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else "no heads"
            raise BindingError(f"this module was built for {self.num_heads} heads, but q has "
                               f"{found}; q must be (B, H, S, D)")
        return self.attention._call(q, k, v, bindings=bindings, learnables=self.learnables(),
                                   scale=scale, q_offset=q_offset, kv_lengths=kv_lengths,
                                   return_lse=return_lse, step=step)

    def learnables(self) -> dict:
        """This module's tables by tensor key, as :class:`Attention` calls take them."""
        return {key: self.tables[name] for key, name in self._keys.items()}

    def extra_repr(self) -> str:
        return f"{str(self.attention.spec)!r}, num_heads={self.num_heads}"
