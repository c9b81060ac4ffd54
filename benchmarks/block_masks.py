"""Benchmark: flexspec's block-mask builder against torch's create_block_mask.

One run prints one table: for each spec and length, the time of flexspec's builder (interval
analysis + exact refinement), of the mask's compiled program (kernels/fused_blocks: intervals
only; on CUDA by default), of eager ``create_block_mask`` and of ``torch.compile``d
``create_block_mask`` where they run, their ratio, and (on CUDA) the builder's peak memory.
Every flexspec block mask is checked against create_block_mask's wherever that one ran.

    python benchmarks/block_masks.py                 # CPU: S = 4K, 16K, 64K (+ 1M builder only)
    python benchmarks/block_masks.py --device cuda   # GPU: S = 8K, 32K, 128K (+ 1M builder only)
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

import flexspec
from flexspec.kernels import fused_blocks
from flexspec.kernels.block_tables import EMPTY, FULL, tile_classes
from flexspec.kernels.blocks import build_block_mask
from flexspec.kernels.lower import lower

SPECS = ["causal", "sliding_window(1024)", "causal & document", "prefix_lm(512)",
         "chunked(2048)", "dilated(512, 4)", "natten"]
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def natten_text(length: int) -> str:
    width = 2 ** math.ceil(math.log2(length) / 2)
    height = length // width
    return f"natten({width}, {height}, 15, 15)"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def case(text: str, length: int, device, *, repeats: int, eager_limit: int, compiled: bool,
         fused: bool):
    label = text
    if text == "natten":
        text = natten_text(length)
        label = f"natten {text[7:-1].split(', ')[0]}x{text[7:-1].split(', ')[1]}, 15x15"
    attn = flexspec.compile(text)
    sizes = {"B": 1, "H": 1, "Q_LEN": length, "KV_LEN": length}
    bindings = {}
    if "document" in text:
        bindings["doc_ids"] = (torch.arange(length, device=device) * 8 // length)
    values, spec = attn._tensors(sizes, bindings, device)
    mask_mod, _ = lower(spec).make_mods(sizes, values)

    def ours():
        return build_block_mask(spec.mask, sizes, (128, 128), values, device, batch=1, heads=1,
                                mask_mod=mask_mod)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ours_ms = timed(ours, device, repeats)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
    row = {"spec": label, "S": length, "flexspec": ours_ms, "fused": None, "eager": None,
           "compiled": None, "peak": peak, "same": None}
    mine = ours()
    if fused and fused_blocks.fits(sizes, (128, 128), batch=1, heads=1):
        def program():
            return fused_blocks.fused_block_mask(spec.mask, sizes, (128, 128), values, device,
                                                 batch=1, heads=1, mask_mod=mask_mod)
        row["fused"] = timed(program, device, repeats)
        # the intervals alone: every block of the exact mask listed, FULL ones truly full
        exact, loose = tile_classes(mine), tile_classes(program())
        row["fused sound"] = bool(((exact == EMPTY) | (loose != EMPTY)).all()
                                  and ((loose != FULL) | (exact == FULL)).all())

    def theirs():
        return create_block_mask(mask_mod, 1, 1, length, length, device=device)

    reference = None
    if length <= eager_limit:
        try:
            row["eager"] = timed(theirs, device, 1)
            reference = theirs()
        except torch.OutOfMemoryError:
            row["eager"] = "OOM"
            torch.cuda.empty_cache()
    if compiled:
        compiled_fn = torch.compile(create_block_mask)
        try:
            row["compiled"] = timed(lambda: compiled_fn(mask_mod, 1, 1, length, length,
                                                        device=device), device, repeats)
            if reference is None:
                reference = compiled_fn(mask_mod, 1, 1, length, length, device=device)
        except torch.OutOfMemoryError:
            row["compiled"] = "OOM"
            torch.cuda.empty_cache()
    if reference is not None:
        row["same"] = torch.equal(mine.to_dense(), reference.to_dense()) and all(
            torch.equal(getattr(mine, f), getattr(reference, f)) for f in FIELDS if "num" in f)
    return row


def fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="*")
    parser.add_argument("--million", action="store_true", default=True,
                        help="also time the builder alone at S = 1M (default on)")
    parser.add_argument("--no-million", dest="million", action="store_false")
    parser.add_argument("--compiled", action="store_true",
                        help="also time torch.compile(create_block_mask) (default on CUDA)")
    parser.add_argument("--fused", action="store_true",
                        help="also time the compiled program of kernels/fused_blocks (default "
                             "on CUDA)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--specs", nargs="*", default=SPECS)
    args = parser.parse_args()
    device = torch.empty(0, device=args.device).device
    on_gpu = device.type == "cuda"
    lengths = args.lengths or ([8192, 32768, 131072] if on_gpu else [4096, 16384, 65536])
    eager_limit = 131072 if on_gpu else 16384
    compiled = args.compiled or on_gpu
    fused = args.fused or on_gpu
    rows = []
    for length in lengths:
        for text in args.specs:
            rows.append(case(text, length, device, repeats=args.repeats, eager_limit=eager_limit,
                             compiled=compiled, fused=fused))
            print(rows[-1], flush=True)
    if args.million:
        for text in args.specs:
            rows.append(case(text, 1 << 20, device, repeats=max(1, args.repeats // 2),
                             eager_limit=0, compiled=False, fused=fused))
            print(rows[-1], flush=True)
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"\nblock-mask build, {name}, torch {torch.__version__}, B=1 H=1, block 128, "
          f"median ms (one eager run)")
    header = ["spec", "S", "flexspec ms", "fused ms", "eager ms", "compiled ms",
              "eager/flexspec", "compiled/flexspec", "peak MiB", "equal", "fused sound"]
    table = [header]
    for r in rows:
        ratio = (f"{r['eager'] / r['flexspec']:.0f}x" if isinstance(r["eager"], float) else "-")
        cratio = (f"{r['compiled'] / r['flexspec']:.1f}x" if isinstance(r["compiled"], float)
                  else "-")
        table.append([r["spec"], str(r["S"]), fmt(r["flexspec"], 2), fmt(r["fused"], 3),
                      fmt(r["eager"]), fmt(r["compiled"], 2), ratio, cratio, fmt(r["peak"], 0),
                      {None: "-", True: "yes", False: "NO"}[r["same"]],
                      {None: "-", True: "yes", False: "NO"}[r.get("fused sound")]])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    main()
