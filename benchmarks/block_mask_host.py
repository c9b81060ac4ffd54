"""Benchmark: where the time of ``Attention.block_mask`` goes for bindings that change every
call (fresh ``doc_ids`` each training step), on CUDA, where the mask's compiled program builds it.

For each ``BxS`` shape it prints, in milliseconds (median of synchronised calls, each with a fresh
copy of one of 8 id tensors; ``causal & doc``, 8 contiguous documents per row):

* ``block_mask``: ``Attention.block_mask`` as a training step calls it;
* ``program``: the mask's compiled program alone (kernels/fused_blocks), tables without the
  BlockMask around them;
* ``flexspec path``: ``Attention.block_mask`` with the builder stubbed out: flexspec's own
  Python (the input plan, the bindings, the cache lookup);
* ``queued``: host time per call of ``block_mask`` when 100 calls are queued without
  synchronising (what the host costs when the GPU never waits for it);
* ``copy``: the fresh copy of the ids alone (counted in every column but ``flexspec path``).

A shape may be given twice: the host's speed drifts within a process (inductor's compile workers,
clocks), so a repeated first shape shows how much.

    python benchmarks/block_mask_host.py 4x8192 1x32768 4x8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flexspec
from flexspec.kernels import fused_blocks
from flexspec.runtime import masks

POOL = 8
DOCUMENTS = 8


def ids_pool(batch: int, length: int, device) -> list:
    generator = torch.Generator().manual_seed(0)
    pool = []
    for _ in range(POOL):
        starts = torch.zeros(batch, length, dtype=torch.int64)
        for row in range(batch):
            starts[row, torch.randperm(length - 1, generator=generator)[:DOCUMENTS - 1] + 1] = 1
        pool.append(starts.cumsum(1).to(device))
    return pool


def median_ms(fn, calls: int = 60) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def queued_ms(fn, calls: int = 100) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def measure(batch: int, length: int, device) -> dict:
    pool = ids_pool(batch, length, device)
    calls = iter(range(10**9))

    def fresh():
        return pool[next(calls) % POOL].clone()

    attn = flexspec.compile("causal & doc")

    def block_mask():
        return attn.block_mask(length, length, batch=batch, device=device, doc_ids=fresh())

    block_mask()  # compiles the program; makes the input plan
    plan = next(iter(attn._mask_plans.values()))
    program = fused_blocks._program(plan.spec.mask, attn.block_size, plan.mask.batch,
                                    plan.mask.heads, str(device), fused_blocks.COMPILER)
    lengths = {"B": batch, "H": 1, "Q_LEN": length, "KV_LEN": length}
    (key,) = plan.mask.reads
    row = {"shape": f"{batch}x{length}", "block_mask": median_ms(block_mask),
           "program": median_ms(lambda: program({key: fresh()}, lengths))}
    ids = fresh()
    built = masks.BlockMasks.get
    masks.BlockMasks.get = lambda *args, **kwargs: None
    try:
        row["flexspec path"] = median_ms(
            lambda: attn.block_mask(length, length, batch=batch, device=device, doc_ids=ids))
    finally:
        masks.BlockMasks.get = built
    row["queued"] = queued_ms(block_mask)
    row["copy"] = median_ms(fresh)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", default=["4x8192", "1x32768", "4x8192"],
                        help="BxS shapes (default: 4x8192 1x32768 4x8192)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("block_mask_host.py measures the CUDA path: no CUDA device here")
    device = torch.device("cuda:0")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    rows = []
    for shape in args.shapes:
        batch, length = (int(n) for n in shape.split("x"))
        rows.append(measure(batch, length, device))
        print(rows[-1], flush=True)
    names = list(rows[0])
    print("\n| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for row in rows:
        print("| " + " | ".join(v if isinstance(v, str) else f"{v:.3f}" for v in row.values())
              + " |")


if __name__ == "__main__":
    main()
