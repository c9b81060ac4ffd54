"""Benchmark: a training step whose mask bindings change every step (packed documents).

Every step takes a new ``doc_ids`` tensor (a copy of the next of 8 precomputed ones, as a data
loader hands out), so no block mask can be reused. For each shape it prints, in milliseconds
(medians):

* ``mask``: flexspec's block mask for fresh ids (``Attention.block_mask``: on CUDA the mask's
  compiled program, kernels/fused_blocks) and the hand-written ``torch.compile(create_block_mask)``;
* ``kernel alone``: forward+backward with the block mask of each step's ids built beforehand
  (FLASH where installed): the same work as a step, without building the mask (the ids of the
  pool differ in their documents' lengths, so a single mask would time other work);
* ``step``: forward+backward including the mask, flexspec (``auto``) and hand-written
  (compiled ``create_block_mask`` + compiled ``flex_attention``, FLASH where installed);
* ``step native hand``, where FlashAttention-4 is installed: FA4's own variable-length kernel
  called by hand, with cumulative lengths computed from each step's ids (a few torch ops and
  one host read), which is what flexspec's ``fa4`` backend does for contiguous documents;
* ``cu_seqlens``: the documents given as boundaries (``cu_seqlens`` and the longest length, as
  a data loader hands them, computed before the timed region), to flexspec through
  ``flexspec.Step(cu_seqlens=..., max_seqlen=...)`` and to FA4's variable-length kernel by hand,
  and the ratio of the two;
* the ratio of flexspec's step to the kernel alone (the target is at most 1.03) and to the
  hand-written step;
* with ``--graphs`` (CUDA): the kernel alone (each replay after the step's prebuilt mask was
  copied into the captured one) and flexspec's whole step (block mask from the step's ids,
  forward, backward) each captured in a CUDA graph and replayed back to back, and their ratio.

q, k and v are views of (B, S, H, D) tensors (``--layout bshd``, the layout projections give
and what FA4's variable-length interface reads without a copy) or contiguous (B, H, S, D)
tensors (``--layout bhsd``).

Outputs of flexspec and the hand-written step are compared each run (relative error printed).

    python benchmarks/training_step.py                         # 4x16x8192x128, 1x16x32768x128, 1x16x131072x128
    python benchmarks/training_step.py 2x4x1024x64 --device cpu # a small check (no FLASH, no backward on CPU)
    python benchmarks/training_step.py --layout bhsd           # contiguous (B, H, S, D) inputs
    python benchmarks/training_step.py 4x16x8192x128 --graphs  # + whole steps in CUDA graphs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexspec
from flexspec.runtime.fa4 import installed as flash_installed

POOL = 8
DOCUMENTS = 8


def doc_ids_pool(batch: int, length: int, device) -> list:
    """POOL tensors of per-row document ids: DOCUMENTS contiguous documents of random lengths."""
    generator = torch.Generator().manual_seed(0)
    pool = []
    for _ in range(POOL):
        starts = torch.zeros(batch, length, dtype=torch.int64)
        for row in range(batch):
            cuts = torch.randperm(length - 1, generator=generator)[:DOCUMENTS - 1] + 1
            starts[row, cuts] = 1
        pool.append(starts.cumsum(1).to(device))
    return pool


def median_ms(fn, device, steps: int, warmup: int) -> float:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(warmup + i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(step, steps: int, feed=None) -> float:
    """Per-step time of ``step(i)`` (after a warm-up) captured once in a CUDA graph and replayed
    ``steps`` times back to back, each replay after the inputs of step ``i`` were copied in by
    ``feed(i)``: mean over the replays, one synchronisation at the end."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        if feed is not None:
            feed(i)
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def cumulative_lengths(ids):
    """Hand-written: where each document starts, rows laid end to end, and the longest one."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    cumulative = torch.cat((first, first.new_tensor([ids.numel()]))).to(torch.int32)
    return cumulative, int((cumulative[1:] - cumulative[:-1]).max())


def measure(batch, heads, length, dim, device, dtype, steps, warmup, layout,
            graphs=False) -> dict:
    pool = doc_ids_pool(batch, length, device)
    grads = device.type == "cuda"  # FlexAttention has no backward on the CPU
    shape = (batch, length, heads, dim) if layout == "bshd" else (batch, heads, length, dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_(grads) for t in (q, k, v))
    attn = flexspec.compile("causal & doc")
    holder = pool[0].clone()  # the hand-written mask reads the ids through this tensor

    def doc_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (holder[b, q_idx] == holder[b, kv_idx])

    compiled_mask = torch.compile(create_block_mask)
    compiled_flex = torch.compile(flex_attention)
    options = {"BACKEND": "FLASH"} if flash_installed() and device.type == "cuda" else None

    def fresh(i):
        return pool[i % POOL].clone()

    def hand_mask(i):
        holder.copy_(pool[i % POOL])
        return compiled_mask(doc_mask, batch, None, length, length, device=device)

    def ours_mask(i):
        return attn.block_mask(length, length, batch=batch, device=device, doc_ids=fresh(i))

    def run(out):
        if grads:
            out.backward(torch.ones_like(out))
        return out

    prebuilt = [hand_mask(i) for i in range(POOL)]  # the mask of each step's ids
    row = {"shape": f"{batch}x{heads}x{length}x{dim}"}
    row["mask flexspec"] = median_ms(ours_mask, device, steps, warmup)
    row["mask hand"] = median_ms(hand_mask, device, steps, warmup)
    row["kernel alone"] = median_ms(
        lambda i: run(compiled_flex(q, k, v, block_mask=prebuilt[i % POOL],
                                    kernel_options=options)),
        device, steps, warmup)
    row["step flexspec"] = median_ms(lambda i: run(attn(q, k, v, doc_ids=fresh(i))), device,
                                     steps, warmup)
    # the documents as boundaries, as a data loader gives them (computed beforehand, one per
    # pool entry): no host read in the step
    bounds = [cumulative_lengths(ids) for ids in pool]

    def given(i):
        cumulative, longest = bounds[i % POOL]
        return cumulative.clone(), longest

    def stepped(i):
        cumulative, longest = given(i)
        return run(attn(q, k, v, step=flexspec.Step(cu_seqlens=cumulative, max_seqlen=longest)))
    row["step flexspec cu_seqlens"] = median_ms(stepped, device, steps, warmup)
    row["step hand"] = median_ms(
        lambda i: run(compiled_flex(q, k, v, block_mask=hand_mask(i), kernel_options=options)),
        device, steps, warmup)
    if options is not None:
        from flash_attn.cute import flash_attn_varlen_func

        def native_hand(i):
            cumulative, longest = cumulative_lengths(fresh(i))
            flat = [t.transpose(1, 2).reshape(batch * length, heads, dim) for t in (q, k, v)]
            out = flash_attn_varlen_func(*flat, cu_seqlens_q=cumulative,
                                         cu_seqlens_k=cumulative, max_seqlen_q=longest,
                                         max_seqlen_k=longest, causal=True)[0]
            return run(out.reshape(batch, length, heads, dim).transpose(1, 2))
        row["step native hand"] = median_ms(native_hand, device, steps, warmup)

        def native_given(i):
            cumulative, longest = given(i)
            flat = [t.transpose(1, 2).reshape(batch * length, heads, dim) for t in (q, k, v)]
            out = flash_attn_varlen_func(*flat, cu_seqlens_q=cumulative,
                                         cu_seqlens_k=cumulative, max_seqlen_q=longest,
                                         max_seqlen_k=longest, causal=True)[0]
            return run(out.reshape(batch, length, heads, dim).transpose(1, 2))
        row["step native hand cu_seqlens"] = median_ms(native_given, device, steps, warmup)
        row["cu_seqlens flexspec / hand"] = (row["step flexspec cu_seqlens"]
                                             / row["step native hand cu_seqlens"])
    row["flexspec / kernel"] = row["step flexspec"] / row["kernel alone"]
    row["flexspec / hand"] = row["step flexspec"] / row["step hand"]
    if graphs and device.type == "cuda":
        # the whole step in a CUDA graph: the ids of each step copied into the captured tensor,
        # flexspec's block mask rebuilt inside the graph (fa4 hands documents to its fallback
        # there: cumulative lengths need a host read)
        static_ids = pool[0].clone()
        static_mask = hand_mask(0)

        def kernel_step(i):
            return run(compiled_flex(q, k, v, block_mask=static_mask, kernel_options=options))

        def copy_mask(i):
            for into, source in zip(static_mask.as_tuple(), prebuilt[i % POOL].as_tuple()):
                if isinstance(into, torch.Tensor):
                    into.copy_(source)

        def flexspec_step(i):
            return run(attn(q, k, v, doc_ids=static_ids))
        row["kernel alone graph"] = graph_ms(kernel_step, steps, feed=copy_mask)
        row["step flexspec graph"] = graph_ms(
            flexspec_step, steps, feed=lambda i: static_ids.copy_(pool[i % POOL]))
        row["graph flexspec / kernel"] = row["step flexspec graph"] / row["kernel alone graph"]
    with torch.no_grad():
        ours = attn(q, k, v, doc_ids=pool[1])
        theirs = compiled_flex(q, k, v, block_mask=hand_mask(1), kernel_options=options)
    row["rel. error"] = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
    row["backend"] = attn.explain(q, k, v, doc_ids=pool[1]).choice.backend
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["4x16x8192x128", "1x16x32768x128",
                                                      "1x16x131072x128"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    parser.add_argument("--graphs", action="store_true",
                        help="also time the kernel alone and flexspec's step in CUDA graphs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for text in args.shapes:
        batch, heads, length, dim = (int(n) for n in text.split("x"))
        rows.append(measure(batch, heads, length, dim, device, dtype, args.steps, args.warmup,
                            args.layout, args.graphs))
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
