"""Benchmark: where the time of ``Attention.block_mask`` goes for bindings that change every
call (fresh ``doc_ids`` each training step), on CUDA, where the mask's compiled program builds it.

For each ``BxS`` shape it prints, in milliseconds (median of synchronised calls, each with a fresh
copy of one of the training step's 8 id tensors (benchmarks/training_step.py); ``causal & doc``,
8 contiguous documents per row):

* ``block_mask``: ``Attention.block_mask`` as a training step calls it;
* ``program``: the mask's compiled program alone (kernels/fused_blocks), tables without the
  BlockMask around them;
* ``flexspec path``: ``Attention.block_mask`` with the builder stubbed out: flexspec's own
  Python (the input plan, the bindings, the cache lookup);
* ``queued``: host time per call of ``block_mask`` when ``--calls`` calls are queued without
  synchronising (what the host costs when the GPU never waits for it);
* ``copy``: the fresh copy of the ids alone (counted in every column but ``flexspec path``).

A shape may be given twice: the host's speed drifts within a process (inductor's compile workers,
clocks), so a repeated first shape shows how much. ``--device cpu`` runs the same path with the
program compiled for the CPU (where flexspec itself builds such masks eagerly): a check that the
script works, not a measurement.

    python benchmarks/block_mask_host.py 4x8192 1x32768 4x8192
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import flexspec
from flexspec.kernels import fused_blocks
from flexspec.runtime import masks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_step import POOL, doc_ids_pool  # noqa: E402 - the training step's ids


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, calls: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def queued_ms(fn, device, calls: int) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    synchronize(device)
    return host


def measure(batch: int, length: int, device, calls: int = 60) -> dict:
    pool = doc_ids_pool(batch, length, device)
    counter = iter(range(10**9))

    def fresh():
        return pool[next(counter) % POOL].clone()

    attn = flexspec.compile("causal & doc")

    def block_mask():
        return attn.block_mask(length, length, batch=batch, device=device, doc_ids=fresh())

    block_mask()  # compiles the program; makes the input plan
    plan = next(iter(attn._calls.mask_plans.values()))
    program = fused_blocks._program(plan.spec.mask, attn.block_size, plan.masks.batch,
                                    plan.masks.heads, str(device), fused_blocks.COMPILER)
    lengths = {"B": batch, "H": 1, "Q_LEN": length, "KV_LEN": length}
    (key,) = plan.masks.reads
    row = {"shape": f"{batch}x{length}", "block_mask": median_ms(block_mask, device, calls),
           "program": median_ms(lambda: program({key: fresh()}, lengths), device, calls)}
    ids = fresh()
    built = masks.MaskCache.get
    masks.MaskCache.get = lambda *args, **kwargs: None
    try:
        row["flexspec path"] = median_ms(
            lambda: attn.block_mask(length, length, batch=batch, device=device, doc_ids=ids),
            device, calls)
    finally:
        masks.MaskCache.get = built
    row["queued"] = queued_ms(block_mask, device, calls)
    row["copy"] = median_ms(fresh, device, calls)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", default=["4x8192", "1x32768", "4x8192"],
                        help="BxS shapes (default: 4x8192 1x32768 4x8192)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--calls", type=int, default=60, help="timed calls per column")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here (--device cpu checks that the script runs)")
        device = torch.device("cuda:0")
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    else:
        device = torch.device("cpu")
        masks.FUSED_DEVICES = masks.FUSED_DEVICES | {"cpu"}
    rows = []
    for shape in args.shapes:
        batch, length = (int(n) for n in shape.split("x"))
        rows.append(measure(batch, length, device, args.calls))
        print(rows[-1], flush=True)
    names = list(rows[0])
    print("\n| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for row in rows:
        print("| " + " | ".join(v if isinstance(v, str) else f"{v:.3f}" for v in row.values())
              + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
