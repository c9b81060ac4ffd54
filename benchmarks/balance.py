"""Context-parallel load balance on the CPU: for each spec, sequence length and number of ranks,
the busiest rank's work over the mean rank's (max/mean) when the query blocks (128 rows) are
assigned by each balancer of :mod:`flexspec.parallel.balance`: none (contiguous shards),
head-tail, per-document head-tail, PTRR (torch's three, at block granularity) and flexspec's.
A query block's work is the key tiles it visits, read off the spec's block mask at the full
length. Issue 30's target: flexspec's at most 1.05 everywhere.

``causal & doc`` has skewed documents: one of half the sequence, the rest in documents of 32
blocks (4096 tokens), so that per-document head-tail applies up to 16 ranks.

    python benchmarks/balance.py                       # 128K and 1M tokens, 2-16 ranks
    python benchmarks/balance.py --lengths 131072 --ranks 2 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from flexspec.parallel import balance  # noqa: E402

SPECS = ["causal", "causal & doc", "sliding_window(4096)", "prefix_lm(8192)",
         "causal & (window(4096) | sink(4))"]
BLOCK = 128
SHORT_DOCUMENT = 32  # blocks


def documents(blocks: int) -> list:
    """One document of half the blocks, the rest in documents of SHORT_DOCUMENT blocks."""
    long = blocks // 2
    return [long] + [SHORT_DOCUMENT] * ((blocks - long) // SHORT_DOCUMENT)


def rows_for(text: str, length: int, ranks: list) -> list:
    blocks = length // BLOCK
    split = documents(blocks) if "doc" in text else [blocks]
    bindings = {}
    if "doc" in text:
        sizes = torch.tensor(split) * BLOCK
        bindings["doc_ids"] = torch.repeat_interleave(torch.arange(len(split)), sizes)[None]
    work = balance.block_work(flexspec.compile(text).block_mask(length, length, **bindings))
    rows = []
    for count in ranks:
        found = {"spec": text, "tokens": length, "ranks": count}
        for name, assign in (("none", lambda: balance.contiguous(blocks, count)),
                             ("head_tail", lambda: balance.head_tail(blocks, count)),
                             ("per_document", lambda: balance.per_document(split, count)),
                             ("ptrr", lambda: balance.ptrr(work, count)),
                             ("flexspec", lambda: balance.balanced(work, count))):
            found[name] = balance.imbalance(work, assign())
        rows.append(found)
    return rows


COLUMNS = ["spec", "tokens", "ranks", "none", "head_tail", "per_document", "ptrr", "flexspec"]


def table(rows: list) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specs", default=";".join(SPECS), help="';'-separated specs")
    parser.add_argument("--lengths", nargs="+", type=int, default=[131072, 1048576])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8, 16])
    args = parser.parse_args(argv)
    rows = []
    for length in args.lengths:
        for text in args.specs.split(";"):
            rows += rows_for(text, length, args.ranks)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
