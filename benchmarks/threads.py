"""Stress: one Attention called from several threads with different bindings; every result must
equal the single-threaded one (tests/runtime/test_threads.py runs a few hundred calls; this runs
as many as asked and prints the count of wrong results and errors).

    python benchmarks/threads.py --threads 8 --calls 125000     # 10^6 calls, about 13 min here
    python benchmarks/threads.py --positions ...                # calls at different offsets
"""

from __future__ import annotations

import argparse
import time

import torch

from flexspec.testing.threads import POSITIONED_SPEC, SPEC, concurrent_calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--calls", type=int, default=1000, help="calls per thread")
    parser.add_argument("--positions", action="store_true",
                        help="calls that differ in their q_offset instead of their doc_ids")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    wrong, errors = concurrent_calls(args.threads, args.calls, length=128,
                                     positions=args.positions)
    spec = POSITIONED_SPEC if args.positions else SPEC
    print(f"{args.threads * args.calls} calls of {spec!r} from {args.threads} threads in "
          f"{time.perf_counter() - start:.0f} s: {len(wrong)} wrong results, {len(errors)} "
          f"errors{': ' + errors[0] if errors else ''}")
    return 1 if wrong or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
