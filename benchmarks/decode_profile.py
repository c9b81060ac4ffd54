"""Where a warm decode call's time goes: a diagnostic behind the decode tables of
docs/performance.md.

For each spec (one new token against a cache, Hq=32, Hkv=8, D=128, bf16), a warm flexspec call, a
later layer's call of a model step (``flexspec step``: ``attn(q, k, v, step=step)`` once the
step's first layers have run) and the hand-written FlexAttention call of ``benchmarks/decode.py``
are each timed three ways:

* ``host us``: the Python time of one call, launches included, with the GPU left to run (the
  mean over 200 calls timed without synchronising, then one synchronisation);
* ``gpu us``: the sum of the CUDA kernels one call runs (torch.profiler over 20 calls);
* ``bench us``: ``triton.testing.do_bench``'s median, what decode.py reports.

A call whose ``bench`` is near its ``host`` is bound by the host; one near its ``gpu`` by its
kernels. The kernels of each call are listed with their mean time. ``--after-loops`` first runs
growing-cache loops of every spec (as decode.py does before the later specs), to see whether
kernels compiled for dynamic lengths are slower.

    python benchmarks/decode_profile.py --cache 32768 --batch 8
    python benchmarks/decode_profile.py --specs "causal + softcap(30)" --after-loops
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from decode import DIM, DOCUMENTS, HEADS, KV_HEADS, SPECS, hand_mask, hand_score  # noqa: E402

HOST_CALLS = 200
PROFILED_CALLS = 20


def host_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    spent = 0.0
    for _ in range(HOST_CALLS):
        started = time.perf_counter()
        fn()
        spent += time.perf_counter() - started
    torch.cuda.synchronize()
    return spent / HOST_CALLS * 1e6


def kernels(fn) -> dict:
    """Mean CUDA time per call of each kernel ``fn`` launches, in us."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    found = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            found[event.name] += event.device_time / PROFILED_CALLS
    return dict(found)


def bench_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def loops(q, k, v, ids, length) -> None:
    """Growing-cache loops of every spec (compiles their kernels for dynamic lengths)."""
    for text in SPECS:
        attn = flexspec.compile(text)
        for n in range(length, length + 4):
            bindings = {"doc_ids": ids[:, :n]} if "doc" in text else {}
            attn(q, k[:, :, :n], v[:, :, :n], q_offset=n - 1, **bindings)
    torch.cuda.synchronize()


def profile_spec(text, q, k, v, ids, length, batch) -> list[tuple]:
    attn = flexspec.compile(text)
    position = length - 1
    kc, vc = k[:, :, :length], v[:, :, :length]
    bindings = {"doc_ids": ids[:, :length]} if "doc" in text else {}
    mask = create_block_mask(hand_mask(text, position, ids), batch if bindings else None, None, 1,
                             length, device=q.device, _compile=True)
    compiled = torch.compile(flex_attention)
    score_mod = hand_score(text, position, q.device)
    step = flexspec.Step(q_offset=position, **bindings)
    calls = {
        "flexspec": lambda: attn(q, kc, vc, q_offset=position, **bindings),
        # a later layer of a model step: the launch the step's first layers resolved
        "flexspec step": lambda: attn(q, kc, vc, step=step),
        "hand flex": lambda: compiled(q, kc, vc, score_mod=score_mod, block_mask=mask,
                                      enable_gqa=True),
    }
    explanation = attn.explain(q, kc, vc, q_offset=position, **bindings)
    print(f"\n## {text} (B={batch}, cache {length}): flexspec on "
          f"{explanation.choice.backend} ({explanation.choice.reason})", flush=True)
    rows = []
    for name, fn in calls.items():
        found = kernels(fn)
        gpu = sum(found.values())
        rows.append((text, name, host_us(fn), gpu, bench_us(fn)))
        print(f"{name}: host {rows[-1][2]:.1f} us, gpu {gpu:.1f} us, bench {rows[-1][4]:.1f} us")
        for kernel, spent in sorted(found.items(), key=lambda item: -item[1])[:8]:
            print(f"    {spent:8.1f} us  {kernel[:110]}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    parser.add_argument("--after-loops", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_profile.py needs a CUDA GPU", file=sys.stderr)
        return 1
    torch._dynamo.config.recompile_limit = 256
    length, batch = args.cache, args.batch
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = length + 8
    k = torch.randn(batch, KV_HEADS, total, DIM, device="cuda", dtype=torch.bfloat16,
                    generator=generator)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16,
                    generator=generator)
    ids = (torch.arange(total, device="cuda") * DOCUMENTS // total).expand(batch, total)
    ids = ids.contiguous()
    rows = []
    with torch.no_grad():
        if args.after_loops:
            loops(q, k, v, ids, length)
        for text in args.specs.split(";"):
            rows += profile_spec(text.strip(), q, k, v, ids, length, batch)
    print(f"\n| spec | call | host us | gpu us | bench us |\n|---|---|---|---|---|")
    for text, name, host, gpu, bench in rows:
        print(f"| `{text}` | {name} | {host:.1f} | {gpu:.1f} | {bench:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
