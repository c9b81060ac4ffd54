"""Values for a spec's tensors without a model (flexspec.tools.values): the demo values drawn in
pictures and used by the demo. The --bind text is tested through the CLI (tests/tools/test_cli.py).
"""

from __future__ import annotations

import pytest
import torch

import flexspec
from flexspec.tools.values import demo_bindings


def test_demo_bindings():
    values, notes = demo_bindings("causal & document", 12, 12)
    assert values["doc_ids"].reshape(-1).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert notes == ["doc_ids: demo value, 3 equal documents (0 0 0 0 1 1 1 1 2 2 2 2)"]
    values, notes = demo_bindings("window(1) | global_tokens", 5, 5)
    assert values["is_global"].reshape(-1).tolist() == [True, False, False, False, False]
    values, _ = demo_bindings("causal + head_bias", 4, 4, heads=3)
    assert values["bias"].tolist() == [0.0]  # broadcast over H
    values, notes = demo_bindings("causal + rel_bias(max_distance=2)", 4, 4)
    assert values["rel_bias_table"].reshape(-1).tolist() == [0, 1, 2, 3, 4]
    assert "entry i = i" in notes[0]
    given, _ = demo_bindings("causal & document", 4, 4, given={"doc_ids": torch.zeros(4)})
    assert given == {}
    _, notes = demo_bindings("causal & document", 600, 600)
    assert "0 at 0..199, 1 at 200..399, 2 at 400..599" in notes[0]


def test_demo_values_beyond_the_allocation_limit_are_a_spec_error():
    """Fuzzer finding: rendering `rel_bias(max_distance=2**40)` allocated the demo table
    directly (8 TB: a raw RuntimeError)."""
    attn = flexspec.compile("causal + rel_bias(max_distance=1099511627776)")
    with pytest.raises(flexspec.SpecError, match="would hold .* entries"):
        demo_bindings(attn, 10, 10)
