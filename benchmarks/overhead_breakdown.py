"""Where flexspec's per-call overhead goes: a diagnostic behind the overhead table of
docs/performance.md.

For three specs at B1 H2 S256 D64 (bf16 on CUDA), where the host path sets the pace, it times in
alternating rounds (medians, each column also as its median difference to the hand-written call):

* ``hand``: the hand-written ``torch.compile(flex_attention)`` call with a prebuilt block mask;
* ``entry+hand mods``: flexspec's compiled entry point (a fresh one) with the hand-written mods
  and block mask, i.e. the cost of the entry itself;
* ``entry+our mods``: the plan's entry with flexspec's own mods and block mask;
* ``flexspec``: the whole call, ``attn(q, k, v, **bindings)`` (which replays the compiled
  code without dynamo's guards where its score and block mask are the last call's:
  flexspec.kernels.replay);
* ``python path only``: the whole call with the kernel entry replaced by a stub.

    python benchmarks/overhead_breakdown.py [--device cuda] [--calls 1000] [--rounds 15]

It reads private state of :class:`flexspec.runtime.Attention` (its plans): a diagnostic, not an
API.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexspec.runtime import compiled  # noqa: E402
from gpu import OVERHEAD_SPECS, OverheadCase, alternate, median_difference  # noqa: E402


def breakdown(text: str, device, calls: int, rounds: int) -> list[str]:
    case = OverheadCase.build(text, device)
    case.ours()  # builds the plan
    q, k, v = case.qkv
    plan = next(iter(case.attn._calls.plans.values()))
    call = plan.state  # a FlexCall: the state of the flex and flash backends
    our_mask = call.block_mask if call.block_mask is not None else call.last[1]
    fresh_entry = compiled.compiled_entry(call.lowered)
    entry = call.entry
    functions = {
        "hand": case.hand,
        "entry+hand mods": lambda: fresh_entry(q, k, v, case.score_mod, case.block_mask, None,
                                               False, call.kernel_options, None),
        "entry+our mods": lambda: entry(q, k, v, call.score_mod, our_mask, None, False,
                                        call.kernel_options, None),
        "flexspec": case.ours,
    }
    times = alternate(functions, device, calls, rounds)
    call.entry = lambda *args: args[0]
    replay, call.replay, call.replays = call.replay, None, False  # a replay skips the entry
    stubbed = alternate({"stub": case.ours}, device, calls * 5, rounds)
    call.entry, call.replay, call.replays = entry, replay, True
    cells = [f"{statistics.median(times[name]):.1f} "
             f"({median_difference(times[name], times['hand']):+.1f})" for name in functions]
    return [text, *cells, f"{statistics.median(stubbed['stub']):.1f}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    header = ["spec", "hand", "entry+hand mods", "entry+our mods", "flexspec",
              "python path only"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for text in OVERHEAD_SPECS:
        lines.append("| " + " | ".join(breakdown(text, device, args.calls, args.rounds)) + " |")
        print(lines[-1], flush=True)
    print()
    print("us per call (difference to hand)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
