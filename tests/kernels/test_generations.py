"""kernels.generations: a call of a compiled function that leaves CUDA graph trees' generation
alone (flexspec.workarounds: compiled-call-new-generation), and dynamo settings in force around
a call that may compile."""

import threading

import pytest
import torch
from torch._dynamo.mutation_guard import GenerationTracker

import flexspec
from flexspec import ir
from flexspec.kernels import fused_blocks
from flexspec.kernels.generations import FAST_GUARDS, call_compiled, call_with_settings


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


def test_settings_are_in_force_during_the_call_and_restored_after_it_even_when_it_raises():
    config = torch._dynamo.config
    before = config.recompile_limit
    seen = []
    assert call_with_settings({"recompile_limit": before + 3},
                              lambda x: seen.append(config.recompile_limit) or x, 5) == 5
    assert seen == [before + 3] and config.recompile_limit == before

    def fails():
        raise ValueError("no")

    with pytest.raises(ValueError):
        call_with_settings({"recompile_limit": before + 3}, fails)
    assert config.recompile_limit == before


@pytest.mark.skipif(not FAST_GUARDS, reason="this torch has no C++ symbolic-shape guards")
def test_block_mask_programs_compile_with_their_length_guards_in_cpp():
    seen = []

    def spy(graph, example_inputs):
        seen.append(torch._dynamo.config.enable_cpp_symbolic_shape_guards)
        return graph.forward

    mask = flexspec.compile("causal & key_padding").ir.mask
    before = torch._dynamo.config.enable_cpp_symbolic_shape_guards
    valid = torch.ones(2, 300, dtype=torch.bool)
    fused_blocks.fused_block_mask(mask, {"B": 2, "H": 1, "Q_LEN": 300, "KV_LEN": 300},
                                  (128, 128), {key: valid for key in ir.tensor_keys(mask)},
                                  torch.device("cpu"), batch=2, heads=1, compiler=spy)
    assert seen == [True]
    assert torch._dynamo.config.enable_cpp_symbolic_shape_guards == before


def test_a_call_that_need_not_wait_runs_without_the_settings_while_another_thread_holds_them():
    config = torch._dynamo.config
    before = config.recompile_limit
    holding, release = threading.Event(), threading.Event()

    def hold():
        call_with_settings({"recompile_limit": before + 5},
                           lambda: holding.set() or release.wait(10))

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        # this call does not wait, and runs without its own settings: it sees the other
        # thread's (where torch's settings are process-wide) or none (where they are per thread)
        seen = call_with_settings({"recompile_limit": before + 3},
                                  lambda: config.recompile_limit, wait=False)
        assert seen in (before, before + 5)
    finally:
        release.set()
        holder.join()
    assert config.recompile_limit == before
    assert call_with_settings({"recompile_limit": before + 3},
                              lambda: config.recompile_limit, wait=False) == before + 3
