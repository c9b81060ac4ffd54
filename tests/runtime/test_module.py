"""SpecAttention inside a model: a first call that happens inside torch.compile(model) works,
with bounded time and memory, and gives the eager outputs and gradients."""

from __future__ import annotations

import resource

import torch

import flexspec


class Block(torch.nn.Module):
    """A projection and a SpecAttention with a learnable relative-position table."""

    def __init__(self, spec: str, heads: int = 4, dim: int = 8):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.proj = torch.nn.Linear(heads * dim, 3 * heads * dim)
        self.attn = flexspec.SpecAttention(spec, num_heads=heads)

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.proj(x).view(batch, length, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).transpose(1, 2).reshape(batch, length, -1)


def test_a_first_call_inside_torch_compile_matches_eager():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Block("causal & window(50) + rel_bias(max_distance=8)")
    with torch.no_grad():
        model.attn.tables["rel_bias_table"].normal_()
    compiled = torch.compile(model)
    x = torch.randn(2, 300, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    # gradients too (on the CPU they run on the dense reference, which has a backward)
    x.requires_grad_(True)
    compiled(x).square().sum().backward()
    got = (x.grad.clone(), model.attn.tables["rel_bias_table"].grad.clone())
    x.grad = None
    model.zero_grad()
    model(x).square().sum().backward()
    torch.testing.assert_close(got[0], x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], model.attn.tables["rel_bias_table"].grad,
                               rtol=1e-5, atol=1e-5)
    # dynamo traced the model, not flexspec's planning (which once took 24 GB and minutes)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 8 * 1024**2  # KiB: 8 GiB
