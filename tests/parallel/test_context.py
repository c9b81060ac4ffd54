"""parallel.context: a spec's attention with the sequence sharded over ranks (torch.distributed,
gloo, processes on the CPU) equals the single-process call, forward and gradients of q, k and
v, for several specs, lengths that are not multiples of ranks x 128, GQA, a binding, and every
balancer."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexspec
from flexspec.parallel import balance as balancers
from flexspec.parallel.context import ContextParallel

CASES = [  # (spec, length, balance)
    ("causal", 300, "flexspec"),
    ("causal & doc", 520, "ptrr"),
    ("sliding_window(100) + alibi", 300, "head_tail"),
    ("prefix_lm(77)", 260, "none"),
    ("causal & doc", 513, "flexspec"),
    ("softcap(20)", 300, "flexspec"),  # reads no position
]


def _inputs(length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, length, 16, generator=generator)
    k, v = (torch.randn(2, 2, length, 16, generator=generator) for _ in range(2))
    weight = torch.randn(2, 4, length, 16, generator=generator)
    doc_ids = torch.sort(torch.randint(0, 4, (2, length), generator=generator)).values
    return q, k, v, weight, doc_ids


def _check(rank, world, path, cases, backend):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for text, length, balance in cases:
            attn = flexspec.compile(text, backend=backend)
            q, k, v, weight, doc_ids = _inputs(length)
            bindings = {"doc_ids": doc_ids} if "doc" in text else {}
            # the single-process call
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            want = attn(*full, **bindings)
            (want * weight).sum().backward()
            # sharded: each rank's loss over its own rows, the gradients summed over ranks
            cp = ContextParallel(attn, length, balance=balance, **bindings)
            if balance in ("flexspec", "ptrr"):  # the shares' work is the whole mask's
                whole_mask = attn.block_mask(cp.padded, cp.padded, batch=2,
                                             kv_lengths=torch.full((2,), length),
                                             **cp.bindings)
                chosen = getattr(balancers, "balanced" if balance == "flexspec" else "ptrr")(
                    balancers.block_work(whole_mask), world)
                assert torch.equal(cp.blocks, chosen[rank]), (text, balance)
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            shards = [cp.shard(t) for t in whole]
            out = cp(*shards)
            (out * cp.shard(weight)).sum().backward()
            torch.testing.assert_close(cp.unshard(out.detach()), want.detach(),
                                       rtol=1e-5, atol=1e-5, msg=f"{text} forward")
            with torch.no_grad():  # a given scale, and the log-sum-exp of each row
                got, lse = cp(*(cp.shard(t) for t in (q, k, v)), scale=0.3, return_lse=True)
                out_ref, lse_ref = attn(q, k, v, scale=0.3, return_lse=True, **bindings)
            torch.testing.assert_close(cp.unshard(got), out_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cp.unshard(lse), lse_ref, rtol=1e-5, atol=1e-5)
            for name, mine, single in zip("qkv", whole, full):
                grad = mine.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, single.grad, rtol=1e-4, atol=1e-5,
                                           msg=f"{text} d{name}")
        _leave_together()
    finally:
        dist.destroy_process_group()
    _exit_now()


def _leave_together() -> None:
    """Wait for every rank before tearing the group down: a rank that destroyed its gloo group
    while another still used its connections aborted the other ("terminate called without an
    active exception", CI on 2026-12-05). Not in a failing rank's path, which must not wait."""
    dist.barrier()


def _exit_now() -> None:
    """End a rank that passed every check without Python's interpreter teardown: gloo's worker
    threads may still hold work objects then, whose destruction aborted a rank at exit ("terminate
    called without an active exception", CI twice on 2026-12-05, the barrier before the
    teardown notwithstanding). A rank that failed raises before this, and spawn reports it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world, tmp_path, cases, backend):
    mp.spawn(_check, args=(world, str(tmp_path / "rendezvous"), cases, backend), nprocs=world,
             join=True)


def _check_chunks(rank, world, path):
    """Each rank gives its contiguous chunk of doc_ids and of q: the plan and the shards equal
    those made from the whole tensors, and q's chunk gets the gradient of its positions."""
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        attn = flexspec.compile("causal & doc", backend="reference")
        length = 515  # chunks of 258 and 257: not a multiple of anything here
        q, _, _, weight, doc_ids = _inputs(length)
        size = -(-length // world)
        mine = slice(rank * size, min((rank + 1) * size, length))
        whole = ContextParallel(attn, length, doc_ids=doc_ids)
        chunked = ContextParallel.from_chunks(attn, length, doc_ids=doc_ids[:, mine])
        assert torch.equal(chunked.blocks, whole.blocks)
        assert torch.equal(chunked.bindings["doc_ids"], whole.bindings["doc_ids"])
        chunk = q[:, :, mine].clone().requires_grad_()
        shard = chunked.shard_chunk(chunk)
        assert torch.equal(shard.detach(), whole.shard(q))
        (shard * chunked.shard(weight)).sum().backward()
        # every position is some rank's row once: the gradient of a chunk is its weights
        torch.testing.assert_close(chunk.grad, weight[:, :, mine])
        with pytest.raises(flexspec.BindingError, match=f"rank {rank} of 2 holds "
                                                        f"{mine.stop - mine.start} of the 515 "
                                                        "positions along dim 1"):
            ContextParallel.from_chunks(attn, length, doc_ids=doc_ids)
        _leave_together()
    finally:
        dist.destroy_process_group()
    _exit_now()


def test_two_ranks_plan_and_shard_from_their_chunks(tmp_path):
    mp.spawn(_check_chunks, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


def test_two_ranks_equal_one_process(tmp_path):
    _spawn(2, tmp_path, CASES, "reference")


@pytest.mark.slow
def test_four_ranks_equal_one_process(tmp_path):
    _spawn(4, tmp_path, CASES, "reference")


@pytest.mark.slow
def test_two_ranks_on_the_compiled_kernels(tmp_path):
    """The same on flexspec's default backend: each run of a rank's blocks has 128 rows or
    more, so it runs on the compiled CPU kernels, forward and backward."""
    _spawn(2, tmp_path, [("causal & doc", 520, "flexspec")], "auto")


class _GradientAtTheGather(torch.autograd.Function):
    """Stands for the all-gather's output: records the gradient its backward (a
    reduce-scatter, which takes contiguous tensors only on NCCL) would be handed."""
    seen: list = []

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        _GradientAtTheGather.seen.append(gradient.is_contiguous())
        return gradient


@pytest.mark.parametrize("dim", [0, 2, 3])
def test_the_gradient_handed_back_to_the_all_gather_is_contiguous(monkeypatch, dim):
    from flexspec.parallel import context

    def two_ranks(tensor, gathered_dim, group):
        return _GradientAtTheGather.apply(torch.cat([tensor, 2 * tensor], gathered_dim))

    monkeypatch.setattr(context, "_all_gather", two_ranks)
    _GradientAtTheGather.seen = []
    shard = torch.randn(2, 3, 5, 4, requires_grad=True)
    laid = context._rank_after_rank(shard, dim, group="two ranks")
    assert laid.shape[dim] == 2 * shard.shape[dim]
    (laid * torch.randn_like(laid)).sum().backward()
    assert _GradientAtTheGather.seen == [True]


def test_a_plan_needs_torch_distributed(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(flexspec.BindingError, match="init_process_group"):
        ContextParallel(flexspec.compile("causal"), 300)


def test_bad_plans_and_shards_are_refused_with_what_to_do(tmp_path):
    """On one rank (a gloo group of one process): the errors of a plan and of its calls."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0,
                            world_size=1)
    try:
        attn = flexspec.compile("causal", backend="reference")
        with pytest.raises(flexspec.BindingError, match="balance must be one of none, "
                                                        "head_tail, per_document, ptrr, "
                                                        "flexspec, got 'greedy'"):
            ContextParallel(attn, 300, balance="greedy")
        with pytest.raises(flexspec.SpecError, match=r"aligns its queries at the end .* "
                                                     r"\(causal instead of causal_bottom_right\)"):
            ContextParallel(flexspec.compile("causal_bottom_right"), 300)
        with pytest.raises(flexspec.BindingError, match="seq_len must be a positive int"):
            ContextParallel(attn, 0)
        with pytest.raises(flexspec.BindingTypeError, match="group must be a torch.distributed "
                                                            "process group .* got str"):
            ContextParallel(attn, 300, group="world")
        # what torch.distributed.new_group gives a process outside the group
        with pytest.raises(flexspec.BindingError, match="this process is not a rank of the "
                                                        "group given"):
            ContextParallel(attn, 300, group=dist.GroupMember.NON_GROUP_MEMBER)
        with pytest.raises(flexspec.BindingError, match="needs documents: the block count of "
                                                        "each document, 3 blocks in all"):
            ContextParallel(attn, 300, balance="per_document")
        from flexspec.lang.library import load_text
        sizes = load_text("mask first_half() = q < Q_LEN / 2\n"
                          "score far(c: float = 1.0) = score - c * (KV_LEN - kv) / KV_LEN\n")
        with pytest.raises(flexspec.SpecError, match=r"reads Q_LEN, which inside a rank is not "
                                                     r"the sequence's \(300\): a rank runs"):
            ContextParallel(flexspec.compile("causal & first_half", library=sizes), 300)
        with pytest.raises(flexspec.SpecError, match=r"reads KV_LEN, .* padded to 384 "
                                                     "positions, a multiple of 128"):
            ContextParallel(flexspec.compile("causal + far", library=sizes), 300)
        ContextParallel(flexspec.compile("causal + far", library=sizes), 256)  # not padded
        cp = ContextParallel(attn, 300)
        assert cp.padded == 384 and cp.rows.tolist() == list(range(384))
        with pytest.raises(flexspec.BindingError, match=r"whole sequence \(300 positions\)"):
            cp.shard(torch.randn(1, 2, 299, 16))
        q, k, v, _, _ = _inputs(300)
        with pytest.raises(flexspec.BindingError, match=r"k must be this rank's shard, "
                                                        r"\(B, H, 384, D\)"):
            cp(cp.shard(q), k, cp.shard(v))
        torch.testing.assert_close(cp.unshard(cp(*(cp.shard(t) for t in (q, k, v)))),
                                   attn(q, k, v), rtol=1e-5, atol=1e-5)
        # the padded keys' lengths are kept per batch size: a call of one row, then of two
        # again (kept per device alone, the second size read the first one's lengths)
        for rows in (slice(0, 1), slice(0, 2)):
            torch.testing.assert_close(
                cp.unshard(cp(*(cp.shard(t[rows]) for t in (q, k, v)))), attn(
                    q[rows], k[rows], v[rows]), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


GPU_CASES = [  # (spec, length, balance): every run of a rank's blocks on the compiled kernels
    ("causal & doc", 1300, "flexspec"),
    ("sliding_window(200) + alibi", 1000, "head_tail"),
    ("causal", 777, "ptrr"),
]


def _check_on_gpus(rank, world, path):
    """One process a GPU (NCCL): each case against the float64 reference on one device."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        for text, length, balance in GPU_CASES:
            q, k, v, weight, doc_ids = (t.cuda() for t in _inputs(length))
            bindings = {"doc_ids": doc_ids} if "doc" in text else {}
            exact = [t.double().requires_grad_() for t in (q, k, v)]
            want = flexspec.compile(text, backend="reference")(*exact, **bindings)
            (want * weight.double()).sum().backward()
            cp = ContextParallel(flexspec.compile(text), length, balance=balance, **bindings)
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            out = cp(*(cp.shard(t) for t in whole))
            (out * cp.shard(weight)).sum().backward()
            torch.testing.assert_close(cp.unshard(out.detach()).double(), want.detach(),
                                       rtol=1e-4, atol=1e-4, msg=f"{text} forward")
            for name, mine, single in zip("qkv", whole, exact):
                grad = mine.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad.double(), single.grad, rtol=1e-3, atol=1e-3,
                                           msg=f"{text} d{name}")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_equal_the_float64_reference(tmp_path):
    mp.spawn(_check_on_gpus, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)
