"""Concurrent calls of one Attention from several threads give each call's single-threaded
result (red-team finding: one result in 160,000 used another thread's block mask, because the
last block mask and its bindings were updated in two steps)."""

from __future__ import annotations

from flexspec.testing.threads import concurrent_calls


def test_concurrent_calls_with_different_bindings_get_their_own_results():
    wrong, errors = concurrent_calls(threads=4, calls=60, length=256)
    assert errors == [] and wrong == []


def test_concurrent_calls_at_different_positions_get_their_own_results():
    """Int and tensor offsets from several threads: the kept position tensors, clamps and
    block masks of one call are never another's."""
    wrong, errors = concurrent_calls(threads=4, calls=40, length=128, positions=True)
    assert errors == [] and wrong == []
