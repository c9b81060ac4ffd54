"""Benchmark: which kernel decodes `causal` fastest as the batch grows, on a GPU.

One new token at the end of a cache (``benchmarks/decode.py``'s shapes: Hq=32, Hkv=8, D=128,
bf16), for each cache length and batch size, a warm call's time (``triton.testing.do_bench``
median, ms) of:

* ``flexspec auto``: ``flexspec.compile("causal")`` with ``q_offset`` (the token sees every
  key, so it runs unmasked; on SDPA that is without cuDNN, in runs of batch rows, see
  :mod:`flexspec.runtime.backends.sdpa`);
* ``flexspec flex``: the same on ``backend="flex"`` (FlexAttention's decoding kernel);
* ``SDPA one call``: ``scaled_dot_product_attention`` over the whole batch with cuDNN left out,
  as flexspec ran decoding calls before it cut them into runs;
* ``cuDNN``: SDPA on cuDNN alone (fast at a fixed key length, but it builds a new plan for every
  new length: flexspec.workarounds ``cudnn-decode-plans``);
* ``floor``: the bytes of the keys and values at 4.3 TB/s.

Each output is checked against flexspec's float64 reference on the first batch row. The last
lines printed are the table (markdown).

    python benchmarks/decode_batches.py
    python benchmarks/decode_batches.py --caches 32768 --batches 16 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from decode import BANDWIDTH, DIM, KV_HEADS, bench, decode_inputs  # noqa: E402

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
COLUMNS = ("flexspec auto", "flexspec flex", "SDPA one call", "cuDNN")


def calls(q, k, v, length: int) -> dict:
    """The column's calls, by column name."""
    auto, flex = flexspec.compile("causal"), flexspec.compile("causal", backend="flex")

    def one_sdpa_call():
        with sdpa_kernel(NOT_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return {"flexspec auto": lambda: auto(q, k, v, q_offset=length - 1),
            "flexspec flex": lambda: flex(q, k, v, q_offset=length - 1),
            "SDPA one call": one_sdpa_call, "cuDNN": cudnn}


def measure(length: int, batch: int) -> dict:
    # a fresh dynamo cache for each: a second batch size would make the batch dynamic
    torch._dynamo.reset()
    q, k, v = decode_inputs(batch, length)
    want = flexspec.compile("causal").reference(q[:1], k[:1], v[:1], q_offset=length - 1)
    row = {"cache": length, "batch": batch,
           "floor": 2 * batch * KV_HEADS * length * DIM * 2 / BANDWIDTH * 1e3}
    with torch.no_grad():
        for name, call in calls(q, k, v, length).items():
            got = call()
            error = ((got[:1].double() - want).norm() / want.norm()).item()
            if error > 2e-2:
                raise AssertionError(f"{name} at {length} keys, B={batch}: relative error "
                                     f"{error:.1e} against the float64 reference")
            row[name] = bench(call)
    return row


def table(rows) -> str:
    lines = ["| cache | B | " + " | ".join(COLUMNS) + " | floor | auto / floor |",
             "|" + "---|" * (len(COLUMNS) + 4)]
    for r in rows:
        cells = " | ".join(f"{r[name]:.3f}" for name in COLUMNS)
        lines.append(f"| {r['cache'] // 1024}K | {r['batch']} | {cells} | {r['floor']:.3f} | "
                     f"{r['flexspec auto'] / r['floor']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caches", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_batches.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for length in args.caches:
        for batch in args.batches:
            rows.append(measure(length, batch))
            print(rows[-1], flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
