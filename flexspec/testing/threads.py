"""Concurrent calls of one Attention object with different bindings, each checked against the
single-threaded result: the thread-safety check that tests/runtime/test_threads.py runs small and
benchmarks/threads.py runs long."""

from __future__ import annotations

import threading

import torch

import flexspec
from flexspec.testing.shapes import Shape

SPEC = "causal & doc"


def concurrent_calls(threads: int, calls: int, length: int) -> tuple[list, list]:
    """``threads`` threads each make ``calls`` calls of one ``causal & doc`` object at
    ``length`` positions, cycling through four document layouts (2 to 5 documents): the calls
    whose output differs from the single-threaded one, as ``(thread, step, layout)``, and the
    errors raised (their ``repr``)."""
    attn = flexspec.compile(SPEC)
    q, k, v = Shape(1, 2, 2, length, length, 16).qkv(0)
    ids = [torch.arange(length) * (n + 2) // length for n in range(4)]
    with torch.no_grad():
        expected = [attn(q, k, v, doc_ids=i) for i in ids]
    wrong, errors = [], []

    def worker(n):
        try:
            with torch.no_grad():
                for step in range(calls):
                    which = (n + step) % len(ids)
                    if not torch.equal(attn(q, k, v, doc_ids=ids[which]), expected[which]):
                        wrong.append((n, step, which))
        except Exception as error:  # noqa: BLE001 - the caller reports it
            errors.append(repr(error))

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return wrong, errors
