"""Benchmark: context parallelism on GPUs, one process a GPU (torchrun, NCCL).

For each sequence length, one training step of one attention call (forward + backward, B=1,
bf16) of ``causal & doc`` over skewed documents (one of half the sequence, the rest of 4096
tokens, as ``benchmarks/balance.py``), in milliseconds (median; each step starts after a
barrier, so it is the slowest rank's time):

* ``1 GPU``: the whole sequence on each GPU alone: flexspec's call, and hand-written
  FlexAttention (compiled ``create_block_mask`` and ``flex_attention``);
* ``flexspec CP``: :class:`flexspec.parallel.ContextParallel` with the sequence sharded over
  the ranks, for its balancers ``flexspec``, ``head_tail`` and ``none``;
* ``torch CP``: torch's own context parallelism for FlexAttention (the ``_ContextParallel``
  module style and ``_context_parallel_shard``, as torch's tests and torchtitan call them) with
  its default balancer, head-tail, and with none. Torch needs the length to be a multiple of
  ranks x 128 (x 2 for head-tail); other lengths print ``not supported``.

Columns: the step time, the speed-up over the same implementation on 1 GPU, the busiest
rank's share of the key tiles over the mean rank's (from the spec's block structure,
:mod:`flexspec.parallel.balance`), the time to make the plan once compiled (flexspec:
``ContextParallel``; hand-written: the block mask; torch: the shards of q, k, v and the block
mask, whose whole-sequence mask is the hand-written one), and the largest error of the output
and of q's gradient against flexspec's call on one GPU (relative to the largest value).

    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py
    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py --lengths 131072
    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py --device cpu \
        --lengths 4096 8000 --heads 1 --dim 16     # gloo, float32: checks the script, not times
    python benchmarks/context_parallel.py --one-device 2 --lengths 131072

``--one-device RANKS`` needs no torchrun and one GPU: each rank's attention (its rows against the
whole keys) runs in turn, timed alone, for each balancer; the 1-device time over the slowest
rank's is the speed-up the ranks could reach with free communication.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from flexspec.parallel import ContextParallel  # noqa: E402
from flexspec.parallel import balance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from balance import documents  # noqa: E402

SPEC = "causal & doc"
BLOCK = 128
DEVICE = "cuda"  # --device cpu: gloo processes, to check the script at small lengths


def flex_backward(out, grad) -> None:
    """``out.backward(grad)`` for torch's own FlexAttention: none on the CPU, where it has no
    backward (flexspec's calls run theirs on its CPU kernels)."""
    if out.requires_grad:
        out.backward(grad)


def flex_leaves(*tensors):
    """:func:`leaves` for torch's own FlexAttention: on the CPU, without gradients."""
    return leaves(*tensors) if DEVICE == "cuda" else [t.detach().clone() for t in tensors]


def grad_error(leaf, want) -> float | None:
    return None if leaf.grad is None else error(leaf.grad, want)


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def doc_ids_for(length: int, device) -> torch.Tensor:
    """Skewed documents: ``benchmarks/balance.py``'s at whole blocks, the last one taking the
    positions past the last whole block."""
    sizes = torch.tensor(documents(length // BLOCK)) * BLOCK
    ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    ids = torch.cat([ids, ids[-1:].expand(length - ids.shape[0])])
    return ids[None].to(device)


def timed(step, repeats: int, ranks: bool = True) -> float:
    """The median over ``repeats`` of ``step``'s time (two warm-ups): with ``ranks``, the
    slowest rank's, each step starting after a barrier; else this device's alone."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        synchronize()
        if ranks:
            dist.barrier()
        start = time.perf_counter()
        step()
        synchronize()
        elapsed = time.perf_counter() - start
        if ranks:
            slowest = torch.tensor(elapsed, device=DEVICE)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            elapsed = slowest.item()
        times.append(elapsed * 1e3)
    return statistics.median(times)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max())


def step_of(tensors: list, run):
    """A step: the gradients of ``tensors`` cleared, then ``run()`` (a forward and backward;
    called at once by :func:`timed`, so it may read the caller's loop variables)."""
    def step():
        for tensor in tensors:
            tensor.grad = None
        run()
    return step


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def plain_rows(length, q, k, v, grad, doc_ids, repeats):
    """flexspec and hand-written FlexAttention on the whole sequence, one GPU each."""
    attn = flexspec.compile(SPEC)
    leaf = leaves(q, k, v)

    ms = timed(step_of(leaf, lambda: attn(*leaf, doc_ids=doc_ids).backward(grad)), repeats)
    reference = attn(*leaf, doc_ids=doc_ids).detach()
    leaf[0].grad = None
    attn(*leaf, doc_ids=doc_ids).backward(grad)
    reference_dq = leaf[0].grad.detach().clone()
    rows = [("1 GPU", "flexspec", ms, None, None, None, None)]

    ids = doc_ids[0]

    def document_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

    make_mask = torch.compile(create_block_mask, dynamic=False, fullgraph=True)
    attend = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    make_mask(document_mask, None, None, length, length, device=DEVICE)  # compiles
    synchronize()
    start = time.perf_counter()
    mask = make_mask(document_mask, None, None, length, length, device=DEVICE)
    synchronize()
    plan_ms = (time.perf_counter() - start) * 1e3
    hand = flex_leaves(q, k, v)

    ms = timed(step_of(hand, lambda: flex_backward(attend(*hand, block_mask=mask), grad)),
               repeats)
    out = attend(*hand, block_mask=mask)
    rows.append(("1 GPU", "hand-written flex", ms, None, plan_ms,
                 error(out, reference), grad_error(hand[0], reference_dq)))
    return rows, reference, reference_dq, mask


def flexspec_cp_rows(length, q, k, v, grad, doc_ids, reference, reference_dq, repeats):
    attn = flexspec.compile(SPEC)
    rows = []
    for balancer in ("flexspec", "head_tail", "none"):
        ContextParallel(attn, length, balance=balancer, doc_ids=doc_ids)  # compiles
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        cp = ContextParallel(attn, length, balance=balancer, doc_ids=doc_ids)
        synchronize()
        plan_ms = (time.perf_counter() - start) * 1e3
        shards = leaves(*(cp.shard(t) for t in (q, k, v)))
        grad_shard = cp.shard(grad)

        ms = timed(step_of(shards, lambda: cp(*shards).backward(grad_shard)), repeats)
        out = cp.unshard(cp(*shards).detach())
        dq = cp.unshard(shards[0].grad)
        rows.append(("flexspec CP", balancer, ms, imbalance_of(cp, attn, doc_ids), plan_ms,
                     error(out, reference), error(dq, reference_dq)))
    return rows


def imbalance_of(cp, attn, doc_ids) -> float:
    """max/mean of the key tiles over the ranks' blocks (every rank's blocks gathered)."""
    mask = attn.block_mask(cp.padded, cp.padded, device=DEVICE,
                           kv_lengths=torch.tensor([cp.seq_len], device=DEVICE), **cp.bindings)
    mine = cp.blocks.to(DEVICE)
    every = [torch.empty_like(mine) for _ in range(cp.ranks)]
    dist.all_gather(every, mine)
    return balance.imbalance(balance.block_work(mask).cpu(), [b.cpu() for b in every])


class Attend(torch.nn.Module):
    """The module torch's context parallelism wraps: compiled ``flex_attention``."""

    def __init__(self):
        super().__init__()
        self.attend = torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def forward(self, q, k, v, block_mask):
        return self.attend(q, k, v, block_mask=block_mask)


def torch_cp_module():
    """The device mesh of every rank, and :class:`Attend` under torch's context parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),), mesh_dim_names=("cp",))
    return mesh, parallelize_module(Attend(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))


def torch_cp_rows(length, q, k, v, grad, mask, reference, reference_dq, repeats, mesh,
                  module):
    """torch's context parallelism for FlexAttention, head-tail (its default) and none."""
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard, _HeadTailLoadBalancer, context_parallel_unshard)

    ranks = dist.get_world_size()
    rows = []
    for name in ("head_tail (default)", "none"):
        if length % (ranks * BLOCK * (2 if name != "none" else 1)):
            # torch's documented limit (its _create_cp_block_mask raises; sharding does not)
            rows.append(("torch CP", name, None, None, None, None, None))
            continue
        balancer = _HeadTailLoadBalancer(length, ranks, DEVICE) if name != "none" else None
        blocks = length // BLOCK
        assignment = (balance.head_tail(blocks, ranks) if balancer
                      else balance.contiguous(blocks, ranks))
        work = balance.block_work(mask).cpu()
        synchronize()
        start = time.perf_counter()
        *shards, shard_mask = _context_parallel_shard(mesh, [q, k, v, grad, mask], [2] * 5,
                                                      load_balancer=balancer)
        synchronize()
        plan_ms = (time.perf_counter() - start) * 1e3
        grad_shard = shards.pop()
        shards = flex_leaves(*shards)

        ms = timed(step_of(shards, lambda: flex_backward(module(*shards, block_mask=shard_mask),
                                                         grad_shard)), repeats)
        out = module(*shards, block_mask=shard_mask).detach()
        dq = shards[0].grad if shards[0].grad is not None else torch.zeros_like(out)
        out, dq = context_parallel_unshard(mesh, [out, dq], [2, 2], load_balancer=balancer)
        rows.append(("torch CP", name, ms, balance.imbalance(work, assignment), plan_ms,
                     error(out, reference),
                     error(dq, reference_dq) if DEVICE == "cuda" else None))
    return rows


def one_device_rows(length, ranks, q, k, v, grad, doc_ids, repeats) -> list:
    """``--one-device``: each rank's attention of each balancer run in turn on this device,
    without collectives (a rank's rows against the whole keys, as ``ContextParallel`` runs
    them: :meth:`flexspec.runtime.attention.Attention.at_rows`). ``(balancer, slowest rank ms,
    fastest rank ms, 1-device ms / slowest, max/mean work, largest output error)``."""
    attn = flexspec.compile(SPEC)
    leaf = leaves(q, k, v)

    single = timed(step_of(leaf, lambda: attn(*leaf, doc_ids=doc_ids).backward(grad)), repeats,
                   ranks=False)
    reference = attn(q, k, v, doc_ids=doc_ids).detach()
    work = balance.block_work(attn.block_mask(length, length, device=DEVICE,
                                              doc_ids=doc_ids)).cpu()
    blocks, at_rows = length // BLOCK, attn.at_rows()
    rows = [("1 device", single, single, None, None, None)]
    for name, assignment in (("flexspec", balance.balanced(work, ranks)),
                             ("head_tail", balance.head_tail(blocks, ranks)),
                             ("none", balance.contiguous(blocks, ranks))):
        times, worst = [], 0.0
        for own in assignment:
            positions = (own.view(-1, 1) * BLOCK + torch.arange(BLOCK)).reshape(-1).to(DEVICE)
            mine = leaves(q[:, :, positions], k, v)
            mine_grad = grad[:, :, positions]
            times.append(timed(step_of(mine, lambda: at_rows(
                *mine, context_q_position=positions, doc_ids=doc_ids).backward(mine_grad)),
                repeats, ranks=False))
            out = at_rows(*mine, context_q_position=positions, doc_ids=doc_ids)
            worst = max(worst, error(out, reference[:, :, positions]))
        rows.append((name, max(times), min(times), single / max(times),
                     balance.imbalance(work, assignment), worst))
    return rows


def one_device_table(length: int, ranks: int, rows: list) -> None:
    for name, slowest, fastest, bound, work, worst in rows:
        print(f"| {length} | {name} | {slowest:.1f} | {fastest:.1f} | {cell(bound, '.2f')} "
              f"| {cell(work, '.3f')} | {cell(worst, '.1e')} |")


def one_device(args) -> None:
    """The ``--one-device`` run (see :func:`one_device_rows`), no process group."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    ranks = args.one_device
    print(f"{SPEC}, B=1, H={args.heads}, D={args.dim}, forward+backward, {ranks} ranks' "
          f"attention in turn on one device (no collectives), torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}")
    print("| tokens | balancer | slowest rank ms | fastest rank ms | speed-up bound "
          "| max/mean work | out error |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        if length % (2 * ranks * BLOCK):
            print(f"| {length} | not a multiple of 2 x {ranks} ranks x {BLOCK}: skipped "
                  "| | | | | |")
            continue
        generator = torch.Generator(device=DEVICE).manual_seed(length)
        q, k, v, grad = (torch.randn(1, args.heads, length, args.dim, device=DEVICE,
                                     dtype=dtype, generator=generator) for _ in range(4))
        one_device_table(length, ranks, one_device_rows(
            length, ranks, q, k, v, grad, doc_ids_for(length, DEVICE), args.repeats))
        sys.stdout.flush()


def cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def header(ranks: int) -> None:
    print(f"| tokens | implementation | balancer | ms / step | speed-up on {ranks} GPUs "
          "| max/mean work | plan ms | out error | dq error |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")


def table(rows: list) -> None:
    """The rows of each length, printed as each length is done (a run cut short keeps them)."""
    for length, rows_of_length in rows:
        single = {row[1]: row[2] for row in rows_of_length if row[0] == "1 GPU"}
        for where, name, ms, work, plan_ms, out_error, dq_error in rows_of_length:
            if ms is None:
                print(f"| {length} | {where} | {name} | not supported | | | | | |")
                continue
            base = single["flexspec" if where == "flexspec CP" else "hand-written flex"]
            speedup = None if where == "1 GPU" else base / ms
            print(f"| {length} | {where} | {name} | {ms:.1f} | {cell(speedup, '.2f')} "
                  f"| {cell(work, '.3f')} | {cell(plan_ms, '.0f')} | {cell(out_error, '.1e')} "
                  f"| {cell(dq_error, '.1e')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 200000])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--one-device", type=int, metavar="RANKS",
                        help="run each of RANKS ranks' attention in turn on one device, "
                             "without torchrun or collectives")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.one_device:
        return one_device(args)
    rank = int(os.environ["LOCAL_RANK"])
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device(DEVICE, rank))
    else:
        dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    if rank == 0:
        print(f"{SPEC}, B=1, H={args.heads}, D={args.dim}, forward+backward, {ranks} ranks, "
              f"torch {torch.__version__}, "
              f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}")
        header(ranks)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    try:
        try:
            mesh, module = torch_cp_module()
        except ImportError as failure:
            mesh = module = None
            if rank == 0:
                print(f"no torch CP: {failure}")
        for length in args.lengths:
            generator = torch.Generator(device=DEVICE).manual_seed(length)
            q, k, v, grad = (torch.randn(1, args.heads, length, args.dim, device=DEVICE,
                                         dtype=dtype, generator=generator)
                             for _ in range(4))
            doc_ids = doc_ids_for(length, DEVICE)
            rows, reference, reference_dq, mask = plain_rows(length, q, k, v, grad,
                                                                 doc_ids, args.repeats)
            rows += flexspec_cp_rows(length, q, k, v, grad, doc_ids, reference, reference_dq,
                                     args.repeats)
            try:
                if module is not None:
                    rows += torch_cp_rows(length, q, k, v, grad, mask, reference,
                                          reference_dq, args.repeats, mesh, module)
            except (ImportError, NotImplementedError) as failure:
                if rank == 0:
                    print(f"torch CP at {length}: {type(failure).__name__}: {failure}")
            if rank == 0:
                table([(length, rows)])
                sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
