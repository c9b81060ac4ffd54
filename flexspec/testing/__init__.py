"""Hypothesis strategies for testing code that uses flexspec, and flexspec itself.

This module needs `hypothesis <https://hypothesis.readthedocs.io>`_, which is a test extra, not a
dependency of flexspec: ``pip install 'flexspec[test]'``. Importing it without hypothesis raises
an ``ImportError`` that says so. torch is imported only by the strategies that build tensors.

Everything is drawn from the pattern registry (:func:`flexspec.patterns`), so new patterns are
covered as soon as their YAML file exists:

* :func:`spec_texts` / :func:`specs`: random, *valid* spec expressions: mask patterns joined with
  ``& | ~`` and parentheses, then up to ``max_scores`` score modifiers in a ``+`` chain, each call
  with parameters valid for its type and its ``constraint``, given positionally or by keyword or
  left at their defaults, and tensor parameters sometimes bound to a fresh runtime name;
* :func:`shapes`: ``Shape(B, Hq, Hkv, Q_LEN, KV_LEN, D)`` with lengths that are not multiples of
  128, ``Q_LEN != KV_LEN`` sometimes and grouped-query heads; given a spec, only shapes for which
  every tensor lookup stays inside its declared shape (a ``document`` mask reads ``doc_ids[b, q]``
  from a ``[B, KV_LEN]`` tensor, so it needs ``Q_LEN <= KV_LEN``);
* :func:`bindings`: values for the runtime bindings of a spec (sorted document ids, random bools,
  random float biases), sometimes in the smaller broadcastable shape (``[KV_LEN]`` for
  ``[B, KV_LEN]``), and optionally values for learnable tables too (passed by name);
* :func:`tensor_values`: values for every tensor an IR reads, keyed by
  :func:`flexspec.kernels.tensors.tensor_key`, for the reference evaluator;
* :func:`cases`: a spec, a shape that fits it and bindings, together;
* :func:`definition_specs` / :func:`definition_texts` (with :func:`mask_bodies`,
  :func:`score_bodies`): specs written in the definition language itself, not from the registry:
  negative divisors and moduli, nested subtraction and division, ``where`` reusing its
  condition's operands, infinities and NaN, lookups through index expressions;
* :func:`binding_calls`: bindings for successive calls of one compiled object, mask and score
  bindings changing between calls, often views of one tensor at different offsets.

>>> from hypothesis import given, settings
>>> import flexspec
>>> from flexspec.testing import cases
>>> @settings(max_examples=10, deadline=None)
... @given(cases(max_len=64))
... def test_mine(case):
...     q, k, v = case.shape.qkv()
...     out = flexspec.compile(case.spec).reference(q, k, v, **case.bindings)
...     assert out.shape == q.shape
>>> test_mine()
"""

from __future__ import annotations

import os

try:
    import hypothesis  # noqa: F401 - the strategies below need it; say so before they fail
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("flexspec.testing needs hypothesis, a test extra: "
                      "pip install 'flexspec[test]' (or pip install hypothesis)") from err

from flexspec.testing.shapes import Shape, lookups_fit, shapes
from flexspec.testing.specs import DEFAULT_KINDS, KINDS, pattern_kind, spec_texts, specs
from flexspec.testing.definitions import (definition_specs, definition_texts, mask_bodies,
                                          score_bodies)
from flexspec.testing.values import (Case, binding_calls, bindings, cases, document_ids,
                                     tensor_values)


def slow_examples(count: int) -> int:
    """How many examples a slow (``@pytest.mark.slow``) sweep draws: ``count``, scaled by the
    environment variable ``FLEXSPEC_SLOW_FRACTION`` (CI's bounded profile sets 0.1)."""
    fraction = float(os.environ.get("FLEXSPEC_SLOW_FRACTION", "1"))
    return max(1, round(count * fraction))


__all__ = ["DEFAULT_KINDS", "KINDS", "Case", "Shape", "binding_calls", "bindings", "cases",
           "definition_specs", "document_ids", "definition_texts", "lookups_fit", "mask_bodies", "pattern_kind",
           "score_bodies", "shapes", "slow_examples", "spec_texts", "specs", "tensor_values"]
