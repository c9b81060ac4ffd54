"""The CPU demo (``./run demo``): compile every spec of an ``.attn`` file, run it, check it.

For each named spec of the file it draws random q, k, v (the spec's runtime bindings get the
example values of :mod:`flexspec.tools.values`), runs it on the backend ``auto`` chooses (``Attention.explain`` says which),
compares the result with the dense float64 reference, and prints one table row: spec, mask
density, the backend, max error, and the time per call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from flexspec import SpecError, compile as compile_spec, load
from flexspec.resources import data_path
from flexspec.tools.values import demo_bindings



def default_file() -> Path:
    path = data_path("examples", "model.attn")
    if path is not None:
        return path
    raise SpecError("the example file model.attn is missing: the installation is incomplete")


def _time(fn, repeats: int) -> float:
    fn()  # compile / warm up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def run(path: Path, *, seq_len: int, heads: int, dim: int, repeats: int, out=sys.stdout) -> int:
    library = load(path)
    generator = torch.Generator().manual_seed(0)
    print(f"flexspec demo: {path.name}, B=1 H={heads} S={seq_len} D={dim}, float32, "
          f"torch {torch.__version__}", file=out)
    print("(the first call of each spec compiles its kernel: expect seconds per spec)\n", file=out)
    rows = [("spec", "definition", "density", "backend", "max |err|", "ms/call", "ok")]
    failures = 0
    for name in library:
        attn = compile_spec(library[name])
        q, k, v = (torch.randn(1, heads, seq_len, dim, generator=generator) for _ in range(3))
        bindings, _ = demo_bindings(attn, seq_len, seq_len, heads=heads)
        started = time.perf_counter()
        out_kernel = attn(q, k, v, **bindings)
        first = time.perf_counter() - started
        error = (out_kernel - attn.reference(q, k, v, **bindings)).abs().max().item()
        explanation = attn.explain(q, k, v, **bindings)
        seconds = _time(lambda: attn(q, k, v, **bindings), repeats)
        ok = error < 1e-4
        failures += not ok
        rows.append((name, str(library[name]), f"{explanation.density:.3f}",
                     explanation.choice.backend, f"{error:.1e}", f"{seconds * 1e3:.1f}",
                     "yes" if ok else "NO"))
        print(f"  {name}: compiled and ran in {first:.1f} s", file=out)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(file=out)
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexspec.tools.demo", description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", type=Path, help="an .attn file (default: the shipped "
                        "examples/model.attn)")
    parser.add_argument("--seq-len", type=int, default=1000, help="sequence length (default 1000)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        return run(args.file or default_file(), seq_len=args.seq_len, heads=args.heads,
                   dim=args.dim, repeats=args.repeats)
    except SpecError as err:
        print(err, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
