"""Concurrent calls of one Attention from several threads give each call's single-threaded
result (red-team finding: one result in 160,000 used another thread's block mask, because the
last block mask and its bindings were updated in two steps)."""

from __future__ import annotations

import threading

import torch

import flexspec
from flexspec.testing import Shape


def test_concurrent_calls_with_different_bindings_get_their_own_results():
    attn = flexspec.compile("causal & doc")
    q, k, v = Shape(1, 2, 2, 256, 256, 16).qkv(0)
    ids = [torch.arange(256) * (n + 2) // 256 for n in range(4)]  # 2, 3, 4, 5 documents
    with torch.no_grad():
        expected = [attn(q, k, v, doc_ids=i) for i in ids]
    failures, errors = [], []

    def worker(n):
        try:
            with torch.no_grad():
                for step in range(60):
                    which = (n + step) % len(ids)
                    out = attn(q, k, v, doc_ids=ids[which])
                    if not torch.equal(out, expected[which]):
                        failures.append((n, step, which))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and failures == []
