"""Stress: one Attention called from several threads with different bindings; every result must
equal the single-threaded one (tests/runtime/test_threads.py runs a few hundred calls; this runs
as many as asked and prints the count of wrong results and errors).

    python benchmarks/threads.py --threads 8 --calls 125000     # 10^6 calls, about 13 min here
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import flexspec
from flexspec.testing import Shape


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--calls", type=int, default=1000, help="calls per thread")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = "causal & doc"
    attn = flexspec.compile(spec)
    q, k, v = Shape(1, 2, 2, 128, 128, 16).qkv(0)
    ids = [torch.arange(128) * (n + 2) // 128 for n in range(4)]  # 2 to 5 documents
    with torch.no_grad():
        expected = [attn(q, k, v, doc_ids=i) for i in ids]
    wrong, errors = [], []

    def worker(n):
        try:
            with torch.no_grad():
                for step in range(args.calls):
                    which = (n + step) % len(ids)
                    if not torch.equal(attn(q, k, v, doc_ids=ids[which]), expected[which]):
                        wrong.append((n, step, which))
        except Exception as error:  # noqa: BLE001 - counted and reported
            errors.append(repr(error))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"{args.threads * args.calls} calls of {spec!r} from {args.threads} threads in "
          f"{time.perf_counter() - start:.0f} s: {len(wrong)} wrong results, {len(errors)} "
          f"errors{': ' + errors[0] if errors else ''}")
    return 1 if wrong or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
