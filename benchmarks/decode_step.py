"""A whole model's decode step on a GPU: every layer's attention call sharing one
``flexspec.Step``, eager and captured in a CUDA graph, against the sum of its kernels.

For each spec, ``LAYERS`` layers of one new token against a preallocated cache (Hq=32, Hkv=8,
D=128, bf16, valid lengths ``kv_lengths`` per row, a tensor updated in place, as transformers'
static cache keeps them):

* ``eager``: ``model_step()`` called as is (one ``Step``, the first layer plans, the others only
  launch), ``do_bench``'s median;
* ``captured``: the same step captured once in a CUDA graph and replayed (each replay builds
  the block mask from the lengths as they are then, and every layer launches with it);
* ``kernels``: the sum of the CUDA kernels one eager step runs (torch.profiler over 10 steps);
* ``captured / kernels``: the issue's target is at most 1.1.

Each layer's output of the last replay is checked against flexspec's float64 reference on one
batch row. The last lines printed are the table (markdown).

    python benchmarks/decode_step.py --layers 8 --cache 32768 --batch 8
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402

SPECS = ["causal_bottom_right & (window(4096) | sink(4))", "causal_bottom_right & doc",
         "causal_bottom_right + alibi", "causal_bottom_right + softcap(30)"]
HEADS, KV_HEADS, DIM = 32, 8, 128
DOCUMENTS = 8


def bench_ms(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def kernels_ms(fn, steps: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    spent = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spent[event.name] += event.device_time / steps
    return sum(spent.values()) / 1e3


def measure(text: str, layers: int, cache: int, batch: int) -> dict:
    attn = flexspec.compile(text)
    generator = torch.Generator(device="cuda").manual_seed(0)
    queries = [torch.randn(batch, HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16,
                           generator=generator) for _ in range(layers)]
    caches = [[torch.randn(batch, KV_HEADS, cache, DIM, device="cuda", dtype=torch.bfloat16,
                           generator=generator) for _ in range(2)] for _ in range(layers)]
    # rows at different lengths, up to the whole cache
    lengths = torch.linspace(cache // 2, cache - 64, batch, device="cuda").long()
    ids = (torch.arange(cache, device="cuda") * DOCUMENTS // cache).expand(batch, cache)
    bindings = {"doc_ids": ids.contiguous()} if "doc" in text else {}

    def model_step():
        step = flexspec.Step(kv_lengths=lengths, **bindings)
        return [attn(q, k, v, step=step) for q, (k, v) in zip(queries, caches)]

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model_step()
        torch.cuda.current_stream().wait_stream(side)
        eager = bench_ms(model_step)
        kernels = kernels_ms(model_step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = model_step()
        captured = bench_ms(graph.replay)
        lengths += 1
        graph.replay()
        errors = []
        n = int(lengths[0])
        for layer, (q, (k, v)) in enumerate(zip(queries, caches)):
            row = {name: t[:1, :n] for name, t in bindings.items()}
            ref = attn.reference(q[:1].double(), k[:1, :, :n].double(), v[:1, :, :n].double(),
                                 **row)
            errors.append(((outs[layer][:1].double() - ref).norm() / ref.norm()).item())
    return {"spec": text, "layers": layers, "cache": cache, "batch": batch, "eager": eager,
            "captured": captured, "kernels": kernels, "error": max(errors)}


def table(rows) -> str:
    lines = ["| spec | layers | cache | B | eager ms | captured ms | kernels ms | "
             "captured / kernels | rel. error |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| `{r['spec']}` | {r['layers']} | {r['cache'] // 1024}K | {r['batch']} | "
                     f"{r['eager']:.3f} | {r['captured']:.3f} | {r['kernels']:.3f} | "
                     f"{r['captured'] / r['kernels']:.3f} | {r['error']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cache", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_step.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for text in args.specs.split(";"):
        rows.append(measure(text.strip(), args.layers, args.cache, args.batch))
        print(rows[-1], flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
