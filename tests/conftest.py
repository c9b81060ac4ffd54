"""Shared pytest configuration: when the ``slow`` and ``gpu`` markers (pyproject.toml) skip.

``slow`` tests (torch.compile runs of 20+ s on a small CPU) are skipped unless selected with
``-m slow`` or ``--run-slow``; ``gpu`` tests are skipped where no CUDA device is present.
"""

import sys
from pathlib import Path

import pytest

# Test helpers shared by the folders (ir_examples) live here, beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
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
