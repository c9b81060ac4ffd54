"""The GPU suite's hand-written options, run small on the CPU: every one must match the float64
reference (the suite's own check), so a wrong hand-written definition or a broken option is
caught here rather than on the lent GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_suite():
    spec = importlib.util.spec_from_file_location("benchmark_gpu", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_gpu"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_suite_options_match_the_reference_on_the_cpu(tmp_path, capsys):
    suite = _load_suite()
    out = tmp_path / "table.md"
    specs = "causal;causal & doc;causal + alibi;causal & window(256) + rel_bias"
    assert suite.main(["--device", "cpu", "--shapes", "2x4x384x32", "--specs", specs,
                       "--modes", "fwd", "--dtype", "float32", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| causal")]
    assert len(rows) == 4
    for row in rows:
        assert "wrong" not in row and "fails" not in row, row
        ratio = float(row.split("|")[-3])  # flexspec / best: a number, so every cell ran
        assert ratio > 0
    torch._dynamo.reset()
