"""Host time of planning a call at a key length not seen before: what every step of a growing KV
cache pays once, since plans are kept by exact shapes (docs/performance.md, "every step of a
growing cache makes a new plan").

For each spec, one new token (B=8, Hq=32, Hkv=8, D=128, bf16 on CUDA, float32 elsewhere) against
keys one longer at every call, from ``--cache`` on; a spec with ``key_padding`` gets a fresh
padding tensor per length, as transformers gives one. Each call plans through the spec's own
path (``Calls.plan``, with the step's positions placed first), and the script prints the mean
microseconds per plan, and of that, per piece of ``runtime.plan.make_plan``: the checks of q, k
and v, gathering the bindings (checked, specialized), the lookups' range proofs, the backend
choice, the block-mask handle, and the backend's prepared state. It reads private state of
:class:`flexspec.runtime.Attention` (its calls): a diagnostic, not an API.

A first table times the block mask a plan's prepared state holds for a decoded token that sees
every key (a spec that hides nothing, in the decoding kernel's partial form) at a new length:
as the runtime makes it (the tables kept per grid of tiles) against the eager builder at every
length (what the runtime did before).

    python benchmarks/planning.py --device cuda
    python benchmarks/planning.py --device cpu --plans 200
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from flexspec.kernels.block_tables import as_partial  # noqa: E402
from flexspec.runtime import masks, plan  # noqa: E402
from flexspec.runtime.bindings import Tensors  # noqa: E402

SPECS = ("causal + softcap(30)", "sliding_window(4096)", "causal & (window(4096) | sink(4))",
         "causal & doc", "causal + alibi", "causal & sliding_window(4095) & key_padding")
# The pieces of make_plan timed apart: (owner, attribute, column).
PIECES = ((plan, "check_qkv", "checks"), (Tensors, "gather", "bindings"),
          (plan, "LookupCheck", "lookups"), (plan, "choose", "choice"),
          (masks.MaskCache, "bind", "mask handle"), (plan, "_prepared", "backend state"))


def timed_pieces(spent: Counter) -> list:
    """Wrap each of :data:`PIECES` to add its time to ``spent``; the originals, to restore."""
    originals = []
    for owner, name, column in PIECES:
        real = getattr(owner, name)
        originals.append((owner, name, real))

        def wrapper(*args, _real=real, _column=column, **kwargs):
            started = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_column] += time.perf_counter() - started
        setattr(owner, name, wrapper)
    return originals


def planner(text: str, device, dtype, cache: int, count: int):
    """A function planning the ``i``-th of ``count`` growing-cache calls of ``text``."""
    calls = flexspec.compile(text)._calls
    batch, heads, kv_heads, dim = 8, 32, 8, 128
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype, generator=generator)
    buffer = torch.randn(batch, kv_heads, cache + count, dim, device=device, dtype=dtype,
                         generator=generator)
    names = {tensor.name for tensor in calls.ir.bindings()}
    ids = (torch.arange(cache + count, device=device) * 4 // (cache + count)).expand(batch, -1)
    paddings = [torch.ones(batch, cache + i, dtype=torch.bool, device=device)
                for i in range(count)] if "valid" in names else None

    def plan_one(i: int):
        n = cache + i
        k = buffer[:, :, :n]
        given = {}
        if "doc_ids" in names:
            given["doc_ids"] = ids[:, :n]
        if paddings is not None:
            given["valid"] = paddings[i]
        placed = calls.placement.for_call(q, k, given, n - 1, None)
        return calls.plan(q, k, k, None, {**given, **placed})
    return plan_one


def hiding_nothing(device, cache: int, count: int) -> tuple:
    """Mean microseconds of the partial-form block mask of a mask that hides nothing at
    ``count`` new key lengths from ``cache`` on (B=8, H=32, one query row): as
    runtime.masks makes it, and built by the eager builder at every length."""
    spec = flexspec.ir.AttentionIR(flexspec.ir.TRUE, flexspec.ir.SCORE, "start")
    made = masks.MaskCache("exact", (128, 128))

    def sizes(i):
        return {"B": 8, "H": 32, "Q_LEN": 1, "KV_LEN": cache + i}

    def kept(i):
        return made.bind(spec, sizes(i), device, partial=True).get({}, device)

    def built(i):
        return as_partial(masks.build_block_mask(spec.mask, sizes(i), (128, 128), {}, device,
                                                 batch=1, heads=1))
    means = []
    for way in (kept, built):
        way(count)  # outside the timed lengths
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(count):
            way(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        means.append((time.perf_counter() - started) / count * 1e6)
    return tuple(means)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cache", type=int, default=32768)
    parser.add_argument("--plans", type=int, default=500, help="new lengths planned per spec")
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: try --device cpu", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    warm = 20
    kept, built = hiding_nothing(device, args.cache, args.plans)
    print(f"\n{device.type}, us per decoding block mask of a spec that hides nothing at a new "
          f"key length (mean of {args.plans})\n")
    print("| kept per grid | built at every length |\n|---:|---:|")
    print(f"| {kept:.0f} | {built:.0f} |")
    rows = []
    with torch.no_grad():
        for text in args.specs.split(";"):
            plan_one = planner(text, device, dtype, args.cache, args.plans + warm)
            for i in range(warm):  # the caches of the spec's structure fill here
                chosen = plan_one(i).choice.backend
            spent: Counter = Counter()
            originals = timed_pieces(spent)
            try:
                started = time.perf_counter()
                for i in range(warm, warm + args.plans):
                    plan_one(i)
                total = time.perf_counter() - started
            finally:
                for owner, name, real in originals:
                    setattr(owner, name, real)
            cells = [f"{spent[column] / args.plans * 1e6:.0f}" for _, _, column in PIECES]
            rows.append(f"| `{text}` | {chosen} | {total / args.plans * 1e6:.0f} | "
                        + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    print(f"\n{device.type}, us per plan at a new key length (mean of {args.plans}; pieces "
          "timed inside the total)\n")
    print("| spec | backend | plan | " + " | ".join(column for _, _, column in PIECES) + " |")
    print("|---|---|---:|" + "---:|" * len(PIECES))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
