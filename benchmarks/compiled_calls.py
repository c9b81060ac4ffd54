"""Host time of flexspec's compiled calls that need no compile, as flexspec makes them (the
cached code dynamo's guards accept, flexspec.kernels.replay.run_cached, or, for a block-mask
program called again at the same shapes, the code kept for them with no guards,
flexspec.kernels.replay.ExactReplays) and through dynamo's frame evaluation.

Four kinds of call, each timed both ways in alternating rounds (``--calls`` calls each,
medians):

* ``growing step``: a model step of ``--layers`` layers at a new key length every step, as a
  growing cache's decoding makes them: a new plan, a new block mask, the first layer's compiled
  FlexAttention call (the one this changes), and the later layers' replays (the same both ways);
* ``mask program``: the compiled block-mask program of ``causal & key_padding`` (left-padded
  rows, as ``generate()`` gives them) at a new key length every call, the program a GPU builds
  a decoding step's block mask with (on the CPU built here by the same program, which flexspec
  itself uses only on CUDA);
* ``mask program, same shapes``: the same program at one length, with fresh padding every call
  (as a static cache's steps or a training step's fresh bindings call it);
* ``mask program, decoding's form``: the program of the partial form FlexAttention's decoding
  kernel reads, at a new length every call (built at the length rounded up to whole tiles, so
  that its calls repeat their signature for a tile's worth of steps).

Inputs: CUDA, one new token (Hq=32, Hkv=8, D=128, bf16, B=8) against a cache that grows from
``--cache``; CPU, 130 query rows (shorter calls run on the dense reference there) against a
cache that grows from 300 keys, float32, B=1, Hq=4, Hkv=2, D=16. On the CPU the kernels' time is
in both columns and the difference is the host's; on CUDA the calls are queued without
synchronising inside a round. The last step of each way is compared with flexspec's float64
reference. The last lines printed are the table (markdown).

    python benchmarks/compiled_calls.py --device cuda
    python benchmarks/compiled_calls.py --device cpu --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from flexspec.kernels import fused_blocks, generations, replay  # noqa: E402
from gpu import alternate, median_difference  # noqa: E402

SPECS = ("causal + softcap(30)", "causal & (window(4096) | sink(4))")
MASK = "causal & key_padding"
WARMUP = 5


@contextlib.contextmanager
def through_dynamo(on: bool):
    """Every compiled call through dynamo's frame evaluation (``on``), or as flexspec makes it."""
    real, exact = generations.run_cached, replay.ExactReplays.call
    if on:
        generations.run_cached = lambda function, args: replay.MISSED
        replay.ExactReplays.call = lambda self, args, lengths, through: through()
    try:
        yield
    finally:
        generations.run_cached, replay.ExactReplays.call = real, exact


class Growing:
    """A cache that grows by one key per call: each call gets the next length."""

    def __init__(self, device, start: int, calls: int):
        generator = torch.Generator(device=device).manual_seed(0)
        if device.type == "cuda":
            batch, heads, kv_heads, self.rows, dim, dtype = 8, 32, 8, 1, 128, torch.bfloat16
        else:
            batch, heads, kv_heads, self.rows, dim, dtype = 1, 4, 2, 130, 16, torch.float32
        self.start, self.lengths = start, itertools.count(start)
        longest = start + calls + 1
        self.q = torch.randn(batch, heads, self.rows, dim, device=device, dtype=dtype,
                             generator=generator)
        self.k = torch.randn(batch, kv_heads, longest, dim, device=device, dtype=dtype,
                             generator=generator)
        self.v = torch.randn_like(self.k)
        # left padding: row i starts at key 3 * i
        keys = torch.arange(longest, device=device)
        self.valid = keys >= 3 * torch.arange(batch, device=device).reshape(-1, 1)

    def step(self, attn, layers: int, dynamo: bool):
        """One step of ``layers`` layers at the next length: its last layer's output, the key
        length and the offset."""
        length = next(self.lengths)
        k, v = self.k[:, :, :length], self.v[:, :, :length]
        offset = length - self.rows
        with through_dynamo(dynamo):
            step = flexspec.Step(q_offset=offset)
            for _ in range(layers):
                out = attn(self.q, k, v, step=step)
        return out, length, offset

    def mask(self, mask, block, compiler: str, dynamo: bool, grows: bool = True,
             partial: bool = False):
        """The block mask of ``mask`` at the next length (or, unless ``grows``, at the first
        length again, with a fresh copy of the padding), in decoding's form with ``partial``."""
        length = next(self.lengths) if grows else self.start
        sizes = {"B": self.q.shape[0], "H": 1, "Q_LEN": self.rows, "KV_LEN": length}
        valid = self.valid[:, :length]
        with through_dynamo(dynamo):
            return fused_blocks.fused_block_mask(
                mask, sizes, block, {key: valid if grows else valid.clone() for key in
                                     flexspec.ir.tensor_keys(mask)},
                self.q.device, batch=sizes["B"], heads=1, compiler=compiler, partial=partial)


def check(attn, growing: Growing, out, length: int, offset: int) -> float:
    q, k, v = growing.q[:1], growing.k[:1, :, :length], growing.v[:1, :, :length]
    want = attn.reference(q, k, v, q_offset=offset)
    return (out[:1].double() - want).abs().max().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cache", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    parser.add_argument("--mask-compiler", default=fused_blocks.COMPILER,
                        help="the block-mask program's torch.compile backend")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: try --device cpu", file=sys.stderr)
        return 1
    start = args.cache if device.type == "cuda" else 300
    calls = args.calls if device.type == "cuda" else max(1, args.calls // 10)
    total = 2 * (WARMUP + args.rounds * calls) + 8
    rows = []
    with torch.no_grad():
        for text in args.specs.split(";"):
            attn = flexspec.compile(text)
            growing = Growing(device, start, total)
            last = {}
            functions = {name: (lambda name=name, dynamo=dynamo: last.__setitem__(
                name, growing.step(attn, args.layers, dynamo)))
                for name, dynamo in (("through dynamo", True), ("flexspec", False))}
            times = alternate(functions, device, calls, args.rounds, warmup=WARMUP)
            for name, (out, length, offset) in last.items():
                error = check(attn, growing, out, length, offset)
                if error > (5e-2 if out.dtype == torch.bfloat16 else 1e-4):
                    print(f"{text} ({name}): max error {error:.3g} against the reference")
                    return 1
            rows.append(row(f"growing step of {args.layers} layers, `{text}`", times))
            print(rows[-1], flush=True)
        mask = flexspec.compile(MASK).ir.mask
        for label, grows, partial in (("", True, False), (", same shapes", False, False),
                                      (", decoding's form", True, True)):
            growing = Growing(device, start, total)
            functions = {name: (lambda dynamo=dynamo: growing.mask(
                mask, (128, 128), args.mask_compiler, dynamo, grows, partial))
                for name, dynamo in (("through dynamo", True), ("flexspec", False))}
            if not grows:  # the same mask both ways (the third call replays the kept code)
                built = [functions["flexspec"]() for _ in range(3)] + [
                    functions["through dynamo"]()]
                if not all(torch.equal(one.kv_indices, built[0].kv_indices) for one in built):
                    print(f"mask program{label}: the two ways built different masks")
                    return 1
            times = alternate(functions, device, calls, args.rounds, warmup=WARMUP)
            rows.append(row(f"mask program{label}, `{MASK}`", times))
            print(rows[-1], flush=True)
    print(f"\n{device.type}, us per call (median of {args.rounds} rounds)\n")
    print("| call | through dynamo | flexspec | saved per call |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))
    return 0


def row(name: str, times: dict) -> str:
    plain = statistics.median(times["through dynamo"])
    ours = statistics.median(times["flexspec"])
    saved = median_difference(times["through dynamo"], times["flexspec"])
    return f"| {name} | {plain:.1f} | {ours:.1f} | {saved:+.1f} |"


if __name__ == "__main__":
    raise SystemExit(main())
