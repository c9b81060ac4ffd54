"""Host time of a model step's later layer: the launch its first layer resolved, with the
compiled kernel's code replayed without dynamo's guards (flexspec.kernels.replay.Replay), run
after a check of its guards only (flexspec.kernels.replay.run_cached), and through dynamo's
frame evaluation.

For each spec, one step's later-layer call ``attn(q, k, v, step=step)`` is timed in alternating
rounds (``--calls`` calls each, medians), all three ways, on the same inputs:

* CUDA: one new token against a ``--cache`` long cache (Hq=32, Hkv=8, D=128, bf16, B=8); the
  calls are queued without synchronising inside a round, so the time is the host's;
* CPU: 130 query rows (shorter calls run on the dense reference there) against 512 keys,
  float32, B=1: the kernel's own time is in every column, the differences are the host's.

The outputs of every way are compared with flexspec's float64 reference. The last lines
printed are the table (markdown).

    python benchmarks/step_replay.py --device cuda --cache 32768
    python benchmarks/step_replay.py --device cpu --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from flexspec.kernels import generations, replay  # noqa: E402
from flexspec.runtime import flexattention  # noqa: E402
from gpu import alternate, median_difference  # noqa: E402

SPECS = ("causal + softcap(30)", "sliding_window(4096)", "causal & (window(4096) | sink(4))",
         "causal + alibi")


def inputs(device, cache: int) -> tuple:
    generator = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        batch, heads, kv_heads, rows, dim, dtype = 8, 32, 8, 1, 128, torch.bfloat16
    else:
        batch, heads, kv_heads, rows, dim, dtype = 1, 4, 2, 130, 16, torch.float32
        cache = 512
    q = torch.randn(batch, heads, rows, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(batch, kv_heads, cache, dim, device=device, dtype=dtype, generator=generator)
    return q, k, torch.randn_like(k), cache - rows


WAYS = {"replayed": (True, True), "guards checked": (False, True),
        "through dynamo": (False, False)}


@contextlib.contextmanager
def checked_runs(on: bool):
    """Compiled calls that run the cached code their guards accept (``on``) or go through
    dynamo."""
    real = generations.run_cached
    if not on:
        generations.run_cached = lambda function, args: replay.MISSED
    try:
        yield
    finally:
        generations.run_cached = real


def later_layer(text, q, k, v, offset, replays: bool, checked: bool):
    """A step whose launch is resolved (with or without a replay), and its later-layer call (an
    Attention of its own each way: a plan keeps the replay of its first call), whose compiled
    calls run the cached code their guards accept or go through dynamo (``checked``)."""
    attn = flexspec.compile(text)
    step = flexspec.Step(q_offset=offset)
    real = flexattention.Replay.of
    if not replays:
        flexattention.Replay.of = lambda entry, args: None
    try:
        attn(q, k, v, step=step)  # the first layer: plans (and compiles)
        attn(q, k, v, step=step)  # resolves the launch
    finally:
        flexattention.Replay.of = real

    def call():
        with checked_runs(checked):
            return attn(q, k, v, step=step)
    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cache", type=int, default=32768)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: try --device cpu", file=sys.stderr)
        return 1
    q, k, v, offset = inputs(device, args.cache)
    calls = args.calls if device.type == "cuda" else max(1, args.calls // 20)
    rows = []
    with torch.no_grad():
        for text in args.specs.split(";"):
            functions = {name: later_layer(text, q, k, v, offset, *way)
                         for name, way in WAYS.items()}
            want = flexspec.compile(text).reference(q[:1], k[:1], v[:1], q_offset=offset)
            for name, fn in functions.items():
                error = (fn()[:1].double() - want).abs().max().item()
                if error > (5e-2 if q.dtype == torch.bfloat16 else 1e-4):
                    print(f"{text} ({name}): max error {error:.3g} against the reference")
                    return 1
            times = alternate(functions, device, calls, args.rounds, warmup=5)
            plain = times["through dynamo"]
            cells = [f"{statistics.median(plain):.1f}"] + [
                f"{statistics.median(times[name]):.1f} "
                f"({median_difference(times[name], plain):+.1f})"
                for name in ("guards checked", "replayed")]
            rows.append(f"| `{text}` | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    print(f"\n{device.type}, us per later-layer call (median of {args.rounds} rounds; in "
          "brackets, the median difference to the call through dynamo)\n")
    print("| spec | through dynamo | guards checked | replayed |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
