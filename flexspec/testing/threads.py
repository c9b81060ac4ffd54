"""Concurrent calls of one Attention object with different bindings or query positions, each
checked against the single-threaded result: the thread-safety check that
tests/runtime/test_threads.py runs small and benchmarks/threads.py runs long."""

from __future__ import annotations

import threading

import torch

import flexspec
from flexspec.testing.shapes import Shape

SPEC = "causal & doc"
# The spec of the calls that differ in where their queries stand: its sink keeps every call on
# the whole cache and masked, so that offsets reach the block-mask cache.
POSITIONED_SPEC = "causal & (window(100) | sink(4))"


def concurrent_calls(threads: int, calls: int, length: int,
                     positions: bool = False) -> tuple[list, list]:
    """``threads`` threads each make ``calls`` calls of one ``causal & doc`` object at
    ``length`` positions, cycling through four document layouts (2 to 5 documents), or (with
    ``positions``) of one :data:`POSITIONED_SPEC` object, ``length`` queries over twice as many
    keys, cycling through four placements (int offsets and tensor offsets, shared by the
    threads): the calls whose output differs from the single-threaded one, as
    ``(thread, step, layout)``, and the errors raised (their ``repr``)."""
    if positions:
        attn = flexspec.compile(POSITIONED_SPEC)
        q, k, v = Shape(2, 2, 2, length, 2 * length, 16).qkv(0)
        layouts = [{"q_offset": 0}, {"q_offset": length},
                   {"q_offset": torch.tensor([length // 2, length])},
                   {"q_offset": torch.tensor([3, length - 1])}]
    else:
        attn = flexspec.compile(SPEC)
        q, k, v = Shape(1, 2, 2, length, length, 16).qkv(0)
        layouts = [{"doc_ids": torch.arange(length) * (n + 2) // length} for n in range(4)]
    with torch.no_grad():
        expected = [attn(q, k, v, **layout) for layout in layouts]
    wrong, errors = [], []

    def worker(n):
        try:
            with torch.no_grad():
                for step in range(calls):
                    which = (n + step) % len(layouts)
                    if not torch.equal(attn(q, k, v, **layouts[which]), expected[which]):
                        wrong.append((n, step, which))
        except Exception as error:  # noqa: BLE001 - the caller reports it
            errors.append(repr(error))

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return wrong, errors
