"""Shared pytest configuration: when the ``slow`` and ``gpu`` markers (pyproject.toml) skip.

``slow`` tests (torch.compile runs of 20+ s on a small CPU) are skipped unless selected with
``-m slow`` or ``--run-slow``; ``gpu`` tests are skipped where no CUDA device is present.
``--shard I/N`` keeps every N-th test from the I-th (the GPU suite in several device calls).
The ``eager_kernels`` fixture runs FlexAttention without torch.compile, for tests of the runtime
around the kernel.
"""

import os
import sys
import warnings
from pathlib import Path

import pytest

# Test helpers shared by the folders (ir_examples) live here, beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th selected test, starting with the I-th (1-based): the "
                          "GPU suite runs in N calls that each fit a lent machine's time limit")


def _shard(config, items) -> None:
    """Keep shard I of N of ``items`` (``--shard I/N``), round robin."""
    text = config.getoption("--shard")
    if text is None:
        return
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard wants I/N such as 1/3, got {text!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--shard {text}: I must be between 1 and N")
    kept, dropped = [], []
    for n, item in enumerate(items):
        (kept if n % count == index - 1 else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    run_slow = config.getoption("--run-slow") or "slow" in (config.getoption("-m") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow or -m slow")
    gpu_items = [item for item in items if "gpu" in item.keywords]
    has_gpu = False
    if gpu_items:
        # Imported only here so test runs that need no torch do not pay for it.
        import torch
        has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(autouse=True)
def _fresh_caches_under_mutmut():
    """Under mutation testing (mutation/run.py), every mutant's tests run in a process forked
    from one that ran the clean tests: flexspec's functools caches (``lower``'s above all) would
    hand out results of the unmutated code and hide the mutant. Empty them first there."""
    if "MUTANT_UNDER_TEST" in os.environ:
        # mutmut's trampolines put two more frames under every call of the mutated module, so
        # a recursion the clean code finishes (the checker inlining a chain of 100 definitions)
        # would hit Python's limit at a third of the depth and fail the clean run
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
        for name, module in list(sys.modules.items()):
            if name.startswith("flexspec"):
                for value in list(vars(module).values()):
                    if callable(getattr(value, "cache_clear", None)):
                        value.cache_clear()
    yield


@pytest.fixture
def eager_kernels(monkeypatch):
    """The ``flex`` backend calls ``flex_attention`` eagerly instead of compiling it (about 20 s
    per spec on a small CPU): for tests of what the runtime passes the kernel (plans, caches,
    block masks, score_mods and their bindings). Eager ``flex_attention`` evaluates the block
    mask's ``mask_mod`` at every position and never reads its tables, which tests/kernels/
    test_blocks.py checks instead."""
    from torch.nn.attention.flex_attention import flex_attention

    from flexspec.runtime import compiled

    def eager_entry(lowered, purpose="call"):
        def run(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, lse,
                pinned=()):
            with warnings.catch_warnings():  # that it is not compiled is the point here
                warnings.filterwarnings("ignore", ".*flex_attention called without torch")
                return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      scale=scale, enable_gqa=enable_gqa,
                                      kernel_options=kernel_options, **(lse or {}))
        return run

    monkeypatch.setattr(compiled, "compiled_entry", eager_entry)
