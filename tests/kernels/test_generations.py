"""kernels.generations: a call of a compiled function that leaves CUDA graph trees' generation
alone (flexspec.workarounds: compiled-call-new-generation)."""

import torch
from torch._dynamo.mutation_guard import GenerationTracker

from flexspec.kernels.generations import call_compiled


def test_a_compiled_call_keeps_the_generation_a_plain_call_moves():
    compiled = torch.compile(lambda x: x * 2, backend="eager")
    x = torch.ones(3)
    compiled(x)  # compiles
    before = GenerationTracker.generation
    compiled(x)
    # torch's behaviour, the reason for the workaround: if this fails, torch no longer starts a
    # generation per call, and the workaround may go
    assert GenerationTracker.generation != before
    before = GenerationTracker.generation
    assert torch.equal(call_compiled(compiled, x), x * 2)
    assert GenerationTracker.generation == before


def test_the_generation_is_kept_when_the_call_raises():
    def fails(x):
        raise ValueError("no")

    compiled = torch.compile(fails, backend="eager")
    before = GenerationTracker.generation
    try:
        call_compiled(compiled, torch.ones(1))
    except Exception:  # noqa: BLE001 - dynamo may wrap the error
        pass
    assert GenerationTracker.generation == before
